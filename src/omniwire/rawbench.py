"""The bare engines, between two processes, doing what their backends do — the
baselines ``omniwire bench`` prints beside each backend's rows (``vs_raw``).

- ``mooncake``: one read of ``size`` bytes from a registered buffer of another
  process into a registered local buffer (``batch_transfer_async_read``, status
  polled as the backend polls it);
- ``nixl``: one READ of ``size`` bytes the same way (``initialize_xfer``,
  ``transfer``, state polled as the backend polls it);
- ``nccl`` (gloo on a CPU): one ``send``/``recv`` of ``size`` bytes, the receive
  posted before the timed send, timed until the receiver says it has the bytes.

Each figure is the median GB/s of ``iters`` transfers after one warm-up; the bytes
that arrive are checked. The other process is ``python -m omniwire.rawbench``
(its exit code is checked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["ENGINES", "gloo", "mooncake", "nixl", "pattern"]


def pattern(n: int) -> torch.Tensor:
    """``n`` bytes that are not all the same (0, 1, …, 250, 0, …)."""
    return (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)


class _Child:
    """``python -m omniwire.rawbench ARGS`` with a line protocol on stdin/stdout."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omniwire.rawbench", *args],
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


def _median_gbps(size: int, iters: int, once: Callable[[], None]) -> float:
    times = []
    for i in range(max(1, iters) + 1):
        start = time.perf_counter()
        once()
        if i:  # the first one is a warm-up
            times.append(time.perf_counter() - start)
    return size / statistics.median(times) / 1e9


# -- mooncake ------------------------------------------------------------------------------


def mooncake(
    sizes: Sequence[int], iters: int, *, host: str = "127.0.0.1", protocol: str = "tcp"
) -> dict[int, float]:
    """GB/s of the bare Mooncake engine reading from another process.

    Raises:
        BackendError: the engine failed or the bytes arrived corrupted.
        RuntimeError: the other process failed.
    """
    from .backends.mooncake._engine import read, shared_engine
    from .backends.mooncake._memory import Registered
    from .errors import BackendError

    if not sizes:
        return {}
    biggest = max(sizes)
    child = _Child("serve-mooncake", "--size", str(biggest), "--host", host, "--protocol", protocol)
    results: dict[int, float] = {}
    try:
        _, session, remote = child.line().split()
        engine = shared_engine(host, protocol, "")
        local = Registered(engine, biggest)
        expected = pattern(biggest)
        try:
            for size in sizes:

                def once(size: int = size) -> None:
                    read(engine, session, [(local.addr, int(remote), size)], 60 + size / 100e6)

                results[size] = _median_gbps(size, iters, once)
                if not torch.equal(local.tensor[:size], expected[:size]):
                    raise BackendError(f"mooncake raw bench: {size} bytes arrived corrupted")
                local.tensor[:size].zero_()
        finally:
            local.release()
    finally:
        child.finish()
    return results


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


def nixl(sizes: Sequence[int], iters: int) -> dict[int, float]:
    """GB/s of bare NIXL READs from a registered buffer of another process.

    Raises:
        BackendError: NIXL failed or the bytes arrived corrupted.
        RuntimeError: the other process failed.
    """
    from .backends.nixl._engine import NixlAgent, agent_name, load_checked, read
    from .backends.nixl._memory import Memory
    from .errors import BackendError

    if not sizes:
        return {}
    biggest = max(sizes)
    child = _Child("serve-nixl", "--size", str(biggest))
    results: dict[int, float] = {}
    try:
        target = json.loads(child.line())
        agent = NixlAgent(agent_name("raw-initiator"))
        memory = Memory(agent, biggest, "DRAM", 0, partial=False)
        try:
            peer = str(target["agent"])
            load_checked(agent, bytes.fromhex(target["metadata"]), peer, "raw bench target")
            remote = int(target["addr"])
            expected = pattern(biggest)
            for size in sizes:

                def once(size: int = size) -> None:
                    reads = [(memory.region.addr, remote, size)]
                    read(agent, reads, (0, "DRAM"), peer, (0, "DRAM"), 60 + size / 50e6, "raw")

                results[size] = _median_gbps(size, iters, once)
                if not torch.equal(memory.tensor[:size], expected[:size]):
                    raise BackendError(f"nixl raw bench: {size} bytes arrived corrupted")
                memory.tensor[:size].zero_()
            agent.unload(peer)
        finally:
            memory.release()
            agent.close()
    finally:
        child.finish()
    return results


