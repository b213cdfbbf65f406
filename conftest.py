"""A hung test fails alone and names itself (every test under this directory).

pytest-timeout's limits stay where they are declared (``timeout`` in pyproject,
``@pytest.mark.timeout(N)``), but this file arms them, in three layers:

1. **An async test** (pytest-asyncio) runs inside a cancel scope that ends at its
   limit: the test fails with ``Failed: <node id>: still running after N s`` and
   the chain of awaits it was stuck in, and the run goes on. No signal is involved.
2. **SIGALRM**, armed only while a test's setup, call or teardown runs (never while
   pytest makes or writes a report): a sync test — or an async one whose loop is
   blocked, 15 s after its limit — fails at its limit. pytest-timeout armed it for
   the whole run protocol, reports included; a signal landing in pytest's own
   report code ended a run in ``INTERNALERROR`` naming no test.
3. **A watchdog thread**, 45 s past the limit, for what nothing above could stop
   (a C call that never returns): it prints the node id and every thread's stack
   and ends the run (exit status 70).

Tracebacks are also made safe to report: an exception raised by a signal can hold
a frame with no line number (``tb_lineno`` None, CPython 3.11+), which pytest's
report cannot format (``INTERNALERROR``); such an entry gets its function's first
line instead.

``tests/test_hangguard.py`` proves it by running ``tests/hung_cases.py`` (kept out
of the normal run) in a pytest of its own.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

# Seconds after a test's limit: SIGALRM for an async test whose loop is blocked; the
# watchdog ends the run. tests/test_hangguard.py shortens both through the environment.
GRACE_BLOCKED_LOOP_S = float(os.environ.get("OMNIWIRE_TEST_GRACE_LOOP", "15"))
GRACE_WATCHDOG_S = float(os.environ.get("OMNIWIRE_TEST_GRACE_WATCHDOG", "45"))
WATCHDOG_EXIT = 70

_DEADLINE = pytest.StashKey[float]()
_LIMIT = pytest.StashKey[float]()
_WATCHDOG = pytest.StashKey[threading.Timer]()
_ASYNC = pytest.StashKey[bool]()


# --- pytest-timeout: we arm its limits ------------------------------------------------


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest-timeout's hook
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    """Called by pytest-timeout at the start of each test's protocol: we take over."""
    limit = float(settings.timeout or 0)
    if limit <= 0:
        return True
    item.stash[_LIMIT] = limit
    item.stash[_DEADLINE] = time.monotonic() + limit
    watchdog = threading.Timer(limit + GRACE_WATCHDOG_S, _watchdog_fires, (item, limit))
    watchdog.daemon = True
    watchdog.name = f"hang watchdog {item.nodeid}"
    item.stash[_WATCHDOG] = watchdog
    watchdog.start()
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest-timeout's hook
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool:
    watchdog = item.stash.get(_WATCHDOG, None)
    if watchdog is not None:
        watchdog.cancel()
    if _DEADLINE in item.stash:
        del item.stash[_DEADLINE]
    return True


def _watchdog_fires(item: pytest.Item, limit: float) -> None:
    import faulthandler

    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # write to the real stderr, not into the test's capture
        with contextlib.suppress(Exception):
            capture.suspend_global_capture(in_=True)
    sys.stderr.write(
        f"\n\n+++ {item.nodeid}: still running {limit + GRACE_WATCHDOG_S:g} s after it "
        f"started (limit {limit:g} s) and nothing could stop it: every thread's stack, "
        "then the run ends +++\n"
    )
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(WATCHDOG_EXIT)


# --- SIGALRM, only while a phase runs -------------------------------------------------


@contextlib.contextmanager
def _alarm(item: pytest.Item, when: str, extra: float = 0.0) -> Iterator[None]:
    deadline = item.stash.get(_DEADLINE, None)
    usable = (
        deadline is not None
        and hasattr(signal, "SIGALRM")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return
    assert deadline is not None
    limit = item.stash[_LIMIT]

    def fire(signum: int, frame: types.FrameType | None) -> None:
        __tracebackhide__ = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        late = f" (its event loop is blocked: {extra:g} s past it)" if extra else ""
        pytest.fail(f"{item.nodeid}: still running at its {limit:g} s limit in {when}{late}")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(0.05, deadline + extra - time.monotonic()))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _alarm(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    extra = GRACE_BLOCKED_LOOP_S if item.stash.get(_ASYNC, False) else 0.0
    with _alarm(item, "the test", extra):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    with _alarm(item, "teardown"):
        return (yield)


# --- async tests: a cancel scope at the limit -----------------------------------------


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        obj = getattr(item, "obj", None)
        if (
            isinstance(item, pytest.Function)
            and item.get_closest_marker("asyncio") is not None
            and inspect.iscoroutinefunction(obj)
            and not getattr(obj, "is_hypothesis_test", False)
        ):
            item.obj = _within_limit(item, obj)  # type: ignore[attr-defined]
            item.stash[_ASYNC] = True


def _within_limit(item: pytest.Item, test: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(test)
    async def run(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        import asyncio

        deadline = item.stash.get(_DEADLINE, None)
        if deadline is None:
            return await test(*args, **kwargs)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        stuck: list[str] = []
        # note where the test waits just before the scope cancels it
        note = loop.call_at(
            loop.time() + max(0.0, deadline - time.monotonic() - 0.01),
            lambda: stuck.extend(_awaiting(task)),
        )
        import anyio

        try:
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())) as scope:
                result = await test(*args, **kwargs)
        finally:
            note.cancel()
        if scope.cancelled_caught:
            where = "\n".join(stuck) or "(no await chain recorded)"
            pytest.fail(
                f"{item.nodeid}: still running after its {item.stash[_LIMIT]:g} s limit; "
                f"cancelled while it waited in:\n{where}",
                pytrace=False,
            )
        return result

    return run


def _awaiting(task: Any) -> list[str]:
    """The chain of awaits a task is suspended in, outermost first."""
    lines = []
    coro = task.get_coro() if task is not None else None
    for _ in range(64):
        if coro is None:
            break
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


# --- reports that can always be written -----------------------------------------------


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    if call.excinfo is not None and _has_lineless_entry(call.excinfo.value):
        value = call.excinfo.value
        _mend_tracebacks(value)
        call.excinfo = pytest.ExceptionInfo.from_exc_info(
            (type(value), value, value.__traceback__)  # type: ignore[arg-type]
        )
    return (yield)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _has_lineless_entry(exc: BaseException) -> bool:
    for e in _chain(exc):
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_lineno is None:
                return True
            tb = tb.tb_next
    return False


def _mend_tracebacks(exc: BaseException) -> None:
    """Give every traceback entry without a line number its function's first line."""
    for e in _chain(exc):
        entries = []
        tb = e.__traceback__
        while tb is not None:
            entries.append(tb)
            tb = tb.tb_next
        mended: types.TracebackType | None = None
        for entry in reversed(entries):
            line = entry.tb_lineno
            if line is None:
                line = entry.tb_frame.f_code.co_firstlineno
            mended = types.TracebackType(mended, entry.tb_frame, entry.tb_lasti, line)
        e.__traceback__ = mended
