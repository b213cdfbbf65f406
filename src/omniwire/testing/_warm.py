"""Warm starts for test processes: a forked child of a process that already imported
torch, instead of a fresh interpreter that imports it again (~2.5 s of CPU each, on
a 2-core CI machine the largest cost of the multi-process tests).

One *starter* process per test process (started on first use) imports the heavy
third-party modules — never omniwire itself, so a child reads its environment as a
fresh interpreter would — and forks a child per request. The child gets its own
stdin/stdout/stderr (passed over a Unix socket), environment and ``sys.argv``, and
runs a module, a script or ``-c`` code as ``python`` would. :class:`WarmProcess` is the part of
:class:`subprocess.Popen` the tests use; signals go through a pidfd (no pid reuse
race), exit statuses come from the starter, which is the child's parent.

``OMNIWIRE_TEST_COLD_START=1`` makes :func:`start` a plain ``subprocess.Popen``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

__all__ = ["WarmProcess", "start"]

#: What the starter imports before forking (not omniwire: its import-time state, such
#: as a host id read from the environment, must be the child's own).
PRELOAD = ("torch", "numpy", "zmq", "zmq.asyncio", "msgspec", "anyio", "asyncio")
_MAX_MSG = 1 << 20  # a request (argv and environment) or a report


def start(
    argv: list[str], env: dict[str, str], *, stdin: bool = False
) -> WarmProcess | subprocess.Popen[str]:
    """``python *argv`` (``["-m", module, ...]``, ``["-c", code, ...]`` or
    ``[script, ...]``) with ``env``; stdout a text pipe, stdin a text pipe if asked
    (else /dev/null), stderr ours. Warm unless ``OMNIWIRE_TEST_COLD_START=1``."""
    if os.environ.get("OMNIWIRE_TEST_COLD_START") == "1":
        return subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
    return _starter().spawn(argv, env, stdin)


class WarmProcess:
    """A child of the starter, as far as tests use a :class:`subprocess.Popen`."""

    def __init__(
        self, starter: _Starter, pid: int, pidfd: int, stdout: IO[str], stdin: IO[str] | None
    ) -> None:
        self._starter = starter
        self.pid = pid
        self._pidfd = pidfd
        self.stdout: IO[str] | None = stdout
        self.stdin = stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._starter.status(self.pid)
            if self.returncode is not None:
                self._close_pidfd()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._starter.wait(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0.0)
            self.returncode = code
            self._close_pidfd()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._close_pidfd()


class _Starter:
    """The client side: one socket to the starter, one thread reading what it says."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # read once, when torch loads
        self.proc = subprocess.Popen(
            # run as a file, not ``-m``: that would import the omniwire package
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one spawn request at a time
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._spawned: list[tuple[int, int]] = []
        self._gone = False
        threading.Thread(target=self._read, name="omniwire-warm-starter", daemon=True).start()

    def spawn(self, argv: list[str], env: dict[str, str], stdin: bool) -> WarmProcess:
        out_r, out_w = os.pipe()
        in_r, in_w = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        try:
            request = json.dumps({"argv": argv, "env": env}).encode()
            if len(request) >= _MAX_MSG:
                raise ValueError(f"a warm start request of {len(request)} bytes is too large")
            with self._lock:
                socket.send_fds(self._sock, [request], [in_r, out_w, 2])
                pid, pidfd = self._next_spawned(60.0)
        except BaseException:
            os.close(out_r)
            if in_w >= 0:
                os.close(in_w)
            raise
        finally:
            os.close(out_w)
            os.close(in_r)
        writer = os.fdopen(in_w, "w", encoding="utf-8") if in_w >= 0 else None
        return WarmProcess(self, pid, pidfd, os.fdopen(out_r, encoding="utf-8"), writer)

    def _next_spawned(self, timeout: float) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._spawned:
                left = deadline - time.monotonic()
                if self._gone or left <= 0:
                    raise RuntimeError("the warm starter process is gone or stuck")
                self._cond.wait(left)
            return self._spawned.pop(0)

    def status(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while pid not in self._exits:
                left = None if deadline is None else deadline - time.monotonic()
                if self._gone or (left is not None and left <= 0):
                    return self._exits.get(pid)
                self._cond.wait(left)
            return self._exits[pid]

    def _read(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, _MAX_MSG, 1)
            except OSError:
                data, fds = b"", []
            if not data:
                with self._cond:
                    self._gone = True
                    self._cond.notify_all()
                return
            msg = json.loads(data)
            with self._cond:
                if "spawned" in msg:
                    self._spawned.append((msg["spawned"], fds[0]))
                else:
                    self._exits[msg["pid"]] = msg["code"]
                self._cond.notify_all()


_the_starter: _Starter | None = None
_starter_lock = threading.Lock()


def _starter() -> _Starter:
    global _the_starter
    with _starter_lock:
        if _the_starter is None or _the_starter._gone:
            _the_starter = _Starter()
        return _the_starter


# -- the starter process ---------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    """Fork a child per request; report each child's exit status (as Popen would
    give it: negative for a signal). Ends when the test process closes its side."""
    import selectors
    import warnings

    for name in PRELOAD:
        __import__(name)
    # Python 3.12+ warns at fork() when other threads exist (torch starts one, idle);
    # the children use nothing of it.
    warnings.filterwarnings("ignore", ".*fork", DeprecationWarning)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    children: set[int] = set()
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 3)
                if not data:
                    return
                pid = _fork(json.loads(data), fds, sock, (wake_r, wake_w))
                for fd in fds:
                    os.close(fd)
                children.add(pid)
                pidfd = os.pidfd_open(pid)
                socket.send_fds(sock, [json.dumps({"spawned": pid}).encode()], [pidfd])
                os.close(pidfd)
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                sock.send(json.dumps({"pid": pid, "code": code}).encode())


def _fork(
    request: dict[str, Any], fds: list[int], sock: socket.socket, wake: tuple[int, int]
) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        code = _run_child(request)
    except BaseException:  # the child reports and ends here, whatever happened
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    finally:
        os._exit(code)


def _run_child(request: dict[str, Any]) -> int:
    """Run ``argv`` as ``python *argv`` would, in this forked child; its exit code."""
    import atexit
    import random
    import runpy

    env: dict[str, str] = request["env"]
    argv: list[str] = request["argv"]
    os.environ.clear()
    os.environ.update(env)
    random.seed()
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.seed()
        if argv[0] == "-m":
            sys.path[:0] = extra
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.path[0:1] = ["", *extra]
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.path[0:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter would: print, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as under ``python -m``, not this file's directory
    _serve(socket.socket(fileno=int(sys.argv[1])))
