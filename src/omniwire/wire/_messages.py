"""The wire messages of specs/wire-v1.md as frozen, keyword-only msgspec structs.

Every struct validates itself in ``__post_init__``, which msgspec runs both when
Python code builds a message and when a frame is decoded, so an invalid message
can neither be sent nor received. The error names the field.

Schema evolution (spec §8): new fields go at the end with a default; an existing
field never changes type; readers ignore fields they do not know.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from ._constants import (
    ALIGNMENT,
    DTYPE_ITEMSIZE,
    INLINE_MAX_TENSOR_BYTES,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_REQUEST_ID_BYTES,
    MAX_TENSORS,
    MAX_TEXT_BYTES,
    U64_MAX,
)

__all__ = [
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
    "InlineStreamChunkRef",
    "Layout",
    "Message",
    "TensorMeta",
]

DataKind = Literal["payload", "stream_chunk"]
Layout = Literal["packed", "per_tensor", "object"]


def _u64(field: str, value: int) -> None:
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{field} must be in [0, 2**64-1], got {value}")


def _text(field: str, value: str, limit: int, *, empty_ok: bool = False) -> None:
    if len(value) > 0 and 4 * len(value) <= limit:
        return  # a UTF-8 character is at most 4 bytes: within the limit, not empty
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ValueError(f"{field} is {size} bytes long; the limit is {limit}")
    if not empty_ok and size == 0:
        raise ValueError(f"{field} must not be empty")


def _name(field: str, value: str) -> None:
    _text(field, value, MAX_NAME_BYTES)


def _version(field: str, value: tuple[int, int]) -> None:
    if len(value) != 2 or not all(0 <= v <= 255 for v in value):
        raise ValueError(f"{field} must be [major, minor] with each in [0, 255], got {value}")


class _Base(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Common settings: immutable, keyword-only, unknown fields ignored."""


