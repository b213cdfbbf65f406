"""The wire messages of specs/wire-v1.md as frozen, keyword-only msgspec structs.

Every struct validates itself in ``__post_init__``, which msgspec runs both when
Python code builds a message and when a frame is decoded, so an invalid message
can neither be sent nor received. The error names the field.

Schema evolution (spec §8): new fields go at the end with a default; an existing
field never changes type; readers ignore fields they do not know.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from ._constants import (
    ALIGNMENT,
    DTYPE_ITEMSIZE,
    I64_MAX,
    INLINE_MAX_TENSOR_BYTES,
    MAX_BATCH_MESSAGES,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_REQUEST_ID_BYTES,
    MAX_TENSORS,
    MAX_TEXT_BYTES,
    U64_MAX,
)

__all__ = [
    "NACK_REASONS",
    "REFUSAL_CODES",
    "AbortMessage",
    "BackendInfo",
    "BackendRef",
    "BatchMessage",
    "BatchedMessage",
    "DataAckMessage",
    "DataKind",
    "DataProgressMessage",
    "DataReadyMessage",
    "DataRef",
    "DeviceInfo",
    "GoodbyeMessage",
    "HelloMessage",
    "InlineStreamChunkRef",
    "Layout",
    "Message",
    "NackReason",
    "RefusalCode",
    "RefusalMessage",
    "TensorMeta",
    "WindowMessage",
    "charge",
]

DataKind = Literal["payload", "stream_chunk"]
Layout = Literal["packed", "per_tensor", "object"]

#: Why a receiver refused an object (``DataAckMessage.reason``, spec §4.4). 1.1.
NackReason = Literal[
    "aborted",  # the request was aborted
    "queue_full",  # the receiver holds too many undelivered objects
    "receiver_closed",  # the receiver is closing
    "malformed",  # the DataRef, header or metadata cannot be read
    "backend_error",  # the backend failed to open or move the bytes
    "unsupported",  # the receiver does not run that backend or layout
    "misaddressed",  # to_stage is not the receiver
    "timeout",  # the sender made no progress on a progressive object
    "digest_mismatch",  # the bytes read do not match DataRef.digest (feature "digest")
    "internal",  # a bug in the receiver
]
NACK_REASONS: frozenset[str] = frozenset(NackReason.__args__)  # type: ignore[attr-defined]

#: Why an endpoint refused a peer or a message (``RefusalMessage.code``, spec §4.9). 1.1.
RefusalCode = Literal[
    "version",  # no wire major version in common
    "name_in_use",  # another live instance holds this stage name
    "name_mismatch",  # the Hello was addressed to another stage name
    "own_name",  # the peer uses the refuser's own stage name
    "peer_limit",  # the refuser's peer table is full
    "bad_hello",  # the Hello is unusable (address, backend info)
    "unknown_peer",  # a message from a stage that has not said Hello
]
REFUSAL_CODES: frozenset[str] = frozenset(RefusalCode.__args__)  # type: ignore[attr-defined]


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


class _Base(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False, gc=False):
    """Common settings: immutable, keyword-only, unknown fields ignored; not tracked by
    the cycle collector (a message holds only immutable values, so no cycle can pass
    through it, and a stream of them then never triggers a full collection)."""


#: Characters that fit their byte limits whatever they are (UTF-8: at most 4 each).
_RID_CHARS: Final = MAX_REQUEST_ID_BYTES // 4
_NAME_CHARS: Final = MAX_NAME_BYTES // 4


class _Valid:
    """What passed a validation that depends only on the values checked (a pure
    function of them), so that the same entry seen again — every chunk of a stream
    carries the same tensor table — is not checked again in Python: membership hashes
    and compares frozen structs in C. Bounded: each key weighs what it holds (an
    inline table: its number of tensor entries), and the memo is emptied when the
    weight reaches ``limit``, so a peer sending ever new (valid) entries costs memory
    up to ``limit`` entries, never more."""

    __slots__ = ("keys", "limit", "weight")

    def __init__(self, limit: int) -> None:
        self.keys: set[object] = set()
        self.limit = limit
        self.weight = 0

    def add(self, key: object, weight: int = 1) -> None:
        keys = self.keys
        if self.weight + weight > self.limit:
            keys.clear()
            self.weight = 0
        keys.add(key)
        self.weight += weight


_VALID_METAS = _Valid(4096)
#: (tensor table, data length) of inline chunks, weighed by their tensor entries: as
#: many entries as 1,024 tables of 16, or 16,384 one-tensor tables (chunks of as many
#: sizes: a stream of varying sizes is checked once per size).
_VALID_INLINE = _Valid(16384)
#: Only small entries are remembered (what the memo holds stays within a few MiB):
#: tensor paths of at most this many characters, inline tables of at most this many
#: tensors.
_MEMO_PATH = 256
_MEMO_TENSORS = 16


class TensorMeta(_Base, frozen=True, kw_only=True):
    """One tensor of a payload: where its bytes are and how to view them."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    device: str = "cpu"
    path: str = ""

    def __post_init__(self) -> None:
        try:
            if self in _VALID_METAS.keys:  # equal to one checked before: valid
                return
            known: bool | None = False
        except TypeError:  # unhashable (a list built by hand): never remembered
            known = None
        self._check()
        if known is False and len(self.path) <= _MEMO_PATH:
            _VALID_METAS.add(self)

    def _check(self) -> None:
        itemsize = DTYPE_ITEMSIZE.get(self.dtype)
        if itemsize is None:
            raise ValueError(f"TensorMeta.dtype {self.dtype!r} is not a wire dtype")
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"TensorMeta.shape has {len(self.shape)} dims; limit {MAX_NDIM}")
        elements, empty = 1, False
        for dim in self.shape:
            if not 0 <= dim <= I64_MAX:
                raise ValueError(
                    f"TensorMeta.shape has a dimension outside [0, 2**63-1]: {self.shape}"
                )
            if dim:
                elements *= dim
            else:
                empty = True
        if elements > I64_MAX:
            raise ValueError(
                f"TensorMeta.shape {self.shape}: the product of its non-zero dimensions "
                "exceeds 2**63-1"
            )
        if not (0 <= self.offset <= U64_MAX and 0 <= self.nbytes <= U64_MAX):
            _u64("TensorMeta.offset", self.offset)
            _u64("TensorMeta.nbytes", self.nbytes)
        expected = 0 if empty else elements * itemsize
        if self.nbytes != expected:
            raise ValueError(
                f"TensorMeta.nbytes is {self.nbytes} but shape {self.shape} of "
                f"{self.dtype} needs {expected}"
            )
        if not 0 < len(self.device) <= _NAME_CHARS:
            _text("TensorMeta.device", self.device, MAX_NAME_BYTES)
        if len(self.path) > MAX_TEXT_BYTES // 4:
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
    #: 1.1, feature ``"digest"`` (spec §7.7): XXH3-64 of the tensor bytes, tensor by
    #: tensor in table order; ``None``: no digest. A reader that does not know it
    #: ignores it.
    digest: int | None = None

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
        if self.digest is not None:
            _u64("DataRef.digest", self.digest)
            if self.layout == "object":
                raise ValueError("DataRef with layout 'object' carries no digest")


