"""The pipeline example: encoder → thinker → talker, three processes, many requests.

    python examples/pipeline/run.py [--requests 8] [--json]

Across hosts (``scripts/cluster.py`` makes namespace hosts to try it on one
machine): ``--bind STAGE=tcp://IP:0`` gives a stage a TCP address,
``--launch STAGE='nsenter ...'`` a command prefix that starts it elsewhere,
``--prefer BACKEND`` a preference-order policy at every stage, and
``--expect PEER=BACKEND`` the backend the hidden-state fan-out must take to PEER
(shm by default).

This process is the encoder; it starts the talker and the thinker as child
processes (``stages.py``), sends every request at once — each served by its own
task at every stage, with no dispatcher — aborts one of them midway, and checks
what comes back against its own computation:

- encoder → thinker: the features (64 KiB, shm); the encoder reads the request's
  replies with ``ep.deliveries(request_id=...)``;
- thinker → encoder and talker: every text token, as a fan-out
  (``ep.stream(["encoder", "talker"], ...)``), then the hidden states (256 KiB) as
  a fan-out packed once into one shared-memory buffer;
- talker → thinker: the audio, with ``delivery.reply`` (the talker has no ``peers=``);
- thinker → encoder: the audio and the text, with ``delivery.reply`` and
  ``end_reply`` (the thinker has no ``peers=`` entry for the encoder either);
- one request is aborted by the encoder: the thinker stops it and forwards the
  abort to the talker.

Exits 0 when every check passes. ``--json`` prints the results as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from stages import audio_of, features_of, hidden_of, tokens_of  # noqa: E402

from omniwire import Endpoint  # noqa: E402
from omniwire.routing import PreferenceOrderPolicy  # noqa: E402

TOKENS = 4
#: Where and how each stage runs (set from the command line by main).
BIND: dict[str, str] = {}
LAUNCH: dict[str, list[str]] = {}
PREFER: list[str] = []


def address(name: str) -> str:
    if name in BIND:
        return BIND[name]
    base = os.path.join(tempfile.gettempdir(), f"omniwire-pipeline-{os.getuid()}")
    return f"ipc://{base}/{name}-{secrets.token_hex(3)}"


def start(stage: str, at: str, *peers: str) -> tuple[subprocess.Popen[str], str]:
    """Start a stage listening at ``at``; once it is ready, it and its address."""
    args = [*LAUNCH.get(stage, []), sys.executable, str(HERE / "stages.py"), stage]
    args += ["--address", at, *(["--prefer", PREFER[0]] if PREFER else [])]
    for peer in peers:
        args += ["--peer", peer]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    ready = child.stdout.readline().strip()
    if not ready.startswith("READY "):
        child.kill()
        raise SystemExit(f"the {stage} did not start (exit {child.wait()})")
    return child, ready.split(" ", 1)[1]


def stop(child: subprocess.Popen[str]) -> dict[str, Any]:
    """SIGTERM a stage and read its report (its last line of output)."""
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=60)
    lines = out.strip().splitlines()
    report: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    report["exit"] = child.returncode
    return report


async def request(ep: Endpoint, rid: str, abort: bool) -> dict[str, Any]:
    """One request, in its own task: send, read the replies, maybe abort."""
    result: dict[str, Any] = {"request": rid, "text": [], "status": "open"}
    # the request's stream holds its replies from now on, before anything is sent
    async with ep.deliveries(request_id=rid, from_stage="thinker") as replies:
        features = features_of(rid)
        metadata = {"tokens": TOKENS, "slow": abort}
        await ep.send("thinker", {"features": features}, request_id=rid, metadata=metadata)
        async for d in replies:
            if d.kind == "stream_chunk":
                result["text"].append(int(d.payload.item()))
                if abort:
                    await ep.abort(rid, "the client went away")
                    result["status"] = "aborted"
                    break
            elif d.kind == "payload" and "hidden" in d.payload:  # the thinker's fan-out
                result["hidden_ok"] = bool(torch.equal(d.payload["hidden"], hidden_of(features)))
            elif d.kind == "payload":  # the reply: audio and text
                expected = audio_of(hidden_of(features), tokens_of(features, TOKENS))
                result["audio_ok"] = bool(torch.equal(d.payload["audio"], expected))
                result["reply_tokens"] = d.payload["tokens"]
            elif d.kind == "stream_end":
                result["status"] = "done"
            else:
                result["status"] = f"{d.kind}: {d.error}"
    return result


async def encoder(n: int, thinker_address: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    policy = PreferenceOrderPolicy(PREFER) if PREFER else None
    async with Endpoint(
        "encoder",
        address=address("encoder"),
        peers={"thinker": thinker_address},
        policy=policy,
        backends=["local", "shm", *PREFER] if PREFER else None,
    ) as ep:
        await ep.wait_peer("thinker", 30)

        async def one(i: int) -> None:
            results.append(await request(ep, f"req-{i}", abort=i == 1))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
    return sorted(results, key=lambda r: int(r["request"].split("-")[1]))


def check(
    n: int,
    results: list[dict[str, Any]],
    thinker: dict[str, Any],
    talker: dict[str, Any],
    expect: dict[str, str] | None = None,
) -> list[str]:
    problems = []
    aborted = "req-1"
    for r in results:
        rid = r["request"]
        expected = tokens_of(features_of(rid), TOKENS)
        if rid == aborted:
            if r["status"] != "aborted" or r["text"] != expected[:1]:
                problems.append(f"{rid}: expected an abort after one token, got {r}")
            continue
        if r["status"] != "done":
            problems.append(f"{rid}: ended {r['status']}")
        if r["text"] != expected or r.get("reply_tokens") != expected:
            problems.append(f"{rid}: text {r['text']} / {r.get('reply_tokens')} != {expected}")
        if not r.get("hidden_ok"):
            problems.append(f"{rid}: the fanned-out hidden states are missing or wrong")
        if not r.get("audio_ok"):
            problems.append(f"{rid}: the audio reply is missing or wrong")
    served = sorted(f"req-{i}" for i in range(n) if i != 1)
    for report in (thinker, talker):
        stage = report.get("stage", "?")
        if report.get("exit") != 0 or report.get("errors"):
            problems.append(f"{stage}: exit {report.get('exit')}, errors {report.get('errors')}")
        if sorted(report.get("served", [])) != served:
            problems.append(f"{stage} served {sorted(report.get('served', []))}, expected {served}")
        # An abort becomes a delivery only where the request was seen (spec §7.6): the
        # talker sees it if the thinker's first token of it reached the talker before
        # the encoder's abort reached the thinker (across hosts it may not have).
        expect_aborts = [aborted] if stage != "talker" or aborted in report.get("seen", []) else []
        if report.get("aborted") != expect_aborts:
            problems.append(f"{stage} saw aborts {report.get('aborted')}, expected {expect_aborts}")
        if report.get("shm"):
            problems.append(f"{stage} still holds {report['shm']} shm export(s)")
    fanouts = thinker.get("fanouts", [])
    routes = [[peer, (expect or {}).get(peer, "shm")] for peer in ("talker", "encoder")]
    if len(fanouts) != n - 1 or any(f != routes for f in fanouts):
        problems.append(f"thinker fan-outs: {fanouts}")
    if thinker.get("counters", {}).get("aborts_forwarded") != 1:
        problems.append(f"the thinker did not forward the abort once: {thinker.get('counters')}")
    return problems


async def main_async(n: int) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    children: dict[str, tuple[subprocess.Popen[str], str]] = {}
    failed: list[SystemExit] = []

    async def launch(stage: str, at: str, *peers: str) -> None:
        try:
            children[stage] = await anyio.to_thread.run_sync(start, stage, at, *peers)
        except SystemExit as exc:  # it did not start: said once both launches are over
            failed.append(exc)

    talker_at = address("talker")
    try:
        if talker_at.endswith(":0"):  # its port is chosen when it binds: it starts first
            await launch("talker", talker_at)
            if not failed:
                await launch("thinker", address("thinker"), f"talker={children['talker'][1]}")
        else:  # known in advance: both start at once (the thinker dials until it is up)
            async with anyio.create_task_group() as tg:
                tg.start_soon(launch, "talker", talker_at)
                tg.start_soon(launch, "thinker", address("thinker"), f"talker={talker_at}")
        if failed:
            raise failed[0]
        results = await encoder(n, children["thinker"][1])
    finally:
        reports = {
            stage: await anyio.to_thread.run_sync(stop, children[stage][0])
            for stage in ("thinker", "talker")
            if stage in children
        }
    return results, reports["thinker"], reports["talker"]


def main() -> int:
    p = argparse.ArgumentParser(prog="run.py", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print the results as one JSON line")
    p.add_argument("--bind", action="append", default=[], help="STAGE=ADDRESS")
    p.add_argument("--launch", action="append", default=[], help="STAGE=COMMAND PREFIX")
    p.add_argument("--prefer", default=None, help="a backend every stage prefers")
    p.add_argument("--expect", action="append", default=[], help="PEER=BACKEND of the fan-out")
    args = p.parse_args()
    BIND.update(b.split("=", 1) for b in args.bind)
    LAUNCH.update((k, shlex.split(v)) for k, v in (x.split("=", 1) for x in args.launch))
    PREFER[:] = [args.prefer] if args.prefer else []
    expect = dict(e.split("=", 1) for e in args.expect)
    results, thinker, talker = anyio.run(main_async, args.requests)
    problems = check(args.requests, results, thinker, talker, expect)
    if args.json:
        print(
            json.dumps(
                {"results": results, "thinker": thinker, "talker": talker, "problems": problems}
            )
        )
    else:
        print(f"{'request':<8} {'status':<8} {'text tokens':<32} {'hidden':<7} audio")
        for r in results:
            print(
                f"{r['request']:<8} {r['status']:<8} {r['text']!s:<32} "
                f"{'ok' if r.get('hidden_ok') else '-':<7} {'ok' if r.get('audio_ok') else '-'}"
            )
        print(
            f"thinker: served {len(thinker['served'])}, aborted {thinker['aborted']}, "
            f"{len(thinker['fanouts'])} hidden-state fan-outs to talker+encoder "
            f"({thinker['fanouts'][0] if thinker['fanouts'] else '-'})"
        )
        print(
            f"talker:  served {len(talker['served'])}, aborted {talker['aborted']} (forwarded by the thinker)"
        )
        for problem in problems:
            print(f"FAILED: {problem}", file=sys.stderr)
        print("pipeline: OK" if not problems else "pipeline: FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
