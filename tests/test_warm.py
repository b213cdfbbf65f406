"""Warm starts of test processes (``omniwire.testing._warm``): a forked child behaves
as a fresh ``python`` would for what the tests use — argv, environment, pipes, exit
codes, signals — and omniwire itself is imported fresh in every child."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from omniwire.testing import _warm as warm

CHILD = """
import os, random, sys
import omniwire.hostinfo
print(" ".join([*sys.argv[1:], os.environ["OW_WARM_TAG"], str(random.getrandbits(64))]), flush=True)
line = sys.stdin.readline().strip()
if line == "exit":
    sys.exit(int(sys.argv[1]))
if line == "wait":
    print("waiting", flush=True)
    sys.stdin.readline()
"""


def _closed(proc: warm.WarmProcess | subprocess.Popen[str]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _start(*args: str, tag: str = "t") -> warm.WarmProcess:
    proc = warm.start(["-c", CHILD, *args], {**os.environ, "OW_WARM_TAG": tag}, stdin=True)
    assert isinstance(proc, warm.WarmProcess)
    return proc


def test_a_warm_child_gets_its_argv_env_pipes_and_exit_code() -> None:
    procs = [_start("3", "x", tag=f"tag{i}") for i in range(2)]
    lines = []
    for proc in procs:
        assert proc.stdout is not None and proc.stdin is not None
        lines.append(proc.stdout.readline().split())
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(30) == 3
        assert proc.poll() == 3
        _closed(proc)
    assert [line[:3] for line in lines] == [["3", "x", "tag0"], ["3", "x", "tag1"]]
    assert lines[0][3] != lines[1][3], "every child draws its own random numbers"


def test_a_warm_child_can_be_signalled_and_reports_the_signal() -> None:
    proc = _start("0")
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdout.readline()
    proc.stdin.write("wait\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "waiting"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    proc.kill()  # after the exit: nothing to signal, no error
    _closed(proc)


def test_omniwire_is_not_preloaded_so_each_child_reads_its_own_environment() -> None:
    code = "import sys; print('omniwire' in sys.modules, 'torch' in sys.modules, flush=True)"
    proc = warm.start(["-c", code], dict(os.environ))
    assert proc.stdout is not None
    assert proc.stdout.readline().split() == ["False", "True"]
    assert proc.wait(30) == 0
    _closed(proc)


def test_a_module_and_a_script_run_as_main(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "s.py")
    with open(script, "w") as f:
        f.write("import sys\nprint(__name__, sys.argv[1:], sys.path[0] == sys.argv[1])\n")
    proc = warm.start([script, os.path.dirname(script)], dict(os.environ))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == f"__main__ ['{tmp_path}'] True"
    assert proc.wait(30) == 0
    _closed(proc)
    proc = warm.start(["-m", "json.tool", "--help"], dict(os.environ))
    assert proc.stdout is not None
    assert "json.tool" in proc.stdout.read()
    assert proc.wait(30) == 0
    _closed(proc)


def test_cold_start_is_a_plain_popen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIWIRE_TEST_COLD_START", "1")
    proc = warm.start(["-c", "print('cold')"], dict(os.environ))
    assert isinstance(proc, subprocess.Popen)
    assert proc.stdout is not None and proc.stdout.read().strip() == "cold"
    assert proc.wait(30) == 0
    _closed(proc)
