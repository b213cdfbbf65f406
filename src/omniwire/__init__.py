"""omniwire: move tensor-bearing payloads between the stages of an inference pipeline."""

from __future__ import annotations

from .errors import OmniwireError, WireFormatError
from .wire import WIRE_VERSION

__all__ = ["WIRE_VERSION", "OmniwireError", "WireFormatError"]
__version__ = "0.1.0"
