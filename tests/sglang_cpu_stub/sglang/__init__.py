"""A stand-in for the few names of `sglang` (the GPU serving engine) that
sglang-omni's comm/, relay/, pipeline/ and scheduling/ modules import at load time.

`sglang` itself cannot be installed on a CPU-only machine (it pins CUDA builds of
torch, flashinfer and sgl-kernel); sglang-omni only reads its platform object
(device type, "is this CUDA?") on the paths the integration tests exercise.
Only tests/test_sglang_omni.py and examples/sglang_omni put this on sys.path,
and only where the real `sglang` is not importable.
"""

__version__ = "0.0.0+omniwire-cpu-stub"
