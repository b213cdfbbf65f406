"""``omniwire bench``: throughput and latency per backend and payload size, two processes.

For each backend (and, for shm, both receive modes) a peer process runs
``python -m omniwire.peer --mode bench``; this process sends it payloads of one
tensor of each size and measures:

- **RTT** p50/p99: the payload goes to the peer and is echoed back;
- **one-way**: a single transfer, from ``send`` to the peer's ACK (the peer has
  copied the data, or in zero-copy mode mapped it) — latency-bound GB/s;
- **streamed**: back-to-back transfers with credits in flight — GB/s and msgs/s.

Modes: ``copy`` (the receiver copies into its own memory), ``zero-copy`` (shm: the
receiver views the sender's memory), ``lent`` (the cross-host engines, with
``send(..., lend=True)``: the engine reads the caller's tensors in place, no
packing copy).

Baselines measured in the same run: the machine's memcpy bandwidth (numpy, warm
pages, single thread), a raw ``zmq.asyncio`` round trip between two processes,
and, for each cross-host engine, the bare engine doing the same operation between
two processes (:mod:`omniwire.rawbench`): its transfers are interleaved one by one
with the row's one-way transfers (a shared machine drifts within minutes), and the
row carries its one-way GB/s as a ratio to the bare engine's (``vs_raw``; both
figures are in ``--json``). With shm, the *obstructed* case is
measured too: a large object sent while a zero-copy consumer holds a 1 KiB one,
beside the same object unobstructed. Set ``OMP_NUM_THREADS=1`` (``make bench``
does).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import numpy as np
import torch

from . import rawbench
from .endpoint import Endpoint
from .registry import backend_status

__all__ = ["main"]

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [
    KiB,
    4 * KiB,
    16 * KiB,
    64 * KiB,
    256 * KiB,
    MiB,
    4 * MiB,
    16 * MiB,
    64 * MiB,
    256 * MiB,
]
QUICK_SIZES = [KiB, 64 * KiB, MiB, 64 * MiB]
CROSS_HOST = ("mooncake", "nixl", "nccl")
OBSTRUCTED_SIZES = [33 * MiB, 64 * MiB]


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    for suffix, scale in (("K", KiB), ("M", MiB), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * scale)
    return int(text)


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


@dataclass
class Row:
    backend: str
    mode: str
    size: int
    rtt_p50_us: float
    rtt_p99_us: float
    oneway_gbps: float
    stream_gbps: float
    msgs_per_s: float
    memcpy_gbps: float
    #: the bare engine's GB/s at this size, its transfers interleaved with this row's
    raw_gbps: float | None = None
    #: one-way GB/s over ``raw_gbps`` (engines only)
    vs_raw: float | None = None


@dataclass
class Results:
    memcpy_gbps: dict[int, float] = field(default_factory=dict)
    zmq_rtt_us: dict[int, float] = field(default_factory=dict)
    raw_engine_gbps: dict[str, dict[int, float]] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    #: size -> (one-way seconds alone, one-way seconds behind a held 1 KiB object)
    obstructed_s: dict[int, tuple[float, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _iters(size: int, base: int) -> int:
    """Fewer repetitions for large sizes: about 1 GiB moved per measurement, at least 5."""
    return max(5, min(base, (1 << 30) // max(size, 1)))


# -- baselines ----------------------------------------------------------------------


def memcpy_gbps(size: int, iters: int = 7) -> float:
    """Warm single-thread copy bandwidth (numpy.copyto), median of ``iters``."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return size / statistics.median(times) / 1e9


async def _zmq_echo(address: str) -> None:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(address)
    push.connect(address + ".back")
    print("READY", flush=True)
    while True:
        msg = await pull.recv()
        if msg == b"stop":
            break
        await push.send(msg)
    pull.close(0)
    push.close(0)
    ctx.term()


def _spawn_zmq_echo(address: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "omniwire.bench", "--zmq-echo", address],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    return proc


