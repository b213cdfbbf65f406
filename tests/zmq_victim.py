"""An endpoint in its own process whose application holds the event loop now and
then, for tests where a peer might make libzmq abort it:
``python zmq_victim.py HEARTBEAT HOLD [PEER_ADDRESS]``.

It prints ``{"ready": address, "abort": abort_address}`` once up (and, given PEER_ADDRESS, after calling
``add_peer("mallory", PEER_ADDRESS)``); then, until stdin says ``quit`` (or 60 s
pass), it sleeps ``HOLD`` seconds *on the loop* (an application step that does
not yield) and yields for 10 ms, over and over; then it prints ``{"alive": n}``
(n: the holds it made) and ends with status 0.
"""

from __future__ import annotations

import json
import sys
import time

import anyio

from omniwire import Endpoint


async def main(heartbeat: float, hold: float, peer: str | None) -> None:
    async with Endpoint(
        "victim", address="tcp://127.0.0.1:0", heartbeat_interval=heartbeat
    ) as victim:
        if peer is not None:
            victim.add_peer("mallory", peer)
        abort = victim._core.control.abort_address
        print(json.dumps({"ready": victim.address, "abort": abort}), flush=True)
        holds = 0
        async with anyio.create_task_group() as tg:

            async def until_quit() -> None:
                await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                tg.cancel_scope.cancel()

            tg.start_soon(until_quit)
            with anyio.move_on_after(60):
                while True:
                    time.sleep(hold)  # noqa: ASYNC251 -- holds the loop: nothing reads the sockets
                    holds += 1
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        print(json.dumps({"alive": holds}), flush=True)


if __name__ == "__main__":
    anyio.run(main, float(sys.argv[1]), float(sys.argv[2]), (sys.argv[3:] or [None])[0])
