"""``cuda_ipc``: CUDA tensors between processes of one host, through CUDA IPC.

Two paths, chosen per object by the sender:

- **Same GPU** (the receiver's GPU holds every tensor): :meth:`CudaIpcBackend.export_tensors`
  shares each tensor's storage with torch's own CUDA IPC machinery
  (``UntypedStorage._share_cuda_``, as ``torch.multiprocessing.reductions.reduce_tensor``
  does) and the receiver maps it (``UntypedStorage._new_shared_cuda``, as
  ``rebuild_cuda_tensor`` does): layout ``per_tensor``, no copy. The sender keeps
  the tensors alive until the ACK.
- **Another GPU** (or a storage torch cannot share, such as one received from
  another process): a **slot pool** on the sender's GPU, reserved by :meth:`start`
  (``backend_options={"cuda_ipc": {"pool_size": ...}}``, so an out-of-memory shows
  when the endpoint starts) and carved by a buddy allocator. Packing copies the
  payload into a slot; :meth:`publish` records an interprocess CUDA event; the
  receiver maps the pool once (its IPC handle is exported once per receiver), waits
  for the event, and copies out (or the endpoint views the slot, in zero-copy
  mode). An object larger than the free pool gets a dedicated buffer, shared the
  same way and dropped after its ACK.

Lifetime (spec §7) and torch's own reference counting
-----------------------------------------------------
torch counts, per ``_share_cuda_`` call, the consumers of a shared block in a
shared-memory file (``/torch_<pid>_…``): the producer's block is not returned to
its caching allocator ("limbo") until every consumer storage built by
``_new_shared_cuda`` is gone — each decrements its counter when it dies, after a
stream sync — or ``_release_ipc_counter_cuda`` is called for it. omniwire's ACK is
the primary rule (the sender holds its tensors / slot until the ACK), and torch's
counters are kept exact so that they cooperate:

- every share the sender makes is either mapped exactly once by the receiver (its
  storage then releases the counter) or released explicitly: by the receiver when it
  refuses an object unopened (:meth:`drop`) or fails half-way, by the sender when a
  share fails half-way, or by the sender for a peer whose process died;
- so a zero-copy view the user keeps after releasing it stays valid memory (torch
  keeps the block in limbo), and nothing stays in limbo once everybody is done.

Receivers drop mapped storages in a helper thread (torch's deleter synchronizes a
stream), after an event recorded where the endpoint copied from them. Pool slots
are reused only after the receiver is done: a receiver that handed out zero-copy
views of a slot records its *release event* (an interprocess event announced in its
Hello) when they are released, and a freed slot is quarantined until that event has
completed (the sender queries it; it never blocks the event loop). In-place writes
by the user into a tensor sent on the same-GPU path, after its ACK, race with the
receiver's pending copy just as with ``torch.multiprocessing``: do not mutate a sent
tensor; send a fresh one.

Each end announces the GPU it receives on; :meth:`connect` refuses a peer whose GPU
cannot access this one's (``torch.cuda.can_device_access_peer``), so the endpoint
routes that peer elsewhere.

Blocking CUDA calls (opening handles, event waits, copies, syncs) run in worker
threads (``anyio.to_thread.run_sync``) bounded by ``timeout``; a failed or timed-out
transfer frees its slot and fails only itself.

Wire blobs (spec §9), msgpack maps of typed structs, validated on receipt:

- Hello (``BackendInfo.info``): ``{"pid": int, "device": <uuid of the GPU this
  endpoint receives on>, "release_event": <64-byte IPC event handle>}``.
- Reference (``BackendRef.info``), tagged by ``"type"``:
  ``{"type": "tensors", "shares": [Share], "tensors": [{"share", "dtype", "shape",
  "stride", "offset"}]}`` or ``{"type": "slot", "buffer": Share, "buffer_id",
  "dedicated", "offset", "size", "event", "event_id"}``, where a Share is
  ``{"device": <GPU uuid>, "handle": <torch shareable IPC handle>, "nbytes",
  "offset" (of the storage in its CUDA allocation), "counter" (torch's ref-counter
  file, ``/torch_<sender pid>_…``), "counter_offset", "event", "event_sync"}``.

Options (``backend_options={"cuda_ipc": {...}}``): ``pool_size`` (bytes, default
256 MiB; 0 disables the pool), ``device`` (the local GPU index this endpoint
receives on and keeps its pool on; default: the current device), ``min_block``
(slot granularity, default 64 KiB), ``timeout`` (seconds for one GPU wait or copy,
default 60).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar, cast

import anyio
import msgspec
import torch

from .. import hostinfo
from ..alloc import BuddyAllocator
from ..errors import BackendClosedError, BackendError
from ..packing import dtype_name, torch_dtype
from ..wire import DTYPE_ITEMSIZE, MAX_NDIM, MAX_TENSORS, align_up
from .base import (
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    InboundBuffer,
    Locality,
    OutboundBuffer,
    PeerInfo,
)

__all__ = ["CudaIpcBackend", "SlotPool"]

log = logging.getLogger("omniwire.cuda_ipc")

#: Size of a CUDA IPC event handle (cudaIpcEventHandle_t).
IPC_EVENT_HANDLE_SIZE = 64
#: torch's shareable memory handles are a 64-byte cudaIpcMemHandle plus a small
#: header, or a longer descriptor for expandable segments; anything beyond this is junk.
MAX_MEM_HANDLE_SIZE = 1024
#: Slots in one of torch's ref-counter files (CUDA_IPC_REF_COUNTER_FILE_SIZE).
TORCH_REF_COUNTER_SLOTS = 10000
#: torch names its ref-counter files ``/torch_<pid>_<random>[_<counter>]``.
_COUNTER = re.compile(r"^/torch_(\d{1,10})_\d{1,20}(?:_\d{1,20})?$")
_MAX_BYTES = 1 << 50
_MAX_ID = 1 << 32
#: freed shares remembered per peer, to release their counters if the peer dies.
_RECENT_SHARES = 4096

_T = TypeVar("_T")

# torch's CUDA IPC entry points are untyped; they are called through these.
_cuda: Any = torch.cuda
_Storage: Any = torch.UntypedStorage


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------- wire blobs


class _HelloInfo(msgspec.Struct, frozen=True):
    pid: int
    device: str
    release_event: bytes = b""


class _Share(msgspec.Struct, frozen=True):
    """One storage shared by ``UntypedStorage._share_cuda_``."""

    device: str
    handle: bytes
    nbytes: int
    offset: int
    counter: str = ""
    counter_offset: int = 0
    event: bytes = b""
    event_sync: bool = False


class _TensorRef(msgspec.Struct, frozen=True):
    share: int
    dtype: str
    shape: list[int]
    stride: list[int]
    offset: int


class _TensorsRef(msgspec.Struct, frozen=True, tag="tensors", tag_field="type"):
    shares: list[_Share]
    tensors: list[_TensorRef]


class _SlotRef(msgspec.Struct, frozen=True, tag="slot", tag_field="type"):
    buffer: _Share
    buffer_id: int
    dedicated: bool
    offset: int
    size: int
    event: bytes
    event_id: int


_Ref = _TensorsRef | _SlotRef

_encoder = msgspec.msgpack.Encoder()
_hello_decoder = msgspec.msgpack.Decoder(_HelloInfo)
_ref_decoder = msgspec.msgpack.Decoder(_Ref)


def decode_hello(peer: PeerInfo) -> _HelloInfo:
    """Decode and validate a peer's Hello info.

    Raises:
        BackendError: it is malformed or does not match the peer.
    """
    try:
        hello = _hello_decoder.decode(peer.info)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BackendError(f"malformed cuda_ipc hello info from {peer.name!r}: {exc}") from None
    if hello.pid != peer.pid:
        raise BackendError(
            f"cuda_ipc hello info from {peer.name!r} names pid {hello.pid}, not {peer.pid}"
        )
    if not 0 < len(hello.device.encode()) <= 256:
        raise BackendError(f"cuda_ipc hello info from {peer.name!r} names no GPU")
    if len(hello.release_event) not in (0, IPC_EVENT_HANDLE_SIZE):
        raise BackendError(f"cuda_ipc hello info from {peer.name!r} has a malformed event handle")
    return hello


def decode_ref(info: bytes, peer: PeerInfo, nbytes: int) -> _Ref:
    """Decode and validate a reference from ``peer`` for an object of ``nbytes``.

    Checks every field: handles and events have sane sizes, torch's ref counter
    belongs to the peer's process and its slot exists, each tensor lies inside its
    storage, a slot lies inside its buffer, and the sizes add up to ``nbytes``.

    Raises:
        BackendError: the reference is malformed, or names memory the peer does not
            own, or lies outside it.
    """
    try:
        ref = _ref_decoder.decode(info)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BackendError(f"malformed cuda_ipc reference from {peer.name!r}: {exc}") from None
    where = f"cuda_ipc reference from {peer.name!r}"
    if isinstance(ref, _TensorsRef):
        _check_tensors(ref, peer, nbytes, where)
    else:
        _check_share(ref.buffer, peer, where)
        if not (0 <= ref.buffer_id < _MAX_ID and 0 <= ref.event_id < _MAX_ID):
            raise BackendError(f"{where} has an id out of range")
        if ref.size != nbytes:
            raise BackendError(f"{where} has size {ref.size} != {nbytes}")
        if ref.offset < 0 or ref.offset + ref.size > ref.buffer.nbytes:
            raise BackendError(
                f"{where} spans [{ref.offset}, {ref.offset + ref.size}) outside its "
                f"{ref.buffer.nbytes}-byte buffer"
            )
        if ref.size and not ref.buffer.handle:
            raise BackendError(f"{where} names no buffer")
        if len(ref.event) != IPC_EVENT_HANDLE_SIZE:
            raise BackendError(f"{where} has a malformed event handle")
    return ref


def _check_share(share: _Share, peer: PeerInfo, where: str) -> None:
    if not 0 < len(share.device.encode()) <= 256:
        raise BackendError(f"{where} names no GPU")
    if not (0 <= share.nbytes <= _MAX_BYTES and 0 <= share.offset <= _MAX_BYTES):
        raise BackendError(f"{where} has a storage size or offset out of range")
    if len(share.handle) > MAX_MEM_HANDLE_SIZE:
        raise BackendError(f"{where} has a {len(share.handle)}-byte memory handle")
    if not share.handle:
        if share.nbytes or share.counter:
            raise BackendError(f"{where} shares {share.nbytes} bytes without a memory handle")
        return
    m = _COUNTER.match(share.counter)
    if m is None:
        raise BackendError(f"{where} names ref counter {share.counter[:80]!r}, not torch's")
    if int(m.group(1)) != peer.pid:
        raise BackendError(
            f"{where} names ref counter {share.counter!r} of pid {m.group(1)}, "
            f"which is not the peer's process ({peer.pid})"
        )
    if not 0 <= share.counter_offset < TORCH_REF_COUNTER_SLOTS:
        raise BackendError(f"{where} has ref counter slot {share.counter_offset} out of range")
    if len(share.event) not in (0, IPC_EVENT_HANDLE_SIZE) or (share.event_sync and not share.event):
        raise BackendError(f"{where} has a malformed event handle")


def _check_tensors(ref: _TensorsRef, peer: PeerInfo, nbytes: int, where: str) -> None:
    if len(ref.tensors) > MAX_TENSORS or len(ref.shares) > len(ref.tensors):
        raise BackendError(f"{where} has {len(ref.tensors)} tensors, {len(ref.shares)} shares")
    for share in ref.shares:
        _check_share(share, peer, where)
    end = 0
    raw = 0
    for i, t in enumerate(ref.tensors):
        if not 0 <= t.share < len(ref.shares):
            raise BackendError(f"{where}: tensor {i} names share {t.share} of {len(ref.shares)}")
        itemsize = DTYPE_ITEMSIZE.get(t.dtype)
        if itemsize is None:
            raise BackendError(f"{where}: tensor {i} has unknown dtype {t.dtype[:40]!r}")
        if len(t.shape) != len(t.stride) or len(t.shape) > MAX_NDIM:
            raise BackendError(f"{where}: tensor {i} has a malformed shape/stride")
        if any(not 0 <= d <= _MAX_BYTES for d in (*t.shape, *t.stride, t.offset)):
            raise BackendError(f"{where}: tensor {i} has a size, stride or offset out of range")
        numel = 1
        for d in t.shape:
            numel *= d
        if numel > _MAX_BYTES:
            raise BackendError(f"{where}: tensor {i} is too large")
        size = numel * itemsize
        if numel:
            last = t.offset + sum((d - 1) * s for d, s in zip(t.shape, t.stride, strict=True))
            if (last + 1) * itemsize > ref.shares[t.share].nbytes:
                raise BackendError(
                    f"{where}: tensor {i} reaches byte {(last + 1) * itemsize} of a "
                    f"{ref.shares[t.share].nbytes}-byte storage"
                )
        end = align_up(end) + size
        raw += size
    if nbytes not in (end, raw):
        raise BackendError(f"{where} describes {end} bytes of tensors, not {nbytes}")


def packed_length(tensors: Sequence[torch.Tensor]) -> int:
    """The packed length of ``tensors`` (spec §5): what the DataRef's length will be."""
    end = 0
    for t in tensors:
        end = align_up(end) + t.numel() * t.element_size()
    return end


