"""CPU platform only: sglang.srt.platforms.current_platform."""

from sglang.srt.platforms.cpu import CpuPlatform

current_platform = CpuPlatform()
