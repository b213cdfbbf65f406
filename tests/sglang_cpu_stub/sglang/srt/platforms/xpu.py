from sglang.srt.platforms.device_mixin import DeviceMixin, PlatformEnum


class XpuDeviceMixin(DeviceMixin):
    device_type = "xpu"
    _enum = PlatformEnum.XPU
