"""A ready-made stage process: ``python -m omniwire.peer --name far --address ...``.

It runs one :class:`~omniwire.Endpoint` and answers every delivery:

- ``echo`` (default): payloads and stream chunks go back to their sender under
  the same request id and kind; a stream end is answered with a stream end; an
  error (also an object it could not take) with an ``error`` stream end naming it;
  an abort with nothing;
- ``sink``: takes everything, answers nothing (``--delay`` seconds per delivery
  makes it a slow consumer);
- ``forward``: a middle stage. Every payload from another stage is sent on to
  ``--forward-to`` (several, comma-separated: one fan-out send) under the same
  request id and metadata, with ``lend=True`` — a zero-copy delivery (``--zero-copy``)
  then goes by reference (spec §9.2 "Forwarding") — and released; what comes back
  from a forward target is relayed to the stage the request came from;
- ``bench``: answers (as ``echo``) only deliveries whose metadata has ``"echo": True``;
  keeps deliveries whose metadata has ``"hold": True`` unreleased (a zero-copy
  consumer that holds on to an object) until one with ``"drop_held": True`` comes;
  counts stream chunks per request and, for chunks whose metadata carries
  ``"t"`` (the sender's ``time.monotonic_ns()``), their latency on arrival. A chunk
  with metadata ``{"last": True, "group": G, "streams": K}`` ends its request's
  tally; once K requests of group G ended, G is answered (a payload, request id
  G) with ``{"n": chunks counted, "lat_ns": int64 tensor of latencies}``; a
  delivery whose metadata has ``"sum": True`` is answered with the sum of its
  tensor's elements, ``{"sum": float}`` (the consumer read every byte).

In every mode a delivery whose metadata has ``"stats": True`` is answered at once
with ``{"stats": {backend: [exports, imports]}}`` (metadata ``{"stats": True}``):
what this endpoint's backends hold, for the conformance suite; one with
``"counters": True`` with ``{"counters": {name: int}}`` (the endpoint's counters:
``bytes_packed``, ``bytes_copied``, ``objects_forwarded``, …).

It prints ``READY <address>`` once listening (and ``PEERS <names>`` once each
``--wait-peer`` completed its handshake) and exits 0 on SIGTERM or when
``--exit-after`` deliveries were handled. Used by the conformance suite and the
multi-process tests and by ``omniwire bench``; it is also a small example of the
Endpoint API.
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

from .endpoint import Endpoint


def _parser(prog: str = "python -m omniwire.peer") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--name", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--peer", action="append", default=[], help="NAME=ADDRESS")
    p.add_argument(
        "--wait-peer",
        action="append",
        default=[],
        help="print PEERS <names> once each NAME completed its handshake (repeatable)",
    )
    p.add_argument("--mode", choices=["echo", "sink", "bench", "forward"], default="echo")
    p.add_argument("--forward-to", default="", help="forward mode: NAME[,NAME...]")
    p.add_argument("--backends", default=None, help="comma-separated backend names")
    p.add_argument("--backend-options", default="{}", help="JSON {backend: {option: value}}")
    p.add_argument("--routes", default="{}", help="JSON {edge: backend}")
    p.add_argument("--policy", default=None)
    p.add_argument("--zero-copy", action="store_true")
    p.add_argument("--host-id", default=None)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--exit-after", type=int, default=0)
    p.add_argument("--ack-timeout", type=float, default=30.0)
    p.add_argument("--receive-buffer", type=int, default=64)
    p.add_argument("--allow-pickle", action="store_true")
    p.add_argument("--auth-key", default=None)
    p.add_argument("--digest", action="store_true", help="send object digests (spec §7.7)")
    return p


async def _answer(ep: Endpoint, d: Any) -> None:
    if d.kind == "payload":
        await ep.send(d.from_stage, d.payload, request_id=d.request_id, metadata=d.metadata)
    elif d.kind == "stream_chunk":
        await ep.stream(d.from_stage, d.payload, request_id=d.request_id, metadata=d.metadata)
    elif d.kind == "stream_end":
        await ep.end_stream(d.from_stage, request_id=d.request_id)
    elif d.kind == "error" and d.from_stage in ep.peer_names():
        await ep.end_stream(
            d.from_stage, request_id=d.request_id, error=f"peer saw error: {d.error}"
        )


class Tally:
    """``bench`` mode's count of stream chunks per request and per group of requests."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.latencies: dict[str, list[int]] = {}
        self.groups: dict[str, list[str]] = {}

    def count(self, request_id: str) -> None:
        """Count one chunk that carries no metadata (it cannot complete its group)."""
        counts = self.counts
        counts[request_id] = counts.get(request_id, 0) + 1

    def add(self, request_id: str, meta: dict[str, Any], now_ns: int) -> tuple[str, Any] | None:
        """Count one chunk; returns ``(group, answer)`` when its group is complete."""
        self.counts[request_id] = self.counts.get(request_id, 0) + 1
        sent = meta.get("t")
        if isinstance(sent, int):
            self.latencies.setdefault(request_id, []).append(now_ns - sent)
        if not meta.get("last"):
            return None
        group = str(meta.get("group", request_id))
        ended = self.groups.setdefault(group, [])
        ended.append(request_id)
        if len(ended) < int(meta.get("streams", 1)):
            return None
        del self.groups[group]
        n = sum(self.counts.pop(r, 0) for r in ended)
        latencies = [x for r in ended for x in self.latencies.pop(r, ())]
        return group, {"n": n, "lat_ns": torch.tensor(latencies, dtype=torch.int64)}


