"""What the backends share besides the slot pool: small helpers, the one thread that
runs blocking clean-ups, the registered receive pool and the cache of engine
registrations of lent tensors (waiting for a transfer's completion is
:mod:`.completion`'s, re-exported here).

Everything here is engine-neutral; third-party backends may use it too.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio
import msgspec
import numpy as np
import torch

from ..errors import BackendError, BadReferenceError
from ..packing import holds_its_values
from ..recvpool import RecvPool, size_class
from ..wire import MAX_TENSORS, align_up
from .base import BackendBase, Export
from .completion import (
    Completions,
    TransferAbandonedError,
    TransferStalledError,
    TransferTimeoutError,
    poll_until,
)
from .threads import Threads, make_in_thread

__all__ = [
    "Completions",
    "HostMemory",
    "LentExport",
    "LentPiece",
    "RegisteredRecvPool",
    "RegistrationCache",
    "Releaser",
    "Threads",
    "TransferAbandonedError",
    "TransferStalledError",
    "TransferTimeoutError",
    "byte_view",
    "check_pieces",
    "check_range",
    "decode_blob",
    "lend",
    "lent_pieces",
    "mib",
    "poll_until",
    "storage_span",
]

log = logging.getLogger("omniwire.backends")

T = TypeVar("T")
H = TypeVar("H")

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


def mib(n: int) -> str:
    """``n`` bytes in MiB, for messages."""
    return f"{n / 2**20:.1f} MiB"


def decode_blob(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str) -> T:
    """Decode a peer's blob (Hello info, reference) with a typed decoder.

    Raises:
        BadReferenceError: ``malformed <what>: <why>``.
    """
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadReferenceError(f"malformed {what}: {exc}") from None


def check_range(lo: int, hi: int, nbytes: int, what: str) -> None:
    """Raises BadReferenceError unless ``0 <= lo <= hi <= nbytes``."""
    if not 0 <= lo <= hi <= nbytes:
        raise BadReferenceError(f"{what}: range [{lo}, {hi}) outside a {nbytes}-byte object")


def check_pieces(pieces: Sequence[tuple[int, int]], nbytes: int, where: str) -> None:
    """Check ``(at, length)`` pieces of an object of ``nbytes``: sorted by ``at``, not
    overlapping, not empty, inside the object, at most MAX_TENSORS of them.

    Raises:
        BadReferenceError: one is not.
    """
    if len(pieces) > MAX_TENSORS:
        raise BadReferenceError(f"{where} has {len(pieces)} pieces")
    end = 0
    for at, length in pieces:
        if length <= 0 or at < end or at + length > nbytes:
            raise BadReferenceError(
                f"{where} has a piece [{at}, {at + length}) that is empty, overlaps "
                f"another or lies outside the {nbytes}-byte object"
            )
        end = at + length


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    """``(address, nbytes)`` of the storage under ``t`` (what a registration covers)."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the bytes of contiguous ``t`` (the same memory).

    Raises:
        ValueError: ``t`` is a lazily conjugated or negated view, or lazy zeros (its
            memory holds other values, or none: see
            :func:`omniwire.packing.holds_its_values`).
    """
    if not holds_its_values(t):
        raise ValueError(
            "a lazily conjugated or negated tensor, or lazy zeros: resolve it first "
            "(omniwire.packing.resolved)"
        )
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) == 1:
        return flat.view(torch.uint8)  # two calls where the general case takes seven
    # (0 elements, or 1 with any stride: torch calls both contiguous)
    nbytes = t.numel() * t.element_size()
    base = torch.empty(0, dtype=torch.uint8, device=t.device)
    return base.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (nbytes,), (1,))


@dataclass(frozen=True)
class LentPiece:
    """One lent tensor as a piece of the object's packed image (spec §5): its bytes
    belong at ``[at, at + nbytes)``."""

    at: int
    tensor: torch.Tensor  # the caller's tensor (kept alive by the export)
    data: torch.Tensor  # a uint8 view of its bytes

    @property
    def addr(self) -> int:
        return self.data.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def lent_pieces(
    tensors: Sequence[torch.Tensor], devices: frozenset[str] = frozenset({"cpu"})
) -> tuple[list[LentPiece], int] | None:
    """The caller's tensors as the pieces of the packed image they would be packed
    into (empty tensors left out) and the image's length; or None when one cannot be
    read in place (not contiguous, on a device kind not in ``devices``, a lazily
    conjugated or negated view, or lazy zeros) or there are no bytes."""
    pieces = []
    end = 0
    for t in tensors:
        if t.device.type not in devices or not t.is_contiguous() or not holds_its_values(t):
            return None
        at = align_up(end)
        nbytes = t.numel() * t.element_size()
        end = at + nbytes
        if nbytes:
            pieces.append(LentPiece(at, t, byte_view(t)))
    return (pieces, end) if pieces else None


class HostMemory:
    """Anonymous host memory (``mmap``), pre-faulted unless ``populate`` is False, and a
    uint8 tensor over all of it."""

    def __init__(self, size: int, *, populate: bool = True) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (_MAP_POPULATE if populate else 0)
        try:
            self._mm: mmap.mmap | None = mmap.mmap(-1, size, flags=flags)
        except OSError as exc:
            raise BackendError(f"cannot map {mib(size)} of host memory: {exc}") from exc
        self.size = size
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.addr = self.tensor.data_ptr()

    def discard(self) -> None:
        """Give the pages back but keep the mapping: a late reader reads zeros, never
        faults."""
        if self._mm is not None and _MADV_DONTNEED is not None:
            with contextlib.suppress(OSError, ValueError):
                self._mm.madvise(_MADV_DONTNEED)

    def close(self) -> None:
        """Unmap (now if no view is alive, else when the last view is collected)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()


