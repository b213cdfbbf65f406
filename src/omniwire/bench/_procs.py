"""The other processes of a bench run: omniwire peers, the CPU burner, CPU clocks."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

from ..rawbench import placement

__all__ = ["Burner", "Child", "bench_env", "cpu_seconds", "ipc_base", "omniwire_peer"]


def bench_env() -> dict[str, str]:
    """The environment of every bench process: one OpenMP thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def ipc_base(tag: str) -> str:
    """A fresh ``ipc://`` path prefix under the temp directory."""
    return f"ipc://{tempfile.gettempdir()}/omniwire-bench-{os.getuid()}-{tag}"


class Child:
    """A process that prints ``READY [info]`` on its stdout once it serves.

    Blocking: start and stop it in a worker thread when an event loop runs.

    Raises:
        RuntimeError: it exited, or printed something else, before READY.
    """

    def __init__(self, argv: list[str], what: str) -> None:
        self.what = what
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=bench_env())
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("READY"):
            self.proc.kill()
            code = self.proc.wait()
            self.proc.stdout.close()
            raise RuntimeError(f"{what} did not start: printed {line!r}, exit code {code}")
        self.info = line[len("READY") :].strip()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM it and wait; returns its exit code (killed after ``timeout`` s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code


def omniwire_peer(name: str, address: str, args: list[str]) -> Child:
    """``python -m omniwire.peer --mode bench``; its bound address is ``child.info``."""
    argv = [*placement().launch, sys.executable, "-m", "omniwire.peer", "--name", name]
    argv += ["--address", address]
    return Child([*argv, "--mode", "bench", *args], f"bench peer {name!r}")


class Burner:
    """One Python busy loop at normal priority, for ``--busy`` ("the other core busy")."""

    def __init__(self) -> None:
        code = "import sys; print('READY', flush=True)\nwhile True: pass"
        self.child = Child([sys.executable, "-c", code], "CPU burner")

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.child.pid)

    def running(self) -> bool:
        return self.child.proc.poll() is None

    def stop(self) -> None:
        self.child.stop(5)


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` used so far, all its threads (ns resolution from
    ``/proc/PID/task/*/schedstat``; ``/proc/PID/stat`` ticks where schedstat is absent).

    Raises:
        OSError: no such process.
    """
    total = 0
    tasks = glob.glob(f"/proc/{pid}/task/*/schedstat")
    try:
        for path in tasks:
            with open(path) as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        tasks = []
    if tasks and total > 0:
        return total / 1e9
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[11], [12]: utime, stime (the 14th and 15th of stat(5), after pid and comm)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