class InlineStreamChunkRef(_Base, frozen=True, kw_only=True):
    """A small CPU stream chunk (or, from 1.1, payload) carried inside the control
    message: no buffer, no ACK."""

    header: bytes = b""
    tensors: tuple[TensorMeta, ...] = ()
    data: bytes = b""
    #: 1.1: what the data is; a 1.0 reader ignores it (and is never sent a payload inline).
    kind: DataKind = "stream_chunk"

    def __post_init__(self) -> None:
        size = len(self.data)
        key = (self.tensors, size)
        known: bool | None = None
        if len(self.tensors) <= _MEMO_TENSORS:
            try:
                if key in _VALID_INLINE.keys:  # the table of a chunk seen before, as long
                    return
                known = False
            except TypeError:  # unhashable (a list built by hand): never remembered
                pass
        self._check(size)
        if known is False and all(len(t.path) <= _MEMO_PATH for t in self.tensors):
            _VALID_INLINE.add(key, max(1, len(self.tensors)))

    def _check(self, size: int) -> None:
        if len(self.tensors) > MAX_TENSORS:
            raise ValueError(
                f"InlineStreamChunkRef.tensors has {len(self.tensors)} entries; limit {MAX_TENSORS}"
            )
        total = 0
        for i, t in enumerate(self.tensors):
            if t.offset % ALIGNMENT or t.offset + t.nbytes > size:
                _check_packed("InlineStreamChunkRef", self.tensors, size)  # says which, why
            if t.device != "cpu":
                raise ValueError(f"InlineStreamChunkRef.tensors[{i}] is on {t.device}, not cpu")
            total += t.nbytes
        if total > INLINE_MAX_TENSOR_BYTES:
            raise ValueError(
                f"InlineStreamChunkRef carries {total} tensor bytes; "
                f"the limit is {INLINE_MAX_TENSOR_BYTES}"
            )
        if size > INLINE_MAX_TENSOR_BYTES + ALIGNMENT * len(self.tensors):
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
    #: 1.1: the stage name the sender addresses (from its configuration); empty if
    #: unknown. A receiver with another name refuses with ``name_mismatch``.
    to_endpoint: str = ""
    #: 1.1 (same host, feature ``"ring"``): the name of a shared-memory ring the sender
    #: created to receive this peer's frames (spec §3.6); empty if none.
    ring: str = ""
    #: 1.1: the peer's ring this sender has just attached to. This Hello is the last
    #: frame of the sender on ZeroMQ; its later frames come through that ring.
    ring_attached: str = ""
    #: 1.1 (§7.6): the bytes of DataReady charge this sender lets the peer have
    #: outstanding before a WindowMessage reopens them; 0: it sends no WindowMessage.
    window: int = 0
    #: 1.1: how many times this instance declared the addressee lost (spec §10.6). A
    #: higher epoch than in the last Hello of an active session ends that session.
    epoch: int = 0
    #: 1.1 (feature ``"resume"``, §10.7): the sender's token for its current session
    #: with the addressee; numbered frames to the sender carry it back. 0: none.
    session: int = 0

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
        _text("HelloMessage.to_endpoint", self.to_endpoint, MAX_NAME_BYTES, empty_ok=True)
        _u64("HelloMessage.epoch", self.epoch)
        _text("HelloMessage.ring", self.ring, MAX_NAME_BYTES, empty_ok=True)
        _text("HelloMessage.ring_attached", self.ring_attached, MAX_NAME_BYTES, empty_ok=True)
        _u64("HelloMessage.window", self.window)
        _u64("HelloMessage.session", self.session)


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
    #: 1.1: W3C trace context (``traceparent``) of the sender's span; empty if none.
    traceparent: str = ""

    def __post_init__(self) -> None:
        # The common case in one test (every message of a stream runs this twice):
        # names within bounds, a chunk id, no error, exactly one of the two data
        # fields, a short traceparent. The checks below say what is wrong otherwise.
        if (
            0 < len(self.request_id) <= _RID_CHARS
            and 0 < len(self.from_stage) <= _NAME_CHARS
            and 0 < len(self.to_stage) <= _NAME_CHARS
            and type(self.chunk_id) is int
            and 0 <= self.chunk_id <= U64_MAX
            and self.error is None
            and (self.inline is None) is not (self.data_ref is None)
            and len(self.traceparent) <= _NAME_CHARS
        ):
            return
        if not (
            0 < len(self.request_id) <= _RID_CHARS
            and 0 < len(self.from_stage) <= _NAME_CHARS
            and 0 < len(self.to_stage) <= _NAME_CHARS
        ):
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
        if len(self.traceparent) > _NAME_CHARS:
            _text("DataReadyMessage.traceparent", self.traceparent, MAX_NAME_BYTES, empty_ok=True)


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
    #: 1.1: why, as a registered code (``NACK_REASONS``), when ``success`` is false.
    #: A reader MUST treat a code it does not know as ``"internal"``.
    reason: str | None = None

    def __post_init__(self) -> None:
        _u64("DataAckMessage.object_id", self.object_id)
        _name("DataAckMessage.from_stage", self.from_stage)
        _name("DataAckMessage.to_stage", self.to_stage)
        if self.error is not None:
            _text("DataAckMessage.error", self.error, MAX_TEXT_BYTES, empty_ok=True)
        if self.reason is not None:
            _name("DataAckMessage.reason", self.reason)
            if self.success:
                raise ValueError("DataAckMessage with success=true must have no reason")


