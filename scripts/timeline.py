"""Where the time of one cross-host object goes: omniwire between two namespace
hosts, beside the bare pieces between the same hosts (needs root).

    sudo python scripts/timeline.py [--backend mooncake] [--size 1M] [--count 40] [--lend]
        [--hops] [--no-verify] [--reuse] [--gap S]

Sends ``--count`` objects one after another (each awaited until its receipt
completes: its ACK, or its landing) from host a
to host b with ``tests/cluster_peer.py`` and prints the medians of: the ``send()``
call (pack and announce), send → the receiver's application has it, send → ACK
back at the sender; beside a raw pyzmq one-way message between the same hosts
(half a round trip) and the bare engine's transfer (``omniwire.rawbench``). The
stamps are ``time.monotonic()``: one clock for every namespace of a kernel.

``--hops`` runs both peers with ``OMNIWIRE_HOPS`` (:mod:`omniwire.hops`) and prints,
per hop of an object, the median time from the sender's object path to it (each
object's marks are those between its first mark and the next object's).
``--no-verify``: the receiver does not compare the bytes (the comparison of object
*i* runs while object *i+1* arrives, on the same 2 cores). ``--reuse``: one send
buffer, refilled for each object (a lent buffer is then registered once, as in
``omniwire bench``); without it each object is a fresh tensor. ``--gap S``: S
seconds between sends, so that a landed object's ACK and the receiver's work on
it are done before the next one starts (as between ``omniwire bench``'s sends,
which its bare-engine transfers separate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

from omniwire.testing.cluster import Cluster, Host

PEER = Path(__file__).resolve().parents[1] / "tests" / "cluster_peer.py"
ZMQ_PING = """
import sys, time, zmq
ctx = zmq.Context(); role, addr, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = ctx.socket(zmq.PAIR)
if role == "echo":
    s.bind(addr); print("READY", flush=True)
    for _ in range(n + 5): s.send(s.recv())
