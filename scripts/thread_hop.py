"""What a blocking call's trip to a worker thread and back costs on the event loop.

    python scripts/thread_hop.py [--calls 400]

Times ``await`` of a call that does nothing, one at a time with a 1 ms pause
between calls (so each finds its thread asleep, as a transfer does), through
``anyio.to_thread.run_sync``, ``loop.run_in_executor`` and
:class:`omniwire.backends.threads.Threads`, alternating twice; prints the median and
p90 of each.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio

from omniwire.backends.threads import Threads


def _nothing() -> int:
    return 1


async def _time(call: Callable[[], Awaitable[object]], n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
        await asyncio.sleep(0.001)
    return sorted(times)


async def main(calls: int) -> None:
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(1)
    threads = Threads("thread-hop")
    ways: dict[str, Callable[[], Awaitable[object]]] = {
        "anyio.to_thread.run_sync": lambda: anyio.to_thread.run_sync(_nothing),
        "loop.run_in_executor": lambda: loop.run_in_executor(executor, _nothing),
        "Threads.run": lambda: threads.run(_nothing),
    }
    for _ in range(2):
        for name, call in ways.items():
            t = await _time(call, calls)
            p90 = t[int(len(t) * 0.9)]
            print(
                f"{name:26s} median {statistics.median(t) * 1e6:6.1f} µs  p90 {p90 * 1e6:6.1f} µs"
            )
    threads.stop()
    executor.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    p.add_argument("--calls", type=int, default=400)
    anyio.run(main, p.parse_args().calls)