async def zmq_rtt_us(sizes: Sequence[int], iters: int) -> dict[int, float]:
    """Median round trip of raw zmq.asyncio PUSH/PULL between two processes, in µs."""
    import zmq
    import zmq.asyncio

    address = f"ipc://{tempfile.gettempdir()}/omniwire-bench-zmq-{secrets.token_hex(3)}"
    proc = await anyio.to_thread.run_sync(_spawn_zmq_echo, address)
    ctx = zmq.asyncio.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind(address + ".back")
    push.connect(address)
    out = {}
    try:
        for size in sizes:
            msg = bytes(size)
            times = []
            for i in range(iters + 20):
                t = time.perf_counter()
                await push.send(msg)
                await pull.recv()
                if i >= 20:
                    times.append(time.perf_counter() - t)
            out[size] = statistics.median(times) * 1e6
        await push.send(b"stop")
    finally:
        push.close(1000)
        pull.close(0)
        ctx.term()
        await anyio.to_thread.run_sync(proc.wait, 10)
        if proc.stdout is not None:
            proc.stdout.close()
    return out


# -- omniwire -----------------------------------------------------------------------


class _Peer:
    def __init__(self, name: str, address: str, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omniwire.peer",
                "--name",
                name,
                "--address",
                address,
                "--mode",
                "bench",
                *args,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"bench peer did not start: {line!r} (exit {self.proc.wait()})")
        self.address = line.split(" ", 1)[1]

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code


async def _stream(ep: Endpoint, peer: str, payload: Any, n: int, tag: str, lend: bool) -> None:
    receipts = [await ep.send(peer, payload, request_id=f"{tag}{i}", lend=lend) for i in range(n)]
    for r in receipts:
        await r.wait()


def _payload(size: int) -> dict[str, torch.Tensor]:
    t = torch.ones(size // 4 if size >= 4 else 1, dtype=torch.float32)
    if size % 4:
        t = torch.ones(size, dtype=torch.uint8)
    return {"x": t}


async def _oneway(
    ep: Endpoint,
    peer: str,
    payload: Any,
    n: int,
    tag: str,
    lend: bool,
    raw: tuple[rawbench.Session, int, list[float]] | None = None,
) -> float:
    """Median seconds from ``send`` to the peer's ACK, one object at a time; with
    ``raw = (session, size, times)``, each preceded by one bare-engine transfer
    (its seconds appended to ``times``)."""
    times = []
    for i in range(n):
        if raw is not None:
            session, size, raw_times = raw
            raw_times.append(await anyio.to_thread.run_sync(session.once, size))
        start = time.perf_counter()
        r = await ep.send(peer, payload, request_id=f"{tag}{i}", lend=lend)
        await r.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _measure(
    ep: Endpoint,
    peer: str,
    size: int,
    iters: int,
    lend: bool = False,
    raw: tuple[rawbench.Session, int, list[float]] | None = None,
) -> tuple[float, float, float, float, float]:
    payload = _payload(size)
    n_rtt = _iters(size, iters)
    # warm up: fault in arenas, pools and the receiver's buffers for this size
    for _ in range(3):
        r = await ep.send(peer, payload, request_id="warm", metadata={"echo": True}, lend=lend)
        (await ep.receive()).release()
        await r.wait()
    rtts = []
    for i in range(n_rtt):
        start = time.perf_counter()
        r = await ep.send(peer, payload, request_id=f"rtt{i}", metadata={"echo": True}, lend=lend)
        d = await ep.receive()
        rtts.append(time.perf_counter() - start)
        d.release()
        await r.wait()
    oneway = await _oneway(ep, peer, payload, max(5, n_rtt), "one", lend, raw)
    n_stream = max(4, n_rtt)
    # warm the receiver's buffer pool for as many objects as may be in flight
    await _stream(ep, peer, payload, n_stream, "warm-stream", lend)
    start = time.perf_counter()
    await _stream(ep, peer, payload, n_stream, "st", lend)
    elapsed = time.perf_counter() - start
    rtts.sort()
    p50 = rtts[len(rtts) // 2]
    p99 = rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))]
    return (
        p50 * 1e6,
        p99 * 1e6,
        size / oneway / 1e9,
        n_stream * size / elapsed / 1e9,
        n_stream / elapsed,
    )


