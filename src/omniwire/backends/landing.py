"""Landings (spec §9.4, §9.5), what the engines that push share: the sender's view of
the memory a peer lent it, and the export of an object written there.

A receiver lends each peer a *landing* in the Hello addressed to it: memory of its
own, registered with its engine, named by a random token. A sender that was lent
one writes a complete object into a range of it before announcing the object
(:meth:`~omniwire.backends.base.ByteBackend.land`); the range is its own until the
object's DataAck.

A landing comes back when its peer has gone (Goodbye, lost, a new instance:
:class:`Lender`), fenced so that no write of the departed instance can land in
memory lent to someone else: it is deregistered once no delivery views it any
more, its pages are given back, and its mapping is lent to nobody for
``landing_quarantine`` seconds before it is unmapped; the next peer gets a fresh
region and token. What the engines do with a write to deregistered memory
(checked, see tests/test_landing.py): Mooncake's tcp server refuses an address
outside its registered buffers (the write fails), an RDMA NIC refuses a stale
rkey; NIXL over UCX's tcp and shared-memory transports writes the address it is
given, registered or not — the quarantine is what keeps such a late write out of
another peer's landing.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, TypeVar

import torch

from ..alloc import BuddyAllocator
from ..errors import BackendError
from .base import BackendBase, Export, Import, PeerInfo
from .completion import TransferStalledError

__all__ = [
    "LANDING_PEERS",
    "LANDING_QUARANTINE",
    "LANDING_SIZE",
    "LandedExport",
    "LandedImport",
    "Lands",
    "Lender",
    "LentLanding",
    "counters",
    "land_into",
    "new_token",
]

log = logging.getLogger("omniwire.landing")

#: Bytes a receiver lends each peer by default: two 64 MiB objects in flight (one
#: landing while the last one's ACK is on its way). Not pre-faulted: a landing's pages
#: become resident as objects land (the most ranges held at once), and stay so.
LANDING_SIZE = 128 << 20
#: How many peers get a landing by default (at most ``LANDING_PEERS * LANDING_SIZE``
#: bytes of landings, 2 GiB); later peers' objects are read.
LANDING_PEERS = 16

#: Seconds a landing that came back is lent to nobody once fenced (deregistered, its
#: pages given back, still mapped) before it is unmapped: a write of its departed
#: peer that arrives meanwhile lands there (nixl) or is refused (mooncake), never in
#: another peer's landing. At least the sender's write timeout (60 s by default).
LANDING_QUARANTINE = 60.0

#: ``(local address, remote address, length)`` of each write
Writes = list[tuple[int, int, int]]

M = TypeVar("M")


def counters() -> dict[str, int]:
    """A backend's landing counters, zero: objects it wrote into a peer's landing,
    objects peers wrote into its own, objects read instead because no range was free,
    because the write failed, or because it stalled (``landing_stalled``, also counted
    as failed)."""
    return {
        "landed": 0,
        "landed_in": 0,
        "landing_full": 0,
        "landing_failed": 0,
        "landing_stalled": 0,
        "landings_returned": 0,
    }


def new_token() -> int:
    """A landing's token: random, 1 to 2**63."""
    return secrets.randbits(63) + 1


class Lands:
    """A landing a peer lent us: where it is, and which of its ranges our objects in
    flight hold.

    Kept per peer name across sessions with the same landing (``same`` says whether a
    new Hello lends the same one): a range whose write was abandoned (timeout, peer
    lost mid-write: it may still land) is never handed out again, also after a
    reconnect."""

    def __init__(self, addr: int, length: int, token: int, owner: str, key: tuple[str, int]):
        self.addr = addr
        self.token = token
        #: who lent it: the peer's engine session or agent name
        self.owner = owner
        #: the peer (name, instance) whose session uses it now
        self.key = key
        self.ranges = BuddyAllocator(length)

    def same(self, token: int, owner: str) -> bool:
        return (self.token, self.owner) == (token, owner)


