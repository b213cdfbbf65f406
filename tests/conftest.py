"""Shared test configuration: bounded Hypothesis budgets, temp dirs for ipc sockets."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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


@pytest.fixture(scope="session", autouse=True)
def _no_shared_memory_left_behind():  # type: ignore[no-untyped-def]
    """After the whole suite — SIGKILL tests included — /dev/shm holds no omniwire segment
    of this process or of any process that has died (segments of unrelated live
    processes, such as a concurrent test run, are not ours to judge)."""
    from omniwire.hostinfo import pid_alive

    before = omniwire_segments()
    yield
    leaked = {
        s
        for s in omniwire_segments() - before
        if int(s.split("-")[1]) == os.getpid() or not pid_alive(int(s.split("-")[1]))
    }
    assert not leaked, f"omniwire segments left in /dev/shm: {sorted(leaked)}"