async def bench_backend(
    backend: str,
    mode: str,
    sizes: Sequence[int],
    iters: int,
    results: Results,
    step: Callable[[str], None],
    with_raw: bool = True,
) -> None:
    zero_copy, lend = mode == "zero-copy", mode == "lent"
    session: rawbench.Session | None = None
    if with_raw and backend in rawbench.ENGINES:
        step(f"raw {backend} (its transfers interleaved with {mode}'s)")
        session = await anyio.to_thread.run_sync(rawbench.open_session, backend, max(sizes))
    tag = secrets.token_hex(3)
    tcp = backend in CROSS_HOST or backend == "example_tcp"
    base = f"{tempfile.gettempdir()}/omniwire-bench-{os.getuid()}"
    addresses = (
        (("tcp://127.0.0.1:0",) * 2) if tcp else (f"ipc://{base}/a-{tag}", f"ipc://{base}/b-{tag}")
    )
    biggest = max(sizes)
    options = {"shm": {"arena_size": max(64 * MiB, 2 * biggest + 8 * MiB)}}
    peer_name, me = f"bench-peer-{tag}", f"bench-{tag}"
    args = [
        "--backends",
        backend,
        "--routes",
        json.dumps({me: backend}),
        "--backend-options",
        json.dumps(options),
    ]
    if zero_copy:
        args.append("--zero-copy")
    peer = await anyio.to_thread.run_sync(_Peer, peer_name, addresses[1], args)
    try:
        async with Endpoint(
            me,
            address=addresses[0],
            peers={peer_name: peer.address},
            backends=[backend],
            routes={peer_name: backend},
            zero_copy=zero_copy,
            backend_options=options,
            ack_timeout=120,
            max_inflight_bytes=options["shm"]["arena_size"] // 2,  # in flight fits an arena
        ) as ep:
            await ep.wait_peer(peer_name, 60)
            for size in sizes:
                step(f"{backend} {mode} {_human(size)}")
                raw_times: list[float] = []
                if session is not None:
                    await anyio.to_thread.run_sync(session.once, size)  # warm-up
                raw = (session, size, raw_times) if session is not None else None
                p50, p99, oneway, stream, msgs = await _measure(
                    ep, peer_name, size, iters, lend, raw
                )
                row = Row(
                    backend, mode, size, p50, p99, oneway, stream, msgs, results.memcpy_gbps[size]
                )
                if raw_times:
                    row.raw_gbps = size / statistics.median(raw_times) / 1e9
                    row.vs_raw = row.oneway_gbps / row.raw_gbps
                results.rows.append(row)
    finally:
        if session is not None:
            await anyio.to_thread.run_sync(session.close)
        code = await anyio.to_thread.run_sync(peer.stop)
        if code != 0:
            results.notes.append(f"{backend} {mode}: the peer process exited with {code}")


async def bench_obstructed(
    sizes: Sequence[int], iters: int, results: Results, step: Callable[[str], None]
) -> None:
    """shm with its default arena, zero-copy receiver: one-way seconds of a large
    object alone, then while the receiver holds an unrelated 1 KiB object."""
    tag = secrets.token_hex(3)
    base = f"{tempfile.gettempdir()}/omniwire-bench-{os.getuid()}"
    peer_name, me = f"bench-peer-{tag}", f"bench-{tag}"
    args = ["--backends", "shm", "--routes", json.dumps({me: "shm"}), "--zero-copy"]
    peer = await anyio.to_thread.run_sync(_Peer, peer_name, f"ipc://{base}/b-{tag}", args)
    n = max(5, iters // 20)
    try:
        async with Endpoint(
            me,
            address=f"ipc://{base}/a-{tag}",
            peers={peer_name: peer.address},
            backends=["shm"],
            routes={peer_name: "shm"},
            ack_timeout=120,
        ) as ep:
            await ep.wait_peer(peer_name, 60)
            for size in sizes:
                step(f"shm zero-copy {_human(size)} behind a held 1 KiB object")
                payload = _payload(size)
                await _oneway(ep, peer_name, payload, 2, "warm-alone", False)
                alone = await _oneway(ep, peer_name, payload, n, "alone", False)
                small = await ep.send(
                    peer_name, _payload(KiB), request_id="held", metadata={"hold": True}
                )
                await _oneway(ep, peer_name, payload, 1, "warm-behind", False)
                behind = await _oneway(ep, peer_name, payload, n, "behind", False)
                drop = await ep.send(peer_name, {}, request_id="drop", metadata={"drop_held": True})
                await drop.wait()
                await small.wait()
                results.obstructed_s[size] = (alone, behind)
    finally:
        code = await anyio.to_thread.run_sync(peer.stop)
        if code != 0:
            results.notes.append(f"shm obstructed: the peer process exited with {code}")


def _plans(backends: Sequence[str]) -> list[tuple[str, str]]:
    plans = []
    for b in backends:
        plans.append((b, "copy"))
        if b == "shm":
            plans.append((b, "zero-copy"))
        if b in CROSS_HOST:
            plans.append((b, "lent"))
    return plans


@dataclass
class _Progress:
    total: int
    done: int = 0
    bar: Any = None

    def __post_init__(self) -> None:
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="step", file=sys.stderr, leave=False)
        except ImportError:
            self.bar = None

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(label)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run(
    backends: Sequence[str],
    sizes: Sequence[int],
    iters: int,
    raw: bool,
    obstructed: Sequence[int] = (),
) -> Results:
    results = Results()
    plans = _plans(backends)
    raw_engines = [b for b in backends if b in rawbench.ENGINES] if raw else []
    obstructed = obstructed if "shm" in backends else ()
    progress = _Progress(
        len(sizes)
        + 1
        + sum(1 for b, _ in plans if b in raw_engines)
        + len(plans) * len(sizes)
        + len(obstructed)
    )
    for size in sizes:
        progress.step(f"memcpy {_human(size)}")
        results.memcpy_gbps[size] = memcpy_gbps(size)
    progress.step("raw zmq.asyncio round trip")
    results.zmq_rtt_us = await zmq_rtt_us([64, KiB], max(iters, 200))
    for backend, mode in plans:
        await bench_backend(
            backend, mode, sizes, iters, results, progress.step, backend in raw_engines
        )
    if obstructed:
        await bench_obstructed(obstructed, iters, results, progress.step)
    for name in raw_engines:  # every interleaved bare transfer of an engine, per size
        figures: dict[int, list[float]] = {}
        for r in results.rows:
            if r.backend == name and r.raw_gbps is not None:
                figures.setdefault(r.size, []).append(r.raw_gbps)
        results.raw_engine_gbps[name] = {s: statistics.mean(g) for s, g in figures.items()}
    progress.close()
    return results