class LandedExport(Export):
    """An object that landed in the peer's memory: holds its range until the ACK."""

    def __init__(
        self, backend: BackendBase, lands: Lands, offset: int, nbytes: int, ref: bytes
    ) -> None:
        super().__init__(backend, nbytes, None)
        self.lands = lands
        self.offset = offset
        self._ref = ref

    @property
    def ref(self) -> bytes:
        return self._ref

    def _release(self) -> None:
        self.lands.ranges.free(self.offset)


async def land_into(
    backend: BackendBase,
    lands: Lands,
    export: Export,
    local: list[tuple[int, int, int]],
    write: Callable[[Writes], Awaitable[None]],
    ref: Callable[[int], bytes],
    counters: dict[str, int],
    *,
    abandoned: Callable[[BackendError], bool],
) -> Export | None:
    """Write ``export`` — its bytes at ``local``, ``(at, address, length)`` per span —
    into a free range of ``lands`` with ``write``, and return the export naming it
    (``ref(offset)``; the caller releases ``export``); None when no range is free or
    the write failed (the object is then read as before). A failure that ``abandoned`` says may
    still land keeps its range out of use for good (see :class:`Lands`); a write that
    ``write`` gave up on while it runs (:class:`TransferStalledError`) keeps it until
    the engine says the write ended.

    Counts ``landed``, ``landing_full`` and ``landing_failed`` in ``counters``.
    """
    nbytes = export.nbytes
    offset = lands.ranges.allocate(nbytes)
    if offset is None:
        counters["landing_full"] += 1
        return None
    base = lands.addr + offset
    try:
        await write([(addr, base + at, length) for at, addr, length in local])
    except BackendError as exc:
        counters["landing_failed"] += 1
        if isinstance(exc, TransferStalledError):
            # still running: out of use until the engine says it ended
            counters["landing_stalled"] += 1
            log.warning(
                "%s: %s (read instead; its range is out of use until it ends)", backend.name, exc
            )

            def ended(late: asyncio.Future[bool]) -> None:
                if late.result():  # nothing of it lands later
                    lands.ranges.free(offset)

            exc.ended.add_done_callback(ended)
        elif abandoned(exc):
            log.warning("%s: %s (read instead; its range stays out of use)", backend.name, exc)
        else:
            lands.ranges.free(offset)
            log.debug("%s: %s (read instead)", backend.name, exc)
        return None
    except BaseException:
        lands.ranges.free(offset)  # written (or never started): nobody names it
        raise
    counters["landed"] += 1
    return LandedExport(backend, lands, offset, nbytes, ref(offset))


# -- the receiver's side: landings lent, and how they come back --------------------------


