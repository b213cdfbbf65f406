"""GPU check for omniwire's ``cuda_ipc`` backend (run by ``scripts/gpu_check.sh``).

Subcommands:

- ``preflight`` — torch, CUDA and the GPUs (with peer access); exits 2 with
  ``no CUDA device: <why>`` when there is none, 1 when cuda_ipc cannot run anyway.
- ``run`` — two-process round trips of CUDA payloads through ``cuda_ipc`` (same GPU,
  and across GPUs when there are two with peer access), copy and zero-copy
  receivers, every byte checked on the receiving side; prints the bandwidth for
  1 MiB, 64 MiB and 1 GiB next to a device-to-device copy measured in the same run.
- ``peer`` — the receiving stage (started by ``run`` and by tests/test_cuda_ipc.py).
- ``run --cpu-dry-run`` — the same round trips through ``shm`` with CPU tensors: checks
  this script itself on a machine without a GPU.

Only torch and omniwire are needed; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch

EXIT_NO_GPU = 2
MiB = 1 << 20
GiB = 1 << 30
SIZES = (1 * MiB, 64 * MiB, 1 * GiB)
#: (warm-up, timed) transfers per size
ITERATIONS = {1 * MiB: (3, 20), 64 * MiB: (2, 8), 1 * GiB: (1, 3)}


def no_cuda_reason() -> str | None:
    """Why there is no usable CUDA device here, or None if there is one."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        reason = f"torch {torch.__version__} is a build without CUDA"
        if os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi"):
            reason += (
                f", although this machine has an NVIDIA GPU: install a CUDA build of torch "
                f"into {sys.executable}, or set OMNIWIRE_PYTHON to a python that has one"
            )
        return reason
    try:
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return "torch sees no GPU" + (
                f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            )
    except Exception as exc:
        return f"CUDA failed to initialise: {exc}"
    return None


def pattern(numel: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """A deterministic int32 pattern, identical on any device (bytes are checked
    against it on the receiving side)."""
    out = torch.empty(numel, dtype=torch.int32, device=device)
    step = 1 << 24
    for lo in range(0, numel, step):
        hi = min(numel, lo + step)
        x = torch.arange(lo, hi, dtype=torch.int64, device=device)
        out[lo:hi] = ((x * 2654435761 + seed) & 0x7FFFFFFF).to(torch.int32)
    return out


def _size(n: int) -> str:
    return f"{n // GiB} GiB" if n >= GiB else f"{n // MiB} MiB"


# --------------------------------------------------------------------------- preflight


def preflight() -> int:
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, python {sys.version.split()[0]}")
    reason = no_cuda_reason()
    if reason is not None:
        print(f"no CUDA device: {reason}")
        return EXIT_NO_GPU
    n = torch.cuda.device_count()
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i}  {p.name}  {p.total_memory / GiB:.0f} GiB  uuid {p.uuid}")
    if n > 1:
        print(
            "  peer access: "
            + ", ".join(
                f"{a}->{b} {'yes' if torch.cuda.can_device_access_peer(a, b) else 'no'}"
                for a in range(n)
                for b in range(n)
                if a != b
            )
        )
    from omniwire.backends.cuda_ipc import CudaIpcBackend

    av = CudaIpcBackend.availability()
    if not av.available:
        print(f"cuda_ipc is unavailable although CUDA is: {av.reason}")
        return 1
    print("cuda_ipc: available")
    return 0


# --------------------------------------------------------------------------- peer


