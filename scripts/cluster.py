"""Make namespace "hosts" on this machine and keep them until Ctrl-C (needs root).

    sudo python scripts/cluster.py [--hosts a,b,c] [--rate 10gbit]

Prints, per host, its address, interface and the command prefix that runs a
process there (its own network stack and /dev/shm: host detection tells the hosts
apart with no OMNIWIRE_HOST_ID). For example, ``omniwire demo --remote`` across
two of them: run ``omniwire demo --remote --listen tcp://IP_B:5555`` with host b's
prefix and ``omniwire demo --remote --connect tcp://IP_B:5555`` with host a's
(see ``omniwire demo --help``). Everything is removed on exit.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

from omniwire.testing.cluster import Cluster, ClusterUnavailableError


def main() -> int:
    p = argparse.ArgumentParser(prog="cluster.py", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="a,b,c", help="comma-separated host names (1-4 chars)")
    p.add_argument("--rate", default="10gbit", help="tbf egress cap per host")
    args = p.parse_args()
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


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())
