"""The bare engines, between two processes, doing what their backends do — the
baselines ``omniwire bench`` measures beside each backend's rows (``vs_raw``).

- ``mooncake``: one read of ``size`` bytes from a registered buffer of another
  process into a registered local buffer (``batch_transfer_async_read``, status
  polled as the backend polls it);
- ``nixl``: one READ of ``size`` bytes the same way (``initialize_xfer``,
  ``transfer``, state polled as the backend polls it);
- ``nccl`` (gloo on a CPU): one ``send``/``recv`` of ``size`` bytes, the receive
  posted before the timed send, timed until the receiver says it has the bytes
  (into a buffer it allocated and touched once per size).

A :class:`Session` keeps the other process (``python -m omniwire.rawbench``, its
exit code checked) and the registered buffers, so that ``omniwire bench`` can
interleave bare transfers with omniwire's, one by one, in the same run (on a
shared machine, figures measured minutes apart are not comparable). The first
transfer of each size checks the bytes that arrive.
"""

from __future__ import annotations

import abc
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import BackendError

__all__ = ["ENGINES", "Placement", "Session", "measure", "open_session", "pattern", "placement"]


@dataclass(frozen=True)
class Placement:
    """Where the other process of a bench pair runs: on this machine over 127.0.0.1
    (the default), or on another host (``omniwire bench --namespaces``): this
    host's address, the other's, and the command prefix that starts a process there.
    Read from ``OMNIWIRE_BENCH_HOSTS=THIS_IP,OTHER_IP`` and
    ``OMNIWIRE_BENCH_PEER_LAUNCH`` (a shell-quoted prefix), which that mode sets."""

    here: str = "127.0.0.1"
    there: str = "127.0.0.1"
    launch: tuple[str, ...] = ()


def placement() -> Placement:
    hosts = os.environ.get("OMNIWIRE_BENCH_HOSTS", "")
    if not hosts:
        return Placement()
    here, _, there = hosts.partition(",")
    launch = tuple(shlex.split(os.environ.get("OMNIWIRE_BENCH_PEER_LAUNCH", "")))
    return Placement(here, there or here, launch)


def pattern(n: int) -> torch.Tensor:
    """``n`` bytes that are not all the same (0, 1, …, 250, 0, …)."""
    return (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)


