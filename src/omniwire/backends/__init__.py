"""Data-plane backends. Each module is one backend; the interface is in ``base``.

Backends are found through the ``omniwire.backends`` entry-point group (see
:mod:`omniwire.registry`); importing this package imports no engine.
"""

from .base import (
    Availability,
    BackendBase,
    BackendContext,
    BackendStats,
    ByteBackend,
    Capabilities,
    Export,
    Import,
    Locality,
    ObjectBackend,
    PeerInfo,
)

__all__ = [
    "Availability",
    "BackendBase",
    "BackendContext",
    "BackendStats",
    "ByteBackend",
    "Capabilities",
    "Export",
    "Import",
    "Locality",
    "ObjectBackend",
    "PeerInfo",
]
