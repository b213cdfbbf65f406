"""sglang-omni's own shm relay against omniwire's relay, side by side in one run.

    python scripts/bench_sglang_omni.py [--quick] [--json out.json]

(sglang-omni from ``.venv/sglang-omni`` as ``make setup`` installs it, or
``$OMNIWIRE_SGLANG_OMNI_SITE``; ``tests/sglang_cpu_stub`` stands in for the GPU engine
``sglang`` where that is not installed.)

Two processes, ``src`` and ``far``, and sglang-omni's real per-object path:
``stage_io.write_payload`` (extract tensors, ``torch.cat`` pack, ``relay.put_async``,
pickled header), a ``DataReadyMessage`` over sglang-omni's own ZeroMQ
``PushSocket``/``PullSocket``; on ``far`` ``DataRef.from_dict`` and
``stage_io.read_payload`` (allocate, ``relay.get_async``, copy); a ``DataAckMessage``
back; on ``src`` ``op.mark_receiver_done()`` and ``op.wait_for_completion()``. Only the
relay differs: sglang-omni's ``ShmRelay`` as ``CommRouter.build_relay`` makes it
(``credits=2``), or ``OmniwireRelay`` over the stage's omniwire endpoint (started
before the clock starts, as ``enable()`` does at stage start).

Figures: sequential p50 of one object's full cycle (put → DataReady → read → DataAck
→ completion), and, with ``--inflight`` requests in flight at once, requests/s and
MiB/s. Each size's rounds alternate the two relays (A B A B) so drift hits both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def _setup_path() -> None:
    """sglang-omni where ``make setup`` puts it, and the CPU stub of ``sglang`` if needed."""
    site = os.environ.get("OMNIWIRE_SGLANG_OMNI_SITE", str(ROOT / ".venv" / "sglang-omni"))
    if os.path.isdir(site) and site not in sys.path:
        sys.path.append(site)
    stub = ROOT / "tests" / "sglang_cpu_stub"
    try:
        import sglang  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(stub))


def make_relay(kind: str, stage: str):
    if kind == "sglang":
        from sglang_omni.relay.shm import ShmRelay

        return ShmRelay(engine_id=f"{stage}_relay", slot_size_mb=512, credits=2, device="cpu")
    from omniwire.integrations.sglang_omni._relay import OmniwireRelay

    return OmniwireRelay(engine_id=f"{stage}_relay", device="cpu")


async def start_wire(kind: str, stage: str, addrs: dict[str, str]):
    if kind != "omniwire":
        return None
    from omniwire import Endpoint
    from omniwire.integrations.sglang_omni._wire import StageWire, endpoint_options

    peers = {n: a for n, a in addrs.items() if n != stage}
    ep = Endpoint(
        stage, address=addrs[stage], peers=peers, **endpoint_options(gpu=False, remote=False)
    )
    wire = StageWire(ep, f"{stage}_relay")
    await wire.start()
    await ep.wait_peer(next(iter(peers)), timeout=30)
    return wire


def far_main(kind: str, ctl: dict[str, str], addrs: dict[str, str]) -> None:
    _setup_path()
    asyncio.run(_far(kind, ctl, addrs))


async def _far(kind: str, ctl: dict[str, str], addrs: dict[str, str]) -> None:
    from sglang_omni.comm import stage_io
    from sglang_omni.comm.data_ref import DataRef
    from sglang_omni.pipeline.control_plane import PullSocket, PushSocket
    from sglang_omni.proto import DataAckMessage

    wire = await start_wire(kind, "far", addrs)
    relay = make_relay(kind, "far")
    pull = PullSocket(ctl["far"], bind=True)
    await pull.start()
    push = PushSocket(ctl["src"])
    await push.connect()

    async def one(msg) -> None:
        ref = DataRef.from_dict(msg.data_ref)
        ok, err = True, None
        try:
            await stage_io.read_payload(relay, msg.request_id, ref)
        except Exception as exc:  # sglang-omni's failure path: a failed DataAck
            ok, err = False, repr(exc)
        await push.send(
            DataAckMessage(
                request_id=msg.request_id,
                from_stage="far",
                to_stage="src",
                object_id=ref.object_id,
                success=ok,
                error=err,
            )
        )

    tasks = set()
    while True:
        msg = await pull.recv()
        if getattr(msg, "data_ref", None) is None:  # the stop message
            break
        t = asyncio.get_running_loop().create_task(one(msg))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    pull.close()
    push.close()
    relay.close()
    if wire is not None:
        await wire.aclose()


async def _src(kind: str, ctl, addrs, plan, out) -> None:
    import torch
    from sglang_omni.comm import stage_io
    from sglang_omni.comm.data_ref import TransportKind
    from sglang_omni.pipeline.control_plane import PullSocket, PushSocket
    from sglang_omni.proto import DataReadyMessage, OmniRequest, StagePayload

    wire = await start_wire(kind, "src", addrs)
    relay = make_relay(kind, "src")
    pull = PullSocket(ctl["src"], bind=True)
    await pull.start()
    push = PushSocket(ctl["far"])
    await push.connect()
    acks: dict[str, asyncio.Future] = {}

    async def ack_loop() -> None:
        while True:
            msg = await pull.recv()
            fut = acks.pop(msg.object_id, None)
            if fut is not None and not fut.done():
                if msg.success:
                    fut.set_result(None)
                else:
                    fut.set_exception(RuntimeError(msg.error))

    ack_task = asyncio.get_running_loop().create_task(ack_loop())
    n = 0

    async def cycle(t: torch.Tensor) -> float:
        nonlocal n
        n += 1
        rid = f"r{n}"
        t0 = time.perf_counter()
        payload = StagePayload(request_id=rid, request=OmniRequest(inputs=None), data={"t": t})
        ref, op = await stage_io.write_payload(
            relay, rid, payload, transport=TransportKind.SHM, from_stage="src", to_stage="far"
        )
        fut = asyncio.get_running_loop().create_future()
        acks[ref.object_id] = fut
        await push.send(
            DataReadyMessage(
                request_id=rid, from_stage="src", to_stage="far", data_ref=ref.to_dict()
            )
        )
        try:
            await asyncio.wait_for(fut, 60)
            op.mark_receiver_done()
        except Exception as exc:
            op.mark_receiver_failed(exc)
            raise
        finally:
            await op.wait_for_completion(timeout=60)
        return time.perf_counter() - t0

    for size, seq, inflight, total in plan:
        t = torch.randint(0, 255, (size,), dtype=torch.uint8)
        await cycle(t)  # warm-up, not counted
        lat = [await cycle(t) for _ in range(seq)]
        sem = asyncio.Semaphore(inflight)

        async def bounded(sem: asyncio.Semaphore, t: torch.Tensor) -> None:
            async with sem:
                await cycle(t)

        t0 = time.perf_counter()
        await asyncio.gather(*(bounded(sem, t) for _ in range(total)))
        wall = time.perf_counter() - t0
        out.append(
            {
                "relay": kind,
                "size": size,
                "p50_ms": statistics.median(lat) * 1e3,
                "inflight": inflight,
                "req_s": total / wall,
                "mib_s": total * size / MiB / wall,
            }
        )
    await push.send(
        DataReadyMessage(
            request_id="stop", from_stage="src", to_stage="far", data_ref=None, is_done=True
        )
    )
    ack_task.cancel()
    pull.close()
    push.close()
    relay.close()
    if wire is not None:
        await wire.aclose()


def run_pair(kind: str, plan, tmp: str) -> list[dict]:
    ctl = {s: f"ipc://{tmp}/{kind}-{s}.ctl" for s in ("src", "far")}
    addrs = {s: f"ipc://{tmp}/{kind}-{s}.ow" for s in ("src", "far")}
    proc = mp.get_context("spawn").Process(target=far_main, args=(kind, ctl, addrs), daemon=True)
    proc.start()
    out: list[dict] = []
    try:
        asyncio.run(_src(kind, ctl, addrs, plan, out))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="fewer rounds (about a minute on 2 busy cores)"
    )
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds per relay")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    _setup_path()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # (size, sequential samples, in flight, total requests in the in-flight phase)
    plan = [(1 * KiB, 100, 200, 400), (4 * MiB, 15, 50, 100), (64 * MiB, 5, 8, 16)]
    if args.quick:
        plan = [(1 * KiB, 60, 200, 400), (4 * MiB, 9, 50, 60), (64 * MiB, 3, 8, 8)]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="owsgo-") as tmp:
        for r in range(args.rounds):
            for kind in ("sglang", "omniwire") if r % 2 == 0 else ("omniwire", "sglang"):
                rows += run_pair(kind, plan, tmp)
    print(f"{'size':>8} {'relay':>9} {'seq p50 ms':>11} {'in flight':>9} {'req/s':>9} {'MiB/s':>9}")
    summary = []
    for size, *_ in plan:
        per = {}
        for kind in ("sglang", "omniwire"):
            rs = [x for x in rows if x["relay"] == kind and x["size"] == size]
            agg = {
                "p50_ms": statistics.median(x["p50_ms"] for x in rs),
                "req_s": statistics.median(x["req_s"] for x in rs),
                "mib_s": statistics.median(x["mib_s"] for x in rs),
                "inflight": rs[0]["inflight"],
            }
            per[kind] = agg
            label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
            print(
                f"{label:>8} {kind:>9} {agg['p50_ms']:>11.3f} {agg['inflight']:>9} {agg['req_s']:>9.1f} {agg['mib_s']:>9.1f}"
            )
        seq_x = per["sglang"]["p50_ms"] / per["omniwire"]["p50_ms"]
        inf_x = per["omniwire"]["req_s"] / per["sglang"]["req_s"]
        print(
            f"{'':>8} omniwire/sglang: sequential {seq_x:.2f}x faster, in flight {inf_x:.2f}x the throughput"
        )
        summary.append(
            {
                "size": size,
                "sglang": per["sglang"],
                "omniwire": per["omniwire"],
                "seq_speedup": seq_x,
                "inflight_speedup": inf_x,
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