else:
    s.connect(addr); times = []
    for i in range(n + 5):
        t = time.perf_counter(); s.send(b"x" * 256); s.recv(); times.append(time.perf_counter() - t)
    times = sorted(times[5:]); print(times[len(times) // 2] / 2)
"""


def env_of(h: Host) -> list[str]:
    return ["env", f"UCX_NET_DEVICES={h.ifname}", "UCX_TLS=tcp", f"GLOO_SOCKET_IFNAME={h.ifname}"]


def main() -> int:
    p = argparse.ArgumentParser(prog="timeline.py", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="mooncake", choices=["mooncake", "nixl", "nccl"])
    p.add_argument("--size", default="1M")
    p.add_argument("--count", type=int, default=40)
    p.add_argument("--lend", action="store_true")
    p.add_argument("--hops", action="store_true", help="the median time to each hop")
    p.add_argument("--no-verify", dest="verify", action="store_false")
    p.add_argument("--reuse", action="store_true", help="one send buffer (lent: registered once)")
    p.add_argument("--gap", type=float, default=0.0,
                   help="seconds between sends (e.g. 0.005: each object alone, its ACK and "
                        "the receiver's work done before the next send)")  # fmt: skip
    args = p.parse_args()
    size = int(args.size[:-1]) << {"K": 10, "M": 20}[args.size[-1]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    hops_dir = tempfile.mkdtemp(prefix="omniwire-hops-") if args.hops else ""
    peer_env = {**env, "OMNIWIRE_HOPS": hops_dir} if hops_dir else env
    with Cluster(["a", "b"], rate="40gbit") as cluster:
        a, b = cluster["a"], cluster["b"]
        # the control plane alone: a raw pyzmq message, a -> b
        echo = b.popen([*env_of(b), sys.executable, "-c", ZMQ_PING, "echo", f"tcp://{b.ip}:5999",
                        "200"], stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        assert echo.stdout is not None
        echo.stdout.readline()
        ping = a.run([*env_of(a), sys.executable, "-c", ZMQ_PING, "ping", f"tcp://{b.ip}:5999",
                      "200"], capture_output=True, text=True, env=env)  # fmt: skip
        echo.wait(30)
        echo.stdout.close()
        zmq_oneway = float(ping.stdout.strip())
        # the bare engine between the same hosts (its far end on b)
        raw_env = {**env, "OMNIWIRE_BENCH_HOSTS": f"{a.ip},{b.ip}",
                   "OMNIWIRE_BENCH_PEER_LAUNCH": " ".join(b.command(env_of(b)))}  # fmt: skip
        raw = a.run([*env_of(a), sys.executable, "-m", "omniwire.rawbench", "run", args.backend,
                     "--sizes", str(size), "--iters", "20"],
                    capture_output=True, text=True, env=raw_env, timeout=300)  # fmt: skip
        raw_s = size / json.loads(raw.stdout.strip().splitlines()[-1])[str(size)] / 1e9
        # omniwire
        common = ["--backends", f"local,shm,{args.backend}"]
        common += [] if args.backend == "mooncake" else ["--route", args.backend]
        recv = b.popen([*env_of(b), sys.executable, str(PEER), "recv", "--name", "r",
                        "--address", f"tcp://{b.ip}:0", *common,
                        *([] if args.verify else ["--no-verify"])],
                       stdout=subprocess.PIPE, text=True, env=peer_env)  # fmt: skip
        assert recv.stdout is not None
        address = json.loads(recv.stdout.readline())["ready"]
        recv.stdout.readline()
        got: list[str] = []  # read while it runs: a full pipe would stop the receiver
        reader = threading.Thread(target=lambda: got.extend(recv.stdout or ()), daemon=True)
        reader.start()
        sent = a.run([*env_of(a), sys.executable, str(PEER), "send", "--name", "s", "--address",
                      f"tcp://{a.ip}:0", "--peer", f"r={address}", "--size", str(size),
                      "--count", str(args.count), "--settle", "1", *common,
                      *(["--lend"] if args.lend else []), *(["--reuse"] if args.reuse else []),
                      "--gap", str(args.gap)],
                     capture_output=True, text=True, env=peer_env, timeout=600)  # fmt: skip
        recv.terminate()
        recv.wait(30)
        reader.join(30)
    lines = [json.loads(x) for x in sent.stdout.splitlines() if x.startswith("{")]
    rlines = [json.loads(x) for x in got if x.startswith("{")]
    skip = 3  # connecting, first touches

    def med(values: list[float]) -> float:
        return statistics.median(values[skip:]) * 1e3

    call = med([m["after"] for m in lines if "sent" in m])
    delivered = med([m["after"] for m in rlines if "after" in m])
    acked = med([m["took"] for m in lines if "took" in m])
    mode = "lent" if args.lend else "copy"
    print(f"{args.backend} {mode} {args.size} between namespace hosts, medians (ms):")
    print(f"  send() call (pack, announce)           {call:7.3f}")
    print(f"  send -> receiver's application has it {delivered:7.3f}")
    print(f"  send -> ACK back at the sender         {acked:7.3f}")
    print(f"  bare engine transfer                   {raw_s * 1e3:7.3f}")
    print(f"  raw pyzmq one-way (half a round trip)  {zmq_oneway * 1e3:7.3f}")
    print(f"  fixed cost (ACK time - engine)         {acked - raw_s * 1e3:7.3f}  "
          f"= {raw_s * 1e3 / acked:.2f}x raw")  # fmt: skip
    if hops_dir:
        print_hops(hops_dir, skip)
    return 0


def print_hops(directory: str, skip: int) -> None:
    """The median time from each object's first mark (the sender's object path) to
    each hop, in order; a hop marked several times per object is numbered."""
    marks: list[tuple[float, str, str]] = []
    sender = set()
    for path in Path(directory).glob("hops-*.json"):
        data = json.loads(path.read_text())
        side = str(data["pid"])
        for name, t in data["marks"]:
            marks.append((t, name, side))
            if name == "send: object path":
                sender.add(side)
    marks.sort()
    starts = [t for t, name, _ in marks if name == "send: object path"]
    per_hop: dict[str, list[float]] = defaultdict(list)
    at = 0
    for i, t0 in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else float("inf")
        seen: dict[str, int] = defaultdict(int)
        while at < len(marks) and marks[at][0] < end:
            t, name, side = marks[at]
            at += 1
            if t < t0:
                continue
            label = f"{'a' if side in sender else 'b'}  {name}"
            seen[label] += 1
            if seen[label] > 1:
                label = f"{label} #{seen[label]}"
            if i >= skip:
                per_hop[label].append((t - t0) * 1e3)
    print("hops (a: sender, b: receiver), median ms after the sender's object path:")
    for label, values in sorted(per_hop.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"  {statistics.median(values):7.3f}  {label}  ({len(values)} objects)")


if __name__ == "__main__":
    sys.exit(main())