def _block_address(block: mmap.mmap) -> int:
    view = np.frombuffer(block, dtype=np.uint8, count=1)
    addr = int(view.ctypes.data)
    del view
    return addr


class RegisteredRecvPool(RecvPool, Generic[H]):
    """Warm receive buffers (:class:`~omniwire.recvpool.RecvPool`) registered with an
    engine once, when their block is made, and unregistered only when the block is
    dropped (beyond ``max_idle_bytes`` of idle blocks, or at :meth:`close`): the
    block reused for the next object needs no registration. Blocks are pre-faulted.

    ``register(addr, nbytes)`` and ``unregister(handle)`` are the engine's blocking
    calls (run in a worker thread and in ``releaser``).
    """

    def __init__(
        self,
        register: Callable[[int, int], H],
        unregister: Callable[[H], None],
        releaser: Releaser,
        *,
        max_idle_bytes: int = 256 << 20,
        min_nbytes: int = 64 << 10,
    ) -> None:
        super().__init__(max_idle_bytes, min_nbytes)
        self._register = register
        self._unregister = unregister
        self._releaser = releaser
        self._handles: dict[int, tuple[H, int]] = {}  # block address -> (handle, size)
        self._closed = False
        self.registrations = 0

    async def take_registered(self, nbytes: int) -> torch.Tensor | None:
        """A registered 1-D uint8 tensor of exactly ``nbytes`` (owned by the caller; its
        block comes back when it is collected), or None below ``min_nbytes`` or once
        closed.

        Raises:
            BackendError: the engine refused to register a new block.
        """
        if nbytes < self.min_nbytes or self._closed:
            return None
        size = size_class(nbytes)
        block = self._pop_idle(size)
        if block is None:
            try:
                block = mmap.mmap(
                    -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE
                )
            except OSError as exc:
                raise BackendError(f"cannot map {mib(size)} of host memory: {exc}") from exc
            self.blocks_created += 1
            addr = _block_address(block)
            unregister = self._unregister
            handle = await make_in_thread(
                lambda: self._register(addr, size), lambda h: _drop_block(unregister, h, block)
            )
            self.registrations += 1
            if not self._keep(addr, handle, size):  # closed meanwhile
                self._releaser.submit(_drop_block, self._unregister, handle, block)
                return None
        return self._wrap(block, size, nbytes)

    async def delivery_buffer(
        self, nbytes: int, counters: dict[str, int], engine: str
    ) -> torch.Tensor | None:
        """:meth:`take_registered` for a backend's ``delivery_buffer``: a block the
        engine refuses to register is no error — None (the endpoint lands the object
        in its own buffer, registered per read), counted in
        ``counters["recv_pool_refused"]`` and logged once."""
        try:
            return await self.take_registered(nbytes)
        except BackendError as exc:
            counters["recv_pool_refused"] += 1
            if counters["recv_pool_refused"] == 1:  # once: it says why
                log.warning("%s: no registered receive buffer of %s: %s", engine, mib(nbytes), exc)
            return None

    def _keep(self, addr: int, handle: H, size: int) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._handles[addr] = (handle, size)
            return True

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies at the start of one of this pool's registered blocks."""
        entry = self._handles.get(t.data_ptr())
        return entry is not None and t.numel() * t.element_size() <= entry[1]

    def handle_of(self, addr: int, nbytes: int) -> H | None:
        """The registration of the block that holds bytes ``[addr, addr + nbytes)``,
        or None."""
        with self._lock:
            for start, (handle, size) in self._handles.items():
                if start <= addr and addr + nbytes <= start + size:
                    return handle
        return None

    def _give_back(self, block: mmap.mmap, size: int) -> None:
        # Runs while the last array viewing the block is deallocated (any thread).
        with self._lock:
            if self._closed:
                return  # unregistered at close; the block is just dropped
            if self._idle_bytes + size <= self.max_idle_bytes:
                self._idle.setdefault(size, []).append(block)
                self._idle_bytes += size
                return
            entry = self._handles.pop(_block_address(block), None)
        if entry is not None:
            # unregistered before the mapping can go (the releaser holds the block)
            self._releaser.submit(_drop_block, self._unregister, entry[0], block)

    def close_registered(self) -> list[H]:
        """Stop pooling: every block's registration is returned for the caller to
        unregister, after which it calls :meth:`clear` (idle blocks are unmapped; those
        still in use stay mapped while their tensors live)."""
        with self._lock:
            self._closed = True
            handles = [h for h, _ in self._handles.values()]
            self._handles.clear()
        return handles

    @property
    def registered_bytes(self) -> int:
        return sum(size for _, size in self._handles.values())