def backend_stats(ep: Endpoint) -> dict[str, list[int]]:
    """``{backend: [live exports, live imports]}`` of an endpoint."""
    out = {}
    for name in ep.running_backends:
        stats = ep.backend(name).stats()
        out[name] = [stats.exports, stats.imports]
    return out


async def _answer_stats(ep: Endpoint, d: Any) -> None:
    try:
        await ep.send(
            d.from_stage,
            {"stats": backend_stats(ep)},
            request_id=d.request_id,
            metadata={"stats": True},
        )
    except Exception as exc:
        print(f"stats answer failed: {type(exc).__name__}: {exc}", file=sys.stderr)


async def _answer_counters(ep: Endpoint, d: Any) -> None:
    try:
        await ep.send(
            d.from_stage,
            {"counters": dict(ep.counters)},
            request_id=d.request_id,
            metadata={"counters": True},
        )
    except Exception as exc:
        print(f"counters answer failed: {type(exc).__name__}: {exc}", file=sys.stderr)


async def _forward(ep: Endpoint, d: Any, targets: list[str], origins: dict[str, str]) -> None:
    """``forward`` mode: a payload goes on to the targets (by reference where it can);
    what a target sends back goes to the request's origin."""
    try:
        if d.from_stage in targets:
            origin = origins.pop(d.request_id, None)
            if origin is not None and d.kind == "payload":
                await ep.send(origin, d.payload, request_id=d.request_id, metadata=d.metadata)
            return
        if d.kind != "payload":
            return
        origins[d.request_id] = d.from_stage
        while len(origins) > 4096:  # answers that never came
            del origins[next(iter(origins))]
        to: str | list[str] = targets[0] if len(targets) == 1 else targets
        await ep.send(to, d.payload, request_id=d.request_id, metadata=d.metadata, lend=True)
    except Exception as exc:
        print(f"forward failed: {type(exc).__name__}: {exc}", file=sys.stderr)


async def _answer_sum(ep: Endpoint, d: Any) -> None:
    """``bench`` mode, metadata ``{"sum": True}``: answer the sum of every element of
    the payload's tensor (the consumer has read every byte), as ``{"sum": float}``."""
    tensor = d.payload if isinstance(d.payload, torch.Tensor) else next(iter(d.payload.values()))
    total = float(tensor.sum())
    del tensor
    d.release()  # zero-copy: the sender's memory is free before the answer leaves
    d.payload = None  # copy mode: the receive buffer goes back to its pool now, warm
    try:
        await ep.send(d.from_stage, {"sum": total}, request_id=d.request_id, metadata={"sum": True})
    except Exception as exc:
        print(f"sum answer failed: {type(exc).__name__}: {exc}", file=sys.stderr)


