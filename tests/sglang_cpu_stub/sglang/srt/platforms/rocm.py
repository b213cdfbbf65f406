from sglang.srt.platforms.device_mixin import DeviceMixin, PlatformEnum


class RocmDeviceMixin(DeviceMixin):
    device_type = "cuda"
    _enum = PlatformEnum.ROCM
