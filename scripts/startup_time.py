"""How long a pipeline takes to come up: N processes started at once, each an
Endpoint that names its downstream peer (encoder -> thinker -> talker, and the
talker names the encoder, which it streams back to). Prints, per process, when its
imports were done, when start() returned and when each wait_peer returned, in
seconds after the launch; and the figure that counts: from the last start()
returning to the last wait_peer returning (what omniwire adds once every process is
up).

    python scripts/startup_time.py [--runs 5] [--stages 3] [--tcp] [--stagger 15]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(
    name: str, address: str, peers: dict[str, str], waits: list[str], t0: float, delay: float
) -> None:
    import anyio

    from omniwire import Endpoint

    imported = time.time() - t0

    async def main() -> None:
        await anyio.sleep(delay)  # a stage whose own start-up takes longer
        ep = Endpoint(name, address=address, peers=peers)
        await ep.start()
        started = time.time() - t0
        ready: dict[str, float] = {}
        for peer in waits:
            await ep.wait_peer(peer, 60)
            ready[peer] = time.time() - t0
        print(json.dumps({"name": name, "imported": imported, "started": started, "ready": ready}))
        sys.stdout.flush()
        await anyio.sleep(1.0)  # let the others finish their handshakes with us
        await ep.aclose()

    anyio.run(main)


def run_once(stages: int, tcp: bool, base_port: int, stagger: float) -> dict[str, object]:
    names = ["encoder", "thinker", "talker", "vocoder", "sink"][:stages]
    if tcp:
        addrs = {n: f"tcp://127.0.0.1:{base_port + i}" for i, n in enumerate(names)}
    else:
        d = tempfile.mkdtemp(prefix="ow-start-")
        addrs = {n: f"ipc://{d}/{n}" for n in names}
    t0 = time.time()
    procs = []
    for i, n in enumerate(names):
        down = names[(i + 1) % len(names)]  # the last names the first: replies go back
        up = names[i - 1]
        spec = {
            "name": n,
            "address": addrs[n],
            "peers": {down: addrs[down]},
            "waits": [down, up],
            "delay": stagger * i,  # the downstream stages come up later
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--child", json.dumps(spec), "--t0", repr(t0)],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        rows.append(json.loads(out.strip().splitlines()[-1]))
    last_start = max(r["started"] for r in rows)
    last_ready = max(max(r["ready"].values()) for r in rows)
    return {"rows": rows, "last_start": last_start, "last_ready": last_ready,
            "after_start": last_ready - last_start}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--t0", type=float)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--tcp", action="store_true")
    ap.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        help="stage i starts its endpoint i*STAGGER s after its imports",
    )
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        child(spec["name"], spec["address"], spec["peers"], spec["waits"], args.t0, spec["delay"])
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    figures = []
    for run in range(args.runs):
        r = run_once(args.stages, args.tcp, 23000 + 10 * run, args.stagger)
        figures.append(r["after_start"])
        per = ", ".join(
            f"{row['name']} imported {row['imported']:.2f} started {row['started']:.2f} "
            f"ready {max(row['ready'].values()):.2f}"
            for row in r["rows"]  # type: ignore[attr-defined]
        )
        print(f"run {run}: last start() {r['last_start']:.2f} s, last wait_peer "
              f"{r['last_ready']:.2f} s, after the last start {r['after_start']:.2f} s  [{per}]")  # fmt: skip
    figures.sort()
    print(f"after the last start(): min {figures[0]:.2f} s, median "
          f"{figures[len(figures) // 2]:.2f} s, max {figures[-1]:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
