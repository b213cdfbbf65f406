"""One side of the inline-traffic partition test, run inside a namespace host
(``tests/test_cluster.py``).

    python cluster_inline.py recv ADDRESS SECONDS
    python cluster_inline.py send ADDRESS PEER_ADDRESS SECONDS

Both take ``--peer-timeout``, ``--heartbeat`` and ``--resume-window``. ``recv`` prints ``{"address"}``,
then, at the sender's last payload (``{"i": -1}``) or after ``SECONDS`` at most,
``{"got": [i or "kind:request_id", …], "counters"}``.
``send`` prints ``{"ready": true}``, sends small tensor-less payloads ``{"i": i}``
(request ids ``q<i>``), one a millisecond for ``SECONDS``, and then prints ``{"ok":
[i whose send returned], "failed": [[i, error]], "lost_at": [i sent next after
each time the peer was declared lost], "counters"}``.
"""

from __future__ import annotations

import argparse
import json
import time

import anyio

from omniwire import Endpoint, OmniwireError

#: The sender's last payload: the receiver stops there (however long the sender took
#: to start: seconds on a loaded machine).
DONE = -1


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer-timeout", type=float, default=10.0)
    p.add_argument("--heartbeat", type=float, default=0.3)
    p.add_argument("--resume-window", type=float, default=30.0)


async def recv(
    address: str, seconds: float, peer_timeout: float, heartbeat: float, resume: float
) -> None:
    async with Endpoint(
        "r", address=address, peer_timeout=peer_timeout, heartbeat_interval=heartbeat,
        backends=["local"], resume_window=resume,
    ) as ep:  # fmt: skip
        print(json.dumps({"address": ep.address}), flush=True)
        got: list[int | str] = []
        with anyio.move_on_after(seconds):  # at most: the sender's last payload ends it
            while True:
                try:
                    d = await ep.receive(timeout=1)
                except TimeoutError:
                    continue
                d.release()
                if d.kind == "payload" and d.payload["i"] == DONE:
                    break
                got.append(d.payload["i"] if d.kind == "payload" else f"{d.kind}:{d.request_id}")
        counters = {k: v for k, v in ep.counters.items() if v}
        print(json.dumps({"got": got, "counters": counters}), flush=True)


async def send(
    address: str, peer: str, seconds: float, peer_timeout: float, heartbeat: float, resume: float
) -> None:
    async with Endpoint(
        "s", address=address, peers={"r": peer}, peer_timeout=peer_timeout,
        heartbeat_interval=heartbeat, backends=["local"], resume_window=resume,
    ) as ep:  # fmt: skip
        await ep.wait_peer("r", 20)
        print(json.dumps({"ready": True}), flush=True)
        ok: list[int] = []
        failed: list[tuple[int, str]] = []
        lost_at: list[int] = []
        start = time.monotonic()
        i = 0
        seen = 0  # losses declared so far
        while time.monotonic() - start < seconds:
            if ep.counters["peers_lost"] > seen:
                seen = ep.counters["peers_lost"]
                lost_at.append(i)
            try:
                with anyio.fail_after(30):
                    await ep.send("r", {"i": i, "pad": b"x" * 1000}, request_id=f"q{i}")
                ok.append(i)
            except OmniwireError as exc:
                failed.append((i, type(exc).__name__))
            i += 1
            await anyio.sleep(0.001)
        try:  # the receiver stops at this one (or at its bound)
            with anyio.fail_after(30):
                await ep.send("r", {"i": DONE}, request_id="done")
        except OmniwireError:
            pass
        await anyio.sleep(1)
        counters = {k: v for k, v in ep.counters.items() if v}
        print(json.dumps({"ok": ok, "failed": failed, "lost_at": lost_at, "counters": counters}),
              flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="role", required=True)
    r = sub.add_parser("recv")
    r.add_argument("address")
    r.add_argument("seconds", type=float)
    _options(r)
    s = sub.add_parser("send")
    s.add_argument("address")
    s.add_argument("peer")
    s.add_argument("seconds", type=float)
    _options(s)
    a = p.parse_args()
    if a.role == "recv":
        anyio.run(recv, a.address, a.seconds, a.peer_timeout, a.heartbeat, a.resume_window)
    else:
        anyio.run(send, a.address, a.peer, a.seconds, a.peer_timeout, a.heartbeat, a.resume_window)


if __name__ == "__main__":
    main()