def _serve_nixl(size: int) -> None:
    from .backends.nixl._engine import NixlAgent, agent_name
    from .backends.nixl._memory import Memory

    agent = NixlAgent(agent_name("raw-target"))
    memory = Memory(agent, size, "DRAM", 0, partial=False)
    memory.tensor[:size].copy_(pattern(size))
    line = {"agent": agent.name, "metadata": agent.metadata().hex(), "addr": memory.region.addr}
    print(json.dumps(line), flush=True)
    sys.stdin.read()
    memory.release()
    agent.close()


# -- gloo (nccl's CPU engine) ------------------------------------------------------------------


def gloo(sizes: Sequence[int], iters: int) -> dict[int, float]:
    """GB/s of bare gloo ``send``/``recv`` between two processes on 127.0.0.1: for each
    transfer, from the send to the receiver's 1-byte "received" (the receiver posts
    its receive before the timed send starts, as the backend's receiver does).

    Raises:
        BackendError: the bytes arrived corrupted.
        RuntimeError: the other process failed.
    """
    from .backends.nccl._engine import TorchDistributed
    from .errors import BackendError

    if not sizes:
        return {}
    dist = TorchDistributed()
    store, port = dist.host_store("127.0.0.1", 60.0)
    child = _Child(
        "gloo-peer",
        "--port",
        str(port),
        "--iters",
        str(iters),
        "--sizes",
        ",".join(str(s) for s in sizes),
    )
    results: dict[int, float] = {}
    try:
        pg = dist.gloo_group(dist.prefix_store("raw", store), 0, 60.0, "127.0.0.1")
        flag = torch.zeros(1, dtype=torch.uint8)
        for size in sizes:
            buf = pattern(size)
            rates = []
            for i in range(iters + 1):
                pg.recv([flag], 1, 1).wait()  # the receive is posted
                t0 = time.perf_counter()
                pg.send([buf], 1, 2).wait()
                pg.recv([flag], 1, 3).wait()  # received
                if i:
                    rates.append(size / (time.perf_counter() - t0) / 1e9)
                pg.recv([flag], 1, 4).wait()  # checked, outside the timed part
                if int(flag[0]) != 1:
                    raise BackendError(f"gloo raw bench: {size} bytes arrived corrupted")
            results[size] = statistics.median(rates)
    finally:
        child.finish(60)
    return results


def _gloo_peer(port: int, sizes: Sequence[int], iters: int) -> None:
    from .backends.nccl._engine import TorchDistributed

    dist = TorchDistributed()
    store = dist.client_store("127.0.0.1", port, 60.0)
    pg = dist.gloo_group(dist.prefix_store("raw", store), 1, 60.0, "127.0.0.1")
    ready = torch.zeros(1, dtype=torch.uint8)
    for size in sizes:
        buf = torch.ones(size, dtype=torch.uint8)  # touched: no page faults while timed
        expected = pattern(size)
        for _ in range(iters + 1):
            work = pg.recv([buf], 0, 2)
            pg.send([ready], 0, 1).wait()
            work.wait()
            pg.send([ready], 0, 3).wait()
            ok = torch.ones(1, dtype=torch.uint8) if torch.equal(buf, expected) else ready
            pg.send([ok], 0, 4).wait()


# -- the command line -------------------------------------------------------------------------

ENGINES: dict[str, Callable[[Sequence[int], int], dict[int, float]]] = {
    "mooncake": mooncake,
    "nixl": nixl,
    "nccl": gloo,
}


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    for suffix, scale in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * scale)
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omniwire.rawbench", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure one bare engine")
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
    peer.add_argument("--iters", type=int, required=True)
    peer.add_argument("--sizes", required=True)
    args = p.parse_args(argv)
    if args.command == "gloo-peer":
        _gloo_peer(args.port, [int(x) for x in args.sizes.split(",")], args.iters)
        return 0
    if args.command == "serve-mooncake":
        _serve_mooncake(args.size, args.host, args.protocol)
        return 0
    if args.command == "serve-nixl":
        _serve_nixl(args.size)
        return 0
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s]
    figures = ENGINES[args.engine](sizes, args.iters)
    print(json.dumps({str(k): v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
