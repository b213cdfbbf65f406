"""A victim endpoint in its own process, for tests where a hostile same-host peer
might kill it (SIGBUS): ``python shm_victim.py ADDRESS [--zero-copy] [--no-ring]``.

It prints one JSON line per event on stdout: ``{"ready": address}`` once up, then
``{"from", "request", "kind", "error", "data"}`` for each delivery (``data``: the
hex of the bytes of its tensor ``t``, or of ``b`` as bytes), and keeps every
delivery from ``mallory`` (zero-copy views of her memory stay alive). On stdin, ``touch`` reads every byte of every
delivery it keeps (``{"touched": n}``), ``quit`` ends it with status 0.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
import torch

from omniwire import Endpoint


def _data(payload: Any) -> str | None:
    if isinstance(payload, dict):
        for key in ("t", "b"):
            value = payload.get(key)
            if isinstance(value, torch.Tensor):
                return bytes(value.contiguous().view(torch.uint8).numpy()).hex()
            if isinstance(value, bytes):
                return value.hex()
    return None


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def main(address: str, zero_copy: bool, ring: bool) -> None:
    kept: list[Any] = []
    async with Endpoint(
        "victim", address=address, zero_copy=zero_copy, control_ring=ring
    ) as victim:
        _say(ready=address)

        async def commands() -> None:
            while True:
                line = await anyio.to_thread.run_sync(sys.stdin.readline)
                cmd = line.strip()
                if cmd in ("", "quit"):
                    tg.cancel_scope.cancel()
                    return
                if cmd == "touch":
                    total = 0
                    for d in kept:
                        for value in d.payload.values() if isinstance(d.payload, dict) else ():
                            if isinstance(value, torch.Tensor):
                                total += int(value.view(torch.uint8).sum())  # reads every byte
                    _say(touched=len(kept), total=total)
                if cmd == "peers":
                    _say(peers=sorted(victim.peer_names()))

        async with anyio.create_task_group() as tg:
            tg.start_soon(commands)
            while True:
                d = await victim.receive()
                _say(
                    **{"from": d.from_stage},
                    request=d.request_id,
                    kind=d.kind,
                    error=d.error,
                    data=_data(d.payload) if d.kind == "payload" else None,
                )
                if d.from_stage == "mallory":
                    kept.append(d)  # held: zero-copy views of her memory stay alive
                else:
                    d.release()


if __name__ == "__main__":
    args = sys.argv[1:]
    anyio.run(main, args[0], "--zero-copy" in args, "--no-ring" not in args)
