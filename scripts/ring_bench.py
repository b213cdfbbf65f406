#!/usr/bin/env python3
"""Micro-benchmark: the shared-memory ring against ZeroMQ, two processes, one run.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/ring_bench.py [--rounds 5] [--n 400]
    .venv/bin/python scripts/ring_bench.py --doorbells     # the doorbell options alone

Ping-pong (this process sends a frame, the child echoes it, this process receives
it), 64 B and 1 KiB, through:

- ``ring``: ``omniwire.ring`` both ways, asyncio on both sides (frames delivered by
  the reader's callback, echoed with ``send_nowait``);
- ``zmq.asyncio``: PUSH/PULL over ipc:// both ways, ``await send`` / ``await recv``;
- ``zmq blocking``: the same sockets' blocking API (the floor ZeroMQ can reach).

The transports are interleaved round by round (each round runs every transport and
size once, in a rotating order) so that noise from the shared machine falls on all
of them. Then one-way pipelined throughput of 1 KiB frames: ``ring`` (``send_nowait``,
``wait_writable`` when full) against a ``zmq.asyncio`` PUSH/PULL loop that awaits one
send per message; the receiver answers once when it has them all.

Prints medians and p99 of the round trips (µs) and msgs/s, and the ratios. A script,
not a test: its figures are measurements, not assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque

os.environ.setdefault("OMP_NUM_THREADS", "1")

import zmq
import zmq.asyncio

from omniwire.ring import RingReader, RingWriter

SIZES = (64, 1024)
TRANSPORTS = ("ring", "zmq.asyncio", "zmq blocking")


# -- the child: an echo server driven by commands on stdin ------------------------------


class RingEnd:
    """One side's reader and writer, with an ordered overflow queue like the outbox's."""

    def __init__(self, reader: RingReader) -> None:
        self.reader = reader
        self.writer: RingWriter | None = None
        self.pending: deque[bytes] = deque()
        self.drainer: asyncio.Task[None] | None = None

    def send(self, frame: bytes) -> None:
        assert self.writer is not None
        if not self.pending and self.writer.send_nowait(frame):
            return
        self.pending.append(frame)
        if self.drainer is None or self.drainer.done():
            self.drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        assert self.writer is not None
        while self.pending:
            if self.writer.send_nowait(self.pending[0]):
                self.pending.popleft()
            else:
                await self.writer.wait_writable()


async def child_main() -> None:
    loop = asyncio.get_running_loop()
    actx = zmq.asyncio.Context()
    bctx = zmq.Context()
    apull, apush = actx.socket(zmq.PULL), actx.socket(zmq.PUSH)
    bpull, bpush = bctx.socket(zmq.PULL), bctx.socket(zmq.PUSH)
    d = tempfile.mkdtemp(prefix="ringbench-")
    apull.bind(f"ipc://{d}/a")
    bpull.bind(f"ipc://{d}/b")
    end = RingEnd(RingReader.create())
    mode: dict[str, int] = {"echo": 0, "count": 0}
    done = asyncio.Event()

    def on_frames(frames: list[bytes]) -> None:
        if mode["echo"]:
            for f in frames:
                end.send(f)
        else:
            mode["count"] -= len(frames)
            if mode["count"] <= 0:
                end.send(b"done")

    end.reader.start(on_frames)
    print(f"HELLO {end.reader.name} ipc://{d}/a ipc://{d}/b", flush=True)
    parent = (await loop.run_in_executor(None, sys.stdin.readline)).split()
    end.writer = RingWriter.attach(parent[0])
    apush.connect(parent[1])
    bpush.connect(parent[2])
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line or line[0] == "quit":
            break
        what, count = line[0], int(line[1])
        if what == "ring-echo":
            mode["echo"] = 1
            print("READY", flush=True)
        elif what == "ring-count":
            mode["echo"], mode["count"] = 0, count
            print("READY", flush=True)
        elif what == "zmq-echo":
            print("READY", flush=True)
            for _ in range(count):
                await apush.send(await apull.recv())
        elif what == "zmq-count":
            print("READY", flush=True)
            for _ in range(count):
                await apull.recv()
            await apush.send(b"done")
        elif what == "blocking-echo":
            print("READY", flush=True)
            for _ in range(count):
                bpush.send(bpull.recv())
    done.set()
    end.reader.close()
    if end.writer is not None:
        end.writer.close()
    for s in (apull, apush, bpull, bpush):
        s.close(linger=0)
    actx.term()
    bctx.term()


# -- the parent ---------------------------------------------------------------------------


class Parent:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.actx = zmq.asyncio.Context()
        self.bctx = zmq.Context()

    def command(self, line: str) -> None:
        self.stdin.write(line + "\n")
        self.stdin.flush()
        assert self.stdout.readline().strip() == "READY"

    async def setup(self) -> None:
        hello = self.stdout.readline().split()
        assert hello[0] == "HELLO", hello
        self.apull, self.apush = self.actx.socket(zmq.PULL), self.actx.socket(zmq.PUSH)
        self.bpull, self.bpush = self.bctx.socket(zmq.PULL), self.bctx.socket(zmq.PUSH)
        d = tempfile.mkdtemp(prefix="ringbench-")
        self.apull.bind(f"ipc://{d}/a")
        self.bpull.bind(f"ipc://{d}/b")
        self.apush.connect(hello[2])
        self.bpush.connect(hello[3])
        self.reader = RingReader.create()
        self.inbox: deque[bytes] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.reader.start(self._on_frames)
        self.stdin.write(f"{self.reader.name} ipc://{d}/a ipc://{d}/b\n")
        self.stdin.flush()
        await asyncio.sleep(0.2)
        self.writer = RingWriter.attach(hello[1])
        await asyncio.sleep(0.2)

    def _on_frames(self, frames: list[bytes]) -> None:
        self.inbox.extend(frames)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def ring_recv(self) -> bytes:
        while not self.inbox:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.inbox.popleft()

    async def pingpong(self, transport: str, size: int, n: int) -> list[float]:
        msg = secrets.token_bytes(size)
        out: list[float] = []
        clock = time.perf_counter_ns
        if transport == "ring":
            self.command(f"ring-echo {n}")
            for _ in range(n):
                t = clock()
                if not self.writer.send_nowait(msg):
                    raise RuntimeError("ring full in a ping-pong")
                got = await self.ring_recv()
                out.append(clock() - t)
                assert len(got) == size
        elif transport == "zmq.asyncio":
            self.command(f"zmq-echo {n}")
            for _ in range(n):
                t = clock()
                await self.apush.send(msg)
                got = await self.apull.recv()
                out.append(clock() - t)
                assert len(got) == size
        else:
            self.command(f"blocking-echo {n}")
            for _ in range(n):
                t = clock()
                self.bpush.send(msg)
                got = self.bpull.recv()
                out.append(clock() - t)
                assert len(got) == size
        return [x / 1000 for x in out]

    async def pipelined(self, transport: str, n: int, size: int = 1024) -> float:
        msg = secrets.token_bytes(size)
        if transport == "ring":
            self.command(f"ring-count {n}")
            t = time.perf_counter()
            w = self.writer
            for _ in range(n):
                while not w.send_nowait(msg):
                    await w.wait_writable()
            assert await self.ring_recv() == b"done"
        else:
            self.command(f"zmq-count {n}")
            t = time.perf_counter()
            for _ in range(n):
                await self.apush.send(msg)
            assert await self.apull.recv() == b"done"
        return n / (time.perf_counter() - t)

    def close(self) -> None:
        self.stdin.write("quit\n")
        self.stdin.flush()
        self.proc.wait(30)
        self.reader.close()
        self.writer.close()
        for s in (self.apull, self.apush, self.bpull, self.bpush):
            s.close(linger=0)
        self.actx.term()
        self.bctx.term()


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


async def parent_main(args: argparse.Namespace) -> None:
    p = Parent()
    await p.setup()
    lat: dict[tuple[str, int], list[float]] = {(t, s): [] for t in TRANSPORTS for s in SIZES}
    thr: dict[str, list[float]] = {"ring": [], "zmq.asyncio": []}
    try:
        for t in TRANSPORTS:  # warm-up
            for s in SIZES:
                await p.pingpong(t, s, 100)
        for r in range(args.rounds):
            order = TRANSPORTS[r % 3 :] + TRANSPORTS[: r % 3]
            for t in order:
                for s in SIZES:
                    lat[(t, s)] += await p.pingpong(t, s, args.n)
            for t in ("ring", "zmq.asyncio") if r % 2 else ("zmq.asyncio", "ring"):
                thr[t].append(await p.pipelined(t, args.messages))
    finally:
        p.close()
    print(f"ping-pong round trip, µs ({args.rounds} rounds × {args.n}, interleaved)")
    print(f"{'transport':14s} {'size':>6s} {'p50':>8s} {'p99':>8s}  {'p50 / zmq.asyncio':>18s}")
    for s in SIZES:
        base = statistics.median(lat[("zmq.asyncio", s)])
        for t in TRANSPORTS:
            v = lat[(t, s)]
            med = statistics.median(v)
            print(f"{t:14s} {s:6d} {med:8.1f} {_p(v, 0.99):8.1f}  {med / base:18.2f}")
    print(f"\none-way pipelined 1 KiB, msgs/s ({args.messages} per round, median of rounds)")
    zr = statistics.median(thr["zmq.asyncio"])
    for t, v in thr.items():
        print(
            f"{t:14s} {statistics.median(v):10.0f}  ({statistics.median(v) / zr:.2f}× zmq.asyncio)"
        )


# -- doorbell options -----------------------------------------------------------------------


class _Fifo:
    def __init__(self, mine: str, theirs: str) -> None:
        self.r = os.open(mine, os.O_RDWR | os.O_NONBLOCK)
        self.w = os.open(theirs, os.O_RDWR | os.O_NONBLOCK)

    def fileno(self) -> int:
        return self.r

    def ring(self) -> None:
        os.write(self.w, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.r, 4096)


class _Dgram:
    def __init__(self, mine: str, theirs: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.s.setblocking(False)
        self.s.bind(b"\0" + mine.encode())
        self.peer = b"\0" + theirs.encode()
        self.o = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.o.setblocking(False)

    def fileno(self) -> int:
        return self.s.fileno()

    def ring(self) -> None:
        with contextlib.suppress(ConnectionRefusedError, FileNotFoundError):
            self.o.sendto(b"\0", self.peer)

    def drain(self) -> None:
        try:
            while True:
                self.s.recv(64)
        except BlockingIOError:
            pass


class _Eventfd:
    def __init__(self, mine: str, theirs: str) -> None:
        self.r, self.w = int(mine), int(theirs)

    def fileno(self) -> int:
        return self.r

    def ring(self) -> None:
        os.eventfd_write(self.w, 1)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.r)


_Bell = _Fifo | _Dgram | _Eventfd
_BELLS: dict[str, type[_Bell]] = {"fifo": _Fifo, "dgram": _Dgram, "eventfd": _Eventfd}


async def _bell_pingpong(kind: str, mine: str, theirs: str, n: int, initiator: bool) -> None:
    loop = asyncio.get_running_loop()
    bell: _Bell = _BELLS[kind](mine, theirs)
    q: asyncio.Queue[None] = asyncio.Queue()

    def cb() -> None:
        bell.drain()
        q.put_nowait(None)

    loop.add_reader(bell.fileno(), cb)
    if not initiator:
        print("READY", flush=True)
        for _ in range(n + 100):
            await q.get()
            bell.ring()
        await asyncio.sleep(0.2)
        return
    await asyncio.sleep(0.3)
    ts = []
    for _ in range(n + 100):
        t = time.perf_counter()
        bell.ring()
        await q.get()
        ts.append(time.perf_counter() - t)
    ts = ts[100:]
    print(f"{kind:8s} p50 {_p(ts, 0.5) * 1e6:7.1f} µs  p99 {_p(ts, 0.99) * 1e6:7.1f} µs")


def doorbells(args: argparse.Namespace) -> None:
    print("asyncio ping-pong of a bare doorbell, two processes (add_reader on both sides)")
    for _ in range(args.rounds):
        for kind in _BELLS:
            tok = secrets.token_hex(4)
            fds: tuple[int, ...] = ()
            if kind == "fifo":
                a, b = f"/dev/shm/ringbench-{tok}-a", f"/dev/shm/ringbench-{tok}-b"
                os.mkfifo(a, 0o600)
                os.mkfifo(b, 0o600)
            elif kind == "dgram":
                a, b = f"ringbench-{tok}-a", f"ringbench-{tok}-b"
            else:
                ea, eb = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
                a, b, fds = str(ea), str(eb), (ea, eb)
            child = subprocess.Popen(
                [sys.executable, __file__, "--bell-child", kind, b, a, str(args.n)],
                pass_fds=fds,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdout is not None and child.stdout.readline().strip() == "READY"
            asyncio.run(_bell_pingpong(kind, a, b, args.n, True))
            child.wait(60)
            child.stdout.close()
            if kind == "fifo":
                os.unlink(a)
                os.unlink(b)
            for fd in fds:
                os.close(fd)
    print("ring + drain with nobody waiting (the syscall cost), µs")
    for kind in _BELLS:
        tok = secrets.token_hex(4)
        bell: _Bell
        if kind == "fifo":
            a = f"/dev/shm/ringbench-{tok}"
            os.mkfifo(a, 0o600)
            bell = _Fifo(a, a)
        elif kind == "dgram":
            bell = _Dgram(f"ringbench-{tok}", f"ringbench-{tok}")
        else:
            e = os.eventfd(0, os.EFD_NONBLOCK)
            bell = _Eventfd(str(e), str(e))
        t = time.perf_counter()
        for _ in range(20000):
            bell.ring()
            bell.drain()
        print(f"{kind:8s} {(time.perf_counter() - t) / 20000 * 1e6:.2f}")
        if kind == "fifo":
            os.unlink(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=400, help="round trips per transport per round")
    ap.add_argument("--messages", type=int, default=20000, help="pipelined messages per round")
    ap.add_argument("--doorbells", action="store_true", help="measure the doorbell options")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bell-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        asyncio.run(child_main())
    elif args.bell_child:
        kind, mine, theirs, n = args.bell_child
        asyncio.run(_bell_pingpong(kind, mine, theirs, int(n), False))
    elif args.doorbells:
        doorbells(args)
    else:
        asyncio.run(parent_main(args))


if __name__ == "__main__":
    main()
