"""64 MiB born in transport memory (issue 20), one way until the receiver has summed
every byte, beside what users pick instead, in the same run:

- **zero-copy receiver** vs ``torch.multiprocessing``: a tensor already in shared
  memory (``share_memory_()``) put on a ``torch.multiprocessing`` queue; the child
  maps it, sums it and puts the sum on another queue (no byte moves either way);
- **copy-mode receiver** vs one ``memcpy`` plus the sum, in this process (the least
  a receiver that owns its copy can do).

omniwire's side: A allocates the tensor with ``Endpoint.empty`` (a slot of its shm
arena), so the send packs nothing; B (``omniwire.peer --mode bench``) answers
metadata ``{"sum": True}`` with the sum. Rounds interleave the three; the first is a
warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import torch
import torch.multiprocessing as tmp

from ..backends.base import COPY_THREADS
from ._model import Figure, Scenario, Target
from ._units import MiB

__all__ = ["born_large", "torch_mp_child"]


def torch_mp_child(requests: Any, answers: Any) -> None:
    """The baseline's consumer: sum each tensor that arrives (None ends it)."""
    torch.set_num_threads(1)
    while True:
        tensor = requests.get()
        if tensor is None:
            return
        answers.put(float(tensor.sum()))
        del tensor


class _TorchMp:
    def __init__(self, size: int) -> None:
        ctx = tmp.get_context("spawn")
        self.requests = ctx.Queue()
        self.answers = ctx.Queue()
        self.proc = ctx.Process(target=torch_mp_child, args=(self.requests, self.answers))
        self.proc.start()
        self.tensor = torch.ones(size // 4, dtype=torch.float32)
        self.tensor.share_memory_()  # type: ignore[no-untyped-call]

    def once(self) -> float:
        start = time.perf_counter()
        self.requests.put(self.tensor)
        total = self.answers.get(timeout=60)
        elapsed = time.perf_counter() - start
        if total != float(self.tensor.numel()):
            raise RuntimeError(f"torch.multiprocessing child summed {total}")
        return elapsed

    def close(self) -> None:
        self.requests.put(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        for q in (self.requests, self.answers):
            q.close()
            q.join_thread()


async def born_large(
    ep: Any,
    copy_peer: str,
    zero_copy_peer: str,
    rounds: int,
    reps: int,
    step: Callable[[str], None],
    size: int = 64 * MiB,
) -> Scenario:
    elements = size // 4
    buf = await ep.empty(zero_copy_peer, (elements,), torch.float32)
    buf.tensor.fill_(1.0)
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    baseline = await anyio.to_thread.run_sync(_TorchMp, size)

    async def omniwire(peer: str, r: int) -> list[float]:
        times = []
        for i in range(reps):
            start = time.perf_counter()
            receipt = await ep.send(
                peer, buf.tensor, request_id=f"born{r}.{i}", metadata={"sum": True}
            )
            d = await ep.receive(60, request_id=f"born{r}.{i}")
            times.append(time.perf_counter() - start)
            if d.kind != "payload" or d.payload.get("sum") != float(elements):
                raise RuntimeError(f"{peer} summed wrong: {d!r}")
            await receipt.wait(60)
        return times

    def memcpy_sum() -> list[float]:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            np.copyto(dst, src)
            float(torch.from_numpy(dst).view(torch.float32).sum())
            times.append(time.perf_counter() - start)
        return times

    async def torch_mp() -> list[float]:
        return [await anyio.to_thread.run_sync(baseline.once) for _ in range(reps)]

    names = ["torch_mp", "zero-copy", "memcpy+sum", "copy"]
    samples: dict[str, list[float]] = {n: [] for n in names}
    try:
        for r in range(rounds + 1):
            step(f"{size // MiB} MiB born in shm round {r}/{rounds}" if r else "born warm-up")
            got: dict[str, list[float]] = {}
            for name in names[r % 4 :] + names[: r % 4]:
                if name == "torch_mp":
                    got[name] = await torch_mp()
                elif name == "memcpy+sum":
                    got[name] = memcpy_sum()
                else:
                    got[name] = await omniwire(
                        zero_copy_peer if name == "zero-copy" else copy_peer, r
                    )
            if r:
                for name, times in got.items():
                    samples[name].extend(times)
    finally:
        await anyio.to_thread.run_sync(baseline.close)
        await buf.settled(60)
        buf.release()

    def rate(name: str) -> float:
        return size / statistics.median(samples[name])

    return Scenario(
        "born",
        f"{size // MiB} MiB born in transport memory",
        "zero-copy: torch.multiprocessing with the tensor already in shared memory "
        "(the child maps it and sums it); copy mode: one memcpy plus the sum",
        f"A fills a {size // MiB} MiB tensor from Endpoint.empty (a slot of its shm arena) "
        "and sends it; B sums every element and answers the sum; time from send() to the "
        f"answer. {reps} per round and mode, rounds interleaved with the baselines; B's "
        f"copy-mode landing runs on {COPY_THREADS} thread(s) (OMNIWIRE_COPY_THREADS).",
        [
            Figure(
                "zero-copy",
                "B/s",
                rate("zero-copy"),
                rate("torch_mp"),
                better="higher",
                targets=[Target(1.0, "higher")],
            ),
            Figure(
                "copy",
                "B/s",
                rate("copy"),
                rate("memcpy+sum"),
                better="higher",
                targets=[Target(0.9, "higher")],
            ),
        ],
        {
            "bytes": size,
            "rounds": rounds,
            "transfers_per_round": reps,
            "seconds_p50": {k: statistics.median(v) for k, v in samples.items()},
            "sender_pack_copies": 0,
            # the receiver's landing copy runs on this many threads (OMNIWIRE_COPY_THREADS)
            "copy_threads": COPY_THREADS,
        },
    )
