"""backends.threads.Threads: blocking calls in a backend's own threads."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from omniwire.backends.threads import Threads
from omniwire.errors import BackendClosedError

pytestmark = pytest.mark.asyncio


async def test_a_call_returns_its_result_or_raises_its_error_and_threads_are_reused() -> None:
    threads = Threads("test-threads-a")
    try:
        assert await threads.run(lambda: 41 + 1) == 42
        with pytest.raises(ZeroDivisionError):
            await threads.run(lambda: 1 // 0)
        names = {await threads.run(lambda: threading.current_thread().name) for _ in range(20)}
        assert names == {"test-threads-a-0"} and len(threads) == 1  # one at a time: one thread
    finally:
        threads.stop()


async def test_calls_beyond_the_limit_wait_for_a_free_thread() -> None:
    threads = Threads("test-threads-b", limit=2)
    gate = threading.Event()
    running: list[int] = []
    most = [0]
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            running.append(i)
            most[0] = max(most[0], len(running))
        gate.wait(10)
        with lock:
            running.remove(i)
        return i

    try:
        results: list[int] = []

        async def call(i: int) -> None:
            results.append(await threads.run(lambda: job(i)))

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(call, i)
            await anyio.sleep(0.2)
            assert len(threads) == 2 and len(running) == 2  # the other three queue
            gate.set()
        assert sorted(results) == [0, 1, 2, 3, 4] and most[0] == 2
    finally:
        threads.stop()


async def test_a_cancelled_call_still_waits_for_its_function_to_return() -> None:
    """Like a worker thread's call: memory the call works on must not be reused early,
    so the cancellation is raised only once the function returned."""
    threads = Threads("test-threads-c")
    returned = threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        returned.set()

    seen_at_cancel: list[bool] = []
    try:
        with anyio.CancelScope() as scope:
            scope.deadline = anyio.current_time() + 0.05
            try:
                await threads.run(slow)
            except anyio.get_cancelled_exc_class():
                seen_at_cancel.append(returned.is_set())
                raise
        assert scope.cancelled_caught and seen_at_cancel == [True]
        assert await threads.run(lambda: "next") == "next"  # the thread serves on
    finally:
        threads.stop()


async def test_after_stop_a_call_is_refused_and_the_threads_end() -> None:
    threads = Threads("test-threads-d")
    await threads.run(lambda: None)
    (thread,) = [t for t in threading.enumerate() if t.name == "test-threads-d-0"]
    threads.stop()
    thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(BackendClosedError, match="stopped"):
        await threads.run(lambda: None)
    with pytest.raises(ValueError, match="at least 1"):
        Threads("x", limit=0)
