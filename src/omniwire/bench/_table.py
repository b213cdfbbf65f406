"""The per-backend table: throughput and latency per backend, mode and payload size.

For each backend (and, for shm, both receive modes; for the cross-host engines,
``lent`` too) a peer process runs ``python -m omniwire.peer --mode bench`` with
every edge routed to that backend; this process sends it payloads of one tensor
of each size and measures:

- **RTT** p50/p99: the payload goes to the peer and is echoed back;
- **one-way**: a single transfer, from ``send`` until its receipt completes (the
  peer's ACK: it has copied the data, or in zero-copy mode mapped it; for an object
  that *landed* — written by the engine into memory the peer lent, then announced —
  the end of that write) — latency-bound throughput; also up to the ACK, and the
  share of transfers that landed;
- **streamed**: back-to-back transfers with credits in flight — throughput and msgs/s.

Baselines from the same run: memcpy per size, a raw ``zmq.asyncio`` round trip
per size (up to ``ZMQ_MAX``; between the two hosts with ``--namespaces``), and for
each cross-host engine the bare engine (:mod:`omniwire.rawbench`), its transfers
interleaved one by one with the row's one-way transfers (``vs_raw``): its reads, and
for mooncake and nixl its writes too; a row whose transfers landed is compared with
the bare writes, any other with the bare reads. With the bare engines, also the bound of
``vs_raw`` that one control round trip sets on a transfer the peer reads: it is
announced to the peer and acknowledged back, so it takes at least the bare transfer
plus a raw zmq round trip of ``CONTROL_BYTES``; ``bound = raw / (raw + round
trip)`` (none for a row whose transfers landed). With shm, the *obstructed* case too: a large
object sent while a zero-copy consumer holds a 1 KiB one. A row (backend and
mode) that fails is reported and the table goes on.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import anyio
import numpy as np
import torch

from .. import rawbench
from ..delivery import SendReceipt
from ..endpoint import Endpoint
from ._model import CONTROL_BYTES, Results, Row, Table
from ._procs import Child, ipc_base, omniwire_peer
from ._rawzmq import RawZmq
from ._units import KiB, MiB, fmt_size

__all__ = [
    "CROSS_HOST",
    "DEFAULT_SIZES",
    "OBSTRUCTED_SIZES",
    "QUICK_SIZES",
    "plans",
    "run_table",
    "steps",
]

DEFAULT_SIZES = [KiB << (2 * i) for i in range(10)]  # 1 KiB, 4 KiB, ..., 256 MiB
QUICK_SIZES = [KiB, 64 * KiB, MiB, 64 * MiB]
CROSS_HOST = ("mooncake", "nixl", "nccl")
OBSTRUCTED_SIZES = [33 * MiB, 64 * MiB]
#: the raw zmq round trip is measured up to this size
ZMQ_MAX = 64 * MiB

#: The bare engine interleaved with a row's transfers: the session, the size, and the
#: seconds of its reads and of its writes (engines that land: mooncake, nixl).
Raw = tuple[rawbench.Session, int, list[float], list[float]]


def _iters(size: int, base: int) -> int:
    """Fewer repetitions for large sizes: about 1 GiB moved per measurement, at least 5."""
    return max(5, min(base, (1 << 30) // max(size, 1)))


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


async def zmq_rtt_us(raw: RawZmq, size: int, iters: int) -> float:
    """Median raw zmq.asyncio round trip of ``size`` bytes, in µs."""
    msg = bytes(size)
    n = _iters(size, iters)
    for _ in range(min(20, n)):
        await raw.echo(msg)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await raw.echo(msg)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def payload(size: int) -> dict[str, torch.Tensor]:
    if size % 4:
        return {"x": torch.ones(size, dtype=torch.uint8)}
    return {"x": torch.ones(max(1, size // 4), dtype=torch.float32)}


async def _stream(ep: Endpoint, peer: str, obj: Any, n: int, tag: str, lend: bool) -> None:
    receipts = [await ep.send(peer, obj, request_id=f"{tag}{i}", lend=lend) for i in range(n)]
    for r in receipts:
        await r.wait()


class OneWay(NamedTuple):
    seconds: float  # until the receipt completed
    acked: float  # until the ACK
    landed: float  # the share of transfers that landed


async def _oneway(
    ep: Endpoint, peer: str, obj: Any, n: int, tag: str, lend: bool, raw: Raw | None = None
) -> OneWay:
    """Median seconds from ``send`` until the receipt completes, and until the ACK,
    one object at a time; with ``raw = (session, size, reads, writes)``, each preceded
    by one bare-engine read (its seconds appended to ``reads``) and, for an engine
    that writes, one bare write (to ``writes``)."""
    times: list[float] = []
    acked: list[float] = []
    landed = 0

    async def ack_of(r: SendReceipt, start: float) -> None:
        await r.settled()
        acked.append(time.perf_counter() - start)

    # each ACK is timed by a task of its own: the next send starts when the receipt
    # completes, as an application's would, not when the ACK of a landed object comes
    async with anyio.create_task_group() as tg:
        for i in range(n):
            if raw is not None:
                session, size, raw_reads, raw_writes = raw
                raw_reads.append(await anyio.to_thread.run_sync(session.once, size))
                if session.writes:
                    raw_writes.append(await anyio.to_thread.run_sync(session.write_once, size))
            start = time.perf_counter()
            r = await ep.send(peer, obj, request_id=f"{tag}{i}", lend=lend)
            await r.wait()
            times.append(time.perf_counter() - start)
            landed += r.outcome == "landed"
            tg.start_soon(ack_of, r, start)
    return OneWay(statistics.median(times), statistics.median(acked), landed / n)


async def _measure(
    ep: Endpoint, peer: str, size: int, iters: int, lend: bool, raw: Raw | None
) -> tuple[float, float, float, float, float, OneWay]:
    obj = payload(size)
    n_rtt = _iters(size, iters)
    # warm up: fault in arenas, pools and the receiver's buffers for this size
    for _ in range(3):
        r = await ep.send(peer, obj, request_id="warm", metadata={"echo": True}, lend=lend)
        (await ep.receive()).release()
        await r.wait()
    rtts = []
    for i in range(n_rtt):
        start = time.perf_counter()
        r = await ep.send(peer, obj, request_id=f"rtt{i}", metadata={"echo": True}, lend=lend)
        d = await ep.receive()
        rtts.append(time.perf_counter() - start)
        d.release()
        await r.wait()
    one = await _oneway(ep, peer, obj, max(5, n_rtt), "one", lend, raw)
    n_stream = max(4, n_rtt)
    # warm the receiver's buffer pool for as many objects as may be in flight
    await _stream(ep, peer, obj, n_stream, "warm-stream", lend)
    start = time.perf_counter()
    await _stream(ep, peer, obj, n_stream, "st", lend)
    elapsed = time.perf_counter() - start
    rtts.sort()
    p50 = rtts[len(rtts) // 2]
    p99 = rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))]
    return (
        p50 * 1e6,
        p99 * 1e6,
        size / one.seconds / 1e9,
        n_stream * size / elapsed / 1e9,
        n_stream / elapsed,
        one,
    )


async def _bench_backend(
    backend: str,
    mode: str,
    sizes: Sequence[int],
    iters: int,
    results: Results,
    table: Table,
    step: Callable[[str], None],
    session: rawbench.Session | None,
    landing_size: int | None = None,
) -> None:
    """One row group; ``session``: the bare engine, its transfers interleaved with
    the rows' (one session serves every mode of a backend)."""
    zero_copy, lend = mode == "zero-copy", mode == "lent"
    tag = secrets.token_hex(3)
    tcp = backend in CROSS_HOST or backend == "example_tcp"
    base = ipc_base(tag)
    place = rawbench.placement()  # the peer on another host (--namespaces), or here
    addresses = (
        (f"tcp://{place.here}:0", f"tcp://{place.there}:0") if tcp else (f"{base}-a", f"{base}-b")
    )
    biggest = max(sizes)
    options: dict[str, dict[str, Any]] = {
        "shm": {"arena_size": max(64 * MiB, 2 * biggest + 8 * MiB)}
    }
    if landing_size is not None:
        options |= {name: {"landing_size": landing_size} for name in ("mooncake", "nixl")}
    peer_name, me = f"bench-peer-{tag}", f"bench-{tag}"
    args = ["--backends", backend, "--routes", json.dumps({me: backend})]
    args += ["--backend-options", json.dumps(options)] + (["--zero-copy"] if zero_copy else [])
    peer: Child | None = None
    try:
        peer = await anyio.to_thread.run_sync(omniwire_peer, peer_name, addresses[1], args)
        async with Endpoint(
            me,
            address=addresses[0],
            peers={peer_name: peer.info},
            backends=[backend],
            routes={peer_name: backend},
            zero_copy=zero_copy,
            backend_options=options,
            ack_timeout=120,
            max_inflight_bytes=options["shm"]["arena_size"] // 2,  # in flight fits an arena
        ) as ep:
            await ep.wait_peer(peer_name, 60)
            for size in sizes:
                step(f"{backend} {mode} {fmt_size(size)}")
                raw_reads: list[float] = []
                raw_writes: list[float] = []
                if session is not None:
                    await anyio.to_thread.run_sync(session.once, size)  # warm-up
                    if session.writes:
                        await anyio.to_thread.run_sync(session.write_once, size)
                raw = (session, size, raw_reads, raw_writes) if session is not None else None
                p50, p99, oneway, streamed, msgs, one = await _measure(
                    ep, peer_name, size, iters, lend, raw
                )
                row = Row(
                    backend, mode, size, p50, p99, oneway, streamed, msgs, table.memcpy_gbps[size]
                )
                row.landed, row.acked_gbps = one.landed, size / one.acked / 1e9
                # a row is compared with the bare engine moving bytes the way it did:
                # written into the peer (landed), or read by it
                raw_times = raw_writes if one.landed >= 0.5 and raw_writes else raw_reads
                if raw_times:
                    if session is not None and session.writes:  # one-sided: say which way
                        row.raw_op = "write" if raw_times is raw_writes else "read"
                    raw_s = statistics.median(raw_times)
                    row.raw_gbps = size / raw_s / 1e9
                    row.vs_raw = row.oneway_gbps / row.raw_gbps
                    if table.control_rtt_us is not None and one.landed < 0.5:
                        row.bound = raw_s / (raw_s + table.control_rtt_us / 1e6)
                zmq = table.zmq_rtt_us.get(size)
                if zmq:
                    row.zmq_rtt_us, row.vs_zmq = zmq, row.rtt_p50_us / zmq
                table.rows.append(row)
    finally:
        if peer is not None:
            code = await anyio.to_thread.run_sync(peer.stop)
            if code != 0:
                results.notes.append(f"{backend} {mode}: the peer process exited with {code}")


