"""The small-message scenarios (issue 14), each beside its baseline from the same run.

Process A (this one) runs an :class:`~omniwire.Endpoint`; process B runs
``python -m omniwire.peer --mode bench`` (its application answers echoes and
tallies stream chunks) with the default routing. A second process serves the raw
``zmq.asyncio`` baselines (:mod:`._rawzmq`). Rounds alternate omniwire and
baseline (omniwire first in odd rounds, the baseline first in even ones) so that
drift on a shared machine falls on both; a first round of each is a warm-up and
is not counted.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import numpy as np
import torch

from ..endpoint import Endpoint
from ._model import Figure, Scenario, Target, percentile
from ._procs import cpu_seconds, omniwire_peer
from ._rawzmq import LAST, RawZmq
from ._units import KiB, MiB

__all__ = [
    "Counts",
    "Pair",
    "echo",
    "idle",
    "mix",
    "shm_large",
    "stream",
]

T = TypeVar("T")

#: no half-round may take longer: a stall fails the scenario (not the run) and says so.
#: Shorter than the bench endpoints' ack_timeout, so that a stall is not waited out.
ROUND_TIMEOUT = 30.0


class RoundTimeout(RuntimeError):
    """A round of a scenario did not finish within ``ROUND_TIMEOUT`` seconds."""


async def _timed_out(label: str, side: str, r: int, fn: Awaitable[T]) -> T:
    with anyio.move_on_after(ROUND_TIMEOUT) as scope:
        return await fn
    assert scope.cancelled_caught
    raise RoundTimeout(
        f"{label}: {side} round {r} did not finish within {ROUND_TIMEOUT:g} s "
        "(stalled; or lower the counts)"
    )


@dataclass(frozen=True)
class Counts:
    """How much each scenario measures (``--quick`` halves most of it)."""

    rounds: int = 10
    echo_iters: int = 200
    stream_n: int = 5000
    mix_rounds: int = 5
    mix_streams: int = 20
    mix_chunks: int = 200
    mix_seed: int = 14
    #: each mix producer (omniwire's and the baseline's) yields to the event loop
    #: after every chunk, as a producer that awaits other work between chunks would
    mix_yield: bool = False
    idle_s: float = 3.0
    shm_rounds: int = 5
    shm_reps: int = 3
    #: seconds of full-speed sending per traffic kind in the slow-consumer scenario
    slow_s: float = 5.0

    @classmethod
    def quick(cls) -> Counts:
        return cls(
            rounds=4,
            echo_iters=100,
            stream_n=2000,
            mix_rounds=2,
            idle_s=2.0,
            shm_rounds=3,
            slow_s=3.0,
        )


@dataclass
class Pair:
    """Endpoint A, the name and pid of its peer B, the raw baseline, a progress step."""

    ep: Endpoint
    peer: str
    peer_pid: int
    raw: RawZmq
    step: Callable[[str], None]


async def _interleaved(
    rounds: int,
    omniwire: Callable[[int], Awaitable[T]],
    baseline: Callable[[int], Awaitable[T]],
    step: Callable[[str], None],
    label: str,
) -> tuple[list[T], list[T]]:
    """Round 0 (warm-up, dropped), then ``rounds`` rounds, alternating who goes first."""
    ours: list[T] = []
    theirs: list[T] = []
    for r in range(rounds + 1):
        step(f"{label} round {r}/{rounds}" if r else f"{label} warm-up")
        if r % 2:
            a = await _timed_out(label, "omniwire", r, omniwire(r))
            b = await _timed_out(label, "baseline", r, baseline(r))
        else:
            b = await _timed_out(label, "baseline", r, baseline(r))
            a = await _timed_out(label, "omniwire", r, omniwire(r))
        if r:
            ours.append(a)
            theirs.append(b)
    return ours, theirs


def _flat(rounds: Sequence[Sequence[float]]) -> list[float]:
    return [x for r in rounds for x in r]


class _CpuPerMessage:
    """CPU seconds per message of both processes — A (this one) and B (omniwire's
    peer, or the raw baseline's process) — over each measured round (round 0, the
    warm-up, is not counted). From ``/proc/PID/task/*/schedstat``: every thread."""

    def __init__(self, pair: Pair) -> None:
        self.pids = {"omniwire": (os.getpid(), pair.peer_pid), "raw": (os.getpid(), pair.raw.pid)}
        self.rounds: dict[str, list[float]] = {"omniwire": [], "raw": []}
        #: each round's A and B apart: which side a difference is on
        self.sides: dict[str, list[tuple[float, float]]] = {"omniwire": [], "raw": []}
        self._started: dict[str, tuple[float, float]] = {}

    def _now(self, side: str) -> tuple[float, float]:
        a, b = self.pids[side]
        return cpu_seconds(a), cpu_seconds(b)

    def start(self) -> None:
        self._started = {side: self._now(side) for side in self.pids}

    def stop(self, side: str, r: int, n: int) -> None:
        if r == 0:
            return
        a0, b0 = self._started[side]
        a1, b1 = self._now(side)
        self.rounds[side].append(((a1 - a0) + (b1 - b0)) / n)
        self.sides[side].append(((a1 - a0) / n, (b1 - b0) / n))

    def split(self) -> dict[str, dict[str, float]]:
        """Median CPU µs per message of A (the sender) and of B, per side."""
        return {
            side: {
                "a_us": statistics.median(a for a, _ in rounds) * 1e6,
                "b_us": statistics.median(b for _, b in rounds) * 1e6,
            }
            for side, rounds in self.sides.items()
            if rounds
        }

    def figure(self) -> Figure:
        ours, raw = self.rounds["omniwire"], self.rounds["raw"]
        return Figure(
            "cpu/msg",
            "s",
            statistics.median(ours) if ours else math.nan,
            statistics.median(raw) if raw else None,
            omniwire_per_round=ours,
            baseline_per_round=raw,
            targets=[Target(2.0, "lower")],
        )


# -- 1 KiB echo round trip ------------------------------------------------------------


async def echo(pair: Pair, counts: Counts) -> Scenario:
    """A sends a payload holding a 1 KiB tensor; B's application sends it back; A
    receives it. Seconds per round trip, against a raw zmq.asyncio echo of 1 KiB."""
    ep, peer, raw = pair.ep, pair.peer, pair.raw
    tensor = torch.arange(256, dtype=torch.float32)  # 1 KiB
    payload = {"x": tensor}
    meta = {"echo": True}
    msg = bytes(range(256)) * 4
    n = counts.echo_iters
    carried: dict[str, str | None] = {}
    cpu = _CpuPerMessage(pair)

    async def ours(r: int) -> list[float]:
        times = []
        receipts = []
        cpu.start()
        for i in range(n):
            start = time.perf_counter()
            receipts.append(await ep.send(peer, payload, request_id=f"echo{r}.{i}", metadata=meta))
            d = await ep.receive()
            times.append(time.perf_counter() - start)
            if r == 0 and i == 0:
                if d.kind != "payload" or not torch.equal(d.payload["x"], tensor):
                    raise RuntimeError(f"echo came back wrong: {d!r}")
                carried["there"], carried["back"] = receipts[0].backend, d.backend
            d.release()
        for receipt in receipts:
            await receipt.wait()
        cpu.stop("omniwire", r, n)
        return times

    async def theirs(r: int) -> list[float]:
        times = []
        cpu.start()
        for i in range(n):
            start = time.perf_counter()
            back = await raw.echo(msg)
            times.append(time.perf_counter() - start)
            if r == 0 and i == 0 and back != msg:
                raise RuntimeError("raw zmq echo came back wrong")
        cpu.stop("raw", r, n)
        return times

    a, b = await _interleaved(counts.rounds, ours, theirs, pair.step, "1 KiB echo")
    flat_a, flat_b = _flat(a), _flat(b)
    per_round = [(statistics.median(x), statistics.median(y)) for x, y in zip(a, b, strict=True)]
    return Scenario(
        "echo",
        "1 KiB echo round trip",
        "raw zmq.asyncio echo of 1 KiB (PUSH/PULL both ways, asyncio on both sides)",
        "A sends a payload {'x': 1 KiB float32 tensor}; B's application receives it and "
        "sends it back (omniwire.peer bench mode); A receives it. Time from send() to "
        "receive() returning, per round trip.",
        [
            Figure(
                "p50",
                "s",
                statistics.median(flat_a),
                statistics.median(flat_b),
                omniwire_per_round=[x for x, _ in per_round],
                baseline_per_round=[y for _, y in per_round],
                targets=[Target(2.0, "lower"), Target(0.5, "lower", stretch=True)],
            ),
            Figure("p99", "s", percentile(flat_a, 99), percentile(flat_b, 99)),
            Figure("mean", "s", statistics.fmean(flat_a), statistics.fmean(flat_b)),
            cpu.figure(),
        ],
        {
            "bytes": 1024,
            "rounds": counts.rounds,
            "cpu_per_msg_by_process": cpu.split(),
            "round_trips_per_round": n,
            "carried_by": carried,
            "ratio_per_round": [x / y for x, y in per_round],
        },
    )


# -- 1 KiB stream chunks one way, pipelined -----------------------------------------------


async def stream(pair: Pair, counts: Counts) -> Scenario:
    """A streams N chunks of 1 KiB, awaiting each ``stream()`` call; B's application
    counts them and answers when the last arrives. msgs/s, against a raw PUSH/PULL
    loop awaiting one send per message, the receiver counting then answering."""
    ep, peer, raw = pair.ep, pair.peer, pair.raw
    n = counts.stream_n
    chunk = torch.ones(256, dtype=torch.float32)
    msg, last_msg = bytes(KiB), LAST + bytes(KiB - 1)
    carried: dict[str, str | None] = {}
    cpu = _CpuPerMessage(pair)

    async def ours(r: int) -> float:
        rid = f"stream{r}"
        group = f"{rid}/done"
        last = {"last": True, "group": group, "streams": 1}
        cpu.start()
        start = time.perf_counter()
        for _ in range(n - 1):
            await ep.stream(peer, chunk, request_id=rid)
        receipt = await ep.stream(peer, chunk, request_id=rid, metadata=last)
        d = await ep.receive()
        elapsed = time.perf_counter() - start
        cpu.stop("omniwire", r, n)
        _check_tally(d, group, n)
        carried["chunks"] = receipt.backend
        await ep.end_stream(peer, request_id=rid)
        await ep.drain(ROUND_TIMEOUT)
        return n / elapsed

    async def theirs(r: int) -> float:
        cpu.start()
        start = time.perf_counter()
        got = await raw.stream(msg, last_msg, n)
        elapsed = time.perf_counter() - start
        cpu.stop("raw", r, n)
        if got != n:
            raise RuntimeError(f"raw zmq receiver counted {got} of {n} messages")
        return n / elapsed

    a, b = await _interleaved(counts.rounds, ours, theirs, pair.step, "1 KiB stream")
    return Scenario(
        "stream",
        "1 KiB stream chunks, one way",
        "raw zmq.asyncio PUSH/PULL loop awaiting one send per 1 KiB message; "
        "the receiver counts, then answers",
        f"A streams {n:,} chunks (a 1 KiB float32 tensor each) with ep.stream(), awaiting "
        "each call; time until A hears from B's application that the last one arrived "
        "(B counts them).",
        [
            Figure(
                "msgs/s",
                "msgs/s",
                statistics.median(a),
                statistics.median(b),
                better="higher",
                omniwire_per_round=a,
                baseline_per_round=b,
                targets=[Target(1.0, "higher")],
            ),
            cpu.figure(),
        ],
        {
            "bytes": 1024,
            "rounds": counts.rounds,
            "cpu_per_msg_by_process": cpu.split(),
            "messages_per_round": n,
            "carried_by": carried,
            "ratio_per_round": [x / y for x, y in zip(a, b, strict=True)],
        },
    )


def _check_tally(d: Any, group: str, n: int) -> None:
    if d.request_id != group or not isinstance(d.payload, dict) or d.payload.get("n") != n:
        raise RuntimeError(f"expected B's tally of {n} chunks for {group!r}, got {d!r}")


# -- 20 concurrent streams of mixed sizes ------------------------------------------------


def mix_sizes(streams: int, chunks: int, seed: int) -> list[list[int]]:
    """Chunk sizes per stream: log-uniform between 64 B and 16 KiB, seeded."""
    rng = random.Random(seed)
    return [[round(64 * 256 ** rng.random()) for _ in range(chunks)] for _ in range(streams)]


async def mix(pair: Pair, counts: Counts) -> Scenario:
    """``mix_streams`` tasks in A each stream ``mix_chunks`` chunks of 64 B–16 KiB to
    B, concurrently. Total msgs/s (until B has them all) and per-chunk latency
    (A's ``monotonic_ns`` in the chunk's metadata → B's application has it),
    against the same producers sharing one raw zmq.asyncio PUSH socket."""
    ep, peer, raw = pair.ep, pair.peer, pair.raw
    k, c = counts.mix_streams, counts.mix_chunks
    sizes = mix_sizes(k, c, counts.mix_seed)
    tensors = [
        [torch.full((s,), j % 251, dtype=torch.uint8) for s in row] for j, row in enumerate(sizes)
    ]
    blobs = [[bytes(s) for s in row] for row in sizes]
    total = k * c
    total_bytes = sum(map(sum, sizes))
    pause = counts.mix_yield

    async def ours(r: int) -> tuple[float, Sequence[int]]:
        group = f"mix{r}"

        async def producer(j: int) -> None:
            rid = f"{group}.{j}"
            row = tensors[j]
            for chunk in row[:-1]:
                await ep.stream(peer, chunk, request_id=rid, metadata={"t": time.monotonic_ns()})
                if pause:
                    await anyio.lowlevel.checkpoint()
            meta = {"t": time.monotonic_ns(), "last": True, "group": group, "streams": k}
            await ep.stream(peer, row[-1], request_id=rid, metadata=meta)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for j in range(k):
                tg.start_soon(producer, j)
        d = await ep.receive()
        elapsed = time.perf_counter() - start
        _check_tally(d, group, total)
        for j in range(k):
            await ep.end_stream(peer, request_id=f"{group}.{j}")
        await ep.drain(ROUND_TIMEOUT)
        return elapsed, d.payload["lat_ns"].tolist()

    async def theirs(r: int) -> tuple[float, Sequence[int]]:
        async def producer(j: int) -> None:
            row = blobs[j]
            for blob in row[:-1]:
                await raw.mix_chunk(blob, False, k)
                if pause:
                    await anyio.lowlevel.checkpoint()
            await raw.mix_chunk(row[-1], True, k)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for j in range(k):
                tg.start_soon(producer, j)
        latencies = await raw.mix_latencies()
        elapsed = time.perf_counter() - start
        if len(latencies) != total:
            raise RuntimeError(f"raw zmq receiver reported {len(latencies)} of {total} chunks")
        return elapsed, latencies

    a, b = await _interleaved(counts.mix_rounds, ours, theirs, pair.step, f"{k}-stream mix")
    rate_a = [total / e for e, _ in a]
    rate_b = [total / e for e, _ in b]
    lat_a = [x / 1e9 for _, lat in a for x in lat]
    lat_b = [x / 1e9 for _, lat in b for x in lat]
    return Scenario(
        "mix",
        f"{k}-stream mix{', yielding' if pause else ''}",
        f"the same {k} producer tasks sharing one raw zmq.asyncio PUSH socket "
        "(omniwire also has one connection to the peer); each message is a 11-byte "
        "header (send time, last flag) and the chunk's bytes",
        f"{k} tasks in A each stream {c} chunks (uint8 tensors, log-uniform 64 B–16 KiB, "
        f"seed {counts.mix_seed}; {total_bytes / total / KiB:.1f} KiB on average) to B "
        "concurrently, each chunk's metadata carrying A's time.monotonic_ns(); B's "
        "application keeps now − t per chunk and reports them when all streams ended. "
        "Total msgs/s until A hears from B.",
        [
            Figure(
                "msgs/s",
                "msgs/s",
                statistics.median(rate_a),
                statistics.median(rate_b),
                better="higher",
                omniwire_per_round=rate_a,
                baseline_per_round=rate_b,
            ),
            Figure(
                "B/s",
                "B/s",
                statistics.median(rate_a) * total_bytes / total,
                statistics.median(rate_b) * total_bytes / total,
                better="higher",
            ),
            Figure("latency p50", "s", percentile(lat_a, 50), percentile(lat_b, 50)),
            Figure("latency p99", "s", percentile(lat_a, 99), percentile(lat_b, 99)),
        ],
        {
            "streams": k,
            "chunks_per_stream": c,
            "sizes": "log-uniform 64 B–16 KiB",
            "seed": counts.mix_seed,
            "mean_chunk_bytes": total_bytes / total,
            "rounds": counts.mix_rounds,
            "raw_sockets": "one PUSH shared by the producer tasks",
            "yield_between_chunks": pause,
            "note": "producers run flat out: a chunk's latency includes queueing behind "
            "the others', so it grows with the rate reached — read it beside msgs/s",
        },
    )


# -- an idle endpoint -------------------------------------------------------------------


async def idle(pair: Pair, counts: Counts) -> Scenario:
    """CPU used by B (an endpoint connected to A, nothing sent) over ``idle_s``
    seconds, against the raw zmq.asyncio process (its sockets connected, idle); and,
    over the same seconds, by a *far* endpoint: another process told apart as another
    host (``--host-id``, TCP), so that the cross-host engines it runs (mooncake, nixl,
    nccl) are started and connected — their progress threads are what idles there.
    A's own CPU over the same interval (its endpoints and raw sockets) is a param."""
    pair.step("idle endpoint")
    tag = secrets.token_hex(3)
    far = await anyio.to_thread.run_sync(
        omniwire_peer, f"far-{tag}", "tcp://127.0.0.1:0", ["--host-id", f"bench-far-{tag}"]
    )
    try:
        async with Endpoint(
            f"near-{tag}",
            address="tcp://127.0.0.1:0",
            peers={f"far-{tag}": far.info},
            host_id=f"bench-near-{tag}",
        ) as near:
            await near.wait_peer(f"far-{tag}", 60)
            await anyio.sleep(0.5)  # let the handshakes' aftermath settle
            pids = {
                "omniwire": pair.peer_pid,
                "far": far.pid,
                "raw": pair.raw.pid,
                "self": os.getpid(),
            }
            before = {k: cpu_seconds(p) for k, p in pids.items()}
            start = time.perf_counter()
            await anyio.sleep(counts.idle_s)
            wall = time.perf_counter() - start
            used = {k: cpu_seconds(p) - before[k] for k, p in pids.items()}
            engines = sorted(near.running_backends)
    finally:
        await anyio.to_thread.run_sync(far.stop)
    return Scenario(
        "idle",
        "idle endpoint CPU",
        "the raw zmq.asyncio process, its sockets connected, idle",
        f"CPU seconds (all threads, /proc/PID/task/*/schedstat) of B — an endpoint "
        f"connected to A, nothing sent yet — over {counts.idle_s:g} s, per second of wall "
        "time (1.0 = one core busy); cross-host: the same for an endpoint connected to "
        "one on another (simulated) host, its cross-host engines started.",
        [
            Figure(
                "cpu",
                "core",
                used["omniwire"] / wall,
                used["raw"] / wall,
                targets=[Target(0.01, "lower", of="value")],
            ),
            Figure(
                "cross-host cpu",
                "core",
                used["far"] / wall,
                used["raw"] / wall,
                targets=[Target(0.01, "lower", of="value")],
            ),
        ],
        {
            "seconds": wall,
            "cpu_s": used,
            "self_cpu_share": used["self"] / wall,
            "far_backends": engines,
        },
    )


