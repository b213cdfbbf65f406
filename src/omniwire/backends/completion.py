"""Waiting for an engine's transfer to complete: :func:`poll_until` (blocking, in a
worker thread) and :class:`Completions` (one thread per backend that polls every
transfer in flight and wakes the event loop when each ends), and the errors both
raise. Engine-neutral; third-party backends may use it too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .. import hops
from ..errors import BackendClosedError, BackendError
from .threads import Threads, settle, until_ended


class Transfer(Protocol):
    """A started transfer, as :meth:`Completions.start_and_wait` takes it."""

    def done(self) -> bool:
        """Whether it ended (called from one thread at a time)."""
        ...


S = TypeVar("S", bound=Transfer)

__all__ = [
    "Completions",
    "Pace",
    "Transfer",
    "TransferAbandonedError",
    "TransferStalledError",
    "TransferTimeoutError",
    "poll_until",
]

log = logging.getLogger("omniwire.backends")

#: The shortest and longest sleep between two completion checks.
POLL_MIN_S = 10e-6
POLL_MAX_S = 500e-6


class TransferTimeoutError(BackendError, TimeoutError):
    """An engine transfer did not complete in time (it may still land later: keep its
    memory out of reuse). What :func:`poll_until` raises on a timeout."""


class TransferStalledError(TransferTimeoutError):
    """A transfer whose waiter gave up on it at its stall bound (``stall_after`` of
    :meth:`Completions.wait`) while it still runs: it may still land, and it is watched
    to its end. ``ended`` (on the waiter's loop) becomes True once the engine says it
    ended, well or not (nothing of it lands later: its memory may be reused), or False
    if it timed out or was given up after all (keep its memory out of reuse)."""

    def __init__(self, message: str, ended: asyncio.Future[bool]) -> None:
        super().__init__(message)
        self.ended = ended


class TransferAbandonedError(BackendError):
    """An engine transfer was given up before the engine said it ended (the peer was
    lost, the backend closed): like a timeout, it may still land later (a link that
    comes back), so keep its memory out of reuse. What :func:`poll_until` raises
    when ``cancelled()`` turns true."""


#: ``prctl`` option: this thread's timer slack, in ns (Linux).
_PR_SET_TIMERSLACK = 29


def _fine_timer_slack(ns: int = 1000) -> None:
    """Let this thread's sleeps end within ``ns`` of their time (best effort, Linux):
    the default slack, 50 µs, is as long as the pauses between completion checks. Only for :class:`Completions`' own thread: in
    :func:`poll_until`'s worker threads the more frequent checks cost mooncake about
    0.2–0.4 ms per 1 MiB read on 2 loaded cores (measured), as they contend for the
    GIL and the cores with the engine and the event loop."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0)


#: A transfer is first checked at this share of the time it is expected to take.
FIRST_CHECK_SHARE = 0.75
#: While a transfer is not checked yet, its ``cancelled()`` and timeout still are, this often.
SKIP_MAX_S = 0.02


class Pace:
    """How long a transfer of ``n`` bytes takes at least, from lower bounds of how long
    the last ones took (:meth:`_Watch.took_at_least`; nothing is expected before
    ``SIMILAR_MIN`` of them): ``n`` times the fewest seconds per byte any of them
    took (bandwidth: a lower bound for any size), or, when longer, the shortest
    duration of at least ``SIMILAR_MIN`` of a similar size, ``[n/2, n]`` bytes, up to
    ``FIXED_MAX_S`` (fixed cost, which dominates small transfers; capped, so that a
    transfer that stalled, through a link down and up, cannot make the next ones of
    its size wait for their first check). Not thread-safe: :class:`Completions` uses
    it under its lock."""

    SIMILAR_MIN = 3
    FIXED_MAX_S = 0.005

    def __init__(self, window: int = 64) -> None:
        #: ``(bytes, seconds)`` of the last transfers that ended
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)

    def learn(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._recent.append((nbytes, seconds))

    def expect(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` is expected to take at least (0: unknown)."""
        if nbytes <= 0 or len(self._recent) < self.SIMILAR_MIN:
            return 0.0
        bandwidth = nbytes * min(s / n for n, s in self._recent)
        similar = [s for n, s in self._recent if nbytes // 2 <= n <= nbytes]
        if len(similar) < self.SIMILAR_MIN:
            return bandwidth
        return max(bandwidth, min(min(similar), self.FIXED_MAX_S))


def _pause(elapsed: float) -> float:
    """The sleep between two completion checks of a transfer ``elapsed`` s old."""
    return min(POLL_MAX_S, max(POLL_MIN_S, elapsed / 32))


def poll_until(
    done: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    cancelled: Callable[[], bool] | None = None,
    spin: bool = False,
) -> None:
    """Call ``done()`` until it returns True; blocking (run it in a worker thread).

    Between checks it sleeps 1/32 of the time waited so far (at least 10 µs, at most
    500 µs): a wake-up adds at most ~3 % to a transfer, and the core stays free for
    the engine. ``spin`` never
    sleeps (benchmarks of the bare engine).

    Raises:
        TransferTimeoutError: not done within ``timeout`` seconds.
        TransferAbandonedError: ``cancelled()`` turned true.
        Whatever ``done()`` raises (the engine's failure).
    """
    started = time.monotonic()
    while not done():
        elapsed = time.monotonic() - started
        if cancelled is not None and cancelled():
            raise TransferAbandonedError(f"{what} was cancelled (peer lost or backend closed)")
        if elapsed > timeout:
            raise TransferTimeoutError(f"{what} did not finish within {timeout:g} s")
        if not spin:
            time.sleep(_pause(elapsed))


class _Watch:
    """One transfer :class:`Completions` waits for, and the future it settles."""

    __slots__ = (
        "cancelled",
        "done",
        "due",
        "finished",
        "first_check",
        "future",
        "loop",
        "nbytes",
        "result",
        "running_at",
        "stall_at",
        "stalled",
        "started",
        "timeout",
        "what",
    )

    def __init__(
        self,
        done: Callable[[], bool],
        timeout: float,
        what: str,
        cancelled: Callable[[], bool] | None,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        finished: asyncio.Future[None],
        nbytes: int,
        result: Any = None,
        stalled: asyncio.Future[bool] | None = None,
    ) -> None:
        self.done = done
        self.timeout = timeout
        self.what = what
        self.cancelled = cancelled
        self.loop = loop
        self.future = future
        #: settled with ``future`` but never cancelled: a cancelled waiter awaits it
        self.finished = finished
        self.started = time.monotonic()
        self.nbytes = nbytes
        #: what the waiter's future gets when the transfer ended
        self.result = result
        #: ``done()`` is not called before this time (near the expected end; set when
        #: watched, from :class:`Pace`)
        self.first_check = self.started
        #: when the completion thread looks at this transfer next
        self.due = self.started
        #: the last time ``done()`` said it still runs
        self.running_at: float | None = None
        #: when its waiter gives up on it (None: never; set when watched, see
        #: :meth:`Completions.wait`'s ``stall_after``) and, once it did, how it ended
        #: (``TransferStalledError.ended``, made on the loop beforehand)
        self.stall_at: float | None = None
        self.stalled = stalled

    def outcome(self, now: float) -> BaseException | bool:
        """False while the transfer runs; True once it ended; else the error it ended
        with (a failure of ``done()``, a timeout, an abandonment). ``done()`` is called
        from ``first_check`` on; the abandonment and the timeout are checked always."""
        if now >= self.first_check:
            try:
                if self.done():
                    return True
            except BaseException as exc:
                return exc
            self.running_at = now
        if self.cancelled is not None and self.cancelled():
            return TransferAbandonedError(
                f"{self.what} was cancelled (peer lost or backend closed)"
            )
        if now - self.started > self.timeout:
            return TransferTimeoutError(f"{self.what} did not finish within {self.timeout:g} s")
        return False

    def took_at_least(self) -> float:
        """A lower bound of how long the ended transfer took, for :class:`Pace`: it ran
        when last checked; done at its first check, it may have been much faster than
        expected, so half of what was expected (the expectation falls until transfers
        are seen running again); 0: unknown (done when first looked at, with no
        expectation: most of it may have happened before the wait began)."""
        if self.running_at is not None:
            return self.running_at - self.started
        return (self.first_check - self.started) / 2

    def next_due(self, now: float) -> float:
        if now < self.first_check:
            return min(self.first_check, now + SKIP_MAX_S)
        return now + _pause(now - self.started)


def _settle(watch: _Watch, outcome: BaseException | bool) -> None:
    if watch.finished.done():  # its waiter gave up on it (_give_up, posted before this)
        assert watch.stalled is not None
        _ended_late(watch.stalled, outcome)
        return
    _settle_with(watch.future, watch.finished, outcome, watch.result)


def _give_up(watch: _Watch, after: float) -> None:
    """On the loop: the waiter stops waiting for a transfer that still runs."""
    assert watch.stalled is not None
    error = TransferStalledError(
        f"{watch.what} did not finish within {after:.3g} s (it still runs)", watch.stalled
    )
    settle(watch.future, watch.finished, False, error)


def _ended_late(stalled: asyncio.Future[bool], outcome: BaseException | bool) -> None:
    """On the loop: how a transfer its waiter gave up on ended at last."""
    if not stalled.done():
        stalled.set_result(not isinstance(outcome, (TransferTimeoutError, TransferAbandonedError)))


def _settle_with(
    future: asyncio.Future[Any],
    finished: asyncio.Future[None],
    outcome: BaseException | bool,
    result: Any,
) -> None:
    failed = isinstance(outcome, BaseException)
    settle(future, finished, not failed, outcome if failed else result)


class Completions:
    """One thread that waits for transfers the event loop already started.

    A backend starts a transfer on the loop (a call that only queues work for the
    engine's own threads) and awaits :meth:`wait`: this thread checks ``done()`` of
    every transfer in flight, each as often as :func:`poll_until` would (every 1/32 of
    its age, 10–500 µs), and settles the waiter's future with
    ``loop.call_soon_threadsafe`` as soon as its transfer ends. The transfer starts
    without waiting for a worker thread to be scheduled, and its end costs one
    wake-up of the loop.

    A wait that names its ``nbytes`` is not checked until ``FIRST_CHECK_SHARE`` of
    the time such a transfer is expected to take at least (:class:`Pace`, learned
    from the transfers that ended): a check is not free (NIXL's runs UCX's progress
    engine; measured, about 100 checks per 1 MiB read between two namespaces took
    ~0.8 ms of CPU per read from the 2 cores the engine and the loops share), and a
    40 ms transfer took ~140 checks where ~10 do.

    The thread starts on the first wait and ends at :meth:`stop` (once nothing is in
    flight). Thread-safe.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._watches: list[_Watch] = []
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._pace = Pace()
        #: Transfers waited for so far (a test checks that the fast path ran).
        self.waited = 0

    async def wait(
        self,
        done: Callable[[], bool],
        *,
        timeout: float,
        what: str,
        cancelled: Callable[[], bool] | None = None,
        nbytes: int = 0,
        stall_after: float | None = None,
    ) -> None:
        """Wait until ``done()`` (called in this object's thread) returns True.

        Like a worker thread's call, the wait is not cancellable: it ends when the
        engine says so, at the timeout, or when ``cancelled()`` turns true; a
        cancellation of the waiter is raised then. ``nbytes``: the bytes the transfer
        moves (0: unknown), to check it only near its expected end.

        ``stall_after``, for a waiter that can do without the transfer: the wait ends
        with :class:`TransferStalledError` once the transfer has run that long, while
        it is still watched to its end (the error's ``ended``). (Not from
        :class:`Pace`: its bound for a size larger than any seen lately comes from the
        small transfers' fixed costs, minutes for 24 MiB after a stream of chunks.)

        Raises:
            TransferStalledError: not done within the stall bound (still running).
            TransferTimeoutError: not done within ``timeout`` seconds.
            TransferAbandonedError: ``cancelled()`` turned true.
            BackendClosedError: :meth:`stop` was called.
            Whatever ``done()`` raises (the engine's failure).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        finished: asyncio.Future[None] = loop.create_future()
        stalled = loop.create_future() if stall_after is not None else None
        watch = _Watch(
            done, timeout, what, cancelled, loop, future, finished, nbytes, None, stalled
        )
        if not self._watch(watch, stall_after):
            raise BackendClosedError(f"{self.name} is stopped")
        await until_ended(future, finished)

    async def start_and_wait(
        self,
        threads: Threads,
        start: Callable[[], S],
        *,
        timeout: float,
        what: str,
        cancelled: Callable[[], bool] | None = None,
        nbytes: int = 0,
        stall_after: float | None = None,
    ) -> S:
        """``start()`` (a blocking call that starts a transfer and returns it: an
        object whose ``done()`` says it ended) in one of ``threads``, then wait for the
        transfer as :meth:`wait` does; returns it. The thread hands the transfer to
        this object's thread itself, so the event loop wakes once, at the end, instead
        of once when ``start()`` returned and once when the transfer ended.

        Not cancellable, as :meth:`wait`; ``stall_after`` as there.

        Raises:
            What ``start()`` raises; what :meth:`wait` raises.
            BackendClosedError: ``threads`` or this object is stopped.
        """
        if self._stopped:
            raise BackendClosedError(f"{self.name} is stopped")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[S] = loop.create_future()
        finished: asyncio.Future[None] = loop.create_future()
        stalled = loop.create_future() if stall_after is not None else None

        def begin() -> None:  # in one of ``threads``
            try:
                transfer = start()
            except BaseException as exc:
                with contextlib.suppress(RuntimeError):  # its loop is closed
                    loop.call_soon_threadsafe(settle, future, finished, False, exc)
                return
            done = transfer.done
            watch = _Watch(
                done, timeout, what, cancelled, loop, future, finished, nbytes, transfer, stalled
            )
            if self._watch(watch, stall_after):
                return
            # stopped meanwhile: the transfer runs all the same, so wait for it here
            outcome: BaseException | bool
            try:
                poll_until(done, timeout=timeout, what=what, cancelled=cancelled)
                outcome = True
            except BaseException as exc:
                outcome = exc
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle_with, future, finished, outcome, transfer)

        threads.post(begin)
        return await until_ended(future, finished)

    def _watch(self, watch: _Watch, stall_after: float | None = None) -> bool:
        """Watch a transfer (from any thread); False (not watched) once stopped."""
        with self._cond:
            if self._stopped:
                return False
            watch.first_check = watch.started + FIRST_CHECK_SHARE * self._pace.expect(watch.nbytes)
            if stall_after is not None:
                watch.stall_at = watch.started + stall_after
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._watches.append(watch)
            self.waited += 1
            self._cond.notify()
        return True

    def _run(self) -> None:
        _fine_timer_slack()
        while True:
            with self._cond:
                while not self._watches:
                    if self._stopped:
                        return
                    self._cond.wait()
                watches = list(self._watches)
            now = time.monotonic()
            ended = []
            for w in watches:
                if w.due > now:
                    continue
                outcome = w.outcome(now)
                if outcome is False:
                    if w.stall_at is not None and now >= w.stall_at:
                        bound = w.stall_at - w.started
                        w.stall_at = None  # its waiter goes; the watch stays
                        with contextlib.suppress(RuntimeError):
                            w.loop.call_soon_threadsafe(_give_up, w, bound)
                    w.due = w.next_due(time.monotonic())
                    continue
                ended.append((w, outcome))
            with self._cond:
                for w, outcome in ended:
                    self._watches.remove(w)  # before its waiter wakes: len() is current
                    if outcome is True:
                        self._pace.learn(w.nbytes, w.took_at_least())
                    hops.mark("engine: transfer ended (completion thread)")
                    with contextlib.suppress(RuntimeError):  # its loop is closed
                        w.loop.call_soon_threadsafe(_settle, w, outcome)
                if self._watches:
                    # a new wait notifies: it is looked at at once, whatever is due
                    delay = min(w.due for w in self._watches) - time.monotonic()
                    if delay > 0:
                        self._cond.wait(delay)

    def stop(self, timeout: float = 10.0) -> None:
        """No more waits; the thread ends once those in flight ended (blocking, at most
        ``timeout`` s)."""
        with self._cond:
            self._stopped = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __len__(self) -> int:
        return len(self._watches)