class LentLanding(Generic[M]):
    """Memory of ours (``memory``, the engine's kind) lent to the peer named ``peer``
    under a fresh ``token``; ``users``: deliveries (imports) viewing it now."""

    __slots__ = ("addr", "gone", "memory", "peer", "size", "token", "users")

    def __init__(self, memory: M, addr: int, size: int, peer: str) -> None:
        self.memory = memory
        self.addr = addr
        self.size = size
        self.peer = peer
        self.token = new_token()
        self.users = 0
        self.gone = False

    def holds(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.addr + self.size


class Lender(Generic[M]):
    """The landings a receiver lends, one per peer name, at most ``peers`` at once
    (``peers * size`` bytes), and their way back.

    :meth:`gone` (the peer's session ended: Goodbye, lost, a new instance) takes a
    peer's landing out of use at once: the peer's next session, or another peer, is
    lent a fresh region under a new token. The old one is *fenced* once no delivery
    views it (``fence``: deregister it from the engine and give its pages back, the
    mapping kept), then *quarantined*: lent to nobody for ``quarantine`` seconds,
    after which ``unmap`` drops it (swept whenever a landing is lent or comes back,
    and at :meth:`close`). Not thread-safe: use it from the event loop.
    """

    def __init__(
        self,
        engine: str,
        *,
        size: int,
        peers: int,
        quarantine: float,
        make: Callable[[int], tuple[M, int, int]],
        fence: Callable[[M], None],
        unmap: Callable[[M], None],
        counters: dict[str, int],
    ) -> None:
        self.engine = engine
        self.size = size
        self.peers = peers
        self.quarantine = quarantine
        self._make = make
        self._fence = fence
        self._unmap = unmap
        self._counters = counters
        self._lent: dict[str, LentLanding[M]] = {}
        #: gone, but a delivery still views it (registered until the last lets go)
        self._draining: list[LentLanding[M]] = []
        #: fenced: (when it may be unmapped, its memory)
        self._quarantined: deque[tuple[float, M]] = deque()

    def lend(self, peer: str) -> LentLanding[M] | None:
        """The landing lent to ``peer`` (made now if it has none and fewer than
        ``peers`` are lent), or None."""
        landing = self._lent.get(peer)
        if landing is not None:
            return landing
        self.sweep()
        if not self.size or len(self._lent) >= self.peers:
            return None
        try:
            memory, addr, size = self._make(self.size)
        except BackendError as exc:
            log.warning("%s: no landing for %r: %s", self.engine, peer, exc)
            return None
        landing = self._lent[peer] = LentLanding(memory, addr, size, peer)
        return landing

    def get(self, peer: str) -> LentLanding[M] | None:
        """The landing lent to ``peer`` now, if any (what its landed references name)."""
        return self._lent.get(peer)

    def registered(self) -> Iterator[LentLanding[M]]:
        """Every landing still registered: lent, or gone and still viewed."""
        yield from self._lent.values()
        yield from self._draining

    def gone(self, peer: str) -> None:
        """``peer``'s session ended: its landing comes back (fenced at once if no
        delivery views it, else when the last one is released)."""
        landing = self._lent.pop(peer, None)
        if landing is None:
            return
        landing.gone = True
        self._counters["landings_returned"] += 1
        if landing.users:
            self._draining.append(landing)
        else:
            self._retire(landing)

    def opened(self, landing: LentLanding[M]) -> None:
        landing.users += 1

    def closed(self, landing: LentLanding[M]) -> None:
        landing.users -= 1
        if landing.gone and landing.users == 0 and landing in self._draining:
            self._draining.remove(landing)
            self._retire(landing)

    def _retire(self, landing: LentLanding[M]) -> None:
        try:
            self._fence(landing.memory)
        except BackendError as exc:  # (the engine may still hold it: never unmapped)
            log.warning("%s: cannot deregister a landing: %s", self.engine, exc)
            return
        self._quarantined.append((time.monotonic() + self.quarantine, landing.memory))
        self.sweep()

    def sweep(self, now: float | None = None) -> None:
        """Unmap the landings whose quarantine is over."""
        now = time.monotonic() if now is None else now
        while self._quarantined and self._quarantined[0][0] <= now:
            self._unmap(self._quarantined.popleft()[1])

    def close(self) -> tuple[list[M], list[M]]:
        """Forget everything: the memories still registered (lent, draining) for the
        caller to release, and the quarantined ones to unmap."""
        registered = [landing.memory for landing in self.registered()]
        quarantined = [memory for _, memory in self._quarantined]
        self._lent.clear()
        self._draining.clear()
        self._quarantined.clear()
        return registered, quarantined

    def detail(self) -> dict[str, int]:
        return {
            "landings_lent": len(self._lent),
            "landings_draining": len(self._draining),
            "landings_quarantined": len(self._quarantined),
            "landing_bytes": sum(landing.size for landing in self.registered()),
        }


class LandedImport(Import):
    """An object that landed in our landing: a view of it, counted as one of the
    landing's users (it is not fenced while viewed) until closed."""

    def __init__(
        self,
        backend: BackendBase,
        peer: PeerInfo,
        nbytes: int,
        lender: Lender[M],
        landing: LentLanding[M],
        view: torch.Tensor,
    ) -> None:
        super().__init__(backend, peer, nbytes, buffer=view)
        lender.opened(landing)
        self._done: Callable[[], None] | None = lambda: lender.closed(landing)

    def _close(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()
