"""CPU per 1 KiB stream chunk on each side, in one process, without sockets' noise.

    python scripts/small_message_cost.py [--reps 12] [--frames 40]

Two endpoints (shm only, so small payloads go inline) in this process:

- **sender**: ``stream()`` calls of 200 chunks, timed while the outbox takes them
  (no suspension: wall time is CPU time), and the outbox flush that frames them;
- **receiver**: frames of 250 inline chunks built with the wire API, fed to the
  receiving endpoint's dispatcher as its control loop would, then every delivery
  taken and released (decode, checks, window, delivery queue, the application's
  receive).

Prints the minimum and the median over ``--reps`` rounds. On a shared machine the
minimum is the figure to compare between two trees (run each a few times,
alternating: ``PYTHONPATH=<tree>/src python scripts/small_message_cost.py``);
the two-process bench (``omniwire bench --scenarios stream``) is what users see.
Reaches into private attributes (``_dispatch``, ``_receiver``, ``_core``).
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
from typing import Any

import anyio
import torch

from omniwire import Endpoint, codec, packing, wire

SEND_BATCH = 200
FRAME_CHUNKS = 250


def _address(name: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/owcost-{name}-{secrets.token_hex(3)}"


async def _sender(a: Any, b: Any, reps: int) -> tuple[list[float], list[float]]:
    outbox = a._core.outbox
    flushes: list[float] = []
    flush = outbox._flush

    def timed_flush() -> None:
        t = time.perf_counter()
        flush()
        flushes.append(time.perf_counter() - t)

    outbox._flush = timed_flush
    chunk = torch.ones(256)
    calls = []
    try:
        for r in range(reps + 3):  # the first 3 warm up
            rid = f"send{r}"
            start = time.perf_counter()
            for _ in range(SEND_BATCH):
                await a.stream("b", chunk, request_id=rid)
            if r >= 3:
                calls.append((time.perf_counter() - start) / SEND_BATCH)
            for _ in range(SEND_BATCH):
                (await b.receive(10)).release()
            await a.end_stream("b", request_id=rid)
            (await b.receive(10)).release()
    finally:
        outbox._flush = flush
    big = [f / SEND_BATCH for f in flushes if f > 20e-6]  # the flushes of whole batches
    return calls, big


async def _receiver(b: Any, reps: int, frames: int) -> list[float]:
    enc = codec.dumps(torch.ones(256))
    layout = packing.plan(enc.tensors, enc.paths)
    data = packing.pack_bytes(enc.tensors, layout)
    inline = wire.InlineStreamChunkRef(
        header=enc.header, tensors=layout.metas, data=data, kind="stream_chunk"
    )

    def frame(rid: str, first: int) -> bytes:
        msgs = tuple(
            wire.DataReadyMessage(
                request_id=rid, from_stage="a", to_stage="b", chunk_id=first + i, inline=inline
            )
            for i in range(FRAME_CHUNKS)
        )
        return wire.encode(wire.BatchMessage(messages=msgs))

    dispatch, receiver = b._dispatch, b._receiver
    out = []
    for r in range(reps + 1):  # the first warms up
        batch = [frame(f"recv{r}", k * FRAME_CHUNKS) for k in range(frames)]
        start = time.process_time()
        for f in batch:
            for peer in dispatch.on_frame(f, abort_channel=False):
                if receiver.pump(peer):
                    await receiver.take_head(peer)
            for _ in range(FRAME_CHUNKS):
                (await b.receive(10)).release()
        if r:
            out.append((time.process_time() - start) / (frames * FRAME_CHUNKS))
    return out


def _line(what: str, values: list[float]) -> str:
    return (
        f"{what}: min {min(values) * 1e6:.2f} µs, median {statistics.median(values) * 1e6:.2f} µs"
    )


async def main(args: argparse.Namespace) -> None:
    a_at, b_at = _address("a"), _address("b")
    async with (
        Endpoint("b", address=b_at, peers={"a": a_at}, backends=["shm"]) as b,
        Endpoint("a", address=a_at, peers={"b": b_at}, backends=["shm"]) as a,
    ):
        await a.wait_peer("b", 30)
        await b.wait_peer("a", 30)
        calls, flushes = await _sender(a, b, args.reps)
        received = await _receiver(b, args.reps, args.frames)
    print(_line("sender stream() per chunk", calls))
    print(_line("sender outbox flush per chunk", flushes))
    print(_line("receiver per chunk (decode to release)", received))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--frames", type=int, default=40)
    anyio.run(main, p.parse_args())