# --------------------------------------------------------------------------- pure helpers


def plan_shares(
    tensors: Sequence[torch.Tensor],
    share: Callable[[torch.UntypedStorage], _Share],
    release: Callable[[_Share], None],
) -> _TensorsRef:
    """Share each distinct storage of ``tensors`` once and describe every tensor as a
    view of its share. If a share fails, those already made are released and the
    error propagates (the caller then packs into a slot instead).
    """
    shares: list[_Share] = []
    index: dict[tuple[str, int, int], int] = {}
    refs: list[_TensorRef] = []
    try:
        for t in tensors:
            storage = t.untyped_storage()
            key = (str(storage.device), storage.data_ptr(), storage.nbytes())
            i = index.get(key)
            if i is None:
                i = index[key] = len(shares)
                shares.append(share(storage))
            refs.append(
                _TensorRef(
                    share=i,
                    dtype=dtype_name(t.dtype),
                    shape=[int(d) for d in t.shape],
                    stride=[int(d) for d in t.stride()],
                    offset=int(t.storage_offset()),
                )
            )
    except BaseException:
        for s in shares:
            release(s)
        raise
    return _TensorsRef(shares=shares, tensors=refs)


def build_views(ref: _TensorsRef, storages: Sequence[torch.UntypedStorage]) -> list[torch.Tensor]:
    """The tensors ``ref`` describes, as views of the mapped ``storages``."""
    out = []
    for t in ref.tensors:
        storage = storages[t.share]
        view = torch.empty(0, dtype=torch_dtype(t.dtype), device=storage.device)
        out.append(view.set_(storage, t.offset, tuple(t.shape), tuple(t.stride)))
    return out


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage``."""
    base = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return base.set_(storage, 0, (storage.nbytes(),), (1,))


class SlotPool:
    """Slots of a fixed pool: buddy-allocated offsets, and a quarantine for freed slots
    that a receiver may still be reading (zero-copy views whose GPU work is pending).

    A freed slot is held for its last holder (a peer key) until ``reclaim`` finds
    that holder done. Pure bookkeeping: it never touches memory. Not thread-safe.
    """

    def __init__(self, capacity: int, min_block: int) -> None:
        self._alloc = BuddyAllocator(capacity, min_block)
        self.capacity = self._alloc.capacity
        self._quarantine: dict[Hashable, list[int]] = {}

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a free slot of at least ``nbytes``, or None."""
        return self._alloc.allocate(max(nbytes, 1))

    def release(self, offset: int, holder: Hashable | None) -> None:
        """Free a slot; with a holder, only once ``reclaim`` finds the holder done."""
        if holder is None:
            self._alloc.free(offset)
        else:
            self._quarantine.setdefault(holder, []).append(offset)

    def reclaim(self, done: Callable[[Hashable], bool]) -> int:
        """Free the quarantined slots of every holder for which ``done`` is true."""
        freed = 0
        for holder in [h for h in self._quarantine if done(h)]:
            freed += self.forget(holder)
        return freed

    def forget(self, holder: Hashable) -> int:
        """Free every slot quarantined for ``holder`` now (it is gone)."""
        offsets = self._quarantine.pop(holder, [])
        for offset in offsets:
            self._alloc.free(offset)
        return len(offsets)

    @property
    def holders(self) -> list[Hashable]:
        return list(self._quarantine)

    @property
    def quarantined(self) -> int:
        return sum(len(v) for v in self._quarantine.values())

    @property
    def bytes_in_use(self) -> int:
        """Bytes in allocated slots, quarantined ones included."""
        return self._alloc.bytes_in_use

    @property
    def allocations(self) -> int:
        return self._alloc.allocations


