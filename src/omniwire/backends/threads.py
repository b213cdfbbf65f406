"""Blocking engine calls off the event loop, without waiting for turns of it.

``anyio.to_thread.run_sync`` lets the event loop run twice before it hands a call to
a worker thread (a checkpoint, then its ``CapacityLimiter``'s). On this project's
2-core test machine, a call and its return took about 170 µs that way, against
about 77 µs through a thread that waits on a queue (``scripts/thread_hop.py``). A
cross-host object pays that once per transfer that waits in a thread, so the
backends use :class:`Threads`: the call goes at once to a daemon thread of the
backend's own, and its outcome comes back with ``loop.call_soon_threadsafe``.
Engine-neutral; third-party backends may use it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from ..errors import BackendClosedError

__all__ = ["Threads", "make_in_thread", "run_to_end", "settle", "until_ended"]

T = TypeVar("T")

log = logging.getLogger("omniwire.backends")

#: a call, and where its outcome goes (all None: posted, not waited for)
_Job = tuple[
    Callable[[], Any],
    asyncio.AbstractEventLoop | None,
    "asyncio.Future[Any] | None",
    "asyncio.Future[None] | None",
]


def settle(
    future: asyncio.Future[Any], finished: asyncio.Future[None], ok: bool, value: Any
) -> None:
    """On the loop, once a thread's work ended: ``finished`` always, ``future`` (with
    ``value`` as its result, or as its exception unless ``ok``) unless its waiter was
    cancelled (then what the work returned or raised goes nowhere)."""
    finished.set_result(None)
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


async def until_ended(future: asyncio.Future[T], finished: asyncio.Future[None]) -> T:
    """``await future``, for work that must not be abandoned: when the waiter is
    cancelled (which cancels ``future``), wait for ``finished`` (see :func:`settle`) in
    anyio's shielded scope, where a cancellation is not delivered again, then let the
    cancellation through. (Entered on every wait, as ``asyncio.shield`` would be, that
    scope costs a turn of the event loop, about 20–25 µs here.)"""
    try:
        return await future
    except asyncio.CancelledError:
        with anyio.CancelScope(shield=True):
            await finished
        raise


async def make_in_thread(make: Callable[[], T], orphan: Callable[[T], object]) -> T:
    """``make()`` in a worker thread, for a call that creates what must be freed (a
    shared-memory segment, a mapping, an engine registration). anyio's cancel scopes
    wait for the thread; a plain ``Task.cancel()`` (``asyncio.wait_for``, a
    ``TaskGroup``) does not: the call then ends at once and the thread runs on. What
    it makes for a caller that is gone goes to ``orphan`` (to free it), in the worker
    thread or, if it was made already, here; nothing is left behind either way."""
    lock = threading.Lock()
    gone = False
    made: list[T] = []

    def run() -> T:
        value = make()
        with lock:
            if not gone:
                made.append(value)
                return value
        _orphan(orphan, value)
        return value

    try:
        return await anyio.to_thread.run_sync(run)
    except BaseException:
        with lock:
            gone = True
            left = made[:]
        for value in left:  # made before the caller was told it was cancelled
            _orphan(orphan, value)
        raise


async def run_to_end(fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread, for a call that writes into memory its caller may
    reuse (an engine's read): a cancellation — a plain ``Task.cancel()`` too, which
    anyio's worker threads do not wait for — lands once ``fn`` returned."""
    task = asyncio.ensure_future(anyio.to_thread.run_sync(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with anyio.CancelScope(shield=True):
            await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # its outcome goes nowhere (retrieved: nothing logged)
        raise


def _orphan(orphan: Callable[[T], object], value: T) -> None:
    try:
        orphan(value)
    except Exception:
        log.exception("freeing what a cancelled call made failed")


class Threads:
    """Up to ``limit`` daemon threads that run blocking calls for one backend.

    A thread is started when a call finds none idle (and fewer than ``limit`` exist);
    beyond that, calls wait in the queue for the next free thread. Threads stay
    until :meth:`stop`. Thread-safe.
    """

    def __init__(self, name: str, limit: int = 32) -> None:
        if limit < 1:
            raise ValueError(f"Threads limit must be at least 1, not {limit}")
        self.name = name
        self.limit = limit
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pending = 0  # calls queued or running
        self._stopped = False

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in one of these threads; its result, or what it raised.

        Like ``anyio.to_thread.run_sync`` (without ``abandon_on_cancel``), the call
        is not cancellable: a cancellation takes effect once ``fn`` returned, so the
        memory it works on is never reused while it runs (:func:`until_ended`).

        Raises:
            BackendClosedError: :meth:`stop` was called.
            Whatever ``fn`` raises.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        finished: asyncio.Future[None] = loop.create_future()  # awaited once cancelled
        self._put((fn, loop, future, finished))
        return await until_ended(future, finished)

    def post(self, fn: Callable[[], None]) -> None:
        """``fn()`` in one of these threads, not waited for: ``fn`` reports its own
        outcome (to the loop, with ``call_soon_threadsafe``) and raises nothing (what it
        raises is logged). For a caller that hands the rest of the work on from the
        thread (:meth:`~omniwire.backends.completion.Completions.start_and_wait`).

        Raises:
            BackendClosedError: :meth:`stop` was called.
        """
        self._put((fn, None, None, None))

    def _put(self, job: _Job) -> None:
        with self._lock:
            if self._stopped:
                raise BackendClosedError(f"{self.name} is stopped")
            self._pending += 1
            started = len(self._threads)
            if self._pending > started and started < self.limit:  # none is idle
                thread = threading.Thread(
                    target=self._serve, name=f"{self.name}-{started}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, loop, future, finished = job
            try:
                outcome: tuple[bool, Any] = (True, fn())
            except BaseException as exc:
                outcome = (False, exc)
            del job, fn  # hold nothing of the call while idle
            with self._lock:
                self._pending -= 1
            if loop is None or future is None or finished is None:  # posted: not waited for
                if not outcome[0]:
                    log.error("%s: a posted call raised", self.name, exc_info=outcome[1])
                del outcome
                continue
            with contextlib.suppress(RuntimeError):  # its loop is closed
                loop.call_soon_threadsafe(settle, future, finished, *outcome)
            del future, finished, outcome

    def stop(self, timeout: float = 10.0) -> None:
        """No more calls; each thread ends after the calls queued before (blocking, at
        most ``timeout`` s in all)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                thread.join(timeout)

    def __len__(self) -> int:
        """Threads started so far."""
        return len(self._threads)
