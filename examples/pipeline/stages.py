"""The three stages of the pipeline example: encoder → thinker → talker.

Run by ``run.py`` (see README.md); each stage is one process::

    python stages.py talker  --address ADDR
    python stages.py thinker --address ADDR --peer talker=ADDR

(the encoder runs inside ``run.py``). The "models" are deterministic stand-ins,
so ``run.py`` can check every result against its own computation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from typing import Any

import anyio
import torch

from omniwire import Endpoint, RequestAbortedError
from omniwire.endpoint import DeliveryStream
from omniwire.routing import PreferenceOrderPolicy

FEATURES = (64, 256)  # encoder output per request: 64 KiB of float32
HIDDEN = (256, 256)  # thinker hidden states: 256 KiB, fanned out over shared memory
AUDIO = 16_000  # talker output samples per request


# -- the stand-in models (run.py recomputes them to check the results) --------------


def features_of(rid: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, rid)))
    return torch.randn(*FEATURES, generator=g)


def tokens_of(features: torch.Tensor, n: int) -> list[int]:
    return [int(abs(float(features[i].sum())) * 1000) % 50_000 for i in range(n)]


def hidden_of(features: torch.Tensor) -> torch.Tensor:
    return features.repeat(4, 1) * 0.5


def audio_of(hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    base = hidden.flatten()[:AUDIO].clone()
    return base + float(sum(tokens) % 97)


# -- talker: no peers= at all; it answers the thinker through delivery.reply --------


async def talker(ep: Endpoint, report: dict[str, Any]) -> None:
    async def serve(request: DeliveryStream) -> None:
        tokens: list[int] = []
        hidden = None
        async with request:
            async for d in request:
                if d.request_id not in report["seen"]:
                    report["seen"].append(d.request_id)
                if d.kind == "stream_chunk":
                    tokens.append(int(d.payload.item()))
                elif d.kind == "payload":
                    hidden = d.payload["hidden"]
                elif d.kind == "aborted":
                    report["aborted"].append(d.request_id)
                    return
                elif d.kind == "error":
                    report["errors"].append(f"{d.request_id}: {d.error}")
                    return
                elif d.kind == "stream_end":
                    assert hidden is not None
                    await d.reply({"audio": audio_of(hidden, tokens)})
                    report["served"].append(d.request_id)

    async with anyio.create_task_group() as tg:
        async for request in ep.requests(from_stage="thinker"):
            tg.start_soon(serve, request)


# -- thinker: one task per request; text fans out to encoder and talker --------------


async def thinker(ep: Endpoint, report: dict[str, Any]) -> None:
    async def serve(request: DeliveryStream) -> None:
        rid = request.request_id
        async with request:
            first = await request.__anext__()
            if first.kind != "payload":
                report["errors"].append(f"{rid}: began with {first.kind}")
                return
            # hold the talker's answer before anything goes to the talker
            async with (
                ep.deliveries(request_id=first.request_id, from_stage="talker") as from_talker,
                anyio.create_task_group() as tg,
            ):

                async def work() -> None:
                    with contextlib.suppress(RequestAbortedError):  # the watcher sees it
                        await think(first, from_talker)
                    tg.cancel_scope.cancel()

                async def watch() -> None:  # the rest of the request: only an abort can come
                    async for d in request:
                        if d.kind == "aborted":
                            report["aborted"].append(d.request_id)
                            tg.cancel_scope.cancel()

                tg.start_soon(work)
                tg.start_soon(watch)

    async def think(first: Any, from_talker: DeliveryStream) -> None:
        rid, features = first.request_id, first.payload["features"]
        n, slow = first.metadata["tokens"], first.metadata["slow"]
        tokens = tokens_of(features, n)
        for i, token in enumerate(tokens):
            # a fan-out: each text token goes to the user (encoder) and the talker
            await ep.stream(["encoder", "talker"], torch.tensor([token]), request_id=rid)
            if slow and i == 0:
                await anyio.sleep(60)  # thinks so long that the encoder aborts it
        # a fan-out of 256 KiB over shm: packed once, one buffer read by both
        receipts = await ep.send(
            ["talker", "encoder"], {"hidden": hidden_of(features)}, request_id=rid
        )
        report["fanouts"].append([[r.peer, r.backend] for r in receipts])
        await ep.end_stream("talker", request_id=rid)
        with anyio.fail_after(60):
            answer = await from_talker.__anext__()
        if answer.kind != "payload":
            raise RuntimeError(f"{rid}: the talker answered {answer.kind}: {answer.error}")
        # a reply to the encoder goes where its Hello said: the thinker has no peers= entry
        await first.reply({"audio": answer.payload["audio"], "tokens": tokens})
        await first.end_reply()
        report["served"].append(rid)

    async with anyio.create_task_group() as tg:
        async for request in ep.requests(from_stage="encoder"):
            tg.start_soon(serve, request)


# -- a stage process -------------------------------------------------------------------


async def run_stage(args: argparse.Namespace) -> int:
    peers = dict(p.split("=", 1) for p in args.peer)
    report: dict[str, Any] = {
        "stage": args.stage,
        "served": [],
        "aborted": [],
        "errors": [],
        "seen": [],  # requests the stage had a delivery of (an abort reaches only those)
    }
    report["fanouts"] = []
    stage = {"talker": talker, "thinker": thinker}[args.stage]
    # --prefer: that engine (started even where it is opt-in, as nccl is) and shm
    policy = PreferenceOrderPolicy([args.prefer]) if args.prefer else None
    backends = ["local", "shm", args.prefer] if args.prefer else None
    async with Endpoint(
        args.stage, address=args.address, peers=peers, policy=policy, backends=backends
    ) as ep:
        print(f"READY {ep.address}", flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stage, ep, report)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break
        report["shm"] = ep.backend("shm").stats().exports if "shm" in ep.running_backends else 0
        report["counters"] = {k: ep.counters[k] for k in ("aborts", "aborts_forwarded")}
    print(json.dumps(report), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="stages.py")
    p.add_argument("stage", choices=["talker", "thinker"])
    p.add_argument("--address", required=True)
    p.add_argument("--peer", action="append", default=[], help="NAME=ADDRESS")
    p.add_argument("--prefer", default=None, help="a backend to prefer (another host: an engine)")
    return anyio.run(run_stage, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