class EventRing:
    """Reusable interprocess events with their IPC handles, created on demand."""

    def __init__(self, factory: Callable[[], tuple[Any, bytes]]) -> None:
        self._factory = factory
        self._events: list[tuple[Any, bytes]] = []
        self._free: list[int] = []

    def take(self) -> tuple[int, Any, bytes]:
        if self._free:
            i = self._free.pop()
        else:
            i = len(self._events)
            self._events.append(self._factory())
        event, handle = self._events[i]
        return i, event, handle

    def give(self, i: int) -> None:
        self._free.append(i)

    def __len__(self) -> int:
        return len(self._events)

    @property
    def in_use(self) -> int:
        return len(self._events) - len(self._free)


class _Reaper:
    """A helper thread that runs clean-ups which may block on the GPU (dropping
    mapped storages runs torch's deleter, which synchronizes a stream)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._stopped:
                _run_quietly(fn)
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="omniwire-cuda-ipc-reaper", daemon=True
                )
                self._thread.start()
            self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            _run_quietly(fn)
            del fn  # the last references to mapped storages die here, in this thread

    def stop(self, timeout: float) -> None:
        with self._lock:
            self._stopped = True
            thread = self._thread
            self._queue.put(None)
        if thread is not None:
            thread.join(timeout)


def _run_quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        log.exception("cuda_ipc clean-up failed")


# --------------------------------------------------------------------------- CUDA calls
# The only functions that call into torch's CUDA IPC internals. They run in worker
# threads (or the reaper), never on the event loop, except where noted.


def _share_storage(storage: torch.UntypedStorage, uuid_of: Callable[[int], str]) -> _Share:
    """``storage._share_cuda_()`` as a typed share (cheap: an event record; loop-safe).

    Raises:
        RuntimeError: torch cannot share it (received from another process, not from
            the caching allocator, …).
    """
    dev, handle, nbytes, offset, counter, counter_offset, event, sync = cast(
        Any, storage
    )._share_cuda_()
    if not handle:
        return _Share(device=uuid_of(int(dev)), handle=b"", nbytes=0, offset=0)
    return _Share(
        device=uuid_of(int(dev)),
        handle=bytes(handle),
        nbytes=int(nbytes),
        offset=int(offset),
        counter=bytes(counter).decode("ascii"),
        counter_offset=int(counter_offset),
        event=bytes(event) if sync else b"",
        event_sync=bool(sync),
    )


def _open_share(share: _Share, index: int) -> torch.UntypedStorage:
    """Map a share on local GPU ``index`` (``_new_shared_cuda``: opens the memory
    handle, makes this thread's current stream wait for the sender's event). The
    storage releases torch's counter when it dies."""
    if not share.handle or not share.nbytes:
        return cast(torch.UntypedStorage, _Storage(0, device=torch.device("cuda", index)))
    return cast(
        torch.UntypedStorage,
        _Storage._new_shared_cuda(
            index,
            share.handle,
            share.nbytes,
            share.offset,
            share.counter.encode("ascii"),
            share.counter_offset,
            share.event or bytes(IPC_EVENT_HANDLE_SIZE),
            share.event_sync,
        ),
    )


