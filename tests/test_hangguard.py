"""A hung test fails alone and names itself; the run goes on (the root conftest.py).

``tests/hung_cases.py`` (kept out of the normal run) hangs in every way we know of;
it runs here in a pytest of its own with a 1 s limit and shortened graces."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = "tests/hung_cases.py"
HUNG = [
    "test_async_hung_on_an_await",
    "test_async_with_its_loop_blocked",
    "test_sync_hung_in_a_wait",
    "test_sync_hung_in_a_busy_loop",
]


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env = dict(
        outer,
        OMNIWIRE_TEST_GRACE_LOOP="1",
        OMNIWIRE_TEST_GRACE_WATCHDOG="2",
        PYTEST_ADDOPTS="",
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rfE",
            "--timeout",
            "1",
            CASES,
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_each_hung_test_fails_alone_naming_itself_and_the_run_goes_on() -> None:
    done = _pytest("-k", "not swallows")
    out = done.stdout + done.stderr
    assert "INTERNALERROR" not in out, out[-3000:]
    assert done.returncode == 1, out[-3000:]  # tests failed; not 3 (internal error), not killed
    for name in HUNG:
        nodeid = f"{CASES}::{name}"
        assert f"FAILED {nodeid}" in out, (name, out[-3000:])
        assert f"{nodeid}: still running" in out, (name, out[-3000:])
    # a teardown that hangs is that test's error, after its call passed
    assert f"ERROR {CASES}::test_hung_in_a_fixture_teardown" in out, out[-3000:]
    assert "still running at its 1 s limit in teardown" in out
    # a traceback entry without a line number is reported, not an INTERNALERROR
    assert f"FAILED {CASES}::test_a_traceback_entry_without_a_line_number" in out
    assert "RuntimeError: raised where no line is" in out
    # the loop-blocked async test is stopped by the signal, the others by the scope
    assert "its event loop is blocked" in out
    assert "cancelled while it waited in:" in out
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\b5 failed, 2 passed, 1 deselected, 1 error\b", summary), summary


def test_under_xdist_even_a_test_nothing_can_stop_fails_alone() -> None:
    """``make test`` runs pytest-xdist: the watchdog ends only that worker, which
    xdist names as crashed while running the test, and replaces."""
    done = _pytest("-n", "2")
    out = done.stdout + done.stderr
    assert "INTERNALERROR" not in out, out[-3000:]
    assert done.returncode == 1, out[-3000:]
    assert f"crashed while running '{CASES}::test_swallows_every_interrupt'" in out, out[-3000:]
    for name in HUNG:
        assert f"FAILED {CASES}::{name}" in out, (name, out[-3000:])
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\b6 failed, 2 passed, 1 error\b", summary), summary


def test_a_test_nothing_can_stop_ends_the_run_naming_itself() -> None:
    done = _pytest("-k", "swallows")
    out = done.stdout + done.stderr
    assert done.returncode == 70, out[-3000:]
    assert f"{CASES}::test_swallows_every_interrupt: still running" in out, out[-3000:]
    assert "test_swallows_every_interrupt" in out.split("still running", 1)[1]  # its stack
