"""``omniwire demo``: a small pipeline that shows which backend carries each edge.

Topology: stages ``src`` and ``near`` share this process; stage ``far`` runs in a
child process (``--remote``: as another host over tcp://, across a cross-host
engine). Each round, ``src`` sends a 4 MiB "encoder output" to ``near`` and
``far``, then streams a 64 B, a 64 KiB and a 4 MiB chunk to ``far`` and ends the
stream. ``near`` and ``far`` reduce what they received and reply; ``src`` checks
the replies against its own reduction and prints, per edge and kind, the
backend, why it was chosen, the bytes and the steady-state latency, then the
merged result.

A first warm-up round is not counted: the first transfer on an edge maps
segments, faults pages in and connects engines, which says nothing about the
transfers that follow. The far stage's stderr (and the engines' own log lines)
is shown only if it fails, or with ``--verbose``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import IO, Any

import anyio
import torch

from .endpoint import Endpoint, RouteStats
from .errors import OmniwireError

__all__ = ["main", "run"]

PAYLOAD_NUMEL = 1 << 20  # 4 MiB of float32
CHUNK_NUMELS = (16, 16 << 10, 1 << 20)  # 64 B, 64 KiB, 4 MiB of float32
ROUNDS = 5  # measured rounds, after one warm-up round
REMOTE_HOST_ID = "omniwire-demo-remote-host"


def _reduce(t: torch.Tensor) -> dict[str, Any]:
    return {"numel": t.numel(), "sum": round(float(t.double().sum()), 3)}


def _inputs() -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(PAYLOAD_NUMEL, generator=g)
    chunks = [torch.randn(n, generator=g) for n in CHUNK_NUMELS]
    return hidden, chunks


async def _far_stage(args: argparse.Namespace) -> int:
    """The ``far`` stage (child process): reduce each request's payload and stream and
    reply to src; exit after ``--rounds`` requests."""
    backends = args.backends.split(",") if args.backends else None
    routes = {"src": args.route} if args.route else None
    async with Endpoint(
        "far", address=args.address, backends=backends, routes=routes, host_id=args.host_id or None
    ) as ep:
        print(f"READY {ep.address}", flush=True)
        for _ in range(args.rounds):
            request = await ep.requests().__anext__()
            payload: dict[str, Any] = {}
            chunks: list[dict[str, Any]] = []
            async with request:
                async for d in request:
                    if d.kind == "payload":
                        payload = {**_reduce(d.payload["hidden"]), "backend": d.backend}
                    elif d.kind == "stream_chunk":
                        chunks.append(
                            {
                                "chunk_id": d.chunk_id,
                                "step": d.metadata["step"],
                                "backend": d.backend,
                                **_reduce(d.payload),
                            }
                        )
                    elif d.kind == "stream_end":
                        answer = {"stage": "far", "payload": payload, "chunks": chunks}
                        await (await d.reply(answer)).wait(30)
                    else:
                        print(f"far: {d.kind} for {d.request_id}: {d.error}", file=sys.stderr)
                        return 1
    return 0


async def _near_stage(ep: Endpoint, rounds: int) -> None:
    for _ in range(rounds):
        d = await ep.receive()
        # off the event loop: src shares it, and its latencies must be the transfers'
        reduced = await anyio.to_thread.run_sync(_reduce, d.payload["hidden"])
        reduced["backend"] = d.backend
        await d.reply({"stage": "near", "payload": reduced})


def _row(s: RouteStats, src: str) -> str:
    lat = s.latency_ms()
    latency = "-" if lat is None else f"{lat:8.2f} ms"
    return f"{src + '→' + s.peer:<10} {s.kind:<13} {s.backend:<9} {s.count:>5} {s.nbytes:>12,} {latency:>12}"


def _table(ep: Endpoint, explain: bool) -> str:
    lines = [
        f"{'edge':<10} {'kind':<13} {'backend':<9} {'count':>5} {'bytes':>12} {'latency p50':>12}",
        "-" * 66,
    ]
    for s in sorted(ep.route_stats.values(), key=lambda s: (s.peer, s.kind, -s.nbytes)):
        lines.append(_row(s, ep.name))
        lines.append(f"{'':<10} why: {s.reason}")
    if explain:
        lines.append("")
        lines.append("routes in full (every candidate and why it lost):")
        for (peer, kind, _), s in sorted(ep.route_stats.items()):
            if s.route is not None:
                lines.append(f"  {ep.name}→{peer} {kind} (policy {s.route.policy}):")
                lines += ["    " + line for line in s.route.explain().splitlines()]
    lines.append(
        f"latency: median over {ROUNDS} rounds after 1 warm-up round (not counted: the first "
        "transfer on an edge maps memory and connects engines); send → ACK (inline chunks: "
        "send → hand-off, they need no ACK)"
    )
    return "\n".join(lines)


async def run(
    *,
    remote: bool = False,
    backend: str | None = None,
    explain: bool = False,
    verbose: bool = False,
    hosts: tuple[str, str] | None = None,
    far_launch: Sequence[str] = (),
) -> int:
    """Run the demo pipeline; returns the process exit code.

    ``hosts`` (with ``remote``): the IP addresses of this host and of the far one,
    whose stage ``far_launch`` (a command prefix: ``ssh host``, ``nsenter ...``)
    starts there; the hosts then tell each other apart by detection alone.
    Default: both on 127.0.0.1, the far one with a host identity of its own.
    """
    with tempfile.TemporaryFile("w+") as far_log:
        log = None if verbose else far_log
        return await _run(remote, backend, explain, log, hosts, list(far_launch))


async def _run(
    remote: bool,
    backend: str | None,
    explain: bool,
    far_log: IO[str] | None,
    hosts: tuple[str, str] | None = None,
    far_launch: list[str] | None = None,
) -> int:
    tmp = os.path.join(tempfile.gettempdir(), f"omniwire-demo-{os.getuid()}")
    tag = secrets.token_hex(3)
    hidden, chunks = _inputs()
    if remote:
        cross = backend or "mooncake"
        src_backends = ["local", "shm", cross]
        far_args = ["--backends", ",".join(src_backends)]
        if hosts is None:
            # Both "hosts" run on this machine over 127.0.0.1: keep UCX (nixl) on loopback.
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
            src_address, far_address = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
            far_args += ["--host-id", REMOTE_HOST_ID]
        else:
            src_address, far_address = (f"tcp://{ip}:0" for ip in hosts)
        routes = {"far": cross} if backend else None
        if backend:
            far_args += ["--route", backend]
    else:
        if backend:
            raise SystemExit("--backend needs --remote (same-host routing picks local/inline/shm)")
        src_address = f"ipc://{tmp}/src-{tag}"
        far_address = f"ipc://{tmp}/far-{tag}"
        src_backends, far_args, routes = None, [], None
    far_args += ["--rounds", str(ROUNDS + 1)]
    far, ready = await anyio.to_thread.run_sync(
        _start_far, far_address, far_args, far_log, far_launch or []
    )
    if not ready.startswith("READY "):
        print(f"omniwire demo: the far stage did not start (exit {far.wait()})", file=sys.stderr)
        _show(far_log)
        return 2
    far_address = ready.split(" ", 1)[1]
    problems: list[str] = []
    try:
        async with (
            Endpoint("near", address=f"ipc://{tmp}/near-{tag}") as near,
            Endpoint(
                "src",
                address=src_address,
                backends=src_backends,
                routes=routes,
                peers={"near": near.address, "far": far_address},
            ) as src,
        ):
            await src.wait_peer("near")
            await src.wait_peer("far", 30)
            answers: dict[str, Any] = {}
            async with anyio.create_task_group() as tg:
                tg.start_soon(_near_stage, near, ROUNDS + 1)
                for round_ in range(ROUNDS + 1):
                    if round_ == 1:
                        src.route_stats.clear()  # the warm-up round is not counted
                    answers = await _one_round(src, f"req-{round_}", hidden, chunks)
                    problems += _check(answers, hidden, chunks)
                await src.drain(30)
            print(_table(src, explain))
            print()
            print("merged result:")
            print(f"  near: {answers['near']['payload']}")
            print(f"  far:  payload {answers['far']['payload']}")
            for c in answers["far"]["chunks"]:
                print(f"        chunk {c}")
    finally:
        code = await anyio.to_thread.run_sync(far.wait, 30)
        if far.stdout is not None:
            far.stdout.close()
    if code != 0:
        problems.append(f"the far stage exited with {code}")
    if problems:
        _show(far_log)
        for p in problems:
            print(f"omniwire demo: FAILED: {p}", file=sys.stderr)
        return 1
    print("\nomniwire demo: OK — every answer matches the source's own reduction")
    return 0


async def _one_round(
    src: Endpoint, rid: str, hidden: torch.Tensor, chunks: list[torch.Tensor]
) -> dict[str, Any]:
    """One request: the payload to near and far, the stream to far; their replies."""
    async with src.deliveries(request_id=rid) as replies:
        payload = {"hidden": hidden, "step": 0}
        # one transfer at a time, each to its ACK: every latency is its edge's own
        await (await src.send("near", payload, request_id=rid)).wait(30)
        await (await src.send("far", payload, request_id=rid)).wait(30)
        for step, chunk in enumerate(chunks):
            sent = await src.stream("far", chunk, request_id=rid, metadata={"step": step})
            await sent.wait(30)
        await src.end_stream("far", request_id=rid)
        answers: dict[str, Any] = {}
        with anyio.fail_after(60):
            async for d in replies:
                if d.kind != "payload":
                    raise OmniwireError(f"unexpected {d.kind} from {d.from_stage}: {d.error}")
                answers[d.payload["stage"]] = d.payload
                if len(answers) == 2:
                    break
        return answers


def _start_far(
    address: str, extra: list[str], log: IO[str] | None, launch: list[str]
) -> tuple[subprocess.Popen[str], str]:
    """The far stage (``launch`` prefixed), its stderr (engine chatter included) into
    ``log`` if given."""
    far = subprocess.Popen(
        [*launch, sys.executable, "-m", "omniwire.demo", "--far", "--address", address, *extra],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert far.stdout is not None
    ready = far.stdout.readline().strip()
    if not ready.startswith("READY "):
        far.kill()
    return far, ready


def _show(log: IO[str] | None) -> None:
    """What the far stage wrote to stderr (shown when something failed)."""
    if log is not None:
        log.seek(0)
        text = log.read().strip()
        if text:
            print("the far stage's stderr:\n" + text, file=sys.stderr)


def _check(answers: dict[str, Any], hidden: torch.Tensor, chunks: list[torch.Tensor]) -> list[str]:
    problems = []
    expected = _reduce(hidden)
    for stage in ("near", "far"):
        got = {k: answers[stage]["payload"][k] for k in ("numel", "sum")}
        if got != expected:
            problems.append(f"{stage} reduced the payload to {got}, expected {expected}")
    far_chunks = answers["far"]["chunks"]
    if [c["chunk_id"] for c in far_chunks] != [0, 1, 2]:
        problems.append(f"far got chunks out of order: {[c['chunk_id'] for c in far_chunks]}")
    for c, t in zip(far_chunks, chunks, strict=False):
        if {k: c[k] for k in ("numel", "sum")} != _reduce(t):
            problems.append(f"far chunk {c['chunk_id']} reduced to {c}, expected {_reduce(t)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omniwire.demo")
    p.add_argument("--far", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--host-id", help=argparse.SUPPRESS)
    p.add_argument("--backends", help=argparse.SUPPRESS)
    p.add_argument("--route", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=ROUNDS + 1, help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true", help="show the far stage's stderr")
    p.add_argument("--remote", action="store_true")
    p.add_argument("--backend", choices=["mooncake", "nixl", "nccl"])
    p.add_argument("--explain", action="store_true")
    p.add_argument("--hosts", help="with --remote: THIS_IP,FAR_IP (no host-id override)")
    p.add_argument("--far-launch", default="", help="with --hosts: a command prefix for far")
    args = p.parse_args(argv)
    hosts = None
    if args.hosts:
        this_ip, sep, far_ip = args.hosts.partition(",")
        if not (args.remote and sep and this_ip and far_ip):
            p.error("--hosts THIS_IP,FAR_IP goes with --remote")
        hosts = (this_ip, far_ip)
    if args.far:
        return anyio.run(_far_stage, args)
    try:
        return anyio.run(
            lambda: run(
                remote=args.remote,
                backend=args.backend,
                explain=args.explain,
                verbose=args.verbose,
                hosts=hosts,
                far_launch=shlex.split(args.far_launch),
            )
        )
    except OmniwireError as exc:
        print(f"omniwire demo: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