def report(results: Results) -> str:
    lines = [
        "omniwire bench — two processes on this machine; medians; compare ratios, not runs",
        "",
    ]
    lines.append(
        "baselines: memcpy "
        + ", ".join(
            f"{_human(s)} {g:.1f} GB/s" for s, g in sorted(results.memcpy_gbps.items()) if s >= MiB
        )
    )
    lines.append(
        "           raw zmq.asyncio round trip: "
        + ", ".join(f"{_human(s)} {us:.0f} µs" for s, us in sorted(results.zmq_rtt_us.items()))
    )
    for name, figures in results.raw_engine_gbps.items():
        lines.append(
            f"           raw {name}: "
            + ", ".join(f"{_human(s)} {g:.2f} GB/s" for s, g in sorted(figures.items()))
        )
    lines.append("")
    header = (
        f"{'backend':<12} {'mode':<9} {'size':>8} {'rtt p50':>10} {'rtt p99':>10} "
        f"{'one-way':>9} {'×memcpy':>7} {'vs raw':>6} {'streamed':>9} {'msgs/s':>9}"
    )
    lines += [header, "-" * len(header)]
    for r in results.rows:
        vs_raw = f"{r.vs_raw:>5.2f}x" if r.vs_raw is not None else f"{'':>6}"
        lines.append(
            f"{r.backend:<12} {r.mode:<9} {_human(r.size):>8} {r.rtt_p50_us:>8.0f}µs "
            f"{r.rtt_p99_us:>8.0f}µs {r.oneway_gbps:>5.2f}GB/s {r.oneway_gbps / r.memcpy_gbps:>6.2f}x "
            f"{vs_raw} {r.stream_gbps:>5.2f}GB/s {r.msgs_per_s:>9.0f}"
        )
    for size, (alone, behind) in sorted(results.obstructed_s.items()):
        lines.append(
            f"shm zero-copy {_human(size)} one-way: {alone * 1e3:.1f} ms alone, "
            f"{behind * 1e3:.1f} ms behind a held 1 KiB object ({behind / alone:.2f}x)"
        )
    lines.append("")
    lines.append("targets:")
    lines += list(_targets(results))
    lines += [f"note: {n}" for n in results.notes]
    return "\n".join(lines)


