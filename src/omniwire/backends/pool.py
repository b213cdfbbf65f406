"""The slot pool every buffer-owning backend uses (shm, mooncake, nixl, cuda_ipc, plugins).

A backend owns one **region** of memory allocated once (a shared-memory arena, a
registered engine pool, a GPU buffer) and hands out **leases** on it:

- a **slot** of the region, carved by :class:`~omniwire.alloc.BuddyAllocator`
  (``lease.offset``), reused as soon as the lease is released;
- when no slot is free, a **dedicated** buffer of the backend's kind
  (``lease.buffer``), made by the backend's ``create`` and given to its ``destroy``
  when the lease is released. The first dedicated buffer is logged once, naming
  the option that sizes the region.

A lease is released exactly once (:meth:`Lease.release` is idempotent). Two other
ends exist: :meth:`Lease.release_when` (a slot a receiver may still read — reused
once ``done()`` says so) and :meth:`Lease.quarantine` (an engine transfer that
could not be stopped may still write into it: never reused while the pool lives).

Objects larger than half the region never wait for a slot: any small slot
anywhere in the region would keep them waiting. With ``keep > 0`` such objects
(up to the region's size) are carved separately, from at most ``keep`` dedicated
buffers of the region's size, kept and reused (warm) instead of made and
destroyed each time: they neither wait behind small objects nor make small ones
wait behind them.

The pool only hands out offsets and buffers; it never touches memory. Use it
from the event loop (``create`` and ``destroy`` run in worker threads, or in
``releaser`` when one is given).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import anyio

from ..alloc import BuddyAllocator
from ..errors import BackendClosedError, BackendError
from .support import Releaser, mib
from .threads import make_in_thread

__all__ = ["Lease", "SlotPool"]

log = logging.getLogger("omniwire.backends.pool")

D = TypeVar("D")


class Lease(Generic[D]):
    """One object's memory: a slot of the region (``offset >= 0``) or a dedicated
    buffer (``buffer``). ``size`` is what was reserved (>= ``nbytes``)."""

    __slots__ = ("buffer", "kept", "key", "nbytes", "offset", "pool", "size", "state")

    def __init__(
        self,
        pool: SlotPool[D],
        nbytes: int,
        size: int,
        offset: int,
        buffer: D | None,
        kept: bool,
        key: Hashable = None,
    ) -> None:
        self.pool = pool
        self.key = key  # whose it is (a peer), for fair shares of the region
        self.nbytes = nbytes
        self.size = size
        self.offset = offset
        self.buffer = buffer
        self.kept = kept
        self.state = "live"  # live | pending | quarantined | released

    @property
    def dedicated(self) -> bool:
        return self.buffer is not None

    def release(self) -> None:
        """The memory may be reused (a slot) or destroyed (a dedicated buffer). Idempotent."""
        if self.state == "live":
            self.pool._give_back(self)

    def release_when(self, done: Callable[[], bool]) -> None:
        """Release, but reuse the memory only once ``done()`` returns True (checked
        whenever the pool looks for a slot, and by :meth:`SlotPool.reclaim`)."""
        if self.state == "live":
            self.pool._defer(self, done)

    def quarantine(self) -> None:
        """Never reuse this memory while the pool lives: something may still write into
        it (an abandoned engine transfer). Dedicated buffers are destroyed at close."""
        if self.state in ("live", "pending"):
            self.pool._quarantine(self)


class SlotPool(Generic[D]):
    """Slots of one region, and dedicated buffers when none is free. See the module
    docstring. ``label`` names the pool in messages, ``option`` the setting that
    sizes its region (``backend_options['shm']['arena_size']``, say).

    ``create(size) -> D`` and ``destroy(D)`` are blocking; without ``create`` an object
    that finds no slot is a BackendError.
    """

    def __init__(
        self,
        label: str,
        *,
        capacity: int = 0,
        min_block: int = 4096,
        create: Callable[[int], D] | None = None,
        destroy: Callable[[D], None] | None = None,
        releaser: Releaser | None = None,
        option: str = "",
        keep: int = 0,
    ) -> None:
        self.label = label
        self.option = option
        self.min_block = min_block
        self.keep = keep
        self._create = create
        self._destroy = destroy
        self._releaser = releaser
        self._alloc: BuddyAllocator | None = None
        self._live: set[Lease[D]] = set()
        self._pending: list[tuple[Lease[D], Callable[[], bool]]] = []
        self._quarantined: list[Lease[D]] = []
        self._kept_free: list[D] = []
        #: bytes of region slots held, by the key they were taken for (a peer)
        self._held: dict[Hashable, int] = {}
        self._kept = 0
        self._freed = anyio.Event()
        self._warned = False
        self.closed = False
        self.dedicated_created = 0
        if capacity > 0:
            self.attach(capacity)

    # -- the region ------------------------------------------------------------------

    def attach(self, capacity: int) -> None:
        """Carve slots from a region of ``capacity`` bytes (once, possibly after start)."""
        if self._alloc is not None:
            raise BackendError(f"{self.label}: the region is attached already")
        if capacity >= self.min_block:
            self._alloc = BuddyAllocator(capacity, self.min_block)

    @property
    def capacity(self) -> int:
        """Bytes of the region (0 while none is attached)."""
        return self._alloc.capacity if self._alloc is not None else 0

    def fits(self, nbytes: int) -> bool:
        """Whether a slot of the region could ever hold ``nbytes``."""
        a = self._alloc
        return a is not None and a.block_size(max(nbytes, 1)) <= a.capacity

    # -- leases ----------------------------------------------------------------------

    def take_slot(self, nbytes: int, key: Hashable = None) -> Lease[D] | None:
        """A slot of the region, now, or None (``key``: whose, for fair shares).

        Raises:
            BackendClosedError: the pool is closed.
        """
        self._check_open()
        a = self._alloc
        if a is None or not self.fits(nbytes):
            return None
        if self._pending:
            self.reclaim()
        offset = a.allocate(max(nbytes, 1))
        if offset is None:
            return None
        size = a.block_size(max(nbytes, 1))
        lease = Lease(self, nbytes, size, offset, None, False, key)
        self._held[key] = self._held.get(key, 0) + size
        self._live.add(lease)
        return lease

    def _under_share(self, key: Hashable) -> bool:
        """Whether ``key`` holds less of the region than its fair share (the region
        over the keys holding slots, itself included)."""
        held = self._held
        holders = len(held) + (key not in held)
        return held.get(key, 0) < self.capacity // holders

    async def take(
        self, nbytes: int, *, wait: float = 0.0, purpose: str = "", key: Hashable = None
    ) -> Lease[D]:
        """A slot; else, for an object of at most half the region, wait up to ``wait``
        seconds for one to be released; else a dedicated buffer. With ``key`` (whose
        it is: a peer), one holding less than its fair share of the region does not
        wait for slots others hold (a peer that never acknowledges would make every
        other peer wait out ``wait``): a dedicated buffer at once.

        Raises:
            BackendClosedError: the pool is closed.
            BackendError: no dedicated buffer could be made (the backend's error, e.g.
                ``ShmFullError``), or the backend has none.
        """
        if self._large(nbytes):  # carved separately: it would block the small ones
            return await self._take_dedicated(nbytes, purpose)
        lease = self.take_slot(nbytes, key)
        if lease is not None:
            return lease
        a = self._alloc
        if key is not None and self._under_share(key):
            wait = 0.0  # what holds the region is others' beyond their shares
        if wait > 0 and a is not None and a.block_size(max(nbytes, 1)) <= a.capacity // 2:
            with anyio.move_on_after(wait):
                while lease is None:
                    await self._freed.wait()
                    lease = self.take_slot(nbytes, key)
            if lease is not None:
                return lease
        return await self._take_dedicated(nbytes, purpose)

    async def _take_dedicated(self, nbytes: int, purpose: str) -> Lease[D]:
        create = self._create
        if create is None:
            raise BackendError(
                f"{self.label} ({mib(self.capacity)}) has no free slot for {mib(nbytes)}"
                + (f"; raise {self.option}" if self.option else "")
            )
        keepable = self._large(nbytes)
        if keepable and self._pending:
            self.reclaim()  # a kept buffer a receiver held may be free again
        if keepable and self._kept_free:
            lease = Lease(self, nbytes, self.capacity, -1, self._kept_free.pop(), True)
            self._live.add(lease)
            return lease
        kept = keepable and self._kept < self.keep
        if not self._warned and not kept:
            self._warned = True
            log.info(
                "%s (%s) has no free slot for %s%s: using a dedicated buffer%s",
                self.label,
                mib(self.capacity),
                mib(nbytes),
                f" ({purpose})" if purpose else "",
                f"; raise {self.option} if this is common" if self.option else "",
            )
        size = self.capacity if kept else max(nbytes, 1)
        if kept:
            self._kept += 1
        try:
            buffer = await make_in_thread(lambda: create(size), self._destroy or _nothing)
        except BaseException:
            if kept:
                self._kept -= 1
            raise
        if self.closed:  # closed meanwhile: aclose did not see it
            await self._run_destroy([buffer])
            raise BackendClosedError(f"{self.label} is closed")
        self.dedicated_created += 1
        lease = Lease(self, nbytes, size, -1, buffer, kept)
        self._live.add(lease)
        return lease

    def _large(self, nbytes: int) -> bool:
        return self.keep > 0 and self.capacity // 2 < nbytes <= self.capacity

    def _give_back(self, lease: Lease[D]) -> None:
        lease.state = "released"
        self._live.discard(lease)
        if self.closed:
            return
        if lease.buffer is None:
            if self._alloc is not None:
                self._alloc.free(lease.offset)
            self._unhold(lease)
        elif lease.kept:
            self._kept_free.append(lease.buffer)
        else:
            self._destroy_later(lease.buffer)
        lease.buffer = None
        self._wake()

    def _unhold(self, lease: Lease[D]) -> None:
        held = self._held.get(lease.key, 0) - lease.size
        if held > 0:
            self._held[lease.key] = held
        else:
            self._held.pop(lease.key, None)

    def _wake(self) -> None:
        freed, self._freed = self._freed, anyio.Event()
        freed.set()

    def _defer(self, lease: Lease[D], done: Callable[[], bool]) -> None:
        lease.state = "pending"
        self._live.discard(lease)
        self._pending.append((lease, done))

    def _quarantine(self, lease: Lease[D]) -> None:
        if lease.state == "pending":
            self._pending = [(x, d) for x, d in self._pending if x is not lease]
        lease.state = "quarantined"
        self._live.discard(lease)
        self._quarantined.append(lease)
        log.warning(
            "%s: %s may still be written by an abandoned transfer; kept out of use "
            "until the backend closes",
            self.label,
            mib(lease.size),
        )

    def reclaim(self) -> int:
        """Release the deferred leases whose ``done()`` is now true. Returns how many."""
        ready: list[Lease[D]] = []
        waiting: list[tuple[Lease[D], Callable[[], bool]]] = []
        for lease, done in self._pending:
            try:
                ok = done()
            except Exception:
                ok = True
            if ok:
                ready.append(lease)
            else:
                waiting.append((lease, done))
        self._pending = waiting
        for lease in ready:
            lease.state = "live"
            self._give_back(lease)
        return len(ready)

    def _destroy_later(self, buffer: D) -> None:
        destroy = self._destroy
        if destroy is None:
            return
        if self._releaser is not None:
            self._releaser.submit(destroy, buffer)
        else:
            try:
                destroy(buffer)
            except Exception:
                log.exception("%s: destroying a dedicated buffer failed", self.label)

    async def _run_destroy(self, buffers: list[D]) -> None:
        destroy = self._destroy
        if destroy is None or not buffers:
            return

        def run() -> None:
            for b in buffers:
                try:
                    destroy(b)
                except Exception:
                    log.exception("%s: destroying a dedicated buffer failed", self.label)

        await anyio.to_thread.run_sync(run)

    def _check_open(self) -> None:
        if self.closed:
            raise BackendClosedError(f"{self.label} is closed")

    # -- the end ---------------------------------------------------------------------

    async def aclose(self) -> None:
        """Destroy every dedicated buffer (live, kept, quarantined); leases still alive
        become inert. The region itself belongs to the backend. Idempotent."""
        if self.closed:
            return
        self.closed = True
        buffers = [x.buffer for x in (*self._live, *self._quarantined) if x.buffer is not None]
        buffers += [x.buffer for x, _ in self._pending if x.buffer is not None]
        buffers += self._kept_free
        for x in (*self._live, *self._quarantined, *(p for p, _ in self._pending)):
            x.state = "released"
            x.buffer = None
        self._live.clear()
        self._pending.clear()
        self._quarantined.clear()
        self._kept_free.clear()
        self._alloc = None
        self._wake()
        await self._run_destroy(buffers)

    # -- numbers ---------------------------------------------------------------------

    @property
    def live(self) -> int:
        """Leases not yet released (deferred and quarantined ones not counted)."""
        return len(self._live)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def quarantined(self) -> int:
        return len(self._quarantined)

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the region in slots not yet reusable (deferred, quarantined included)."""
        return self._alloc.bytes_in_use if self._alloc is not None else 0

    @property
    def dedicated_live(self) -> int:
        return sum(1 for x in self._live if x.buffer is not None)

    def detail(self, prefix: str = "pool_") -> dict[str, int]:
        """Counters for a backend's ``detail()``."""
        return {
            f"{prefix}bytes": self.capacity,
            f"{prefix}bytes_in_use": self.bytes_in_use,
            f"{prefix}leases": self.live,
            f"{prefix}deferred": self.pending,
            f"{prefix}quarantined": self.quarantined,
            f"{prefix}dedicated": self.dedicated_live,
            f"{prefix}dedicated_created": self.dedicated_created,
            f"{prefix}kept": self._kept,
        }


def _nothing(buffer: object) -> None:
    """What freeing a buffer without a ``destroy`` takes (it goes with its last user)."""