class AbortMessage(_Base, frozen=True, kw_only=True, tag="abort", tag_field="type"):
    """Broadcast: release every in-flight buffer of ``request_id`` on both sides."""

    request_id: str
    from_stage: str
    reason: str = ""
    #: 1.1: the stage where the abort began, when ``from_stage`` forwards it; empty
    #: means ``from_stage`` itself.
    origin: str = ""

    def __post_init__(self) -> None:
        _text("AbortMessage.request_id", self.request_id, MAX_REQUEST_ID_BYTES)
        _name("AbortMessage.from_stage", self.from_stage)
        _text("AbortMessage.reason", self.reason, MAX_TEXT_BYTES, empty_ok=True)
        _text("AbortMessage.origin", self.origin, MAX_NAME_BYTES, empty_ok=True)


class GoodbyeMessage(_Base, frozen=True, kw_only=True, tag="goodbye", tag_field="type"):
    """1.1. The sender closes cleanly: every object of ``instance`` is released, in
    both directions, and its open streams end. The peer is *closed*, not lost."""

    from_stage: str
    instance: int
    reason: str = ""

    def __post_init__(self) -> None:
        _name("GoodbyeMessage.from_stage", self.from_stage)
        _u64("GoodbyeMessage.instance", self.instance)
        _text("GoodbyeMessage.reason", self.reason, MAX_TEXT_BYTES, empty_ok=True)