def _release_share(share: _Share) -> None:
    """Give back torch's counter of a share that will never be mapped (best effort)."""
    if share.counter:
        _Storage._release_ipc_counter_cuda(share.counter.encode("ascii"), share.counter_offset)


def _release_shares(shares: Iterable[_Share]) -> None:
    for share in shares:
        try:
            _release_share(share)
        except Exception as exc:  # the producer may be gone: torch calls this best effort
            log.debug("cuda_ipc: releasing ref counter %s failed: %s", share.counter, exc)


def _on_device(index: int) -> contextlib.AbstractContextManager[Any]:
    """Make GPU ``index`` current in this thread for the block."""
    return torch.cuda.device(index)


def _empty(nbytes: int, index: int) -> torch.Tensor:
    """A fresh uint8 buffer on GPU ``index`` (from torch's caching allocator, so that
    ``_share_cuda_`` can share it)."""
    with _on_device(index):
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=torch.device("cuda", index))


def _gpu_index(t: torch.Tensor) -> int | None:
    """The GPU a tensor is on, or None for a tensor off the GPU."""
    return t.device.index if t.device.type == "cuda" else None


def _sync_streams(indices: Iterable[int]) -> None:
    """Wait for this thread's current stream on each GPU."""
    for index in sorted(set(indices)):
        torch.cuda.current_stream(index).synchronize()


def _peer_access(a: int, b: int) -> bool:
    """Whether GPUs ``a`` and ``b`` can access each other's memory."""
    return bool(torch.cuda.can_device_access_peer(a, b)) and bool(
        torch.cuda.can_device_access_peer(b, a)
    )


def _new_ipc_event(index: int) -> tuple[Any, bytes]:
    with _on_device(index):
        event = _cuda.Event(interprocess=True)
        handle = bytes(cast(Any, event).ipc_handle())
    return event, handle


def _open_event(index: int, handle: bytes) -> Any:
    with _on_device(index):
        return _cuda.Event.from_ipc_handle(torch.device("cuda", index), handle)


def _record_after(event: Any, index: int, others: Iterable[int] = ()) -> None:
    """Record ``event`` on this thread's current stream of GPU ``index``, after the
    work already queued on the default stream there (packing runs in worker threads,
    whose current stream is the default one) and on the current streams of ``others``."""
    current = torch.cuda.current_stream(index)
    default = torch.cuda.default_stream(index)
    if current != default:
        current.wait_stream(default)
    for other in others:
        if other != index:
            current.wait_stream(torch.cuda.current_stream(other))
    event.record(current)


def _local_events(devices: Iterable[int]) -> list[Any]:
    """Events recorded now on the current streams of ``devices`` (loop-safe)."""
    events = []
    for index in sorted(set(devices)):
        with _on_device(index):
            event = _cuda.Event()
            event.record(torch.cuda.current_stream(index))
            events.append(event)
    return events


# --------------------------------------------------------------------------- bookkeeping


@dataclass(eq=False)
class _TensorLease:
    peer: tuple[str, int]
    tensors: list[torch.Tensor]
    ref: _TensorsRef


@dataclass(eq=False)
class _SlotLease:
    peer: tuple[str, int]
    share: _Share
    buffer_id: int
    offset: int
    event_id: int
    event: Any
    event_handle: bytes
    dedicated: torch.Tensor | None = None


@dataclass(eq=False)
class _Mapped:
    share: _Share
    storage: torch.UntypedStorage
    base: torch.Tensor
    index: int


@dataclass(eq=False)
class _Mapping:
    """What a mapping thread did: the storages mapped so far, and whether it ended."""

    storages: list[torch.UntypedStorage] = field(default_factory=list)
    settled: bool = False


@dataclass(eq=False)
class _Inbound:
    ref: _Ref
    index: int
    mapping: _Mapping | None = None
    dedicated: _Mapped | None = None
    event: Any = None
    ready: bool = False
    viewed: bool = False


