"""Flow control: a budget of objects and bytes in flight, granted in FIFO order."""

from __future__ import annotations

from collections import deque

import anyio

__all__ = ["Credits"]


class Credits:
    """At most ``max_count`` objects and ``max_bytes`` bytes held at once.

    ``acquire`` waits (backpressure) instead of over-committing; waiters are
    served first come, first served, so a large request is not starved by small
    ones. A single request larger than ``max_bytes`` is admitted when nothing
    else is held, so it cannot deadlock.
    """

    def __init__(self, max_count: int, max_bytes: int) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError("credit limits must be at least 1")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.count = 0
        self.bytes = 0
        self._waiters: deque[_Waiter] = deque()

    def _fits(self, nbytes: int) -> bool:
        if self.count >= self.max_count:
            return False
        return self.count == 0 or self.bytes + nbytes <= self.max_bytes

    @property
    def waiting(self) -> int:
        """How many ``acquire`` calls wait for a credit now."""
        return len(self._waiters)

    def would_admit(self, nbytes: int) -> bool:
        """Whether ``try_acquire(nbytes)`` would succeed now."""
        return not self._waiters and self._fits(nbytes)

    def try_acquire(self, nbytes: int) -> bool:
        """Take a credit if one is free now and nobody is queued ahead."""
        if self._waiters or not self._fits(nbytes):
            return False
        self.count += 1
        self.bytes += nbytes
        return True

    async def acquire(self, nbytes: int) -> None:
        """Wait for a credit of ``nbytes``. Cancellation leaves nothing held."""
        if self.try_acquire(nbytes):
            return
        waiter = _Waiter(nbytes)
        self._waiters.append(waiter)
        try:
            while True:
                await waiter.event.wait()
                if self._waiters[0] is waiter and self._fits(nbytes):
                    self._waiters.popleft()
                    self.count += 1
                    self.bytes += nbytes
                    self._wake()  # the next one may fit too
                    return
                waiter.event = anyio.Event()
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self._wake()
            raise

    def _wake(self) -> None:
        if self._waiters and self._fits(self._waiters[0].nbytes):
            self._waiters[0].event.set()

    def release(self, nbytes: int) -> None:
        """Return a credit taken with ``acquire``/``try_acquire``."""
        self.count -= 1
        self.bytes -= nbytes
        assert self.count >= 0 and self.bytes >= 0, "credit released twice"
        self._wake()


class _Waiter:
    __slots__ = ("event", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.event = anyio.Event()
