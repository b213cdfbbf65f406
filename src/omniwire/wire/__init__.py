"""The omniwire wire format, version 1 (specs/wire-v1.md), with no I/O.

``encode(msg) -> bytes`` and ``decode(data) -> message``; the message types; the
limits and dtype names the spec fixes; and the per-peer state table
(:class:`Session`). Nothing here imports asyncio, zmq or a backend.
"""

from __future__ import annotations

from ._constants import (
    ALIGNMENT,
    DTYPE_ITEMSIZE,
    INLINE_MAX_TENSOR_BYTES,
    MAGIC,
    MAX_FRAME_SIZE,
    MAX_HEADER_DEPTH,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_REQUEST_ID_BYTES,
    MAX_TENSORS,
    MAX_TEXT_BYTES,
    PREFIX_SIZE,
    SUPPORTED_MAJORS,
    WIRE_VERSION,
    align_up,
)
from ._frame import decode, encode, peek_version
from ._messages import (
    AbortMessage,
    BackendInfo,
    BackendRef,
    DataAckMessage,
    DataKind,
    DataProgressMessage,
    DataReadyMessage,
    DataRef,
    DeviceInfo,
    HelloMessage,
    InlineStreamChunkRef,
    Layout,
    Message,
    TensorMeta,
)
from ._state import InboundObject, OutboundObject, PeerState, Session

__all__ = [
    "ALIGNMENT",
    "DTYPE_ITEMSIZE",
    "INLINE_MAX_TENSOR_BYTES",
    "MAGIC",
    "MAX_FRAME_SIZE",
    "MAX_HEADER_DEPTH",
    "MAX_NAME_BYTES",
    "MAX_NDIM",
    "MAX_REQUEST_ID_BYTES",
    "MAX_TENSORS",
    "MAX_TEXT_BYTES",
    "PREFIX_SIZE",
    "SUPPORTED_MAJORS",
    "WIRE_VERSION",
    "AbortMessage",
    "BackendInfo",
    "BackendRef",
    "DataAckMessage",
    "DataKind",
    "DataProgressMessage",
    "DataReadyMessage",
    "DataRef",
    "DeviceInfo",
    "HelloMessage",
    "InboundObject",
    "InlineStreamChunkRef",
    "Layout",
    "Message",
    "OutboundObject",
    "PeerState",
    "Session",
    "TensorMeta",
    "align_up",
    "decode",
    "encode",
    "peek_version",
]