# -- 64 MiB over shm ----------------------------------------------------------------------


async def shm_large(
    copy: tuple[Endpoint, str],
    zero_copy: tuple[Endpoint, str],
    counts: Counts,
    step: Callable[[str], None],
    size: int = 64 * MiB,
) -> Scenario:
    """One-way ``size`` bytes over shm (send → ACK), to a copy-mode and to a
    zero-copy receiver, against memcpy of the same size, interleaved round by round."""
    payload = {"x": torch.ones(size // 4, dtype=torch.float32)}
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    reps = counts.shm_reps

    async def oneway(target: tuple[Endpoint, str], r: int) -> list[float]:
        ep, peer = target
        times = []
        for i in range(reps):
            start = time.perf_counter()
            receipt = await ep.send(peer, payload, request_id=f"shm{r}.{i}")
            await receipt.wait()
            times.append(time.perf_counter() - start)
        return times

    def memcpy() -> list[float]:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - start)
        return times

    samples: dict[str, list[float]] = {"copy": [], "zero-copy": [], "memcpy": []}
    per_round: dict[str, list[float]] = {"copy": [], "zero-copy": [], "memcpy": []}
    order = ["memcpy", "copy", "zero-copy"]
    for r in range(counts.shm_rounds + 1):
        step(f"{size // MiB} MiB over shm round {r}/{counts.shm_rounds}" if r else "shm warm-up")
        got: dict[str, list[float]] = {}
        for name in order[r % 3 :] + order[: r % 3]:
            if name == "memcpy":
                got[name] = memcpy()
            else:
                target = copy if name == "copy" else zero_copy
                got[name] = await _timed_out("64 MiB over shm", name, r, oneway(target, r))
        if r:
            for name, times in got.items():
                samples[name].extend(times)
                per_round[name].append(size / statistics.median(times))
    memcpy_rate = size / statistics.median(samples["memcpy"])
    figures = [
        Figure(
            mode,
            "B/s",
            size / statistics.median(samples[mode]),
            memcpy_rate,
            better="higher",
            omniwire_per_round=per_round[mode],
            baseline_per_round=per_round["memcpy"],
            targets=[Target(target, "higher")],
        )
        for mode, target in (("copy", 0.5), ("zero-copy", 0.8))
    ]
    return Scenario(
        "shm",
        f"{size // MiB} MiB over shm",
        "memcpy of the same size (numpy.copyto, warm pages, one thread)",
        f"One-way transfers of a {size // MiB} MiB tensor payload over shm (send → the "
        "receiver's ACK: it copied the data, or in zero-copy mode mapped it), one at a "
        f"time; {reps} per round and receiver mode.",
        figures,
        {
            "bytes": size,
            "rounds": counts.shm_rounds,
            "transfers_per_round": reps,
            "seconds_p50": {k: statistics.median(v) for k, v in samples.items()},
            "seconds_min": {k: min(v) for k, v in samples.items()},
            "ratio_is": "omniwire GB/s / memcpy GB/s",
            "note": "compare with the previous run's figure for 'no slower than before'",
        },
    )