class _Child:
    """``python -m omniwire.rawbench ARGS`` with a line protocol on stdin/stdout."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*placement().launch, sys.executable, "-m", "omniwire.rawbench", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.stdout = self.proc.stdout

    def line(self) -> str:
        text = self.stdout.readline()
        if not text:
            raise RuntimeError(f"rawbench peer {self.proc.args!r} exited with {self.proc.wait()}")
        return text.strip()

    def finish(self, timeout: float = 30.0) -> None:
        """Close its stdin (it exits) and check its exit code.

        Raises:
            RuntimeError: it exited with a non-zero code.
        """
        if not self.stdin.closed:
            self.stdin.close()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.stdout.close()
        if code != 0:
            raise RuntimeError(f"rawbench peer {self.proc.args!r} exited with {code}")


class Session(abc.ABC):
    """The bare engine, ready to move up to ``max_size`` bytes from another process.

    Blocking: run :meth:`once` in a worker thread when an event loop is around.
    """

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._checked: set[int] = set()
        self._refilled: set[int] = set()

    def once(self, size: int) -> float:
        """Seconds one transfer of ``size`` bytes takes.

        Raises:
            BackendError: the engine failed, or the bytes arrived corrupted.
        """
        start = time.perf_counter()
        self._transfer(size)
        elapsed = time.perf_counter() - start
        if size not in self._checked:
            self._checked.add(size)
            if not self._arrived_intact(size):
                raise BackendError(f"{type(self).__name__}: {size} bytes arrived corrupted")
        return elapsed

    #: Whether :meth:`write_once` moves bytes the other way (the engines that land).
    writes: bool = False

    def write_once(self, size: int) -> float:
        """Seconds one transfer of ``size`` bytes *to* the other process takes (the
        way a landed object moves); only where :attr:`writes`.

        Raises:
            BackendError: the engine failed.
        """
        raise NotImplementedError(f"{type(self).__name__} does not write")

    def _refill(self, local: torch.Tensor, size: int) -> None:
        """Before a write back to the peer: ``local`` holds the pattern again where the
        first check of ``size`` zeroed it (the peer's memory must keep the pattern for
        the next size's check)."""
        if size not in self._refilled:
            self._refilled.add(size)
            local[:size].copy_(pattern(size))

    @abc.abstractmethod
    def _transfer(self, size: int) -> None: ...

    @abc.abstractmethod
    def _arrived_intact(self, size: int) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the other process and release the buffers.

        Raises:
            RuntimeError: the other process failed.
        """

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The bare NIXL agents' progress-thread wake-up (µs): 1 ms, the bare engine's best
#: here (1 MiB READs 10–30 % faster than with the backend's 10 ms; the backend is
#: faster with 10 ms, whose wake-ups take less CPU from its own work): each side of
#: the comparison runs as it runs best. See ``backends.nixl._engine.PROGRESS_POLL_US``.
RAW_NIXL_POLL_US = 1000


# -- mooncake ------------------------------------------------------------------------------


class _MooncakeSession(Session):
    writes = True

    def __init__(self, max_size: int, protocol: str = "tcp") -> None:
        from .backends.mooncake._engine import read, shared_engine
        from .backends.mooncake._memory import Registered

        super().__init__(max_size)
        self._read = read
        where = placement()
        host = where.here
        self.child = _Child("serve-mooncake", "--size", str(max_size), "--host", where.there,
                            "--protocol", protocol)  # fmt: skip
        try:
            _, self.session, remote = self.child.line().split()
            self.remote = int(remote)
            self.engine = shared_engine(host, protocol, "")
            self.local = Registered(self.engine, max_size)
        except BaseException:
            self.child.finish()
            raise

    def write_once(self, size: int) -> float:
        self._refill(self.local.tensor, size)
        start = time.perf_counter()
        writes = [(self.local.addr, self.remote, size)]
        self._read(self.engine, self.session, writes, 60 + size / 100e6, write=True)
        return time.perf_counter() - start

    def _transfer(self, size: int) -> None:
        reads = [(self.local.addr, self.remote, size)]
        self._read(self.engine, self.session, reads, 60 + size / 100e6)

    def _arrived_intact(self, size: int) -> bool:
        ok = torch.equal(self.local.tensor[:size], pattern(size))
        self.local.tensor[:size].zero_()
        return ok

    def close(self) -> None:
        self.local.release()
        self.child.finish()


def _serve_mooncake(size: int, host: str, protocol: str) -> None:
    from .backends.mooncake._engine import TransferEngine
    from .backends.mooncake._memory import Registered

    engine = TransferEngine(host, protocol)
    memory = Registered(engine, size)
    memory.tensor.copy_(pattern(size))
    print(f"READY {engine.session} {memory.addr}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    engine.unregister(memory.addr)
    sys.stdout.flush()
    os._exit(0)  # stopping the engine would take a second; the OS reclaims it all


# -- nixl -----------------------------------------------------------------------------------


class _NixlSession(Session):
    writes = True

    def __init__(self, max_size: int) -> None:
        from .backends.nixl._engine import NixlAgent, agent_name, load_checked, read
        from .backends.nixl._memory import Memory

        super().__init__(max_size)
        self._read = read
        self.child = _Child("serve-nixl", "--size", str(max_size))
        try:
            target = json.loads(self.child.line())
            self.agent = NixlAgent(agent_name("raw-initiator"), progress_poll_us=RAW_NIXL_POLL_US)
            self.memory = Memory(self.agent, max_size, "DRAM", 0, partial=False)
            self.peer = str(target["agent"])
            load_checked(self.agent, bytes.fromhex(target["metadata"]), self.peer, "raw target")
            self.remote = int(target["addr"])
        except BaseException:
            self.child.finish()
            raise

    def write_once(self, size: int) -> float:
        self._refill(self.memory.tensor, size)
        start = time.perf_counter()
        writes = [(self.memory.region.addr, self.remote, size)]
        local = remote = (0, "DRAM")
        timeout = 60 + size / 50e6
        self._read(self.agent, writes, local, self.peer, remote, timeout, "raw", write=True)
        return time.perf_counter() - start

    def _transfer(self, size: int) -> None:
        reads = [(self.memory.region.addr, self.remote, size)]
        local = remote = (0, "DRAM")
        self._read(self.agent, reads, local, self.peer, remote, 60 + size / 50e6, "raw")

    def _arrived_intact(self, size: int) -> bool:
        ok = torch.equal(self.memory.tensor[:size], pattern(size))
        self.memory.tensor[:size].zero_()
        return ok

    def close(self) -> None:
        try:
            self.agent.unload(self.peer)
            self.memory.release()
            self.agent.close()
        finally:
            self.child.finish()


def _serve_nixl(size: int) -> None:
    from .backends.nixl._engine import NixlAgent, agent_name
    from .backends.nixl._memory import Memory

    agent = NixlAgent(agent_name("raw-target"), progress_poll_us=RAW_NIXL_POLL_US)
    memory = Memory(agent, size, "DRAM", 0, partial=False)
    memory.tensor[:size].copy_(pattern(size))
    line = {"agent": agent.name, "metadata": agent.metadata().hex(), "addr": memory.region.addr}
    print(json.dumps(line), flush=True)
    sys.stdin.read()
    memory.release()
    agent.close()


# -- gloo (nccl's CPU engine) ------------------------------------------------------------------

# Tags of the gloo protocol between the session (rank 0) and its peer (rank 1).
_SIZE, _POSTED, _DATA, _RECEIVED, _CHECKED = 5, 1, 2, 3, 4


class _GlooSession(Session):
    """Rank 0 sends; the peer (rank 1) posts its receive, says so, receives, says so,
    and, for the first transfer of each size only, then says (outside the timed part)
    whether the bytes were right.

    Only the first is checked, as for the other engines: a check takes the peer about
    a second (64 MiB compared with a fresh pattern), and a loopback TCP connection
    left idle longer than its retransmission timeout (~0.2 s) restarts its congestion
    window (``tcp_slow_start_after_idle``), which on this kind of machine made the
    next bare transfer about 30 % faster than one on a connection in steady use, as
    omniwire's is between its transfers. Checked every time, the baseline measured
    that effect, not the engine.
    """

    def __init__(self, max_size: int) -> None:
        from .backends.nccl._engine import TorchDistributed

        super().__init__(max_size)
        dist = TorchDistributed()
        where = placement()
        store, port = dist.host_store(where.here, 60.0)
        self.child = _Child("gloo-peer", "--port", str(port), "--store", where.here,
                            "--host", where.there)  # fmt: skip
        try:
            self.pg = dist.gloo_group(dist.prefix_store("raw", store), 0, 60.0, where.here)
        except BaseException:
            self.child.finish()
            raise
        self.store = store
        self.data = pattern(max_size)
        self.flag = torch.zeros(1, dtype=torch.uint8)
        self.ok = True

    def _transfer(self, size: int) -> None:
        pg = self.pg
        check = size not in self._checked
        pg.send([torch.tensor([size, int(check)], dtype=torch.int64)], 1, _SIZE).wait()
        pg.recv([self.flag], 1, _POSTED).wait()
        start = time.perf_counter()
        pg.send([self.data[:size]], 1, _DATA).wait()
        pg.recv([self.flag], 1, _RECEIVED).wait()
        self._elapsed = time.perf_counter() - start
        if check:
            pg.recv([self.flag], 1, _CHECKED).wait()
            self.ok = int(self.flag[0]) == 1

    def once(self, size: int) -> float:
        super().once(size)
        return self._elapsed  # from the send, once the receive was posted

    def _arrived_intact(self, size: int) -> bool:
        return self.ok

    def close(self) -> None:
        try:
            self.pg.send([torch.tensor([0, 0], dtype=torch.int64)], 1, _SIZE).wait()
        finally:
            self.child.finish(60)


def _gloo_peer(port: int, store_host: str, host: str) -> None:
    from .backends.nccl._engine import TorchDistributed

    dist = TorchDistributed()
    store = dist.client_store(store_host, port, 60.0)
    pg = dist.gloo_group(dist.prefix_store("raw", store), 1, 60.0, host)
    flag = torch.ones(1, dtype=torch.uint8)
    header = torch.zeros(2, dtype=torch.int64)  # size (0: stop), whether to check
    buffers: dict[int, torch.Tensor] = {}
    while True:
        pg.recv([header], 0, _SIZE).wait()
        size, check = int(header[0]), bool(header[1])
        if size == 0:
            return
        buf = buffers.get(size)
        if buf is None:  # touched: no page faults while timed
            buf = buffers[size] = torch.zeros(size, dtype=torch.uint8)
        work = pg.recv([buf], 0, _DATA)
        pg.send([flag], 0, _POSTED).wait()
        work.wait()
        pg.send([flag], 0, _RECEIVED).wait()
        if check:
            ok = torch.equal(buf, pattern(size))
            pg.send([torch.tensor([int(ok)], dtype=torch.uint8)], 0, _CHECKED).wait()


# -- entry points ------------------------------------------------------------------------------

ENGINES: dict[str, Callable[[int], Session]] = {
    "mooncake": _MooncakeSession,
    "nixl": _NixlSession,
    "nccl": _GlooSession,
}


def open_session(engine: str, max_size: int) -> Session:
    """A session of the bare engine behind backend ``engine`` (blocking).

    Raises:
        KeyError: no raw engine for that backend.
        BackendError, RuntimeError: the engine or the other process failed.
    """
    return ENGINES[engine](max_size)


def measure(engine: str, sizes: Sequence[int], iters: int) -> dict[int, float]:
    """GB/s of the bare engine per size: the median of ``iters`` transfers after one
    warm-up (blocking).

    Raises:
        BackendError, RuntimeError: as :func:`open_session`.
    """
    if not sizes:
        return {}
    results = {}
    with open_session(engine, max(sizes)) as session:
        for size in sizes:
            session.once(size)
            times = [session.once(size) for _ in range(max(1, iters))]
            results[size] = size / statistics.median(times) / 1e9
    return results


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    for suffix, scale in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * scale)
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omniwire.rawbench", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure one bare engine; prints JSON {size: GB/s}")
    run.add_argument("engine", choices=sorted(ENGINES))
    run.add_argument("--sizes", default="1M,64M")
    run.add_argument("--iters", type=int, default=10)
    serve = sub.add_parser("serve-mooncake", help=argparse.SUPPRESS)
    serve.add_argument("--size", type=int, required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--protocol", default="tcp")
    serve_nixl = sub.add_parser("serve-nixl", help=argparse.SUPPRESS)
    serve_nixl.add_argument("--size", type=int, required=True)
    peer = sub.add_parser("gloo-peer", help=argparse.SUPPRESS)
    peer.add_argument("--port", type=int, required=True)
    peer.add_argument("--store", default="127.0.0.1")
    peer.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    if args.command == "serve-mooncake":
        _serve_mooncake(args.size, args.host, args.protocol)
    elif args.command == "serve-nixl":
        _serve_nixl(args.size)
    elif args.command == "gloo-peer":
        _gloo_peer(args.port, args.store, args.host)
    else:
        sizes = [_parse_size(s) for s in args.sizes.split(",") if s]
        figures = measure(args.engine, sizes, args.iters)
        print(json.dumps({str(k): v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