async def peer_main(args: argparse.Namespace) -> int:
    from omniwire import Endpoint

    if args.backend == "cuda_ipc":
        torch.cuda.set_device(args.device)
    ep = Endpoint(
        args.name,
        address=args.address,
        backends=[args.backend],
        backend_options={"cuda_ipc": {"device": args.device, "pool_size": 64 * MiB}},
        zero_copy=args.zero_copy,
        receive_buffer_bytes=4 * GiB,
        max_inflight_bytes=4 * GiB,
        ack_timeout=120,
    )
    async with ep:
        print(f"READY {ep.address}", flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:

                async def stop() -> None:
                    async for _ in signals:
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(stop)
                async for d in ep:
                    await _answer(ep, d)
    return 0


async def _answer(ep: Any, d: Any) -> None:
    rid = d.request_id
    if d.kind != "payload":
        if d.kind in ("error", "aborted"):
            await ep.end_stream(d.from_stage, request_id=rid + "/got", error=f"{d.kind}: {d.error}")
        return
    error = None
    meta: dict[str, Any] = {}
    async with d:  # zero-copy: the views are released (and acknowledged) at the end
        x = d.payload["x"]
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        meta = {"device": str(x.device), "zero_copy": d.zero_copy, "backend": d.backend}
        await ep.end_stream(d.from_stage, request_id=rid + "/got", metadata=meta)
        expected = pattern(x.numel(), int(d.payload["seed"]), x.device)
        if x.dtype != torch.int32 or not torch.equal(x, expected):
            bad = (x.reshape(-1) != expected).nonzero()[:1].tolist() if x.numel() else []
            error = f"bytes differ (first differing int32 at {bad})"
        del expected, x
    await ep.end_stream(d.from_stage, request_id=rid + "/ok", error=error, metadata=meta)


class Peer:
    """``gpu_check.py peer`` in a child process."""

    def __init__(self, device: int, zero_copy: bool, backend: str = "cuda_ipc") -> None:
        base = os.path.join(tempfile.gettempdir(), f"owgpu-{os.getuid()}")
        os.makedirs(base, exist_ok=True)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "peer",
            "--name",
            "peer",
            "--address",
            f"ipc://{base}/peer-{os.getpid()}-{device}-{int(zero_copy)}",
            "--device",
            str(device),
            "--backend",
            backend,
            *(["--zero-copy"] if zero_copy else []),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"peer did not start (said {line!r}, exit {self.proc.wait()})")
        self.address = line.split(" ", 1)[1]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code


# --------------------------------------------------------------------------- sender


@dataclass
class Result:
    path: str
    mode: str
    size: int
    seconds: list[float]
    delivered_on: str
    sent_via: str
    d2d_gbps: float

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.size / self.median / 1e9


