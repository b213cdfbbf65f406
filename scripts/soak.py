#!/usr/bin/env python3
"""Soak: many mixed payloads and stream chunks through two processes, each verified.

    .venv/bin/python scripts/soak.py [--messages 100000] [--seed 0] [--zero-copy]

This process sends ``--messages`` items to a receiver process: payloads of random
size (64 B … 1 MiB, most small) and chunks of several interleaved streams. Every
item carries its sequence number and the CRC32 of its tensor bytes. The receiver
checks each CRC, that each stream arrives in order, and that nothing arrives
twice; at the end it reports back, and this process prints the table: sent,
received, lost, duplicated, corrupted, out of order, throughput, peak RSS of both
processes, and whether /dev/shm was left clean. Exit status 0 only if nothing
was lost, duplicated, corrupted or reordered.

A script, not a test: its figures are measurements, not assertions on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import zlib

import anyio
import torch

from omniwire.endpoint import Endpoint

STREAMS = 8


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def sink(args: argparse.Namespace) -> int:
    """Receiver: verify everything, answer with a report when the sender says done."""
    received = corrupted = duplicates = out_of_order = 0
    seen: set[tuple[str, int]] = set()
    next_chunk: dict[str, int] = {}
    async with Endpoint("soak-sink", address=args.address, zero_copy=args.zero_copy) as ep:
        print(f"READY {ep.address}", flush=True)
        async for d in ep:
            async with d:
                if d.kind == "payload" and d.request_id == "done":
                    report = {
                        "received": received,
                        "corrupted": corrupted,
                        "duplicates": duplicates,
                        "out_of_order": out_of_order,
                        "peak_rss_mib": _peak_rss_mib(),
                    }
                    await (await ep.send(d.from_stage, report, request_id="report")).wait(60)
                    return 0
                if d.kind not in ("payload", "stream_chunk"):
                    continue
                item = d.payload
                key = (d.request_id, item["seq"])
                if key in seen:
                    duplicates += 1
                seen.add(key)
                if _crc(item["t"]) != item["crc"]:
                    corrupted += 1
                if d.kind == "stream_chunk":
                    expected = next_chunk.get(d.request_id, 0)
                    if item["seq"] != expected:
                        out_of_order += 1
                    next_chunk[d.request_id] = item["seq"] + 1
                received += 1
    return 1


def _size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.6:
        return rng.randint(16, 4096)  # small: inline chunks, small payloads
    if r < 0.95:
        return rng.randint(4096, 128 << 10)
    return rng.randint(128 << 10, 1 << 20)


def _start_sink(address: str, zero_copy: bool) -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "sink", "--address", address]
        + (["--zero-copy"] if zero_copy else []),
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


async def source(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    address = f"ipc://{tempfile.gettempdir()}/omniwire-soak-{os.getpid()}"
    child, ready = await anyio.to_thread.run_sync(_start_sink, address, args.zero_copy)
    if not ready.startswith("READY "):
        print(f"soak: receiver did not start: {ready!r}", file=sys.stderr)
        return 2
    stream_seq = [0] * STREAMS
    payload_seq = 0
    started = time.perf_counter()
    nbytes = 0
    async with Endpoint(
        "soak-src", address=address + "-src", peers={"soak-sink": ready[6:]}, ack_timeout=120
    ) as ep:
        await ep.wait_peer("soak-sink", 60)
        for i in range(args.messages):
            n = _size(rng)
            t = torch.randint(0, 256, (n,), dtype=torch.uint8)
            nbytes += n
            if rng.random() < 0.5:
                s = rng.randrange(STREAMS)
                item = {"seq": stream_seq[s], "crc": _crc(t), "t": t}
                stream_seq[s] += 1
                await ep.stream("soak-sink", item, request_id=f"stream-{s}")
            else:
                item = {"seq": payload_seq, "crc": _crc(t), "t": t}
                payload_seq += 1
                await ep.send("soak-sink", item, request_id="payloads")
            if args.progress and i % 10000 == 0:
                print(f"  {i} sent", file=sys.stderr, flush=True)
        for s in range(STREAMS):
            await ep.end_stream("soak-sink", request_id=f"stream-{s}")
        await ep.drain(120)
        elapsed = time.perf_counter() - started
        await ep.send("soak-sink", {"done": True}, request_id="done")
        with anyio.fail_after(120):
            report = (await ep.receive()).payload
        routes = {f"{k[1]}/{k[2]}": v.count for k, v in ep.route_stats.items()}
    code = await anyio.to_thread.run_sync(child.wait, 60)
    if child.stdout is not None:
        child.stdout.close()
    ours = (f"omniwire-{os.getpid()}-", f"omniwire-{child.pid}-")
    leaked = [n for n in os.listdir("/dev/shm") if n.startswith(ours)]
    lost = args.messages - report["received"]
    rows = [
        ("messages sent", args.messages),
        ("received (verified)", report["received"]),
        ("lost", lost),
        ("duplicated", report["duplicates"]),
        ("corrupted (CRC mismatch)", report["corrupted"]),
        ("stream chunks out of order", report["out_of_order"]),
        ("tensor bytes", nbytes),
        (
            "throughput",
            f"{args.messages / elapsed:,.0f} msgs/s, {nbytes / elapsed / 1e6:,.1f} MB/s",
        ),
        ("elapsed", f"{elapsed:.1f} s"),
        (
            "peak RSS sender / receiver",
            f"{_peak_rss_mib():.0f} MiB / {report['peak_rss_mib']:.0f} MiB",
        ),
        ("routes used", json.dumps(routes)),
        ("segments of either process left in /dev/shm", len(leaked)),
        ("receiver exit code", code),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    ok = lost == 0 and not (report["duplicates"] or report["corrupted"] or report["out_of_order"])
    return 0 if ok and not leaked and code == 0 else 1


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zero-copy", action="store_true")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--role", default="source", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    args = p.parse_args()
    return anyio.run(sink if args.role == "sink" else source, args)


if __name__ == "__main__":
    sys.exit(main())
