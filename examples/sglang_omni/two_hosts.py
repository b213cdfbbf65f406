"""sglang-omni stages on two hosts, their data through omniwire's mooncake.

sglang-omni 0.1.9's runner places every stage on one host, so this builds the
stages as its runner does, by hand: ``src`` (and the coordinator) on one host,
``far`` on the other, each a real sglang-omni ``Stage`` with a ``StageControlPlane``
over ``tcp://``, ``remote_stage_names`` naming the other, so ``CommRouter`` asks for
its ``mooncake`` relay, which ``enable()`` makes omniwire's. Run ``far`` first::

    python two_hosts.py far --src-ip A --far-ip B &
    python two_hosts.py src --src-ip A --far-ip B --chunk 64 --chunk 65536

``src`` prints one JSON line: per request what far computed, and which omniwire
backend carried the src → far objects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PORTS = {"completion": 0, "abort": 1, "src": 2, "far": 3}


def endpoints(args: argparse.Namespace) -> dict[str, str]:
    ip = {"completion": args.src_ip, "abort": args.src_ip, "src": args.src_ip, "far": args.far_ip}
    return {k: f"tcp://{ip[k]}:{args.base_port + p}" for k, p in PORTS.items()}


def build_stage(name: str, args: argparse.Namespace):  # -> Stage
    import stages
    from sglang_omni.pipeline.control_plane import StageControlPlane
    from sglang_omni.pipeline.stage.runtime import Stage
    from sglang_omni.pipeline.stage.stream_queue import StreamQueue

    ep = endpoints(args)
    other = "far" if name == "src" else "src"
    stage = Stage(
        name=name,
        role="single",
        get_next=(lambda rid, result: "far") if name == "src" else (lambda rid, result: None),
        gpu_id=None,
        endpoints={"src": ep["src"], "far": ep["far"]},
        control_plane=StageControlPlane(name, ep[name], ep["completion"], ep["abort"]),
        scheduler=stages.create_src() if name == "src" else stages.create_far(),
        stream_targets=["far"] if name == "src" else None,
        remote_stage_names={other},
        can_accept_stream_before_payload=name == "far",
        is_terminal=name == "far",
    )
    if name == "far":
        stage.stream_queue = StreamQueue()
    return stage


async def run_far(args: argparse.Namespace) -> None:
    stage = build_stage("far", args)
    await stage.run()  # until the coordinator's shutdown


async def run_src(args: argparse.Namespace) -> dict[str, object]:
    from sglang_omni.pipeline.coordinator import Coordinator
    from sglang_omni.proto.request import OmniRequest

    from omniwire.integrations.sglang_omni._wire import wires

    ep = endpoints(args)
    coord = Coordinator(ep["completion"], ep["abort"], entry_stage="src", terminal_stages=["far"])
    coord.register_stage("src", ep["src"])
    coord.register_stage("far", ep["far"])
    await coord.start()
    loop_task = asyncio.get_running_loop().create_task(coord.run_completion_loop())
    stage = build_stage("src", args)
    stage_task = asyncio.get_running_loop().create_task(stage.run())
    results: dict[str, object] = {}
    backends: set[str] = set()
    try:
        for _ in range(200):  # far's omniwire endpoint answers (bounded: 60 s)
            wire = next(iter(wires().values()), None)
            if wire is not None and "far" in wire.ep.peer_names():
                break
            await asyncio.sleep(0.3)
        for i in range(args.requests):
            rid = f"req-{i}"
            req = OmniRequest(inputs={"seed": i, "chunks": args.chunk or [64]})
            try:
                out = await asyncio.wait_for(coord.submit(rid, req), args.timeout)
                results[rid] = {k: v for k, v in sorted(out.items()) if k != "pid"}
            except Exception as exc:
                results[rid] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        for wire in wires().values():
            backends |= {b for (peer, _kind, b) in wire.ep.route_stats if peer == "far"}
    finally:
        await coord.shutdown_stages(["src", "far"])
        await asyncio.wait_for(stage_task, 30)
        loop_task.cancel()
        await coord.stop()
    return {"results": results, "backends": sorted(backends)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("role", choices=("src", "far"))
    ap.add_argument("--src-ip", required=True)
    ap.add_argument("--far-ip", required=True)
    ap.add_argument("--base-port", type=int, default=47200)
    ap.add_argument("--chunk", type=int, action="append")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    if os.environ.get("OMNIWIRE_SGLANG_OMNI_SITE"):
        sys.path.append(os.environ["OMNIWIRE_SGLANG_OMNI_SITE"])
    sys.path.insert(0, str(HERE))
    os.environ["OMNIWIRE_SGLANG_OMNI"] = "1"  # stages.py enables omniwire
    os.environ.setdefault("OMNIWIRE_SGLANG_BACKENDS", "local,shm,mooncake")
    if args.role == "far":
        asyncio.run(run_far(args))
        return 0
    print(json.dumps(asyncio.run(run_src(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
