"""The ``omniwire`` console script: ``demo``, ``backends``, ``bench``, ``peer``."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main"]


def _backends(args: argparse.Namespace) -> int:
    from .registry import backend_status, backends

    rows = []
    for name in sorted(backends()):
        entry = backend_status(name)
        if entry.status == "available" and entry.cls is not None:
            detail = entry.cls.capabilities.describe()
        else:
            detail = entry.error
            hint = entry.availability.hint if entry.availability else ""
            if not hint and entry.cls is not None:
                hint = entry.cls.install_hint
            if hint:
                detail += f" — {hint}"
        rows.append((name, entry.source, entry.status or "?", detail))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'backend':<{width[0]}}  {'source':<{width[1]}}  {'status':<{width[2]}}  details")
    for name, source, status, detail in rows:
        print(f"{name:<{width[0]}}  {source:<{width[1]}}  {status:<{width[2]}}  {detail}")
    print(
        f"{'inline':<{width[0]}}  {'built-in':<{width[1]}}  {'available':<{width[2]}}  "
        "stream chunks of ≤ 16 KiB of CPU tensor data, carried in the control message"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    argv = ["--explain"] if args.explain else []
    if args.remote:
        argv.append("--remote")
    if args.backend:
        argv += ["--backend", args.backend]
    if args.verbose:
        argv.append("--verbose")
    if args.hosts:
        argv += ["--hosts", args.hosts, "--far-launch", args.far_launch]
    return demo.main(argv)


def main(argv: list[str] | None = None) -> int:
    from . import WIRE_VERSION, __version__

    wire_version = ".".join(map(str, WIRE_VERSION))
    parser = argparse.ArgumentParser(
        prog="omniwire",
        description="Move tensor-bearing payloads between the stages of an inference pipeline.",
    )
    parser.add_argument(
        "-V", "--version", action="version", version=f"omniwire {__version__} (wire {wire_version})"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log routing decisions (and show the engines' own log lines)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run a small pipeline and show which backend carried what")
    p.add_argument("--explain", action="store_true", help="show every candidate and why it lost")
    p.add_argument(
        "--remote", action="store_true", help="run the far stage as another host over tcp://"
    )
    p.add_argument(
        "--backend", choices=["mooncake", "nixl", "nccl"], help="cross-host engine (with --remote)"
    )
    p.add_argument(
        "--hosts",
        metavar="THIS_IP,FAR_IP",
        help="with --remote: the far stage on another host (started with --far-launch), "
        "told apart by host detection (scripts/cluster.py --demo tries it in namespaces)",
    )
    p.add_argument(
        "--far-launch", default="", metavar="PREFIX", help="the command that runs far elsewhere"
    )
    p.set_defaults(func=_demo)
    p = sub.add_parser("backends", help="list every registered backend, available or why not")
    p.set_defaults(func=_backends)
    sub.add_parser(
        "bench",
        help="small-message scenarios and per-backend throughput and latency, each beside "
        "its baseline (omniwire bench -h)",
    )
    sub.add_parser(
        "peer",
        help="run a reference endpoint (echo or sink) for foreign implementations (omniwire peer -h)",
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("bench", "peer"):  # each has its own parser
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        if argv[0] == "bench":
            from . import bench

            return bench.main(argv[1:])
        from . import peer

        peer.main(argv[1:], prog="omniwire peer")  # exits with the peer's status
        return 0
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
