"""Landings (spec §9.4, §9.5), what the engines that push share: the sender's view of
the memory a peer lent it, and the export of an object written there.

A receiver lends each peer a *landing* in the Hello addressed to it: memory of its
own, registered with its engine, named by a random token. A sender that was lent
one writes a complete object into a range of it before announcing the object
(:meth:`~omniwire.backends.base.ByteBackend.land`); the range is its own until the
object's DataAck.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable

from ..alloc import BuddyAllocator
from ..errors import BackendError
from .base import BackendBase, Export

__all__ = [
    "LANDING_PEERS",
    "LANDING_SIZE",
    "LandedExport",
    "Lands",
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

#: ``(local address, remote address, length)`` of each write
Writes = list[tuple[int, int, int]]


def counters() -> dict[str, int]:
    """A backend's landing counters, zero: objects it wrote into a peer's landing,
    objects peers wrote into its own, objects read instead because no range was free
    or because the write failed."""
    return {"landed": 0, "landed_in": 0, "landing_full": 0, "landing_failed": 0}


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
    still land keeps its range out of use for good (see :class:`Lands`).

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
        if abandoned(exc):
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
