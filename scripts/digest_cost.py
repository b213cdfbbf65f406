"""The cost of ``Endpoint(digest=True)``: one-way send → ACK of 64 MiB objects over
mooncake between two namespace hosts, with and without the digest (needs root).

    sudo python scripts/digest_cost.py [--size 67108864] [--count 8]

Prints the median one-way time of each and the hash alone (``digest_of``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from omniwire.digest import digest_of
from omniwire.testing.cluster import Cluster

PEER = Path(__file__).resolve().parents[1] / "tests" / "cluster_peer.py"


def one(cluster: Cluster, size: int, count: int, digest: bool) -> float:
    a, b = cluster["a"], cluster["b"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--backends", "local,shm,mooncake", *(["--digest"] if digest else [])]
    recv = b.popen([sys.executable, str(PEER), "recv", "--name", "r", "--address",
                    f"tcp://{b.ip}:0", *common], stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert recv.stdout is not None
    address = json.loads(recv.stdout.readline())["ready"]
    recv.stdout.readline()  # READY
    done = a.run([sys.executable, str(PEER), "send", "--name", "s", "--address",
                  f"tcp://{a.ip}:0", "--peer", f"r={address}", "--size", str(size),
                  "--count", str(count), "--settle", "1", *common],
                 capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    recv.terminate()
    recv.communicate(timeout=30)
    took = [json.loads(line)["took"] for line in done.stdout.splitlines()
            if line.startswith("{") and '"took"' in line]  # fmt: skip
    return statistics.median(took[1:])  # the first one connects and faults pages in


def main() -> int:
    p = argparse.ArgumentParser(prog="digest_cost.py", description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=64 << 20)
    p.add_argument("--count", type=int, default=8)
    args = p.parse_args()
    t = torch.arange(args.size // 8, dtype=torch.int64)
    started = time.perf_counter()
    digest_of([t])
    hashed = time.perf_counter() - started
    with Cluster(["a", "b"], rate="40gbit") as cluster:
        rows = []
        for digest in (False, True, False, True):
            rows.append((digest, one(cluster, args.size, args.count, digest)))
    off = statistics.median(s for d, s in rows if not d)
    on = statistics.median(s for d, s in rows if d)
    mib = args.size / 2**20
    print(f"{mib:.0f} MiB one-way over mooncake between namespace hosts (median of medians):")
    print(f"  digest off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms: +{(on - off) * 1e3:.1f} ms "
          f"({on / off - 1:+.0%}); the hash alone {hashed * 1e3:.1f} ms per side")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
