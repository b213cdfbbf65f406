"""One side of a partition test, run inside a namespace host (``tests/test_cluster.py``).

    python cluster_peer.py recv --name r --address tcp://IP:0 [--backends ...]
    python cluster_peer.py send --name s --address tcp://IP:0 --peer r=ADDR \
        --size BYTES --count N [--stream] [--backends ...]

``recv`` prints ``READY <address>``, then one JSON line per delivery
(``{"rid", "kind", "chunk", "ok"}``: ``ok`` when the bytes are what the sender
computed; None with ``--no-verify``) and, on SIGTERM, ``{"end": true, "held":
{backend: exports}}``.

``send`` sends ``N`` objects of ``BYTES`` one after another (payloads with request
ids ``p0``, ``p1``, …; with ``--stream``, chunks of one request ``s0`` until one
fails, then of ``s1``, …). It prints ``{"sent": i}`` once object ``i`` is
announced and ``{"i", "rid", "ok", "error", "took", "outcome"}`` once its receipt is
done; after a failure it waits (up to ``--rejoin`` seconds) for the peer to come
back and goes on; then it waits ``--settle`` seconds for late ACKs and prints
``{"settled": {i: outcome}}``. Exits 0 unless something unexpected was raised.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

import anyio
import torch

from omniwire import Endpoint, OmniwireError
from omniwire.delivery import SendReceipt


def pattern(i: int, nbytes: int) -> torch.Tensor:
    return torch.arange(nbytes // 8, dtype=torch.int64) * 7 + i


def check(t: torch.Tensor, i: int) -> tuple[bool, dict[str, list[int]]]:
    """Whether ``t`` holds object ``i``'s pattern; else where it differs, and whose bytes
    are there."""
    want = pattern(i, t.numel() * 8)
    if torch.equal(t, want):
        return True, {}
    diff = (t != want).nonzero()
    lo, hi = int(diff[0]), int(diff[-1])
    return False, {"bad": [lo * 8, hi * 8 + 8, int(t[lo] - want[lo])]}


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def endpoint(args: argparse.Namespace) -> Endpoint:
    return Endpoint(
        args.name,
        address=args.address,
        peers=dict(p.split("=", 1) for p in args.peer),
        backends=args.backends.split(","),
        routes={p.split("=", 1)[0]: args.route for p in args.peer} if args.route else None,
        ack_timeout=args.ack_timeout,
        peer_timeout=args.peer_timeout,
        resume_window=args.resume_window,
        heartbeat_interval=args.heartbeat or args.peer_timeout / 4,
        handshake_timeout=args.rejoin,
        digest=args.digest,
        backend_options=(
            {engine: {"landing_size": args.landing_size} for engine in ("mooncake", "nixl")}
            if args.landing_size is not None
            else None
        ),
    )


async def receive(args: argparse.Namespace) -> int:
    async with endpoint(args) as ep:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            say(ready=ep.address)
            print(f"READY {ep.address}", flush=True)
            async with anyio.create_task_group() as tg:

                async def take() -> None:
                    while True:
                        d = await ep.receive()
                        # CLOCK_MONOTONIC is one clock for every namespace of a kernel
                        late = time.monotonic() - (d.metadata or {}).get("t0", 0.0)
                        if d.kind in ("payload", "stream_chunk"):
                            t = d.payload["x"] if d.kind == "payload" else d.payload
                            ok, bad = check(t, d.metadata["i"]) if args.verify else (None, {})
                            say(rid=d.request_id, kind=d.kind, i=d.metadata["i"], ok=ok,
                                after=late, **bad)  # fmt: skip
                        else:
                            say(rid=d.request_id, kind=d.kind, error=d.error)
                        d.release()

                tg.start_soon(take)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break
        held = {n: ep.backend(n).stats().exports for n in ep.running_backends}
    say(end=True, held=held)
    return 0


async def send(args: argparse.Namespace) -> int:
    (peer,) = [p.split("=", 1)[0] for p in args.peer]
    receipts: dict[int, SendReceipt] = {}
    async with endpoint(args) as ep:
        await ep.wait_peer(peer, 30)
        say(ready=True)
        stream = 0
        reused = torch.empty(args.size // 8, dtype=torch.int64)
        for i in range(args.count):
            rid = f"s{stream}" if args.stream else f"p{i}"
            # --reuse: one buffer, refilled once the last send of it completed
            tensor = reused.copy_(pattern(i, args.size)) if args.reuse else pattern(i, args.size)
            started = time.monotonic()
            meta = {"i": i, "t0": started}
            try:
                if args.stream:
                    receipt = await ep.stream(peer, tensor, request_id=rid, metadata=meta)
                else:
                    receipt = await ep.send(
                        peer, {"x": tensor}, request_id=rid, metadata=meta, lend=args.lend
                    )
                receipts[i] = receipt
                say(sent=i, after=time.monotonic() - started)
                await receipt.wait()
                say(i=i, rid=rid, ok=True, took=time.monotonic() - started, outcome=receipt.outcome)
            except OmniwireError as exc:
                receipt_ = receipts.get(i)
                say(
                    i=i,
                    rid=rid,
                    ok=False,
                    error=type(exc).__name__,
                    message=str(exc),
                    took=time.monotonic() - started,
                    outcome=receipt_.outcome if receipt_ is not None else "not sent",
                )
                stream += 1
                try:
                    await ep.wait_peer(peer, args.rejoin)
                    say(rejoined=i, after=time.monotonic() - started)
                except OmniwireError as exc2:
                    say(gone=type(exc2).__name__, message=str(exc2))
                    break
            if args.gap:
                await anyio.sleep(args.gap)
        with anyio.move_on_after(args.settle):
            for r in receipts.values():
                await r.settled()
        say(settled={i: r.outcome for i, r in receipts.items()})
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="cluster_peer.py")
    p.add_argument("role", choices=["send", "recv"])
    p.add_argument("--name", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--peer", action="append", default=[], help="NAME=ADDRESS")
    p.add_argument("--backends", default="local,shm,mooncake")
    p.add_argument("--route", default=None, help="the backend to route to the peer")
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--gap", type=float, default=0.0, help="seconds between sends")
    p.add_argument("--ack-timeout", type=float, default=30.0)
    p.add_argument("--peer-timeout", type=float, default=2.0)
    p.add_argument("--resume-window", type=float, default=30.0)
    p.add_argument("--heartbeat", type=float, default=0.0, help="default: peer_timeout / 4")
    p.add_argument("--rejoin", type=float, default=20.0)
    p.add_argument("--settle", type=float, default=10.0)
    p.add_argument("--digest", action="store_true", help="Endpoint(digest=True)")
    p.add_argument("--lend", action="store_true", help="send(..., lend=True)")
    p.add_argument("--reuse", action="store_true", help="send: one buffer for every object")
    p.add_argument(
        "--landing-size", type=int, default=None, help="mooncake, nixl: bytes lent to each peer"
    )
    p.add_argument(
        "--no-verify", dest="verify", action="store_false", help="recv: do not compare the bytes"
    )
    args = p.parse_args()
    return anyio.run(receive if args.role == "recv" else send, args)


if __name__ == "__main__":
    sys.exit(main())
