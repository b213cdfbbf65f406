import enum


class PlatformEnum(enum.Enum):
    CUDA = "cuda"
    ROCM = "rocm"
    CPU = "cpu"
    XPU = "xpu"
    NPU = "npu"
    MPS = "mps"
    MUSA = "musa"


class DeviceMixin:
    """The platform predicates sglang-omni asks; everything answers "no" except CPU."""

    device_type = "cpu"
    device_name = "cpu"
    _enum = PlatformEnum.CPU

    def is_cuda(self) -> bool:
        return self._enum is PlatformEnum.CUDA

    def is_rocm(self) -> bool:
        return self._enum is PlatformEnum.ROCM

    def is_cpu(self) -> bool:
        return self._enum is PlatformEnum.CPU

    def is_xpu(self) -> bool:
        return self._enum is PlatformEnum.XPU

    def is_npu(self) -> bool:
        return self._enum is PlatformEnum.NPU

    def is_mps(self) -> bool:
        return self._enum is PlatformEnum.MPS

    def is_musa(self) -> bool:
        return self._enum is PlatformEnum.MUSA

    def is_cuda_alike(self) -> bool:
        return self._enum in (PlatformEnum.CUDA, PlatformEnum.ROCM)