def _targets(results: Results) -> Iterator[str]:
    def row(backend: str, mode: str, size: int) -> Row | None:
        return next(
            (r for r in results.rows if (r.backend, r.mode, r.size) == (backend, mode, size)), None
        )

    size = 64 * MiB
    for mode, target in (("copy", 0.5), ("zero-copy", 0.8)):
        r = row("shm", mode, size)
        if r is not None:
            ratio = r.oneway_gbps / r.memcpy_gbps
            yield (
                f"  shm {mode} 64 MiB one-way: {r.oneway_gbps:.2f} GB/s = {ratio:.2f}x memcpy "
                f"(target >= {target}x: {'met' if ratio >= target else 'NOT met'})"
            )
    r = row("shm", "copy", KiB)
    zmq = results.zmq_rtt_us.get(KiB)
    if r is not None and zmq:
        ratio = r.rtt_p50_us / zmq
        yield (
            f"  shm 1 KiB round trip: {r.rtt_p50_us:.0f} µs = {ratio:.2f}x raw zmq.asyncio "
            f"({zmq:.0f} µs) (target <= 2x: {'met' if ratio <= 2 else 'NOT met'})"
        )
    for name, figures in results.raw_engine_gbps.items():
        for s in (MiB, 64 * MiB):
            raw = figures.get(s)
            for mode in ("copy", "lent"):
                r = row(name, mode, s)
                if r is None or not raw or r.vs_raw is None:
                    continue
                met = ""
                if s == 64 * MiB and mode == "lent":
                    met = f" (target >= 0.9x: {'met' if r.vs_raw >= 0.9 else 'NOT met'})"
                yield (
                    f"  {name} {mode} {_human(s)}: {r.oneway_gbps:.2f} GB/s one-way = "
                    f"{r.vs_raw:.2f}x the raw engine ({raw:.2f} GB/s){met}; "
                    f"{r.stream_gbps:.2f} GB/s streamed"
                )
    for size, (alone, behind) in sorted(results.obstructed_s.items()):
        ratio = behind / alone
        yield (
            f"  shm {_human(size)} behind a held 1 KiB object: {ratio:.2f}x the time alone "
            f"(target < 2x: {'met' if ratio < 2 else 'NOT met'})"
        )


def plot(results: Results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    sizes = sorted(results.memcpy_gbps)
    ax.plot(sizes, [results.memcpy_gbps[s] for s in sizes], "k--", label="memcpy (same run)")
    for key in sorted({(r.backend, r.mode) for r in results.rows}):
        rows = [r for r in results.rows if (r.backend, r.mode) == key]
        ax.plot(
            [r.size for r in rows],
            [r.oneway_gbps for r in rows],
            "o-",
            label=f"{key[0]} {key[1]} one-way",
        )
    for name, figures in results.raw_engine_gbps.items():
        s = sorted(figures)
        ax.plot(s, [figures[x] for x in s], "x:", label=f"raw {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload bytes")
    ax.set_ylabel("GB/s")
    ax.set_title("omniwire: one-way throughput per backend (two processes)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="omniwire bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated (default: shm and every available cross-host engine)",
    )
    p.add_argument(
        "--sizes", default=None, help="comma-separated, e.g. 1K,1M,64M (default 1K..256M)"
    )
    p.add_argument("--quick", action="store_true", help="four sizes, fewer repetitions")
    p.add_argument("--iters", type=int, default=200, help="round trips for small sizes")
    p.add_argument("--no-raw", action="store_true", help="skip the raw engine baselines")
    p.add_argument(
        "--no-obstructed",
        action="store_true",
        help="skip the shm case of a large object behind a held 1 KiB one",
    )
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a chart")
    p.add_argument("--zmq-echo", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.zmq_echo:
        anyio.run(_zmq_echo, args.zmq_echo)
        return 0
    if args.backends:
        backends = args.backends.split(",")
    else:
        backends = ["shm"] + [b for b in CROSS_HOST if backend_status(b).status == "available"]
    for b in backends:
        status = backend_status(b)
        if status.status != "available":
            print(
                f"omniwire bench: backend {b!r} is {status.status}: {status.error}", file=sys.stderr
            )
            return 2
    sizes = (
        [_parse_size(s) for s in args.sizes.split(",")]
        if args.sizes
        else (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    )
    iters = 50 if args.quick else args.iters
    obstructed = [] if args.no_obstructed else OBSTRUCTED_SIZES
    results = anyio.run(run, backends, sizes, iters, not args.no_raw, obstructed)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "memcpy_gbps": results.memcpy_gbps,
                    "zmq_rtt_us": results.zmq_rtt_us,
                    "raw_engine_gbps": results.raw_engine_gbps,
                    "rows": [asdict(r) for r in results.rows],
                    "obstructed_s": {
                        s: {"alone": a, "behind_1KiB": b}
                        for s, (a, b) in results.obstructed_s.items()
                    },
                    "notes": results.notes,
                },
                f,
                indent=1,
            )
    if args.plot:
        plot(results, args.plot)
        print(f"chart written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
