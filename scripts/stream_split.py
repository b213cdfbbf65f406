"""Where the wall time of the bench's 1 KiB stream goes on the sending side.

    python scripts/stream_split.py [--busy] [--rounds 6] [--chunks 5000]

The ``stream`` scenario of ``omniwire bench`` (A streams 1 KiB chunks with
``ep.stream()``, awaiting each call, to an ``omniwire.peer --mode bench`` process B
that answers when the last one arrived), with A's side split per round into: wall
time, A's CPU time, the time A's event loop slept in ``epoll`` (waiting for B), and
the counters that moved. A sender that is neither on the CPU nor asleep was
runnable but preempted: with ``--busy`` (a CPU burner on the other core) A and B
then share about one core, and msgs/s follows the CPU per message of both.
Reaches into private parts (the bench's endpoint helper, the loop's selector).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import anyio
import torch

from omniwire.bench._cli import _endpoint
from omniwire.bench._procs import Burner

PEER = "bench-b"


class _Sleeps:
    """Seconds the event loop spent in a blocking ``select`` (timeout not 0)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        selector = loop._selector  # type: ignore[attr-defined]
        self.seconds = 0.0
        self.count = 0
        select = selector.select

        def timed(timeout: float | None = None) -> Any:
            if timeout is not None and timeout <= 0:
                return select(timeout)
            start = time.perf_counter()
            try:
                return select(timeout)
            finally:
                self.seconds += time.perf_counter() - start
                self.count += 1

        selector.select = timed


async def main(args: argparse.Namespace) -> None:
    sleeps = _Sleeps(asyncio.get_running_loop())
    burner = Burner() if args.busy else None
    try:
        async with _endpoint({PEER: []}) as (ep, _children):
            chunk = torch.ones(256, dtype=torch.float32)
            n = args.chunks
            for r in range(args.rounds + 1):  # round 0 warms up
                rid = f"split{r}"
                last = {"last": True, "group": f"{rid}/done", "streams": 1}
                before = dict(ep.counters)
                sleeps.seconds, sleeps.count = 0.0, 0
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(n - 1):
                    await ep.stream(PEER, chunk, request_id=rid)
                await ep.stream(PEER, chunk, request_id=rid, metadata=last)
                answer = await ep.receive(60)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                answer.release()
                moved = {k: d for k, v in ep.counters.items() if (d := v - before.get(k, 0))}
                print(
                    f"round {r}{' (warm-up)' if not r else ''}: {n / wall:,.0f} msgs/s; "
                    f"wall {wall * 1e3:.1f} ms = A on CPU {cpu * 1e3:.1f} ms "
                    f"({cpu / n * 1e6:.2f} µs/msg) + asleep {sleeps.seconds * 1e3:.1f} ms "
                    f"({sleeps.count} sleeps) + runnable, not running "
                    f"{max(0.0, wall - cpu - sleeps.seconds) * 1e3:.1f} ms; "
                    f"counters {moved}",
                    flush=True,
                )
                await ep.end_stream(PEER, request_id=rid)
                await ep.drain(60)
    finally:
        if burner is not None:
            burner.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    p.add_argument("--busy", action="store_true", help="a CPU burner on the other core")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--chunks", type=int, default=5000)
    anyio.run(main, p.parse_args())