class RefusalMessage(_Base, frozen=True, kw_only=True, tag="refusal", tag_field="type"):
    """1.1. The sender refuses a peer's Hello (or a message from a stage it does not
    know), so the refused side can tell refusal from death. Always framed as 1.x."""

    from_stage: str
    #: The refused stage, as it named itself (may be empty if it could not be read).
    to_stage: str = ""
    #: A registered code (``REFUSAL_CODES``); readers treat unknown codes as generic.
    code: str
    detail: str = ""
    #: The stage name the refused Hello addressed (its ``to_endpoint``), if any.
    addressed: str = ""

    def __post_init__(self) -> None:
        _name("RefusalMessage.from_stage", self.from_stage)
        _text("RefusalMessage.to_stage", self.to_stage, MAX_NAME_BYTES, empty_ok=True)
        _name("RefusalMessage.code", self.code)
        _text("RefusalMessage.detail", self.detail, MAX_TEXT_BYTES, empty_ok=True)
        _text("RefusalMessage.addressed", self.addressed, MAX_NAME_BYTES, empty_ok=True)


class WindowMessage(_Base, frozen=True, kw_only=True, tag="window", tag_field="type"):
    """1.1 (§7.6). Receiver → sender: ``increment`` more bytes of DataReady charge may
    be outstanding; sent as the application takes what the charged messages carried."""

    from_stage: str
    to_stage: str
    increment: int

    def __post_init__(self) -> None:
        _name("WindowMessage.from_stage", self.from_stage)
        _name("WindowMessage.to_stage", self.to_stage)
        if not 0 < self.increment <= U64_MAX:
            raise ValueError(
                f"WindowMessage.increment must be in [1, 2**64-1], got {self.increment}"
            )


#: The fixed charge of every DataReadyMessage (its envelope), spec §7.6.
CHARGE_BASE = 256
#: The charge of each tensor table entry.
CHARGE_PER_TENSOR = 64


def charge(msg: DataReadyMessage) -> int:
    """What ``msg`` counts against the receiver's window (spec §7.6): a fixed 256 for
    its envelope, 64 per tensor table entry, and the length of every variable part
    (metadata, headers, inline data, the error's UTF-8 bytes)."""
    total = CHARGE_BASE + len(msg.metadata)
    inline = msg.inline
    if inline is not None:
        total += len(inline.header) + len(inline.data) + CHARGE_PER_TENSOR * len(inline.tensors)
    ref = msg.data_ref
    if ref is not None:
        total += len(ref.header) + len(ref.ref.info) + CHARGE_PER_TENSOR * len(ref.tensors)
    if msg.error:
        total += len(msg.error.encode("utf-8", "surrogatepass"))
    return total


#: What a BatchMessage may carry: the per-object messages, never a Hello, Goodbye,
#: Refusal or another batch.
BatchedMessage = (
    DataReadyMessage | DataProgressMessage | DataAckMessage | AbortMessage | WindowMessage
)


class BatchMessage(_Base, frozen=True, kw_only=True, tag="batch", tag_field="type"):
    """1.1. Several messages to one peer in one frame, applied in order, exactly as
    if each had arrived in a frame of its own."""

    messages: tuple[BatchedMessage, ...]
    #: 1.1, feature ``"resume"`` (§10.7): the sender, for a numbered frame or an ack.
    from_stage: str = ""
    #: The addressee's session token (its Hello's ``session``) this frame belongs to.
    session: int = 0
    #: This frame's number in the session, from 1; 0: not numbered (an ack alone).
    seq: int = 0
    #: The highest number of the addressee's frames the sender applied, in order.
    ack: int = 0

    def __post_init__(self) -> None:
        # on every numbered frame, sent and received: the common case (a frame of one
        # or a few messages, numbers in range) is a handful of comparisons
        count = len(self.messages)
        seq, ack = self.seq, self.ack
        alone = ack and not seq  # an ack alone carries no message
        if (count == 0) is not bool(alone) or count > MAX_BATCH_MESSAGES:
            least, most = (0, 0) if alone else (1, MAX_BATCH_MESSAGES)
            raise ValueError(
                f"BatchMessage carries {count} messages; it must carry "
                f"{least} to {most}" + (" (an ack alone)" if alone else "")
            )
        if seq or ack:
            if not 0 < self.session <= U64_MAX:
                raise ValueError("a numbered BatchMessage or an ack needs a session token")
            if not (0 <= seq <= U64_MAX and 0 <= ack <= U64_MAX):
                _u64("BatchMessage.seq", seq)
                _u64("BatchMessage.ack", ack)
            sender = self.from_stage
            if alone:
                _name("BatchMessage.from_stage", sender)
            for m in self.messages:  # each checked its own from_stage as a name
                if m.from_stage != sender:
                    raise ValueError(
                        f"BatchMessage from {sender!r} holds a message from {m.from_stage!r}"
                    )


Message = (
    HelloMessage
    | DataReadyMessage
    | DataProgressMessage
    | DataAckMessage
    | AbortMessage
    | GoodbyeMessage
    | RefusalMessage
    | BatchMessage
    | WindowMessage
)
