#!/usr/bin/env python3
"""What session resumption (spec §10.7) costs the hot path: a 1 KiB echo and a
1 KiB stream between two processes, with ``resume_window=30`` (numbered frames,
acks) and ``0`` (plain 1.1 frames), interleaved in one run.

    OMP_NUM_THREADS=1 python scripts/resume_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import anyio
import torch

from omniwire import Endpoint

N_ECHO = 400
N_STREAM = 3000


async def _peer(address_q: mp.Queue, window: float) -> None:  # type: ignore[type-arg]
    async with Endpoint("echo", backends=["local", "shm"], resume_window=window) as ep:
        address_q.put(ep.address)
        taken = 0
        while taken < N_ECHO + N_STREAM:
            d = await ep.receive(timeout=30)
            taken += 1
            if d.request_id.startswith("e"):
                await ep.send("src", d.payload, request_id=d.request_id)
            d.release()
        await anyio.sleep(0.5)


def _run_peer(address_q: mp.Queue, window: float) -> None:  # type: ignore[type-arg]
    anyio.run(_peer, address_q, window)


async def _measure(address: str, window: float) -> tuple[float, float]:
    chunk = torch.arange(256, dtype=torch.float32)  # 1 KiB
    async with Endpoint(
        "src", backends=["local", "shm"], peers={"echo": address}, resume_window=window
    ) as ep:
        await ep.wait_peer("echo", 20)
        rtts = []
        for i in range(N_ECHO):
            t = time.perf_counter()
            await ep.send("echo", chunk, request_id=f"e{i}")
            d = await ep.receive(timeout=10)
            d.release()
            rtts.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(N_STREAM):
            await ep.stream("echo", chunk, request_id="s")
        stream_s = time.perf_counter() - t
        await anyio.sleep(0.3)
    return statistics.median(rtts) * 1e6, stream_s / N_STREAM * 1e6


def one(window: float) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    p = ctx.Process(target=_run_peer, args=(q, window))
    p.start()
    try:
        return anyio.run(_measure, q.get(timeout=60), window)
    finally:
        p.join(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    res: dict[float, list[tuple[float, float]]] = {30.0: [], 0.0: []}
    for _ in range(a.rounds):
        for w in (30.0, 0.0):
            res[w].append(one(w))
    for w, rows in res.items():
        echo = statistics.median(r[0] for r in rows)
        stream = statistics.median(r[1] for r in rows)
        print(f"resume_window={w:>4}: 1 KiB echo p50 {echo:7.1f} µs, stream {stream:6.2f} µs/chunk")
    e = statistics.median(r[0] for r in res[30.0]) / statistics.median(r[0] for r in res[0.0])
    s = statistics.median(r[1] for r in res[30.0]) / statistics.median(r[1] for r in res[0.0])
    print(f"resume / plain: echo {e:.3f}x, stream {s:.3f}x")


if __name__ == "__main__":
    main()
