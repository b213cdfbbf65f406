from sglang.srt.platforms.device_mixin import DeviceMixin


class SRTPlatform(DeviceMixin):
    pass