@dataclass(eq=False)
class _PeerState:
    key: tuple[str, int]
    pid: int
    name: str
    reachable: bool
    #: the peer's receiving GPU, as a local index (None: not visible here)
    device: int | None
    release_handle: bytes
    #: sender side: the peer's release event, opened here (None: not yet; False: cannot)
    release: Any = None
    pool_share: _Share | None = None
    recent_shares: collections.deque[_Share] = field(
        default_factory=lambda: collections.deque(maxlen=_RECENT_SHARES)
    )
    #: receiver side: the peer's buffers mapped here, its events opened here
    pools: dict[int, _Mapped] = field(default_factory=dict)
    events: dict[int, tuple[bytes, Any]] = field(default_factory=dict)
    unopened: dict[int, _Share] = field(default_factory=dict)


class CudaIpcBackend(ByteBackend):
    """CUDA tensors between GPU stages of one host. See the module docstring."""

    name: ClassVar[str] = "cuda_ipc"
    summary: ClassVar[str] = "CUDA IPC: same GPU mapped in place, other GPUs via a slot pool"
    install_hint: ClassVar[str] = "needs an NVIDIA GPU and a CUDA build of torch"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cuda"}),
        localities=frozenset({Locality.SAME_HOST}),
        streaming=True,
        payloads=True,
        host_staging=False,
        zero_copy=True,
        needs_gpu_peer_access=True,
        preference=85,
    )
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "always"
    needs_gpu: ClassVar[bool] = True

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        opts = ctx.options
        self.pool_size = int(opts.get("pool_size", 256 << 20))
        self.min_block = int(opts.get("min_block", 64 << 10))
        self.timeout = float(opts.get("timeout", 60.0))
        self._wanted_device = opts.get("device")
        if self.pool_size < 0 or self.min_block <= 0 or self.min_block & (self.min_block - 1):
            raise BackendError(
                "cuda_ipc options: pool_size must be >= 0 and min_block a power of two"
            )
        self.device: int | None = None
        self._uuid_by_index: dict[int, str] = {}
        self._index_by_uuid: dict[str, int] = {}
        self._pool: torch.Tensor | None = None
        self._slots: SlotPool | None = None
        self._events: EventRing | None = None
        self._release_event: Any = None
        self._release_handle = b""
        self._peers: dict[tuple[str, int], _PeerState] = {}
        self._leases: set[_TensorLease | _SlotLease] = set()
        self._dedicated_ids = itertools.count(1)
        self._reaper = _Reaper()
        self._open = 0
        self._started = False
        self._closed = False
        self._warned: set[str] = set()
        #: objects sent per path, since start
        self._counts = {"in_place": 0, "pooled": 0, "dedicated": 0}

    @classmethod
    def availability(cls) -> Availability:
        if not hasattr(torch.UntypedStorage, "_share_cuda_"):
            return Availability.missing(
                f"torch {torch.__version__} has no CUDA IPC storage sharing", cls.install_hint
            )
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return Availability.missing(
                f"no CUDA device: torch {torch.__version__} is a build without CUDA",
                cls.install_hint,
            )
        try:
            ok = torch.cuda.is_available()
        except Exception as exc:
            return Availability.missing(f"no CUDA device: CUDA failed to initialise ({exc})")
        if not ok:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            extra = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return Availability.missing(f"no CUDA device: torch sees no GPU{extra}")
        return Availability.ok()

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Pick this endpoint's GPU, reserve the slot pool, create the release event.

        Raises:
            BackendError: no CUDA device, or the pool does not fit on the GPU.
        """
        if self._started:
            return
        av = self.availability()
        if not av.available:
            raise BackendError(f"cuda_ipc cannot start: {av.reason}")
        self._started = True
        # The current device is per thread: read it here, on the endpoint's thread.
        # (The endpoint listed its GPUs already, so CUDA is initialised and this is cheap.)
        wanted = self._wanted_device
        current = torch.cuda.current_device() if wanted is None else int(wanted)
        # The rest (CUDA initialisation, the pool's cudaMalloc) can take a while.
        await anyio.to_thread.run_sync(self._pick_device, current)
        device = self.device
        try:
            await anyio.to_thread.run_sync(self._reserve)
        except torch.cuda.OutOfMemoryError as exc:
            free, total = await anyio.to_thread.run_sync(torch.cuda.mem_get_info, device)
            raise BackendError(
                f"cannot reserve the cuda_ipc slot pool of {_mib(self.pool_size)} on cuda:{device} "
                f"({_mib(free)} of {_mib(total)} free): lower "
                "backend_options['cuda_ipc']['pool_size']"
            ) from exc
        except RuntimeError as exc:
            raise BackendError(f"cuda_ipc cannot start on cuda:{device}: {exc}") from exc

    def _pick_device(self, device: int) -> None:
        _cuda.init()
        for d in hostinfo.local_devices():
            if d.kind == "cuda":
                # Without a UUID (old drivers) fall back to the index, as
                # torch.multiprocessing does: both ends must then number GPUs alike.
                self._uuid_by_index[d.index] = d.uuid or f"cuda-index-{d.index}"
        self._index_by_uuid = {u: i for i, u in self._uuid_by_index.items()}
        if device not in self._uuid_by_index:
            raise BackendError(
                f"cuda_ipc: device {device} is not one of this process's GPUs "
                f"({sorted(self._uuid_by_index)})"
            )
        self.device = device

    def _reserve(self) -> None:
        assert self.device is not None
        index = self.device
        self._release_event, self._release_handle = _new_ipc_event(index)
        if self.pool_size >= self.min_block:
            self._pool = _empty(self.pool_size, index)
            self._slots = SlotPool(self.pool_size, self.min_block)
        self._events = EventRing(lambda: _new_ipc_event(index))

    def local_info(self) -> bytes:
        device = self._uuid_by_index.get(self.device, "") if self.device is not None else ""
        return _encoder.encode(
            _HelloInfo(pid=os.getpid(), device=device, release_event=self._release_handle)
        )

    async def connect(self, peer: PeerInfo) -> None:
        """Learn the peer's GPU and release event.

        Raises:
            BackendError: malformed Hello info, or the two GPUs cannot access each
                other (the endpoint then routes this peer elsewhere).
        """
        hello = decode_hello(peer)
        reachable = peer.locality is Locality.SAME_HOST
        device = self._index_by_uuid.get(hello.device)
        mine = self.device
        if reachable and device is not None and mine is not None and device != mine:
            ok = await self._gpu("checking peer access", _peer_access, mine, device)
            if not ok:
                raise BackendError(
                    f"cuda:{mine} (here) and cuda:{device} ({peer.name!r}) cannot access "
                    "each other's memory"
                )
        self._peers[peer.key] = _PeerState(
            key=peer.key,
            pid=peer.pid,
            name=peer.name,
            reachable=reachable,
            device=device,
            release_handle=hello.release_event,
        )

    async def disconnect(self, peer: PeerInfo) -> None:
        st = self._peers.pop(peer.key, None)
        if st is None:
            return
        self._forget_peer(st, dead=not hostinfo.pid_alive(st.pid))

    def _forget_peer(self, st: _PeerState, dead: bool) -> None:
        if self._slots is not None:
            self._slots.forget(st.key)
        mapped = list(st.pools.values())
        unopened = list(st.unopened.values())
        st.pools.clear()
        st.events.clear()
        st.unopened.clear()
        # The peer cannot give back torch's counters of what we shared with it any more:
        # do it for it (an extra release of a dead consumer's share frees nothing early).
        orphaned = list(st.recent_shares) if dead else []
        if dead and st.pool_share is not None:
            orphaned.append(st.pool_share)
        st.recent_shares.clear()
        st.release = None

        def clean_up() -> None:
            _release_shares(unopened + orphaned)
            mapped.clear()  # the storages die here, in the reaper

        if mapped or unopened or orphaned:
            self._reaper.submit(clean_up)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for st in list(self._peers.values()):
            self._forget_peer(st, dead=False)
        self._peers.clear()
        self._leases.clear()
        self._pool = None
        self._slots = None
        self._events = None
        self._release_event = None
        await anyio.to_thread.run_sync(self._reaper.stop, 10.0)
        if self._started:
            with contextlib.suppress(Exception):
                await anyio.to_thread.run_sync(torch.cuda.ipc_collect)

    def stats(self) -> dict[str, int]:
        slots = self._slots
        return {
            "leases": len(self._leases),
            "open": self._open,
            "pool_bytes": slots.capacity if slots else 0,
            "pool_bytes_in_use": slots.bytes_in_use if slots else 0,
            "quarantined_slots": slots.quarantined if slots else 0,
            "dedicated_buffers": sum(
                1 for x in self._leases if isinstance(x, _SlotLease) and x.dedicated is not None
            ),
            "events": len(self._events) if self._events else 0,
            "mapped_buffers": sum(len(st.pools) for st in self._peers.values()),
            "sent_in_place": self._counts["in_place"],
            "sent_pooled": self._counts["pooled"],
            "sent_dedicated": self._counts["dedicated"],
        }

    # -- helpers ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError("cuda_ipc backend is closed")
        if not self._started:
            raise BackendError("cuda_ipc backend is not started")

    def _state(self, peer: PeerInfo) -> _PeerState:
        st = self._peers.get(peer.key)
        if st is None:
            raise BackendError(f"{peer.name!r} did not announce cuda_ipc in its Hello")
        if not st.reachable:
            raise BackendError(
                f"cuda_ipc reaches processes on this host only; {peer.name!r} is "
                f"{peer.locality.value.replace('_', ' ')}"
            )
        return st

    def _uuid_of(self, index: int) -> str:
        try:
            return self._uuid_by_index[index]
        except KeyError:
            raise BackendError(f"cuda:{index} is not a GPU this process knows") from None

    def _index_of(self, uuid: str, peer: PeerInfo) -> int:
        index = self._index_by_uuid.get(uuid)
        if index is None:
            raise BackendError(
                f"GPU {uuid[:64]!r} of {peer.name!r} is not visible in this process "
                "(check CUDA_VISIBLE_DEVICES on both ends)"
            )
        return index

    async def _gpu(self, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking CUDA call in a worker thread, bounded by ``timeout``."""
        try:
            with anyio.fail_after(self.timeout):
                return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except TimeoutError:
            raise BackendError(
                f"cuda_ipc: {what} did not finish within {self.timeout:g} s"
            ) from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise BackendError(f"cuda_ipc: {what} failed: {exc}") from exc

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # -- sender ------------------------------------------------------------------------

    async def export_tensors(
        self, peer: PeerInfo, tensors: list[torch.Tensor]
    ) -> OutboundBuffer | None:
        """Same GPU: share the tensors in place (layout ``per_tensor``). Returns None —
        so the endpoint packs into a slot — when the peer receives on another GPU, a
        tensor is not on CUDA, or torch cannot share a storage."""
        self._check_open()
        st = self._state(peer)
        if not tensors or st.device is None:
            return None
        if any(_gpu_index(t) != st.device for t in tensors):
            return None
        try:
            ref = plan_shares(
                tensors,
                lambda s: _share_storage(s, self._uuid_of),
                lambda s: self._reaper.submit(lambda: _release_shares([s])),
            )
        except (RuntimeError, BackendError) as exc:
            self._warn_once(
                "export",
                "cuda_ipc: cannot share a tensor in place (%s); copying through the slot pool",
                exc,
            )
            return None
        lease = _TensorLease(peer.key, list(tensors), ref)
        self._leases.add(lease)
        self._counts["in_place"] += 1
        return OutboundBuffer(peer, packed_length(tensors), None, lease, layout="per_tensor")

    async def allocate(self, peer: PeerInfo, nbytes: int, device: str) -> OutboundBuffer:
        """A slot of the pool (or a dedicated buffer when none is free) on this
        endpoint's GPU, with an interprocess event for :meth:`publish`.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: the peer is unknown, or no GPU memory for a dedicated buffer.
        """
        self._check_open()
        st = self._state(peer)
        assert self.device is not None and self._events is not None
        if st.release is None and st.release_handle and st.device is not None:
            try:
                st.release = await self._gpu(
                    "opening the peer's release event", _open_event, st.device, st.release_handle
                )
            except BackendError as exc:
                st.release = False
                self._warn_once(
                    "release",
                    "cuda_ipc: cannot open the release event of %s (%s): freed slots are "
                    "reused at once",
                    peer.name,
                    exc,
                )
        offset = await self._take_slot(nbytes)
        event_id, event, handle = self._events.take()
        try:
            if offset is not None:
                assert self._pool is not None
                if st.pool_share is None:
                    st.pool_share = _share_storage(self._pool.untyped_storage(), self._uuid_of)
                lease = _SlotLease(peer.key, st.pool_share, 0, offset, event_id, event, handle)
                buffer = self._pool[offset : offset + nbytes]
                self._counts["pooled"] += 1
            else:
                dedicated = await self._new_dedicated(nbytes)
                share = _share_storage(dedicated.untyped_storage(), self._uuid_of)
                st.recent_shares.append(share)
                lease = _SlotLease(
                    peer.key,
                    share,
                    next(self._dedicated_ids),
                    0,
                    event_id,
                    event,
                    handle,
                    dedicated,
                )
                buffer = dedicated[:nbytes]
                self._counts["dedicated"] += 1
        except BaseException as exc:
            self._events.give(event_id)
            if offset is not None and self._slots is not None:
                self._slots.release(offset, None)
            if isinstance(exc, RuntimeError):
                raise BackendError(
                    f"cuda_ipc: cannot share a buffer with {peer.name!r}: {exc}"
                ) from exc
            raise
        self._leases.add(lease)
        return OutboundBuffer(peer, nbytes, buffer, lease)

    async def _take_slot(self, nbytes: int) -> int | None:
        slots = self._slots
        if slots is None or nbytes > slots.capacity:
            return None
        if slots.quarantined:
            slots.reclaim(self._released)
        offset = slots.allocate(nbytes)
        if offset is None and slots.quarantined:
            # Wait (off the loop, bounded) for the receivers still holding slots.
            for holder in slots.holders:
                st = self._peers.get(cast(tuple[str, int], holder))
                if st is not None and st.release not in (None, False):
                    with contextlib.suppress(BackendError):
                        await self._gpu(
                            "waiting for a receiver to release its slots",
                            st.release.synchronize,
                        )
            slots.reclaim(self._released)
            offset = slots.allocate(nbytes)
        if offset is None:
            self._warn_once(
                "dedicated",
                "cuda_ipc slot pool (%s) has no free slot for %s: using a dedicated buffer; "
                "raise backend_options['cuda_ipc']['pool_size'] if this is common",
                _mib(slots.capacity),
                _mib(nbytes),
            )
        return offset

    def _released(self, holder: Hashable) -> bool:
        st = self._peers.get(cast(tuple[str, int], holder))
        if st is None or st.release in (None, False):
            return True
        try:
            return bool(st.release.query())
        except Exception:
            return True

    async def _new_dedicated(self, nbytes: int) -> torch.Tensor:
        assert self.device is not None
        index = self.device
        try:
            return await anyio.to_thread.run_sync(_empty, nbytes, index)
        except torch.cuda.OutOfMemoryError as exc:
            raise BackendError(
                f"cuda_ipc: no GPU memory for a dedicated {_mib(nbytes)} buffer on cuda:{index} "
                "(the slot pool is full)"
            ) from exc

    async def publish(self, out: OutboundBuffer, lo: int, hi: int) -> None:
        """Record the slot's interprocess event after the packing copies."""
        lease = out.handle
        if isinstance(lease, _SlotLease) and self.device is not None:
            _record_after(lease.event, self.device)

    def describe(self, out: OutboundBuffer) -> bytes:
        lease = out.handle
        if isinstance(lease, _TensorLease):
            return _encoder.encode(lease.ref)
        assert isinstance(lease, _SlotLease)
        return _encoder.encode(
            _SlotRef(
                buffer=lease.share,
                buffer_id=lease.buffer_id,
                dedicated=lease.dedicated is not None,
                offset=lease.offset,
                size=out.nbytes,
                event=lease.event_handle,
                event_id=lease.event_id,
            )
        )

    def free(self, out: OutboundBuffer) -> None:
        lease = out.handle
        if lease not in self._leases:
            return
        self._leases.discard(lease)
        out.buffer = None
        st = self._peers.get(lease.peer)
        if isinstance(lease, _TensorLease):
            if st is not None:
                st.recent_shares.extend(lease.ref.shares)
            lease.tensors = []  # torch keeps the blocks (limbo) while the receiver maps them
            return
        if self._events is not None:
            self._events.give(lease.event_id)
        if lease.dedicated is not None:
            lease.dedicated = None  # likewise protected by torch's counter
        elif self._slots is not None and not self._closed:
            if st is None or self._released(lease.peer):
                self._slots.forget(lease.peer)  # its earlier slots are done with too
                self._slots.release(lease.offset, None)
            else:  # zero-copy views of it may still be in use on the receiver's GPU
                self._slots.release(lease.offset, lease.peer)

    # -- receiver ------------------------------------------------------------------------

    async def open(self, peer: PeerInfo, info: bytes, nbytes: int) -> InboundBuffer:
        """Validate a reference; for a slot, map the peer's buffer (once per pool) and
        open its event. Tensors shared in place are mapped by :meth:`fetch`.

        Raises:
            BackendError: malformed or foreign reference, or the mapping failed.
        """
        self._check_open()
        st = self._state(peer)
        ref = decode_ref(info, peer, nbytes)
        if isinstance(ref, _TensorsRef):
            for s in ref.shares:
                self._index_of(s.device, peer)
            self._open += 1
            return InboundBuffer(peer, nbytes, handle=_Inbound(ref, self.device or 0))
        index = self._index_of(ref.buffer.device, peer)
        h = _Inbound(ref, index)
        if ref.dedicated:
            storage = await self._gpu("mapping the peer's buffer", _open_share, ref.buffer, index)
            h.dedicated = _Mapped(ref.buffer, storage, byte_view(storage), index)
            mapped = h.dedicated
        else:
            mapped_or_none = st.pools.get(ref.buffer_id)
            if mapped_or_none is None:
                st.unopened.pop(ref.buffer_id, None)
                storage = await self._gpu("mapping the peer's pool", _open_share, ref.buffer, index)
                mapped_or_none = st.pools[ref.buffer_id] = _Mapped(
                    ref.buffer, storage, byte_view(storage), index
                )
            elif mapped_or_none.share != ref.buffer:
                raise BackendError(f"{peer.name!r} changed its cuda_ipc pool {ref.buffer_id}")
            mapped = mapped_or_none
        try:
            cached = st.events.get(ref.event_id)
            if cached is None or cached[0] != ref.event:
                event = await self._gpu("opening the peer's event", _open_event, index, ref.event)
                cached = st.events[ref.event_id] = (ref.event, event)
            h.event = cached[1]
        except BaseException:
            self._drop_dedicated(h)
            raise
        self._open += 1
        return InboundBuffer(
            peer, nbytes, buffer=mapped.base[ref.offset : ref.offset + ref.size], handle=h
        )

    async def fetch(
        self, inb: InboundBuffer, lo: int, hi: int, dest: torch.Tensor | None = None
    ) -> None:
        """Tensors shared in place: map them (``inb.tensors``) once the sender's work is
        done. A slot: wait for the sender's event, then copy ``[lo, hi)`` into ``dest``
        (and synchronize) or leave the bytes to be viewed in ``inb.buffer``.

        Raises:
            BackendError: the mapping, the wait or the copy failed or timed out.
        """
        h = inb.handle
        if not isinstance(h, _Inbound):
            raise BackendError("cuda_ipc: fetch on a closed inbound buffer")
        if isinstance(h.ref, _TensorsRef):
            if h.mapping is None:
                index_of = {s.device: self._index_of(s.device, inb.peer) for s in h.ref.shares}
                h.mapping = _Mapping()
                inb.tensors = await self._gpu(
                    "mapping the peer's tensors", _map_tensors, h.ref, index_of, h.mapping
                )
            elif inb.tensors is None:
                raise BackendError("cuda_ipc: mapping the peer's tensors failed before")
            return
        if not h.ready:
            await self._gpu("waiting for the sender's copy", h.event.synchronize)
            h.ready = True
        if dest is None:
            h.viewed = True
            return
        if hi > lo:
            assert inb.buffer is not None
            await self._gpu("copying out of the peer's slot", _copy_out, dest, inb.buffer, lo, hi)

    def close(self, inb: InboundBuffer) -> None:
        h = inb.handle
        if not isinstance(h, _Inbound):
            return
        inb.handle = None
        self._open -= 1
        if isinstance(h.ref, _TensorsRef):
            views = inb.tensors
            inb.tensors = None
            m = h.mapping
            # Shares never mapped give their counter back. While an abandoned (timed-out)
            # mapping thread may still run, nothing is released: a leak beats a double free.
            if m is None:
                unmapped = list(h.ref.shares)
            elif m.settled:
                unmapped = list(h.ref.shares[len(m.storages) :])
            else:
                unmapped = []
            storages = list(m.storages) if m is not None else []
            events = _local_events({s.device.index or 0 for s in storages}) if storages else []
            keep: list[Any] = [views, storages]

            def clean_up() -> None:
                for event in events:
                    event.synchronize()
                keep.clear()
                _release_shares(unmapped)

            self._reaper.submit(clean_up)
            return
        inb.buffer = None
        if h.viewed and self._release_event is not None and self.device is not None:
            # zero-copy views of the slot were handed out: tell the sender when the work
            # queued on them (on this GPU or the slot's) is done
            try:
                with _on_device(self.device):
                    _record_after(self._release_event, self.device, (h.index,))
            except Exception:
                log.exception("cuda_ipc: cannot record the release event")
        self._drop_dedicated(h)

    def _drop_dedicated(self, h: _Inbound) -> None:
        if h.dedicated is None:
            return
        mapped = [h.dedicated]
        h.dedicated = None
        events = _local_events({mapped[0].index})

        def clean_up() -> None:
            for event in events:
                event.synchronize()
            mapped.clear()

        self._reaper.submit(clean_up)

    def drop(self, peer: PeerInfo, info: bytes, nbytes: int) -> None:
        """Refused unopened: give back torch's counters of what was shared for us."""
        st = self._peers.get(peer.key)
        if st is None or not st.reachable or self._closed:
            return
        try:
            ref = decode_ref(info, peer, nbytes)
        except BackendError as exc:
            log.warning("%s", exc)
            return
        if isinstance(ref, _TensorsRef):
            shares = list(ref.shares)
        elif ref.dedicated:
            shares = [ref.buffer]
        else:
            if ref.buffer_id not in st.pools:
                st.unopened.setdefault(ref.buffer_id, ref.buffer)
            shares = []
        if shares:
            self._reaper.submit(lambda: _release_shares(shares))


def _map_tensors(ref: _TensorsRef, index_of: dict[str, int], m: _Mapping) -> list[torch.Tensor]:
    """Map every share (recording each in ``m`` as it goes), wait for the sender's
    events, and build the views. Runs in a worker thread."""
    try:
        for share in ref.shares:
            m.storages.append(_open_share(share, index_of[share.device]))
        # _new_shared_cuda made this thread's current stream wait for the sender's
        # event; wait here so that the views are ready for any stream.
        _sync_streams(index_of.values())
        return build_views(ref, m.storages)
    finally:
        m.settled = True


def _copy_out(dest: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """``dest[lo:hi] = src[lo:hi]`` and wait for it. Runs in a worker thread."""
    dest[lo:hi].copy_(src[lo:hi])
    _sync_streams(t.device.index or 0 for t in (src, dest) if t.is_cuda)