class Replies:
    """Deliveries by request id (the peer answers each transfer twice)."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.seen: dict[str, Any] = {}

    async def get(self, rid: str, timeout: float = 120.0) -> Any:
        with anyio.fail_after(timeout):
            while rid not in self.seen:
                d = await self.ep.receive()
                self.seen[d.request_id] = d
        return self.seen.pop(rid)


async def transfer(
    ep: Any, replies: Replies, payload: dict[str, Any], rid: str
) -> tuple[float, Any]:
    """Send one payload; return the seconds until the peer had it, and its check."""
    t0 = time.perf_counter()
    receipt = await ep.send("peer", payload, request_id=rid)
    got = await replies.get(rid + "/got")
    elapsed = time.perf_counter() - t0
    ok = await replies.get(rid + "/ok")
    await receipt.wait(120)
    if got.error or ok.error:
        raise AssertionError(f"transfer {rid}: {got.error or ok.error}")
    return elapsed, ok


def _sync(*devices: str) -> None:
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


def d2d_gbps(size: int, src: str, dst: str, iterations: int = 5) -> float:
    """Copy bandwidth ``src`` -> ``dst`` (device-to-device on GPUs), measured now."""
    a = torch.empty(size, dtype=torch.uint8, device=src)
    b = torch.empty(size, dtype=torch.uint8, device=dst)
    b.copy_(a)
    times = []
    for _ in range(iterations):
        _sync(src, dst)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(src, dst)
        times.append(time.perf_counter() - t0)
    del a, b
    return size / statistics.median(times) / 1e9


async def run_pair(
    src: int,
    dst: int,
    zero_copy: bool,
    sizes: Sequence[int],
    check_only: bool = False,
    backend: str = "cuda_ipc",
) -> list[Result]:
    """Start a peer on cuda:dst and send CUDA payloads from cuda:src to it (with
    ``backend="shm"``: CPU payloads, to check this script without a GPU)."""
    from omniwire import Endpoint

    gpu = backend == "cuda_ipc"
    src_dev = f"cuda:{src}" if gpu else "cpu"
    dst_dev = f"cuda:{dst}" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(src)
    peer = Peer(dst, zero_copy, backend)
    results = []
    try:
        ep = Endpoint(
            "gpu-check",
            peers={"peer": peer.address},
            backends=[backend],
            routes={"peer": backend},
            backend_options={"cuda_ipc": {"device": src, "pool_size": 3 * GiB}},
            max_inflight_bytes=4 * GiB,
            receive_buffer_bytes=4 * GiB,
            ack_timeout=120,
        )
        async with ep:
            await ep.wait_peer("peer", 60)
            replies = Replies(ep)
            path = _path(src, dst) if gpu else f"{backend} (CPU dry run)"
            for size in sizes:
                x = pattern(size // 4, size, src_dev)
                warm, timed = (0, 1) if check_only else ITERATIONS.get(size, (1, 3))
                before = dict(ep.backend(backend).stats().detail)
                seconds = []
                meta: dict[str, Any] = {}
                for i in range(warm + timed):
                    _sync(src_dev)
                    elapsed, ok = await transfer(ep, replies, {"x": x, "seed": size}, f"{size}-{i}")
                    meta = ok.metadata or {}
                    if i >= warm:
                        seconds.append(elapsed)
                after = ep.backend(backend).stats().detail
                via = [
                    name
                    for key, name in (
                        ("sent_in_place", "in place"),
                        ("sent_pooled", "slot pool"),
                        ("sent_dedicated", "dedicated"),
                    )
                    if after.get(key, 0) > before.get(key, 0)
                ] or ([backend] if not gpu else [])
                results.append(
                    Result(
                        path,
                        "zero-copy" if zero_copy else "copy",
                        size,
                        seconds,
                        str(meta.get("device", "?")),
                        "+".join(via) or "?",
                        0.0 if check_only else d2d_gbps(size, src_dev, dst_dev),
                    )
                )
                del x
    finally:
        code = peer.stop()
        if code != 0:
            raise RuntimeError(f"peer exited with {code}")
    return results


def _path(src: int, dst: int) -> str:
    return "same GPU" if src == dst else f"cuda:{src}->cuda:{dst}"


def print_table(results: Sequence[Result]) -> None:
    header = (
        "path",
        "receiver",
        "size",
        "n",
        "median ms",
        "GB/s",
        "D2D copy GB/s",
        "vs D2D",
        "sent via",
        "delivered on",
        "bytes",
    )
    rows = [
        (
            r.path,
            r.mode,
            _size(r.size),
            str(len(r.seconds)),
            f"{r.median * 1e3:.2f}",
            f"{r.gbps:.1f}",
            f"{r.d2d_gbps:.1f}",
            f"{r.gbps / r.d2d_gbps:.2f}x" if r.d2d_gbps else "-",
            r.sent_via,
            r.delivered_on,
            "ok",
        )
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = "+".join("-" * (w + 2) for w in widths)
    print(line)
    print("|".join(f" {h:<{w}} " for h, w in zip(header, widths, strict=True)))
    print(line)
    for row in rows:
        print(
            "|".join(
                f" {c:>{w}} " if c[:1].isdigit() else f" {c:<{w}} "
                for c, w in zip(row, widths, strict=True)
            )
        )
    print(line)
    print(
        "GB/s: payload bytes / time from send() until the receiving process holds the data "
        "(copy mode: copied; zero-copy: mapped), including two control messages."
    )


async def run_all(quick: bool, cpu_dry_run: bool = False) -> int:
    sizes = SIZES[:1] if quick else SIZES
    if cpu_dry_run:
        results: list[Result] = []
        for zero_copy in (False, True):
            results += await run_pair(0, 0, zero_copy, sizes, backend="shm")
        print_table(results)
        return 0
    reason = no_cuda_reason()
    if reason is not None:
        print(f"no CUDA device: {reason}")
        return EXIT_NO_GPU
    n = torch.cuda.device_count()
    pairs = [(0, 0)]
    if n >= 2:
        if torch.cuda.can_device_access_peer(0, 1):
            pairs.append((0, 1))
        else:
            print("across GPUs: skipped: cuda:0 and cuda:1 cannot access each other")
    else:
        print("across GPUs: skipped: only one GPU")
    results = []
    for src, dst in pairs:
        for zero_copy in (False, True):
            started = time.monotonic()
            results += await run_pair(src, dst, zero_copy, sizes)
            print(
                f"  {_path(src, dst)}, "
                f"{'zero-copy' if zero_copy else 'copy'} receiver: bytes ok "
                f"({time.monotonic() - started:.1f} s)",
                flush=True,
            )
    print_table(results)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/gpu_check.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("preflight")
    run = sub.add_parser("run")
    run.add_argument("--quick", action="store_true", help="1 MiB only")
    run.add_argument(
        "--cpu-dry-run", action="store_true", help="through shm with CPU tensors (no GPU needed)"
    )
    peer = sub.add_parser("peer")
    peer.add_argument("--name", required=True)
    peer.add_argument("--address", required=True)
    peer.add_argument("--device", type=int, default=0)
    peer.add_argument("--zero-copy", action="store_true")
    peer.add_argument("--backend", default="cuda_ipc")
    args = p.parse_args(argv)
    if args.cmd == "preflight":
        return preflight()
    if args.cmd == "peer":
        return anyio.run(peer_main, args)
    try:
        return anyio.run(run_all, args.quick, args.cpu_dry_run)
    except Exception as exc:
        print(f"gpu check FAILED: {type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
