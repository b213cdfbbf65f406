"""CPU per request when ``requests()`` dispatches a burst, by burst size.

    python scripts/burst_dispatch.py [--sizes 4000,16000,48000] [--gc]

Endpoint ``a`` opens N one-chunk streams (inline) to endpoint ``b`` in the same
process; once ``b`` holds all N, the README's serving loop (``async for request in
b.requests()``) takes them, and the CPU time of that loop is printed per request.
O(1) dispatch prints about the same figure for every N. The cyclic garbage
collector is off while measuring (``--gc`` leaves it on): its full collections
scan a heap that grows with N, which is not the dispatch's cost.
"""

from __future__ import annotations

import argparse
import gc
import os
import secrets
import tempfile
import time

import anyio
import torch

from omniwire import Endpoint


def _address(name: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/owb-{os.getuid()}/{name}-{secrets.token_hex(3)}"


async def _burst(n: int, keep_gc: bool) -> float:
    """Seconds of CPU per request for dispatching a burst of ``n``."""
    room = {
        "receive_buffer": n + 16,
        "receive_window": 1 << 30,
        "receive_buffer_bytes": 1 << 31,
        "max_open_streams": n + 16,
    }
    async with (
        Endpoint("b", address=_address("b"), **room) as b,  # type: ignore[arg-type]
        Endpoint("a", address=_address("a"), peers={"b": b.address}, routes={"b": "inline"}) as a,
    ):
        await a.wait_peer("b", 10)
        chunk = torch.ones(1)
        for i in range(n):
            await a.stream("b", chunk, request_id=f"r{i}")
        with anyio.fail_after(120):
            while b.queued() < n:  # noqa: ASYNC110 (a count to reach, no event to wait on)
                await anyio.sleep(0.01)
        gc.collect()
        if not keep_gc:
            gc.disable()
        try:
            start = time.process_time()
            streams = []
            async for request in b.requests():
                streams.append(request)
                if len(streams) == n:
                    break
            took = time.process_time() - start
        finally:
            gc.enable()
        for s in streams:
            s.close()
        return took / n


async def main(args: argparse.Namespace) -> None:
    for n in (int(s) for s in args.sizes.split(",")):
        per = await _burst(n, args.gc)
        print(f"burst of {n:>7,}: {per * 1e6:6.2f} µs of CPU per request", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    p.add_argument("--sizes", default="4000,16000,48000")
    p.add_argument("--gc", action="store_true", help="leave the garbage collector on")
    anyio.run(main, p.parse_args())
