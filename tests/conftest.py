"""Shared test configuration: bounded Hypothesis budgets, temp dirs for ipc sockets."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Under pytest-xdist each worker (and every process it starts) has a temp directory of
# its own: ipc sockets, the demo's directory and other per-user paths under
# tempfile.gettempdir() are never shared between two tests running at once, and
# tests that compare a directory's listing before and after see only their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import atexit
    import pathlib
    import shutil
    import tempfile

    for _stale in pathlib.Path("/tmp").glob("owx-gw*-*-*"):  # of workers that were killed
        _pid = _stale.name.split("-")[2]
        if _pid.isdigit() and not os.path.exists(f"/proc/{_pid}"):
            shutil.rmtree(_stale, ignore_errors=True)
    _worker = os.environ["PYTEST_XDIST_WORKER"]
    _worker_tmp = tempfile.mkdtemp(prefix=f"owx-{_worker}-{os.getpid()}-", dir="/tmp")
    os.environ["TMPDIR"] = _worker_tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    atexit.register(shutil.rmtree, _worker_tmp, ignore_errors=True)

# The frozen peers (tests/frozen) run in a pytest of their own (tests/test_frozen_peers.py).
# Ignored here, their conftest.py is never imported: it would replace this module as
# `conftest` in sys.modules, and `from conftest import omniwire_segments` would fail.
collect_ignore = ["frozen"]

# The nccl tests close pairs whose gloo rendezvous may still run in a builder thread
# (it cannot be cancelled): when the store's host goes first, torch's C++ logger
# prints a TCPStore "recvValueWithTimeout failed" warning with a 30-frame stack
# trace, which buries real failures. torch reads this once, at import (before any
# test module imports it); the subprocess peers inherit it. Errors still print;
# TORCH_CPP_LOG_LEVEL=WARNING brings the warnings back.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

# CI runs on 2 shared cores: examples are bounded, deadlines off (clocks are noisy),
# and derandomized so a red run reproduces.
settings.register_profile(
    "ci",
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


import pathlib  # noqa: E402

import pytest  # noqa: E402


def omniwire_segments() -> set[str]:
    """Names of omniwire shared-memory segments currently in /dev/shm."""
    return {p.name for p in pathlib.Path("/dev/shm").glob("omniwire-*")}


def _leaked(before: set[str], *, dead_too: bool) -> set[str]:
    """Segments made since ``before`` by this process, or (``dead_too``) by one that died."""
    from omniwire.hostinfo import pid_alive

    return {
        s
        for s in omniwire_segments() - before
        if int(s.split("-")[1]) == os.getpid() or (dead_too and not pid_alive(int(s.split("-")[1])))
    }


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


@pytest.fixture(scope="session", autouse=True)
def _no_shared_memory_left_behind(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """After the whole suite — SIGKILL tests included — /dev/shm holds no omniwire segment
    of this process or of any process that has died (segments of unrelated live
    processes, such as a concurrent test run, are not ours to judge). Under
    pytest-xdist a worker judges only its own segments: a peer another worker just
    killed may not be reclaimed yet; the controller judges the dead ones at the end
    (pytest_sessionfinish below)."""
    before = omniwire_segments()
    yield
    leaked = _leaked(before, dead_too=not _xdist_worker(request.config))
    assert not leaked, f"omniwire segments left in /dev/shm: {sorted(leaked)}"


_SEGMENTS_BEFORE = pytest.StashKey[set[str]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SEGMENTS_BEFORE] = omniwire_segments()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The xdist controller: once every worker is done, no segment of a dead process."""
    config = session.config
    if _xdist_worker(config) or not config.pluginmanager.hasplugin("dsession"):
        return
    leaked = _leaked(config.stash.get(_SEGMENTS_BEFORE, set()), dead_too=True)
    if leaked:
        writer = config.get_terminal_writer()
        writer.line()
        writer.line(f"omniwire segments left in /dev/shm: {sorted(leaked)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
