"""Landings (spec §9.4, §9.5), what the engines that push share: the sender's view of
the memory a peer lent it, and the export of an object written there.

A receiver lends each peer a *landing* in the Hello addressed to it: memory of its
own, registered with its engine, named by a random token. A sender that was lent
one writes a complete object into a range of it before announcing the object
(:meth:`~omniwire.backends.base.ByteBackend.land`); the range is its own until the
object's DataAck.
"""

from __future__ import annotations

import secrets

from ..alloc import BuddyAllocator
from .base import BackendBase, Export

__all__ = ["LandedExport", "Lands", "new_token"]


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
