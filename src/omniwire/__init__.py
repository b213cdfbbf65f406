"""omniwire: move tensor-bearing payloads between the stages of an inference pipeline.

``import omniwire`` is light (no torch, no zmq); :class:`Endpoint` and friends are
imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    AckTimeoutError,
    BackendError,
    BackendUnavailableError,
    EndpointClosedError,
    HandshakeError,
    NoRouteError,
    OmniwireError,
    PeerLostError,
    RequestAbortedError,
    ShmFullError,
    UnsupportedVersionError,
    WireFormatError,
)
from .wire import WIRE_VERSION

if TYPE_CHECKING:
    from .delivery import Delivery, SendReceipt
    from .endpoint import DeliveryStream, Endpoint

__all__ = [
    "WIRE_VERSION",
    "AckTimeoutError",
    "BackendError",
    "BackendUnavailableError",
    "Delivery",
    "DeliveryStream",
    "Endpoint",
    "EndpointClosedError",
    "HandshakeError",
    "NoRouteError",
    "OmniwireError",
    "PeerLostError",
    "RequestAbortedError",
    "SendReceipt",
    "ShmFullError",
    "UnsupportedVersionError",
    "WireFormatError",
]
__version__ = "0.1.0"

_LAZY = {
    "Endpoint": "endpoint",
    "DeliveryStream": "endpoint",
    "Delivery": "delivery",
    "SendReceipt": "delivery",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omniwire' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)
