"""Flow control (spec §7.2, §7.6): budgets granted in FIFO order.

Three budgets, one shape — a waiter is served first come, first served, and one
request larger than the whole budget is admitted when nothing else is held, so it
cannot deadlock:

- :class:`Credits` — the sender's objects in flight to one peer, in count and bytes;
  an ACK or NACK returns one.
- :class:`Window` — the sender's view of the DataReady charge one peer lets it have
  outstanding (HTTP/2's flow-control window); the peer's WindowMessages reopen it.
- :class:`ReceiveWindow` — the receiver's side of the same window: what one peer's
  messages hold here until the application takes them, and when to tell the peer.

:class:`FairBudget` is the receiver's budget of undelivered objects, shared by its
peers: no peer holds more than an equal share of it while another peer waits.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable

import anyio

__all__ = ["Credits", "FairBudget", "ReceiveWindow", "Window"]


class _Waiter:
    __slots__ = ("count", "event", "granted", "key", "nbytes")

    def __init__(self, nbytes: int, key: Hashable = None, count: int = 1) -> None:
        self.nbytes = nbytes
        self.key = key
        self.count = count
        self.event = anyio.Event()
        self.granted = False  # Window: its charge was taken for it (see Window._wake)


class _Fifo:
    """A budget whose waiters are served in order: subclasses say what fits and take it."""

    def __init__(self) -> None:
        self._waiters: deque[_Waiter] = deque()
        #: bytes given back in all, and when last (``time.monotonic()``; 0.0: never)
        self.returned = 0
        self.returned_at = 0.0

    def _returned(self, nbytes: int) -> None:
        self.returned += nbytes
        self.returned_at = time.monotonic()

    def stalled(self, patience: float) -> str:
        """Why ``acquire(…, patience)`` returned False, for an error message."""
        raise NotImplementedError

    def _history(self) -> str:
        if not self.returned_at:
            return "it gave back nothing since the session began"
        ago = time.monotonic() - self.returned_at
        return f"it gave back {self.returned} bytes in all, the last {ago:.1f} s ago"

    async def _until(self, waiter: _Waiter, patience: float, started: float) -> bool:
        """Wait for ``waiter``'s event while the budget keeps giving something back:
        False when nothing came back for ``patience`` seconds (since the wait began,
        ``started``, or since the last return, whichever is later)."""
        while True:
            left = max(started, self.returned_at) + patience - time.monotonic()
            if left <= 0:
                return False
            with anyio.move_on_after(left):
                await waiter.event.wait()
                return True

    def _fits(self, nbytes: int) -> bool:
        raise NotImplementedError

    def _take(self, nbytes: int) -> None:
        raise NotImplementedError

    @property
    def waiting(self) -> int:
        """How many ``acquire`` calls wait now."""
        return len(self._waiters)

    def would_admit(self, nbytes: int) -> bool:
        """Whether ``try_acquire(nbytes)`` would succeed now."""
        return not self._waiters and self._fits(nbytes)

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit now and nobody is queued ahead."""
        if self._waiters or not self._fits(nbytes):
            return False
        self._take(nbytes)
        return True

    async def acquire(self, nbytes: int, patience: float = math.inf) -> bool:
        """Wait until ``nbytes`` fit, then take them; True. False (nothing taken) when
        nothing came back for ``patience`` seconds: the wait goes on as long as the
        budget is being given back. Cancellation leaves nothing held."""
        if self.try_acquire(nbytes):
            return True
        waiter = _Waiter(nbytes)
        self._waiters.append(waiter)
        started = time.monotonic()
        try:
            while await self._until(waiter, patience, started):
                if self._waiters[0] is waiter and self._fits(nbytes):
                    self._waiters.popleft()
                    self._take(nbytes)
                    self._wake()  # the next one may fit too
                    return True
                waiter.event = anyio.Event()
        except BaseException:
            self._leave(waiter)
            raise
        self._leave(waiter)
        return False

    def _leave(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            self._wake()

    def _wake(self) -> None:
        if self._waiters and self._fits(self._waiters[0].nbytes):
            self._waiters[0].event.set()


class Credits(_Fifo):
    """At most ``max_count`` objects and ``max_bytes`` bytes held at once."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError("credit limits must be at least 1")
        super().__init__()
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.count = 0
        self.bytes = 0

    def _fits(self, nbytes: int) -> bool:
        if self.count >= self.max_count:
            return False
        return self.count == 0 or self.bytes + nbytes <= self.max_bytes

    def _take(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes

    def release(self, nbytes: int) -> None:
        """Return a credit taken with ``acquire``/``try_acquire``."""
        self.count -= 1
        self.bytes -= nbytes
        assert self.count >= 0 and self.bytes >= 0, "credit released twice"
        self._returned(nbytes)
        self._wake()

    def stalled(self, patience: float) -> str:
        return (
            f"acknowledged no object within {patience:g} s, and no credit is left to send "
            f"it more: {self.count} objects ({self.bytes} bytes) are unacknowledged "
            f"({self._history()})"
        )


class Window(_Fifo):
    """The sender's side of a peer's receive window of ``size`` bytes (spec §7.6).

    ``acquire(charge)`` before a DataReady is posted; :meth:`reopen` when the peer's
    WindowMessage arrives. A message charged more than the whole window goes when
    nothing is outstanding. ``size`` 0: the peer grants no window (an older peer):
    nothing waits here.
    """

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.available = size

    def _fits(self, nbytes: int) -> bool:
        return self.size == 0 or nbytes <= self.available or self.available >= self.size

    def _take(self, nbytes: int) -> None:
        if self.size:
            self.available -= nbytes

    def try_acquire(self, nbytes: int) -> bool:
        """:meth:`_Fifo.try_acquire` in one call (it runs before every DataReady)."""
        if self._waiters:
            return False
        if self.size == 0:
            return True
        if nbytes <= self.available or self.available >= self.size:
            self.available -= nbytes
            return True
        return False

    async def acquire(self, nbytes: int, patience: float = math.inf) -> bool:
        """Wait until ``nbytes`` fit, then take them (handed over by :meth:`_wake`);
        True. False (nothing taken) when the peer reopened nothing for ``patience``
        seconds. Cancellation leaves nothing held."""
        if self.try_acquire(nbytes):
            return True
        waiter = _Waiter(nbytes)
        self._waiters.append(waiter)
        try:
            if await self._until(waiter, patience, time.monotonic()) or waiter.granted:
                return True
        except BaseException:
            if waiter.granted:  # handed its charge, then cancelled: it goes back
                self.reopen(nbytes)
            else:
                self._leave(waiter)
            raise
        self._leave(waiter)
        return False

    def reopen(self, increment: int) -> None:
        """The peer took ``increment`` bytes of charge; more than it was charged is ignored."""
        self.available = min(self.size, self.available + increment)
        self._returned(increment)
        self._wake()

    def stalled(self, patience: float) -> str:
        return (
            f"reopened no flow-control window within {patience:g} s: its application took "
            f"nothing of the {self.size - self.available} bytes outstanding in that time "
            f"({self._history()})"
        )

    def _wake(self) -> None:
        """Hand the window, at once and in order, to every waiter at the head that it
        lets go: their charge is taken here, so they leave the queue now. They run in
        one turn of the event loop (their messages leave in one batch), and a task
        that was let go sends on without waiting again behind the others while the
        window has room (no convoy of one wait per message)."""
        waiters = self._waiters
        while waiters and self._fits(waiters[0].nbytes):
            waiter = waiters.popleft()
            self._take(waiter.nbytes)
            waiter.granted = True
            waiter.event.set()


class ReceiveWindow:
    """The receiver's side of one peer's window of ``size`` bytes (spec §7.6).

    :meth:`charge` on every DataReady from the peer; False means the peer overran
    the window it was granted (it ends its own session). :meth:`credit` when what the
    message carried left this endpoint (taken by the application, or dropped);
    returns the increment to announce in a WindowMessage now, or 0: returns are
    batched until a quarter of the window is free. Whatever came back and is not yet
    announced goes at a :meth:`flush` (the housekeeping tick, a few times a second),
    so the peer learns of every byte its application took within two ticks —
    a consumer taking one small message a second keeps its sender going (it waits
    as long as something comes back: ``Window.acquire``'s ``patience``) — without a
    WindowMessage per message of a request/reply exchange.
    """

    __slots__ = ("held", "on_reopen", "quarter", "recent", "size", "unreported")

    def __init__(self, size: int) -> None:
        self.size = size
        self.quarter = size // 4
        self.held = 0  # charge of the peer's messages still here
        self.unreported = 0  # charge given back and not yet announced to the peer
        self.recent = False  # a quarter was announced since the last flush
        #: Called with the increment when :meth:`give` makes a WindowMessage due.
        self.on_reopen: Callable[[int], None] | None = None

    def charge(self, nbytes: int) -> bool:
        before = self.held + self.unreported  # what the sender believes is outstanding
        self.held += nbytes
        return before == 0 or before + nbytes <= self.size

    def credit(self, nbytes: int) -> int:
        self.held -= nbytes
        self.unreported += nbytes
        if self.unreported >= self.quarter:
            increment, self.unreported = self.unreported, 0
            self.recent = True
            return increment
        return 0

    def give(self, nbytes: int) -> None:
        """:meth:`credit` for what a delivery held, as it leaves the queue (once per
        small message): ``on_reopen(increment)`` when a WindowMessage is due."""
        self.held -= nbytes
        unreported = self.unreported + nbytes
        if unreported >= self.quarter and self.on_reopen is not None:
            self.unreported = 0
            self.recent = True
            self.on_reopen(unreported)
        else:
            self.unreported = unreported

    def flush(self) -> int:
        """The increment to announce now (or 0): all that came back since the last,
        unless the peer still holds some here and was told of a quarter since the last
        flush (a consumer that keeps up needs no more): so what came back is
        announced within two flushes."""
        recent, self.recent = self.recent, False
        if not self.unreported or (recent and self.held):
            return 0
        increment, self.unreported = self.unreported, 0
        return increment


class FairBudget:
    """The receiver's budget of undelivered objects (``max_count``, ``max_bytes``),
    shared by its peers (``key``): while another peer waits, a peer that holds some
    of it may hold at most ``max_bytes / active`` (``active``: peers holding or
    waiting), so one peer's slow or stalled objects cannot keep the others out. A
    peer holding nothing may always take one object that fits, and one larger than
    the whole budget goes when nothing is held. Waiters that may go are served in
    arrival order. An object may grow (``count=0``: more bytes of one held object,
    as a progressive object's bytes are announced).
    """

    def __init__(self, max_count: int, max_bytes: int) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError("budget limits must be at least 1")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.count = 0
        self.bytes = 0
        self._held: dict[Hashable, int] = {}  # key -> bytes held (at most one per peer)
        self._waiters: list[_Waiter] = []  # at most one per peer's take path, in order

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def held_by(self, key: Hashable) -> int:
        return self._held.get(key, 0)

    def _may(self, key: Hashable, nbytes: int, count: int) -> bool:
        if count and self.count >= self.max_count:
            return False
        if self.bytes and self.bytes + nbytes > self.max_bytes:
            return False
        if not any(w.key != key for w in self._waiters):
            return True
        mine = self._held.get(key, 0)
        if mine == 0 and count:
            return True
        active = len({*self._held, *(w.key for w in self._waiters), key})
        return mine + nbytes <= self.max_bytes // active

    def would_admit(self, key: Hashable, nbytes: int) -> bool:
        return not self._waiters and self._may(key, nbytes, 1)

    def try_acquire(self, key: Hashable, nbytes: int, count: int = 1) -> bool:
        if self._waiters or not self._may(key, nbytes, count):
            return False
        self._take(key, nbytes, count)
        return True

    def _take(self, key: Hashable, nbytes: int, count: int) -> None:
        self.count += count
        self.bytes += nbytes
        self._held[key] = self._held.get(key, 0) + nbytes

    async def acquire(self, key: Hashable, nbytes: int, count: int = 1) -> None:
        """Wait for ``nbytes`` (and ``count`` objects) of the budget for ``key``.
        Cancellation leaves nothing held."""
        if self.try_acquire(key, nbytes, count):
            return
        waiter = _Waiter(nbytes, key, count)
        self._waiters.append(waiter)
        self._wake()  # it may go at once, past waiters that may not
        try:
            while True:
                await waiter.event.wait()
                if self._may(key, nbytes, count):
                    self._waiters.remove(waiter)
                    self._take(key, nbytes, count)
                    self._wake()
                    return
                waiter.event = anyio.Event()
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self._wake()
            raise

    def release(self, key: Hashable, nbytes: int, count: int = 1) -> None:
        """Give back what ``key`` took (all its acquisitions of one object at once)."""
        self.count -= count
        self.bytes -= nbytes
        left = self._held.get(key, 0) - nbytes
        assert self.count >= 0 and self.bytes >= 0 and left >= 0, "budget released twice"
        if left:
            self._held[key] = left
        else:
            self._held.pop(key, None)
        self._wake()

    def _wake(self) -> None:
        """Wake the first waiter that may go now (it checks again when it runs)."""
        for waiter in self._waiters:
            if self._may(waiter.key, waiter.nbytes, waiter.count):
                waiter.event.set()
                return
