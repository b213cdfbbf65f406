"""Deliberately hung tests, kept out of the normal run (the name does not match
``test_*.py``): ``tests/test_hangguard.py`` runs them in a pytest of its own with a
short limit and checks each fails alone, naming itself, and the run goes on."""

from __future__ import annotations

import threading
import time
import types

import anyio
import pytest


@pytest.mark.asyncio
async def test_async_hung_on_an_await() -> None:
    await anyio.Event().wait()  # nobody sets it


@pytest.mark.asyncio
async def test_async_with_its_loop_blocked() -> None:
    threading.Event().wait()  # blocks the event loop itself: no cancel scope can end it


def test_sync_hung_in_a_wait() -> None:
    threading.Event().wait()


def test_sync_hung_in_a_busy_loop() -> None:
    n = 0
    while True:
        n += 1


def test_a_traceback_entry_without_a_line_number() -> None:
    """What a signal landing on an instruction without a line number leaves behind
    (CPython 3.11+): pytest's report cannot format it by itself."""

    def f() -> types.FrameType:
        for _ in range(2):
            with open(__file__):
                pass
        import sys

        return sys._getframe()

    frame = f()
    lasti = next(start for start, _, line in f.__code__.co_lines() if line is None)
    error = RuntimeError("raised where no line is")
    raise error.with_traceback(types.TracebackType(None, frame, lasti, -1))


@pytest.fixture
def hangs_in_teardown():  # type: ignore[no-untyped-def]
    yield
    time.sleep(3600)


def test_hung_in_a_fixture_teardown(hangs_in_teardown: None) -> None:
    pass


def test_swallows_every_interrupt() -> None:
    """Nothing in-process can end it: the watchdog ends the run, naming it (run alone)."""
    for _ in range(1000):
        try:
            time.sleep(60)
        except BaseException:
            pass


def test_after_them_all_still_runs() -> None:
    assert True