async def _answer_tally(ep: Endpoint, to: str, group: str, answer: Any) -> None:
    try:
        await ep.send(to, answer, request_id=group, metadata={"tally": True})
    except Exception as exc:
        print(f"tally answer failed: {type(exc).__name__}: {exc}", file=sys.stderr)


async def run(args: argparse.Namespace) -> int:
    peers = dict(p.split("=", 1) for p in args.peer)
    ep = Endpoint(
        args.name,
        address=args.address,
        peers=peers,
        backends=args.backends.split(",") if args.backends else None,
        backend_options=json.loads(args.backend_options),
        routes=json.loads(args.routes) or None,
        policy=args.policy,
        zero_copy=args.zero_copy,
        host_id=args.host_id,
        ack_timeout=args.ack_timeout,
        receive_buffer=args.receive_buffer,
        allow_pickle=args.allow_pickle,
        auth_key=args.auth_key,
        digest=args.digest,
    )
    handled = 0
    async with ep:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            # READY only once SIGTERM is handled: a stop right after it is a clean exit
            print(f"READY {ep.address}", flush=True)
            async with anyio.create_task_group() as tg:

                async def stop_on_signal() -> None:
                    async for _ in signals:
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(stop_on_signal)
                if args.wait_peer:

                    async def announce_peers() -> None:
                        for name in args.wait_peer:
                            await ep.wait_peer(name, 120)  # HandshakeError: exit 1
                        print(f"PEERS {','.join(args.wait_peer)}", flush=True)

                    tg.start_soon(announce_peers)
                held = []
                tally = Tally()
                targets = [t for t in args.forward_to.split(",") if t]
                origins: dict[str, str] = {}
                # a chunk without metadata, most of a stream, is only counted
                counting = args.mode == "bench" and not args.delay and not args.exit_after
                async for d in ep:
                    if counting and d.metadata is None and d.kind == "stream_chunk":
                        tally.count(d.request_id)
                        d.release()
                        handled += 1
                        continue
                    now_ns = time.monotonic_ns()
                    meta = d.metadata if isinstance(d.metadata, dict) else {}
                    if args.mode == "bench" and meta.get("hold"):
                        held.append(d)
                        continue
                    if meta.get("drop_held"):
                        for h in held:
                            h.release()
                        held.clear()
                    async with d:
                        if (
                            args.mode == "bench"
                            and d.kind == "stream_chunk"
                            and not meta.get("echo")
                        ):
                            done = tally.add(d.request_id, meta, now_ns)
                            if done is not None:
                                await _answer_tally(ep, d.from_stage, *done)
                        elif meta.get("stats"):
                            await _answer_stats(ep, d)
                            continue
                        elif meta.get("counters"):
                            await _answer_counters(ep, d)
                            continue
                        elif args.mode == "forward":
                            await _forward(ep, d, targets, origins)
                            handled += 1
                            continue
                        elif args.mode == "bench" and meta.get("sum"):
                            await _answer_sum(ep, d)
                            continue
                        if args.delay:
                            await anyio.sleep(args.delay)
                        wants = args.mode == "echo" or (
                            args.mode == "bench"
                            and isinstance(d.metadata, dict)
                            and d.metadata.get("echo")
                        )
                        if wants:
                            try:
                                await _answer(ep, d)
                            except Exception as exc:
                                print(
                                    f"answer failed: {type(exc).__name__}: {exc}", file=sys.stderr
                                )
                    handled += 1
                    if args.exit_after and handled >= args.exit_after:
                        tg.cancel_scope.cancel()
                        break
    print(f"DONE {handled}", flush=True)
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m omniwire.peer") -> None:
    """Run the peer with ``argv`` (default: the command line); exits with its status."""
    sys.exit(anyio.run(run, _parser(prog).parse_args(argv)))


if __name__ == "__main__":
    main()