def _drop_block(unregister: Callable[[H], None], handle: H, block: mmap.mmap) -> None:
    unregister(handle)
    with contextlib.suppress(BufferError):
        block.close()


class Releaser:
    """One helper thread that runs blocking clean-ups in order (unregistering memory,
    dropping GPU mappings), so that releasing a handle never blocks the event loop.

    After :meth:`stop`, :meth:`submit` runs the call at once in the caller's thread.
    A failing call is logged, never raised.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        call: Callable[[], None] = (lambda: fn(*args)) if args else fn
        with self._lock:
            if not self._stopped:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
                self._queue.put(call)
                return
        self._run_one(call)

    def _run(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            self._run_one(call)
            del call  # the last references of what it released die here, in this thread

    def _run_one(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception:
            log.exception("%s: clean-up failed", self.name)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until everything submitted so far ran. Returns False on timeout."""
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Run what is queued, then end the thread (blocking, at most ``timeout`` s)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
            self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


class _Registration(Generic[H]):
    __slots__ = ("handle", "nbytes", "storage", "users")

    def __init__(self, handle: H, storage: torch.UntypedStorage, nbytes: int) -> None:
        self.handle = handle
        self.storage: torch.UntypedStorage | None = storage  # keeps the memory alive
        self.nbytes = nbytes
        self.users = 0


class RegistrationCache(Generic[H]):
    """Engine registrations of the storages of lent tensors, reused across sends.

    Registering memory with an engine costs a system call or a page pinning; a caller
    that lends the same tensors again (a reused buffer) finds them registered. Each
    cached registration keeps its storage alive, so its memory is never freed and
    reused while registered. At most ``max_entries`` registrations and ``max_bytes``
    are kept; beyond, the least recently used ones that no live export uses are
    unregistered (through ``releaser``, off the event loop).

    ``register(addr, nbytes, device)`` and ``unregister(handle)`` are the engine's
    blocking calls (run in a worker thread and in ``releaser``). A host storage of at
    most ``inline_bytes`` is registered on the event loop instead, when the engine
    says such a registration is cheap: mooncake's tcp transport takes 4–76 µs for
    1–64 MiB, where the trip to a worker thread and back took 0.4–0.6 ms of a 1 MiB
    send between two namespace hosts on 2 loaded cores (measured). Not thread-safe:
    use it from the event loop.
    """

    def __init__(
        self,
        register: Callable[[int, int, torch.device], H],
        unregister: Callable[[H], None],
        releaser: Releaser,
        *,
        max_entries: int = 64,
        max_bytes: int = 4 << 30,
        inline_bytes: int = 0,
    ) -> None:
        self._register = register
        self.inline_bytes = inline_bytes
        self._unregister = unregister
        self._releaser = releaser
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, _Registration[H]] = OrderedDict()
        self._bytes = 0
        self._lock = anyio.Lock()
        #: Memory of registrations the engine failed to unregister (never reused).
        self._stuck: list[torch.UntypedStorage | None] = []
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(t: torch.Tensor) -> Hashable:
        addr, nbytes = storage_span(t)
        return (str(t.device), addr, nbytes)

    async def acquire(self, t: torch.Tensor) -> tuple[Hashable, H]:
        """The registration of ``t``'s storage, made now (in a worker thread) if it is
        not cached, and marked in use until :meth:`release` of the key.

        Raises:
            BackendError: the engine refused to register it.
        """
        key = self.key(t)
        entry = self._entries.get(key)
        if entry is None:
            storage = t.untyped_storage()
            if t.is_cpu and storage.nbytes() <= self.inline_bytes:
                # no await between the lookup and the insert: nobody registers it twice
                handle = self._register(storage.data_ptr(), storage.nbytes(), t.device)
                entry = self._add(key, handle, storage)
            else:
                async with self._lock:  # one registration of a storage at a time
                    entry = self._entries.get(key)
                    if entry is None:
                        ptr, size = storage.data_ptr(), storage.nbytes()
                        handle = await make_in_thread(
                            lambda: self._register(ptr, size, t.device), self._unregister
                        )
                        entry = self._add(key, handle, storage)
        else:
            self.hits += 1
        self._entries.move_to_end(key)
        entry.users += 1
        self._evict()
        return key, entry.handle

    def _add(self, key: Hashable, handle: H, storage: torch.UntypedStorage) -> _Registration[H]:
        entry = _Registration(handle, storage, storage.nbytes())
        self._entries[key] = entry
        self._bytes += entry.nbytes
        self.misses += 1
        return entry

    async def acquire_all(self, tensors: Sequence[torch.Tensor]) -> list[tuple[Hashable, H]]:
        """:meth:`acquire` each tensor's registration; on a failure, release those
        acquired and raise.

        Raises:
            BackendError: the engine refused to register one.
        """
        got: list[tuple[Hashable, H]] = []
        try:
            for t in tensors:
                got.append(await self.acquire(t))
        except BaseException:
            for key, _ in got:
                self.release(key)
            raise
        return got

    def release(self, key: Hashable) -> None:
        """An export that used the registration of ``key`` is done."""
        entry = self._entries.get(key)
        if entry is not None and entry.users > 0:
            entry.users -= 1
            self._evict()

    def _evict(self) -> None:
        over = len(self._entries) - self.max_entries
        for key in list(self._entries):
            if over <= 0 and self._bytes <= self.max_bytes:
                return
            entry = self._entries[key]
            if entry.users:
                continue
            del self._entries[key]
            self._bytes -= entry.nbytes
            over -= 1
            storage, entry.storage = entry.storage, None
            # the memory stays alive until it is unregistered: freed now, it could be
            # allocated to a new tensor whose registration the engine would refuse
            # (an overlap with one not unregistered yet)
            self._releaser.submit(self._unregister_then_free, entry.handle, storage)

    def _unregister_then_free(self, handle: H, storage: torch.UntypedStorage | None) -> None:
        """In the releaser's thread; ``storage`` is dropped after this returns (or kept
        for good when the engine could not unregister it: it may still hold it)."""
        try:
            self._unregister(handle)
        except BaseException:
            self._stuck.append(storage)
            raise

    def clear(self) -> list[tuple[H, torch.UntypedStorage | None]]:
        """Forget every registration; returns each handle with the storage it keeps
        alive. The caller unregisters the handles, then drops the list: freed before,
        the memory could go to a new tensor whose registration the engine refuses."""
        retired = [(e.handle, e.storage) for e in self._entries.values()]
        self._entries.clear()
        self._bytes = 0
        return retired

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes


async def lend(
    cache: RegistrationCache[H],
    tensors: Sequence[torch.Tensor],
    devices: frozenset[str],
    own: Callable[[int, int], H | None] | None = None,
) -> tuple[list[LentPiece], int, list[tuple[Hashable | None, H]]] | None:
    """The caller's lent tensors as pieces of the packed image (:func:`lent_pieces`),
    each registered through ``cache``; None when they cannot be read in place.

    ``own(address, nbytes)``: the handle of memory the backend registered itself
    (a landing, its pool, a receive block) that holds those bytes, or None. Such a
    piece (a delivery forwarded from where it landed, say) is not registered again
    — an engine may refuse a registration that overlaps one it has (mooncake: "does
    not support overlapped memory region") — and its key is None.

    Raises:
        BackendError: the engine refused a registration (none is kept).
    """
    image = lent_pieces(tensors, devices)
    if image is None:
        return None
    pieces, nbytes = image
    handles = [own(p.addr, p.nbytes) if own is not None else None for p in pieces]
    acquired = iter(
        await cache.acquire_all(
            [p.tensor for p, h in zip(pieces, handles, strict=True) if h is None]
        )
    )
    out: list[tuple[Hashable | None, H]] = [
        (None, h) if h is not None else next(acquired) for h in handles
    ]
    return pieces, nbytes, out


class LentExport(Export):
    """An export of the caller's lent tensors, read in place by the peer through their
    registrations in ``cache`` (held until the export is released)."""

    def __init__(
        self,
        backend: BackendBase,
        nbytes: int,
        ref: bytes,
        cache: RegistrationCache[H],
        keys: Sequence[Hashable | None],
        tensors: Sequence[torch.Tensor],
        spans: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        super().__init__(backend, nbytes, None)
        #: ``(at, address, length)`` of each piece, for a backend that writes them itself
        self.spans = list(spans)
        self._ref = ref
        self._cache: RegistrationCache[H] | None = cache
        self._keys = list(keys)
        self.tensors: list[torch.Tensor] | None = list(tensors)

    @property
    def ref(self) -> bytes:
        return self._ref

    def _release(self) -> None:
        self.tensors = None
        cache, self._cache = self._cache, None
        if cache is not None:
            for key in self._keys:
                if key is not None:  # (None: memory the backend registered itself)
                    cache.release(key)
