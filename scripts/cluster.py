"""Make namespace "hosts" on this machine and keep them until Ctrl-C (needs root).

    sudo python scripts/cluster.py [--hosts a,b,c] [--rate 10gbit]
    sudo python scripts/cluster.py --demo [--backend mooncake|nixl|nccl]

Prints, per host, its address, interface and the command prefix that runs a
process there (its own network stack and /dev/shm: host detection tells the hosts
apart with no OMNIWIRE_HOST_ID). ``--demo`` runs ``omniwire demo --remote`` with
``src`` on host a and ``far`` on host b (``--hosts`` and ``--far-launch``), then
removes the cluster. Everything is removed on exit.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

from omniwire.testing.cluster import Cluster, ClusterUnavailableError, Host


def main() -> int:
    p = argparse.ArgumentParser(prog="cluster.py", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="a,b,c", help="comma-separated host names (1-4 chars)")
    p.add_argument("--rate", default="10gbit", help="tbf egress cap per host")
    p.add_argument("--demo", action="store_true", help="run omniwire demo --remote across a, b")
    p.add_argument("--backend", default=None, help="with --demo: the cross-host engine")
    args = p.parse_args()
    if args.demo:
        return demo(args.rate, args.backend)
    try:
        cluster = Cluster(args.hosts.split(","), rate=args.rate)
    except ClusterUnavailableError as exc:
        print(f"cluster.py: {exc}", file=sys.stderr)
        return 1
    with cluster:
        for host in cluster.hosts.values():
            env = f"env UCX_NET_DEVICES={host.ifname} GLOO_SOCKET_IFNAME={host.ifname}"
            print(f"host {host.name}: {host.ip} dev {host.ifname} (rate {args.rate})")
            print(f"  run there: {shlex.join(host.command([]))} {env} <command>")
            print(f"  partition: ip -n {host.netns} link set {host.ifname} down  (heal: up)")
        print("Ctrl-C removes every namespace, link and mount.", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


def engine_env(host: Host) -> list[str]:
    """UCX and gloo on the host's veth; UCX over TCP (its shared-memory transports
    would reach across namespaces of one kernel, as no two real hosts can)."""
    return ["env", f"UCX_NET_DEVICES={host.ifname}", "UCX_TLS=tcp",
            f"GLOO_SOCKET_IFNAME={host.ifname}"]  # fmt: skip


def demo(rate: str, backend: str | None) -> int:
    """``omniwire demo --remote`` with src on host a and far on host b."""
    try:
        cluster = Cluster(["a", "b"], rate=rate)
    except ClusterUnavailableError as exc:
        print(f"cluster.py: {exc}", file=sys.stderr)
        return 1
    with cluster:
        a, b = cluster["a"], cluster["b"]
        far = shlex.join(b.command(engine_env(b)))
        argv = [*engine_env(a), sys.executable, "-m", "omniwire.cli", "demo", "--remote",
                "--hosts", f"{a.ip},{b.ip}", "--far-launch", far]  # fmt: skip
        if backend:
            argv += ["--backend", backend]
        env = {k: v for k, v in os.environ.items() if k != "OMNIWIRE_HOST_ID"}
        print(f"src on {a}, far on {b}", flush=True)
        code: int = a.run(argv, timeout=300, env=env).returncode
        return code


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())
