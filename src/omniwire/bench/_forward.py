"""A 3-stage forward (issue 20): A → B → C on one host, B sending on what it received
zero-copy with ``lend=True`` (by reference, spec §9.2 "Forwarding"), beside the
2-stage A → C in the same run.

A fills a 64 MiB tensor from ``Endpoint.empty`` (a slot of its shm arena: no pack
copy); C (``omniwire.peer --mode bench --zero-copy``) sums every element and answers
the sum; B (``omniwire.peer --mode forward --zero-copy``) sends payloads on to C and
relays the answer back. Bytes copied per hop come from each endpoint's counters
(``bytes_packed`` on the sender, ``bytes_copied`` on the receiver) over the measured
rounds. Rounds interleave the two chains; the first is a warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ._model import Figure, Scenario, Target
from ._units import MiB

__all__ = ["forward_chain"]


async def _counters(ep: Any, peer: str, tag: str) -> dict[str, int]:
    rid = f"counters-{peer}-{tag}"
    await ep.send(peer, {}, request_id=rid, metadata={"counters": True})
    d = await ep.receive(60, request_id=rid)
    out: dict[str, int] = d.payload["counters"]
    return out


_KEYS = ("bytes_packed", "bytes_copied", "bytes_forwarded", "objects_forwarded")


async def forward_chain(
    ep: Any,
    forwarder: str,
    summer: str,
    rounds: int,
    reps: int,
    step: Callable[[str], None],
    size: int = 64 * MiB,
) -> Scenario:
    elements = size // 4
    buf = await ep.empty(summer, (elements,), torch.float32)
    buf.tensor.fill_(1.0)

    async def once(peer: str, r: int) -> list[float]:
        times = []
        for i in range(reps):
            rid = f"fwd-{peer}-{r}.{i}"
            start = time.perf_counter()
            receipt = await ep.send(peer, buf.tensor, request_id=rid, metadata={"sum": True})
            d = await ep.receive(60, request_id=rid)
            times.append(time.perf_counter() - start)
            if d.kind != "payload" or d.payload.get("sum") != float(elements):
                raise RuntimeError(f"{peer} summed wrong: {d!r}")
            await receipt.wait(60)
        return times

    samples: dict[str, list[float]] = {"3-stage": [], "2-stage": []}
    before: dict[str, dict[str, int]] = {}
    try:
        for r in range(rounds + 1):
            step(f"{size // MiB} MiB a→b→c round {r}/{rounds}" if r else "forward warm-up")
            if r == 1:
                before = {
                    "a": dict(ep.counters),
                    "b": await _counters(ep, forwarder, "0"),
                    "c": await _counters(ep, summer, "0"),
                }
            order = [("3-stage", forwarder), ("2-stage", summer)]
            for name, peer in order if r % 2 else order[::-1]:
                times = await once(peer, r)
                if r:
                    samples[name].extend(times)
        after = {
            "a": dict(ep.counters),
            "b": await _counters(ep, forwarder, "1"),
            "c": await _counters(ep, summer, "1"),
        }
    finally:
        await buf.settled(60)
        buf.release()
    n = rounds * reps  # objects per chain in the measured rounds

    def delta(who: str, key: str) -> int:
        return int(after[who].get(key, 0)) - int(before.get(who, {}).get(key, 0))

    # per object through the 3-stage chain (the 2-stage objects add nothing at b)
    hops = {
        "a→b packed at a": delta("a", "bytes_packed") / (2 * n),  # a packs neither chain's
        "b copied in": delta("b", "bytes_copied") / n,
        "b packed for c": delta("b", "bytes_packed") / n,
        "c copied in": delta("c", "bytes_copied") / (2 * n),
    }
    forwarded = delta("b", "bytes_forwarded") / n
    p50 = {k: statistics.median(v) for k, v in samples.items()}
    copied = sum(hops.values())
    return Scenario(
        "forward",
        f"{size // MiB} MiB through a 3-stage forward",
        "the 2-stage A → C, same tensor, same consumer, same run",
        f"A sends a {size // MiB} MiB tensor born in its shm arena to B, which forwards "
        "the zero-copy delivery to C with lend=True (by reference); C sums every element "
        f"and the answer comes back through B. {reps} per round and chain, rounds "
        "interleaved with A → C direct.",
        [
            Figure(
                "3-stage",
                "s",
                p50["3-stage"],
                p50["2-stage"],
                better="lower",
            ),
            Figure(
                "bytes copied per object, all hops",
                "B",
                copied,
                float(size),
                better="lower",
                targets=[Target(0.0, "lower", of="value")],
            ),
        ],
        {
            "bytes": size,
            "rounds": rounds,
            "transfers_per_round": reps,
            "seconds_p50": p50,
            "bytes_copied_per_hop": hops,
            "bytes_forwarded_by_reference_per_object": forwarded,
            "counters": {w: {k: delta(w, k) for k in _KEYS} for w in ("a", "b", "c")},
        },
    )