async def _bench_obstructed(
    sizes: Sequence[int], iters: int, table: Table, step: Callable[[str], None]
) -> None:
    """shm with its default arena, zero-copy receiver: one-way seconds of a large
    object alone, then while the receiver holds an unrelated 1 KiB object."""
    tag = secrets.token_hex(3)
    base = ipc_base(tag)
    peer_name, me = f"bench-peer-{tag}", f"bench-{tag}"
    args = ["--backends", "shm", "--routes", json.dumps({me: "shm"}), "--zero-copy"]
    peer = await anyio.to_thread.run_sync(omniwire_peer, peer_name, f"{base}-b", args)
    n = max(5, iters // 20)
    try:
        async with Endpoint(
            me,
            address=f"{base}-a",
            peers={peer_name: peer.info},
            backends=["shm"],
            routes={peer_name: "shm"},
            ack_timeout=120,
        ) as ep:
            await ep.wait_peer(peer_name, 60)
            for size in sizes:
                step(f"shm zero-copy {fmt_size(size)} behind a held 1 KiB object")
                obj = payload(size)
                await _oneway(ep, peer_name, obj, 2, "warm-alone", False)
                alone = await _oneway(ep, peer_name, obj, n, "alone", False)
                small = await ep.send(
                    peer_name, payload(KiB), request_id="held", metadata={"hold": True}
                )
                await _oneway(ep, peer_name, obj, 1, "warm-behind", False)
                behind = await _oneway(ep, peer_name, obj, n, "behind", False)
                drop = await ep.send(peer_name, {}, request_id="drop", metadata={"drop_held": True})
                await drop.wait()
                await small.wait()
                table.obstructed_s[size] = (alone.seconds, behind.seconds)
    finally:
        code = await anyio.to_thread.run_sync(peer.stop)
        if code != 0:
            raise RuntimeError(f"shm obstructed: the peer process exited with {code}")


def _modes(backend: str) -> list[str]:
    """The row groups of one backend."""
    return ["copy", *(["zero-copy"] if backend == "shm" else []),
            *(["lent"] if backend in CROSS_HOST else [])]  # fmt: skip


def plans(backends: Sequence[str]) -> list[tuple[str, str]]:
    """(backend, mode) per table row group."""
    return [(b, m) for b in backends for m in _modes(b)]


def steps(
    backends: Sequence[str], sizes: Sequence[int], raw: bool, obstructed: Sequence[int]
) -> int:
    """Progress steps :func:`run_table` takes."""
    ps = plans(backends)
    n_raw = len({b for b, _ in ps if raw and b in rawbench.ENGINES})
    n_control = 1 if n_raw else 0
    n_obstructed = len(obstructed) if "shm" in backends else 0
    return 2 * len(sizes) + n_raw + n_control + len(ps) * len(sizes) + n_obstructed


async def run_table(
    backends: Sequence[str],
    sizes: Sequence[int],
    iters: int,
    raw_engines: bool,
    obstructed: Sequence[int],
    zmq: RawZmq | None,
    results: Results,
    step: Callable[[str], None],
    *,
    landing_size: int | None = None,
) -> Table:
    """Measure the table into ``results.table``; a failing row group or baseline is
    recorded in ``results.errors`` and the rest goes on. ``landing_size``: mooncake's
    and nixl's (None: their default)."""
    table = results.table = Table()
    if zmq is not None:
        table.zmq_peer = zmq.peer_addresses[0]
    for size in sizes:
        step(f"memcpy {fmt_size(size)}")
        table.memcpy_gbps[size] = memcpy_gbps(size)
    for size in sizes:
        step(f"raw zmq.asyncio round trip {fmt_size(size)}")
        if zmq is not None and size <= ZMQ_MAX:
            try:
                table.zmq_rtt_us[size] = await zmq_rtt_us(zmq, size, max(iters, 200))
            except Exception as exc:
                results.fail(f"table: raw zmq.asyncio round trip of {fmt_size(size)}", exc)
    if zmq is not None and raw_engines and any(b in rawbench.ENGINES for b in backends):
        step(f"raw zmq.asyncio round trip {fmt_size(CONTROL_BYTES)} (a control round trip)")
        try:
            table.control_rtt_us = await zmq_rtt_us(zmq, CONTROL_BYTES, max(iters, 400))
        except Exception as exc:
            results.fail("table: raw zmq.asyncio control round trip", exc)
    for backend in dict.fromkeys(backends):
        modes = _modes(backend)
        session: rawbench.Session | None = None
        if raw_engines and backend in rawbench.ENGINES:
            step(f"raw {backend} (its transfers interleaved with the {' and '.join(modes)} rows)")
            try:
                session = await anyio.to_thread.run_sync(rawbench.open_session, backend, max(sizes))
            except Exception as exc:
                results.fail(f"table {backend}: raw {backend} baseline", exc)
        try:
            for mode in modes:
                try:
                    await _bench_backend(
                        backend, mode, sizes, iters, results, table, step, session, landing_size
                    )
                except Exception as exc:
                    results.fail(f"table {backend} {mode}", exc)
        finally:
            if session is not None:
                try:
                    await anyio.to_thread.run_sync(session.close)
                except Exception as exc:
                    results.fail(f"table {backend}: closing the raw {backend} baseline", exc)
    if obstructed and "shm" in backends:
        try:
            await _bench_obstructed(obstructed, iters, table, step)
        except Exception as exc:
            results.fail("table shm obstructed", exc)
    table.finish()
    return table
