"""``omniwire bench``'s command line and the order a run goes in."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import secrets
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from .. import rawbench
from . import _born as _born_mod
from . import _forward as _forward_mod
from . import _scenarios, _table
from . import _slow as _slow_mod
from ._model import Results, Scenario
from ._procs import Burner, Child, ipc_base, omniwire_peer
from ._rawzmq import RawZmq, new_base
from ._units import MiB, parse_size

__all__ = ["SCENARIOS", "Options", "main", "run"]

#: in the order they run; ``idle`` first, before anything is sent
SCENARIOS = ("idle", "echo", "stream", "mix", "shm", "born", "forward", "slow", "table")
SMALL = ("idle", "echo", "stream", "mix")


@dataclass
class Options:
    scenarios: Sequence[str] = SCENARIOS
    counts: _scenarios.Counts = field(default_factory=_scenarios.Counts)
    backends: Sequence[str] = ("shm",)
    sizes: Sequence[int] = tuple(_table.DEFAULT_SIZES)
    iters: int = 200
    raw_engines: bool = True
    obstructed: Sequence[int] = tuple(_table.OBSTRUCTED_SIZES)
    busy: bool = False
    quick: bool = False
    #: mooncake's and nixl's ``landing_size`` (None: their default)
    landing_size: int | None = None


class _Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.bar: Any = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", file=sys.stderr, leave=False)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(label)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _steps(opts: Options) -> int:
    c = opts.counts
    per = {
        "idle": 1,
        "echo": c.rounds + 1,
        "stream": c.rounds + 1,
        "mix": c.mix_rounds + 1,
        "shm": c.shm_rounds + 1,
        "born": c.shm_rounds + 1,
        "forward": c.shm_rounds + 1,
        "slow": 2,
        "table": _table.steps(
            opts.backends,
            opts.sizes,
            opts.raw_engines,
            opts.obstructed if "shm" in opts.backends else (),
        ),
    }
    return sum(per[s] for s in opts.scenarios)


def _host() -> dict[str, Any]:
    import torch
    import zmq

    from .. import __version__

    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "omniwire": __version__,
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "loadavg_at_start": list(os.getloadavg()),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


@contextlib.asynccontextmanager
async def _raw_zmq() -> AsyncIterator[RawZmq]:
    """The raw zmq.asyncio peer: here over ipc, or on the other host over TCP (the
    peers' placement, ``--namespaces``)."""
    place = rawbench.placement()
    remote = place.launch or place.there != place.here
    raw = RawZmq(f"tcp://{place.here}" if remote else new_base())
    try:
        argv = [sys.executable, "-m", "omniwire.bench._rawzmq"]
        argv += [f"tcp://{place.there}", raw.back_address] if remote else [raw.base]
        child = await anyio.to_thread.run_sync(
            Child, [*place.launch, *argv], "raw zmq.asyncio peer"
        )
    except BaseException:
        raw.close()
        raise
    try:
        raw.connect(child.pid, child.info.split())
        yield raw
    finally:
        raw.close()
        await anyio.to_thread.run_sync(child.stop)


@contextlib.asynccontextmanager
async def _endpoint(
    peers: dict[str, list[str]], **kwargs: Any
) -> AsyncIterator[tuple[Any, dict[str, Child]]]:
    """Endpoint A and one ``omniwire.peer --mode bench`` per entry of ``peers``
    (name → extra peer arguments), handshakes done."""
    from ..endpoint import Endpoint

    tag = secrets.token_hex(3)
    base = ipc_base(tag)
    me = f"bench-{tag}"
    children: dict[str, Child] = {}
    try:
        for i, (name, args) in enumerate(peers.items()):
            args = [a.replace("{me}", me) for a in args]
            children[name] = await anyio.to_thread.run_sync(
                omniwire_peer, name, f"{base}-b{i}", args
            )
        async with Endpoint(
            me,
            address=f"{base}-a",
            peers={name: c.info for name, c in children.items()},
            ack_timeout=60,
            **kwargs,
        ) as ep:
            for name in children:
                await ep.wait_peer(name, 60)
            yield ep, children
    finally:
        for c in children.values():
            await anyio.to_thread.run_sync(c.stop)


async def run(opts: Options, results: Results) -> Results:
    """Measure what ``opts`` selects into ``results``; whatever fails is recorded in
    ``results.errors`` and the run goes on."""
    started = time.perf_counter()
    progress = _Progress(_steps(opts))
    counts = opts.counts
    burner: Burner | None = None
    burner_cpu = 0.0
    if opts.busy:
        results.busy["requested"] = True
        burner = await anyio.to_thread.run_sync(Burner)
        burner_cpu = burner.cpu_seconds()

    async def attempt(name: str, fn: Callable[[], Awaitable[Scenario]]) -> None:
        try:
            results.scenarios[name] = await fn()
        except Exception as exc:
            results.fail(f"scenario {name}", exc)

    try:
        need_raw = any(s in opts.scenarios for s in (*SMALL, "table"))
        async with contextlib.AsyncExitStack() as stack:
            raw: RawZmq | None = None
            if need_raw:
                try:
                    raw = await stack.enter_async_context(_raw_zmq())
                except Exception as exc:
                    results.fail("raw zmq.asyncio baseline process", exc)
            small = [s for s in SMALL if s in opts.scenarios]
            if small and raw is not None:
                try:
                    async with _endpoint({"bench-b": []}) as (ep, children):
                        pair = _scenarios.Pair(
                            ep, "bench-b", children["bench-b"].pid, raw, progress.step
                        )
                        for name in small:
                            fn: Callable[[_scenarios.Pair, _scenarios.Counts], Awaitable[Scenario]]
                            fn = getattr(_scenarios, name)
                            await attempt(name, functools.partial(fn, pair, counts))
                except Exception as exc:
                    results.fail("scenarios " + ",".join(small), exc)
            elif small:
                results.notes.append("scenarios " + ",".join(small) + " need the raw zmq baseline")
            if "shm" in opts.scenarios:
                await attempt("shm", lambda: _shm(counts, progress.step))
            if "born" in opts.scenarios:
                await attempt("born", lambda: _born(counts, progress.step))
            if "forward" in opts.scenarios:
                await attempt("forward", lambda: _forward(counts, progress.step))
            if "slow" in opts.scenarios:
                await attempt("slow", lambda: _slow(counts, progress.step))
            if "table" in opts.scenarios:
                try:
                    await _table.run_table(
                        opts.backends,
                        opts.sizes,
                        opts.iters,
                        opts.raw_engines,
                        opts.obstructed,
                        raw,
                        results,
                        progress.step,
                        landing_size=opts.landing_size,
                    )
                except Exception as exc:
                    results.fail("table", exc)
    finally:
        progress.close()
        results.wall_s = time.perf_counter() - started
        if burner is not None:
            results.busy["ran"] = burner.running()
            results.busy["cpu_share"] = (burner.cpu_seconds() - burner_cpu) / results.wall_s
            await anyio.to_thread.run_sync(burner.stop)
    return results


@contextlib.asynccontextmanager
async def _shm_pair(size: int) -> AsyncIterator[Any]:
    """Endpoint A with two shm-only bench peers, a copy-mode and a zero-copy one,
    and an arena that holds two objects of ``size``. A pins its sends to shm; the
    peers route theirs by default, so that an answer (the born scenario's sum, a
    tensor-less payload) rides inline as any application's would, instead of as an
    shm object of its own (a pack, an import and an ACK on the path being timed)."""
    options = {"shm": {"arena_size": 2 * size + 8 * MiB}}
    shm = ["--backends", "shm"]
    shm += ["--backend-options", json.dumps(options)]
    peers = {"bench-copy": shm, "bench-zero-copy": [*shm, "--zero-copy"]}
    async with _endpoint(
        peers,
        backends=["shm"],
        routes={name: "shm" for name in peers},
        backend_options=options,
        max_inflight_bytes=options["shm"]["arena_size"] // 2,
    ) as (ep, _):
        yield ep


async def _shm(counts: _scenarios.Counts, step: Callable[[str], None]) -> Scenario:
    size = 64 * MiB
    async with _shm_pair(size) as ep:
        return await _scenarios.shm_large(
            (ep, "bench-copy"), (ep, "bench-zero-copy"), counts, step, size
        )


async def _born(counts: _scenarios.Counts, step: Callable[[str], None]) -> Scenario:
    size = 64 * MiB
    async with _shm_pair(size) as ep:
        return await _born_mod.born_large(
            ep, "bench-copy", "bench-zero-copy", counts.shm_rounds, counts.shm_reps, step, size
        )


async def _forward(counts: _scenarios.Counts, step: Callable[[str], None]) -> Scenario:
    """A, a summing zero-copy peer C, and a forwarding zero-copy peer B in front of it."""
    from ..endpoint import Endpoint

    size = 64 * MiB
    options = json.dumps({"shm": {"arena_size": 2 * size + 8 * MiB}})
    tag = secrets.token_hex(3)
    base = ipc_base(tag)
    me = f"bench-{tag}"
    summer, forwarder = "bench-sum", "bench-forward"
    shm = ["--backends", "shm", "--backend-options", options, "--zero-copy"]
    children: list[Child] = []
    try:
        c = await anyio.to_thread.run_sync(
            omniwire_peer, summer, f"{base}-c", [*shm, "--routes", f'{{"{me}": "shm"}}']
        )
        children.append(c)
        routes = json.dumps({summer: "shm"})
        b_args = [*shm, "--routes", routes, "--mode", "forward", "--forward-to", summer]
        b_args += ["--peer", f"{summer}={c.info}"]
        b = await anyio.to_thread.run_sync(omniwire_peer, forwarder, f"{base}-b", b_args)
        children.append(b)
        async with Endpoint(
            me,
            address=f"{base}-a",
            peers={summer: c.info, forwarder: b.info},
            backends=["shm"],
            routes={summer: "shm", forwarder: "shm"},
            backend_options=json.loads(options),
            ack_timeout=60,
        ) as ep:
            for name in (summer, forwarder):
                await ep.wait_peer(name, 60)
            return await _forward_mod.forward_chain(
                ep, forwarder, summer, counts.shm_rounds, counts.shm_reps, step, size
            )
    finally:
        for child in children:
            await anyio.to_thread.run_sync(child.stop)


async def _slow(counts: _scenarios.Counts, step: Callable[[str], None]) -> Scenario:
    async def start_peer() -> tuple[Any, int, Callable[[], Awaitable[None]]]:
        stack = contextlib.AsyncExitStack()
        sink = ["--mode", "sink", "--delay", "0.01"]  # (the last --mode wins)
        ep, children = await stack.enter_async_context(_endpoint({"bench-slow": sink}))
        return ep, children["bench-slow"].pid, stack.aclose

    return await _slow_mod.slow_consumer(start_peer, counts.slow_s, step)


def _parser() -> argparse.ArgumentParser:
    from . import __doc__ as doc

    p = argparse.ArgumentParser(
        prog="omniwire bench",
        description=(doc or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, any of {','.join(SCENARIOS)} (default: all)",
    )
    p.add_argument("--quick", action="store_true", help="smaller counts, four table sizes")
    p.add_argument(
        "--busy", action="store_true", help="run a CPU burner (one busy loop) throughout"
    )
    d, q = _scenarios.Counts(), _scenarios.Counts.quick()
    g = p.add_argument_group("scenario counts (a warm-up round of each comes on top)")
    g.add_argument(
        "--rounds",
        type=int,
        help=f"interleaved rounds of echo and stream (default {d.rounds}, quick {q.rounds})",
    )
    g.add_argument(
        "--round-trips",
        type=int,
        help=f"echo round trips per round (default {d.echo_iters}, quick {q.echo_iters})",
    )
    g.add_argument(
        "--chunks",
        type=int,
        help=f"stream chunks per round (default {d.stream_n:,}, quick {q.stream_n:,})",
    )
    g.add_argument(
        "--mix",
        metavar="STREAMSxCHUNKS",
        help=f"the mix's shape (default {d.mix_streams}x{d.mix_chunks})",
    )
    g.add_argument(
        "--mix-yield",
        action="store_true",
        help="each mix producer, omniwire's and the baseline's, yields to the event loop "
        "after every chunk (anyio.lowlevel.checkpoint())",
    )
    g.add_argument(
        "--mix-rounds",
        type=int,
        help=f"interleaved rounds of the mix (default {d.mix_rounds}, quick {q.mix_rounds})",
    )
    g.add_argument(
        "--shm-rounds",
        type=int,
        help=f"interleaved rounds of 64 MiB over shm, {d.shm_reps} transfers each per "
        f"receiver and memcpy (default {d.shm_rounds}, quick {q.shm_rounds})",
    )
    g.add_argument(
        "--idle-seconds",
        type=float,
        help=f"how long the idle endpoint is watched (default {d.idle_s:g}, quick {q.idle_s:g})",
    )
    g = p.add_argument_group("the per-backend table (scenario 'table')")
    g.add_argument(
        "--backends",
        default=None,
        help="comma-separated (default: shm and every available cross-host engine)",
    )
    g.add_argument(
        "--sizes", default=None, help="comma-separated, e.g. 1K,1M,64M (default 1K..256M)"
    )
    g.add_argument("--iters", type=int, default=200, help="round trips for small sizes")
    g.add_argument("--no-raw", action="store_true", help="skip the raw engine baselines")
    g.add_argument(
        "--no-obstructed",
        action="store_true",
        help="skip the shm case of a large object behind a held 1 KiB one",
    )
    g.add_argument(
        "--landing-size",
        default=None,
        help="mooncake's and nixl's landing per peer, e.g. 0 (every object read by the "
        "receiver) or 64M (default: the backends' own, 16M)",
    )
    p.add_argument(
        "--namespaces",
        action="store_true",
        help="(root) the table's cross-host engines between two namespace hosts "
        "(omniwire.testing.cluster): this process on one, the peers and the bare "
        "engines' other ends on the other; --rate caps the link",
    )
    p.add_argument("--rate", default="40gbit", help="with --namespaces: tbf cap per host")
    p.add_argument("--json", metavar="FILE", help="write every figure and ratio as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a chart (needs matplotlib)")
    return p


def _options(args: argparse.Namespace, p: argparse.ArgumentParser) -> Options:
    from ..registry import backend_status

    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        p.error(f"unknown scenario(s) {unknown}; choose from {','.join(SCENARIOS)}")
    counts = _scenarios.Counts.quick() if args.quick else _scenarios.Counts()
    changes: dict[str, Any] = {}
    if args.rounds is not None:
        changes["rounds"] = args.rounds
    if args.round_trips is not None:
        changes["echo_iters"] = args.round_trips
    if args.chunks is not None:
        changes["stream_n"] = args.chunks
    if args.mix:
        try:
            streams, chunks = (int(x) for x in args.mix.lower().split("x"))
        except ValueError:
            p.error(f"--mix wants STREAMSxCHUNKS (e.g. 20x200), not {args.mix!r}")
        changes["mix_streams"], changes["mix_chunks"] = streams, chunks
    for flag, key in (("mix_rounds", "mix_rounds"), ("shm_rounds", "shm_rounds")):
        if getattr(args, flag) is not None:
            changes[key] = getattr(args, flag)
    if args.mix_yield:
        changes["mix_yield"] = True
    if args.idle_seconds is not None:
        changes["idle_s"] = args.idle_seconds
    counts = replace(counts, **changes)
    if min(counts.rounds, counts.mix_rounds, counts.shm_rounds) < 1 or counts.stream_n < 1:
        p.error("rounds and messages must be at least 1")
    if counts.echo_iters < 1 or counts.mix_streams < 1 or counts.mix_chunks < 1:
        p.error("counts must be at least 1")
    opts = Options(scenarios=[s for s in SCENARIOS if s in scenarios], counts=counts)
    opts.busy, opts.quick, opts.iters = args.busy, args.quick, 50 if args.quick else args.iters
    opts.raw_engines = not args.no_raw
    opts.obstructed = () if args.no_obstructed else tuple(_table.OBSTRUCTED_SIZES)
    if args.landing_size is not None:
        try:
            opts.landing_size = parse_size(args.landing_size)
        except ValueError as exc:
            p.error(str(exc))
    if args.sizes:
        try:
            opts.sizes = [parse_size(s) for s in args.sizes.split(",")]
        except ValueError as exc:
            p.error(str(exc))
    else:
        opts.sizes = _table.QUICK_SIZES if args.quick else _table.DEFAULT_SIZES
    if "table" in opts.scenarios:
        if args.backends:
            opts.backends = args.backends.split(",")
            for b in opts.backends:
                status = backend_status(b)
                if status.status != "available":
                    p.error(f"backend {b!r} is {status.status}: {status.error}")
        else:
            opts.backends = ["shm"] + [
                b for b in _table.CROSS_HOST if backend_status(b).status == "available"
            ]
    return opts


def _clean(value: Any) -> Any:
    """NaN and infinities become null (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _in_namespaces(
    args: argparse.Namespace, args_list: list[str], p: argparse.ArgumentParser
) -> int:
    """Run this bench again inside host a of a two-host namespace cluster, its peers
    (and the bare engines' other ends) in host b: only the table, cross-host engines."""
    import shlex
    import subprocess

    from ..testing.cluster import Cluster, ClusterUnavailableError

    backends = args.backends.split(",") if args.backends else list(_table.CROSS_HOST)
    if not set(backends) <= set(_table.CROSS_HOST):
        p.error(f"--namespaces runs cross-host engines only ({', '.join(_table.CROSS_HOST)})")
    rest, skip = [], False
    for arg in args_list:  # drop the options this wrapper handles
        if skip:
            skip = False
        elif arg == "--namespaces":
            continue
        elif arg in ("--scenarios", "--backends", "--rate"):
            skip = True
        elif not arg.startswith(("--scenarios=", "--backends=", "--rate=")):
            rest.append(arg)
    try:
        cluster = Cluster(["a", "b"], rate=args.rate)
    except ClusterUnavailableError as exc:
        print(f"omniwire bench --namespaces: {exc}", file=sys.stderr)
        return 1
    with cluster:
        a, b = cluster["a"], cluster["b"]

        def engines(h: Any) -> list[str]:  # UCX over TCP: its shm would cross namespaces
            return [f"UCX_NET_DEVICES={h.ifname}", "UCX_TLS=tcp", f"GLOO_SOCKET_IFNAME={h.ifname}"]

        env = {k: v for k, v in os.environ.items() if k != "OMNIWIRE_HOST_ID"}
        env["OMNIWIRE_BENCH_HOSTS"] = f"{a.ip},{b.ip}"
        env["OMNIWIRE_BENCH_PEER_LAUNCH"] = shlex.join(b.command(["env", *engines(b)]))
        print(f"omniwire bench: namespace hosts {a} and {b}, tbf {args.rate}", flush=True)
        argv = ["env", *engines(a), sys.executable, "-m", "omniwire.cli", "bench"]
        argv += ["--scenarios", "table", "--backends", ",".join(backends), "--no-obstructed"]
        done: subprocess.CompletedProcess[bytes] = a.run([*argv, *rest], timeout=3600, env=env)
        return done.returncode


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; returns 0, or 1 when something failed (reported, the rest ran)."""
    from ._plot import plot
    from ._report import report

    os.environ["OMP_NUM_THREADS"] = "1"  # this process; the children get bench_env()
    import torch

    torch.set_num_threads(1)
    p = _parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(args_list)
    if args.namespaces:
        return _in_namespaces(args, args_list, p)
    opts = _options(args, p)
    results = Results(
        command=["omniwire", "bench", *args_list],
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=_host(),
        quick=opts.quick,
    )
    anyio.run(run, opts, results)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_clean(results.to_json()), f, indent=1)
        print(f"JSON written to {args.json}")
    if args.plot:
        try:
            plot(results, args.plot)
            print(f"chart written to {args.plot}")
        except Exception as exc:
            print(f"omniwire bench: no chart: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    return 1 if results.errors else 0
