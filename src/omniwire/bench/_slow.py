"""The slow-consumer scenario (issue 18): a full-speed sender against a consumer that
takes one delivery per 10 ms. What the receiver holds must stay within its budgets
(``receive_buffer_bytes`` plus the window, spec §7.6) and the sender must wait.

Process A (this one) sends as fast as its endpoint lets it, for ``slow_s`` seconds,
to a ``python -m omniwire.peer --mode sink --delay 0.01`` process B; A samples B's
resident memory (``/proc/B/status``) every 20 ms. Two traffic kinds, each with a
fresh B: 1 KiB inline stream chunks, and 1 MiB tensor-less payloads (a header of
bytes: inline, no backend object, no credit). The figure is B's peak RSS growth over
its RSS before the run; its "baseline" is the bound it is held to.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch

from ._model import Figure, Scenario, Target
from ._units import KiB, MiB

__all__ = ["slow_consumer"]

#: The receiver's defaults (``Endpoint``): what its growth is held to.
RECEIVE_BUFFER_BYTES = 1 << 30
RECEIVE_WINDOW = 4 << 20


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS``), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS for pid {pid}")


async def _one(
    kind: str,
    seconds: float,
    start_peer: Callable[[], Awaitable[tuple[Any, int, Callable[[], Awaitable[None]]]]],
) -> dict[str, Any]:
    ep, pid, stop = await start_peer()
    try:
        peer = "bench-slow"
        await anyio.sleep(0.5)
        rss0 = rss_bytes(pid)
        peak = rss0
        waits0 = ep.counters["window_waits"]
        sent = 0
        blocked = 0.0  # seconds spent in sends that waited (more than 1 ms)
        done = False

        async def sample() -> None:
            nonlocal peak
            while not done:
                peak = max(peak, rss_bytes(pid))
                await anyio.sleep(0.02)

        chunk = torch.ones(256)  # 1 KiB
        blob = {"blob": b"x" * MiB}
        async with anyio.create_task_group() as tg:
            tg.start_soon(sample)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                started = time.monotonic()
                if kind == "inline_1k":
                    await ep.stream(peer, chunk, request_id="slow")
                else:
                    await ep.send(peer, blob, request_id=f"slow{sent}")
                took = time.monotonic() - started
                if took > 1e-3:
                    blocked += took
                sent += 1
            done = True
        return {
            "sent": sent,
            "rss_before": rss0,
            "rss_peak_growth": peak - rss0,
            "window_waits": ep.counters["window_waits"] - waits0,
            "sender_blocked_s": blocked,
        }
    finally:
        await stop()


async def slow_consumer(
    start_peer: Callable[[], Awaitable[tuple[Any, int, Callable[[], Awaitable[None]]]]],
    seconds: float,
    step: Callable[[str], None],
) -> Scenario:
    """Both traffic kinds; ``start_peer()`` gives a fresh (endpoint A, pid of B, stop)."""
    bound = RECEIVE_BUFFER_BYTES + RECEIVE_WINDOW
    figures = []
    params: dict[str, Any] = {"seconds": seconds, "consumer_delay_s": 0.01, "bound": bound}
    for kind, label in (("inline_1k", "1 KiB inline chunks"), ("tensorless_1m", "1 MiB payloads")):
        step(f"slow consumer: {label}")
        got = await _one(kind, seconds, start_peer)
        params[kind] = got
        figures.append(
            Figure(
                f"{kind}_rss_growth",
                "B",
                float(got["rss_peak_growth"]),
                float(bound),
                targets=[Target(1.0, "lower")],
            )
        )
        figures.append(  # the sender must wait: most of the time, once the window is full
            Figure(
                f"{kind}_sender_blocked",
                "s",
                got["sender_blocked_s"],
                None,
                better="higher",
                targets=[Target(seconds / 10, "higher", of="value")],
            )
        )
    return Scenario(
        "slow",
        "slow consumer",
        f"the receiver's budgets: receive_buffer_bytes + its window ({bound / MiB:.0f} MiB)",
        f"A sends at full speed for {seconds:g} s to B, whose application takes one "
        f"delivery per 10 ms: 1 KiB ({KiB} B) inline stream chunks, then 1 MiB tensor-less "
        "payloads. Figures: B's peak RSS growth (/proc, every 20 ms) against its budgets, "
        "and the seconds A's sends spent waiting (sends that took over 1 ms: for B's "
        "window, or its socket); a sender that never waits is one whose bytes pile up at B.",
        figures,
        params,
    )
