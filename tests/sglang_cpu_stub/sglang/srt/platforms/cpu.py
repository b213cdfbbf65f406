from sglang.srt.platforms.device_mixin import DeviceMixin, PlatformEnum
from sglang.srt.platforms.interface import SRTPlatform


class CpuDeviceMixin(DeviceMixin):
    device_type = "cpu"
    _enum = PlatformEnum.CPU


class CpuPlatform(CpuDeviceMixin, SRTPlatform):
    pass
