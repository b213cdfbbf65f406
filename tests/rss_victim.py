"""An endpoint in its own process whose memory a test measures after an attack:
``python rss_victim.py``.

It prints ``{"ready": address}`` once up; then, for each line on stdin: ``rss`` —
after ``gc.collect()`` and ``malloc_trim(0)``, prints ``{"rss": MiB, "counters":
{...}, "queued": n}``; ``quit`` (or end of input) — closes the endpoint and exits 0.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys

import anyio

from omniwire import Endpoint


def rss_mib() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def main() -> None:
    async with Endpoint("victim", address="tcp://127.0.0.1:0") as victim:
        print(json.dumps({"ready": victim.address}), flush=True)
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if line.strip() != "rss":
                break
            await anyio.sleep(0.2)  # a few turns of the loop: what is due is done
            report = {
                "rss": rss_mib(),
                "counters": dict(victim.counters),
                "queued": victim.queued(),
            }
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    anyio.run(main)
