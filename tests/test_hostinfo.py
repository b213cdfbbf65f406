"""Process states read from /proc: a zombie is dead, a stopped process is alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from omniwire import hostinfo


def _wait_for_state(pid: int, state: str) -> str:
    """Poll until ``pid`` is in ``state`` (bounded: 30 s); returns the last state seen."""
    deadline = time.monotonic() + 30
    seen = hostinfo.process_state(pid)
    while seen != state and time.monotonic() < deadline:
        time.sleep(0.01)
        seen = hostinfo.process_state(pid)
    return seen


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], stdin=subprocess.DEVNULL
    )
    yield proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(timeout=30)


def test_this_process_is_alive() -> None:
    assert hostinfo.process_state(os.getpid()) == "alive"
    assert hostinfo.pid_alive(os.getpid())


def test_a_killed_unreaped_child_is_a_zombie_and_not_alive(
    child: subprocess.Popen[bytes],
) -> None:
    os.kill(child.pid, signal.SIGKILL)  # not reaped: the pid stays, as a zombie
    assert _wait_for_state(child.pid, "zombie") == "zombie"
    assert not hostinfo.pid_alive(child.pid)
    child.wait(timeout=30)  # reaped: the pid is gone
    assert hostinfo.process_state(child.pid) == "dead"
    assert not hostinfo.pid_alive(child.pid)


def test_a_stopped_child_is_stopped_and_still_alive(child: subprocess.Popen[bytes]) -> None:
    os.kill(child.pid, signal.SIGSTOP)
    assert _wait_for_state(child.pid, "stopped") == "stopped"
    assert hostinfo.pid_alive(child.pid)
    os.kill(child.pid, signal.SIGCONT)
    assert _wait_for_state(child.pid, "alive") == "alive"


def test_a_process_name_cannot_spoof_its_state() -> None:
    # comm is free text chosen by the process: parentheses and a fake state inside it
    code = "open('/proc/self/comm', 'w').write(') Z (x'); print(flush=True); import time; time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"\n"
        with open(f"/proc/{proc.pid}/comm") as f:
            assert f.read().strip() == ") Z (x"
        assert hostinfo.process_state(proc.pid) == "alive"
    finally:
        proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.parametrize("pid", [0, -1, -(2**40), 2**31, 2**63, 2**64 + 1])
def test_impossible_pids_are_dead_without_an_error(pid: int) -> None:
    assert hostinfo.process_state(pid) == "dead"
    assert not hostinfo.pid_alive(pid)


def test_without_proc_it_falls_back_to_signal_zero(
    child: subprocess.Popen[bytes], tmp_path: os.PathLike[str]
) -> None:
    empty = str(tmp_path)  # no <pid>/stat here, no self/stat either: as if /proc were absent
    assert hostinfo.process_state(child.pid, proc_root=empty) == "alive"
    assert hostinfo.process_state(os.getpid(), proc_root=empty) == "alive"
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert hostinfo.process_state(child.pid, proc_root=empty) == "dead"


def test_a_pid_hidden_from_proc_but_alive_is_not_called_dead(
    child: subprocess.Popen[bytes], tmp_path: os.PathLike[str]
) -> None:
    # procfs mounted with hidepid= hides other users' processes: no stat file, yet alive
    root = os.fspath(tmp_path)
    os.makedirs(os.path.join(root, "self"))
    with open(os.path.join(root, "self", "stat"), "w") as f:
        f.write("1 (x) R 0")
    assert hostinfo.process_state(child.pid, proc_root=root) == "alive"