class TensorMeta(_Base, frozen=True, kw_only=True):
    """One tensor of a payload: where its bytes are and how to view them."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    device: str = "cpu"
    path: str = ""

    def __post_init__(self) -> None:
        itemsize = DTYPE_ITEMSIZE.get(self.dtype)
        if itemsize is None:
            raise ValueError(f"TensorMeta.dtype {self.dtype!r} is not a wire dtype")
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"TensorMeta.shape has {len(self.shape)} dims; limit {MAX_NDIM}")
        for dim in self.shape:
            if dim < 0:
                raise ValueError(f"TensorMeta.shape has a negative dimension: {self.shape}")
        _u64("TensorMeta.offset", self.offset)
        _u64("TensorMeta.nbytes", self.nbytes)
        expected = math.prod(self.shape) * itemsize
        if self.nbytes != expected:
            raise ValueError(
                f"TensorMeta.nbytes is {self.nbytes} but shape {self.shape} of "
                f"{self.dtype} needs {expected}"
            )
        _text("TensorMeta.device", self.device, MAX_NAME_BYTES)
        _text("TensorMeta.path", self.path, MAX_TEXT_BYTES, empty_ok=True)


def _check_packed(owner: str, tensors: tuple[TensorMeta, ...], length: int) -> None:
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"{owner}.tensors has {len(tensors)} entries; limit {MAX_TENSORS}")
    for i, t in enumerate(tensors):
        if t.offset % ALIGNMENT:
            raise ValueError(f"{owner}.tensors[{i}].offset {t.offset} is not {ALIGNMENT}-aligned")
        if t.offset + t.nbytes > length:
            raise ValueError(
                f"{owner}.tensors[{i}] spans [{t.offset}, {t.offset + t.nbytes}) "
                f"beyond the {length}-byte buffer"
            )


class BackendRef(_Base, frozen=True, kw_only=True):
    """Where a backend put the bytes. ``info`` is opaque to everyone but that backend."""

    backend: str
    info: bytes = b""
    length: int = 0

    def __post_init__(self) -> None:
        _name("BackendRef.backend", self.backend)
        _u64("BackendRef.length", self.length)


class DataRef(_Base, frozen=True, kw_only=True):
    """A payload or stream chunk held by a backend until its DataAckMessage."""

    version: int = 1
    object_id: int
    kind: DataKind
    backend: str
    layout: Layout
    ref: BackendRef
    header: bytes = b""
    tensors: tuple[TensorMeta, ...] = ()
    #: Bytes ``[0, ready)`` are valid now; the rest follow in DataProgressMessages.
    #: ``None`` means all ``ref.length`` bytes are valid.
    ready: int | None = None

    def __post_init__(self) -> None:
        if self.version != 1:
            raise ValueError(f"DataRef.version {self.version} is not supported (expected 1)")
        _u64("DataRef.object_id", self.object_id)
        _name("DataRef.backend", self.backend)
        if self.ref.backend != self.backend:
            raise ValueError(
                f"DataRef.backend {self.backend!r} differs from ref.backend {self.ref.backend!r}"
            )
        if self.layout == "packed":
            _check_packed("DataRef", self.tensors, self.ref.length)
        elif self.layout == "object" and self.tensors:
            raise ValueError("DataRef with layout 'object' must have an empty tensor table")
        elif len(self.tensors) > MAX_TENSORS:
            raise ValueError(
                f"DataRef.tensors has {len(self.tensors)} entries; limit {MAX_TENSORS}"
            )
        if self.ready is not None and not 0 <= self.ready <= self.ref.length:
            raise ValueError(f"DataRef.ready {self.ready} is outside [0, {self.ref.length}]")


class InlineStreamChunkRef(_Base, frozen=True, kw_only=True):
    """A small CPU stream chunk carried inside the control message: no buffer, no ACK."""

    header: bytes = b""
    tensors: tuple[TensorMeta, ...] = ()
    data: bytes = b""

    def __post_init__(self) -> None:
        _check_packed("InlineStreamChunkRef", self.tensors, len(self.data))
        total = sum(t.nbytes for t in self.tensors)
        if total > INLINE_MAX_TENSOR_BYTES:
            raise ValueError(
                f"InlineStreamChunkRef carries {total} tensor bytes; "
                f"the limit is {INLINE_MAX_TENSOR_BYTES}"
            )
        for i, t in enumerate(self.tensors):
            if t.device != "cpu":
                raise ValueError(f"InlineStreamChunkRef.tensors[{i}] is on {t.device}, not cpu")
        if len(self.data) > INLINE_MAX_TENSOR_BYTES + ALIGNMENT * len(self.tensors):
            raise ValueError(f"InlineStreamChunkRef.data is {len(self.data)} bytes: too long")


class DeviceInfo(_Base, frozen=True, kw_only=True):
    """A device a stage can hold tensors on."""

    kind: str
    index: int = 0
    uuid: str = ""

    def __post_init__(self) -> None:
        _name("DeviceInfo.kind", self.kind)
        _u64("DeviceInfo.index", self.index)
        _text("DeviceInfo.uuid", self.uuid, MAX_NAME_BYTES, empty_ok=True)


class BackendInfo(_Base, frozen=True, kw_only=True):
    """A backend this endpoint runs, with the connection info its peers need."""

    name: str
    info: bytes = b""

    def __post_init__(self) -> None:
        _name("BackendInfo.name", self.name)


class HelloMessage(_Base, frozen=True, kw_only=True, tag="hello", tag_field="type"):
    """First message on every connection; answered once with ``is_reply=True``."""

    endpoint: str
    wire_min: tuple[int, int]
    wire_max: tuple[int, int]
    features: tuple[str, ...] = ()
    host_id: str
    hostname: str = ""
    pid: int
    process_token: str
    instance: int
    address: str
    abort_address: str = ""
    devices: tuple[DeviceInfo, ...] = ()
    backends: tuple[BackendInfo, ...] = ()
    is_reply: bool = False

    def __post_init__(self) -> None:
        _name("HelloMessage.endpoint", self.endpoint)
        _version("HelloMessage.wire_min", self.wire_min)
        _version("HelloMessage.wire_max", self.wire_max)
        if self.wire_min > self.wire_max:
            raise ValueError(f"HelloMessage.wire_min {self.wire_min} > wire_max {self.wire_max}")
        if len(self.features) > 256:
            raise ValueError("HelloMessage.features has more than 256 entries")
        for f in self.features:
            _name("HelloMessage.features[]", f)
        _text("HelloMessage.host_id", self.host_id, MAX_TEXT_BYTES)
        _text("HelloMessage.hostname", self.hostname, MAX_NAME_BYTES, empty_ok=True)
        _u64("HelloMessage.pid", self.pid)
        _text("HelloMessage.process_token", self.process_token, MAX_NAME_BYTES)
        _u64("HelloMessage.instance", self.instance)
        _text("HelloMessage.address", self.address, MAX_TEXT_BYTES)
        _text("HelloMessage.abort_address", self.abort_address, MAX_TEXT_BYTES, empty_ok=True)
        if len(self.devices) > 1024:
            raise ValueError("HelloMessage.devices has more than 1024 entries")
        if len(self.backends) > 256:
            raise ValueError("HelloMessage.backends has more than 256 entries")


class DataReadyMessage(_Base, frozen=True, kw_only=True, tag="data_ready", tag_field="type"):
    """A payload, stream chunk, stream end or stream error for ``request_id``."""

    request_id: str
    from_stage: str
    to_stage: str
    chunk_id: int = 0
    data_ref: DataRef | None = None
    inline: InlineStreamChunkRef | None = None
    is_done: bool = False
    error: str | None = None
    metadata: bytes = b""

    def __post_init__(self) -> None:
        _text("DataReadyMessage.request_id", self.request_id, MAX_REQUEST_ID_BYTES)
        _name("DataReadyMessage.from_stage", self.from_stage)
        _name("DataReadyMessage.to_stage", self.to_stage)
        _u64("DataReadyMessage.chunk_id", self.chunk_id)
        if self.data_ref is not None and self.inline is not None:
            raise ValueError("DataReadyMessage has both data_ref and inline; at most one allowed")
        if self.error is not None:
            _text("DataReadyMessage.error", self.error, MAX_TEXT_BYTES, empty_ok=True)
            if self.data_ref is not None or self.inline is not None:
                raise ValueError("DataReadyMessage with an error must carry no data")
        has_data = self.data_ref is not None or self.inline is not None
        if not has_data and not self.is_done and self.error is None:
            raise ValueError("DataReadyMessage carries no data, no error and is not is_done")


class DataProgressMessage(_Base, frozen=True, kw_only=True, tag="data_progress", tag_field="type"):
    """More bytes of an announced object are valid: ``[0, ready)``."""

    object_id: int
    from_stage: str
    to_stage: str
    ready: int

    def __post_init__(self) -> None:
        _u64("DataProgressMessage.object_id", self.object_id)
        _name("DataProgressMessage.from_stage", self.from_stage)
        _name("DataProgressMessage.to_stage", self.to_stage)
        _u64("DataProgressMessage.ready", self.ready)


class DataAckMessage(_Base, frozen=True, kw_only=True, tag="data_ack", tag_field="type"):
    """Receiver → sender: the object is taken (or failed); its buffer may be reused."""

    object_id: int
    from_stage: str
    to_stage: str
    success: bool = True
    error: str | None = None

    def __post_init__(self) -> None:
        _u64("DataAckMessage.object_id", self.object_id)
        _name("DataAckMessage.from_stage", self.from_stage)
        _name("DataAckMessage.to_stage", self.to_stage)
        if self.error is not None:
            _text("DataAckMessage.error", self.error, MAX_TEXT_BYTES, empty_ok=True)


class AbortMessage(_Base, frozen=True, kw_only=True, tag="abort", tag_field="type"):
    """Broadcast: release every in-flight buffer of ``request_id`` on both sides."""

    request_id: str
    from_stage: str
    reason: str = ""

    def __post_init__(self) -> None:
        _text("AbortMessage.request_id", self.request_id, MAX_REQUEST_ID_BYTES)
        _name("AbortMessage.from_stage", self.from_stage)
        _text("AbortMessage.reason", self.reason, MAX_TEXT_BYTES, empty_ok=True)


Message = HelloMessage | DataReadyMessage | DataProgressMessage | DataAckMessage | AbortMessage
