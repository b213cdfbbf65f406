from sglang.srt.platforms.device_mixin import DeviceMixin, PlatformEnum


class CudaDeviceMixin(DeviceMixin):
    device_type = "cuda"
    _enum = PlatformEnum.CUDA
