"""Fault injection: peers SIGKILLed at random (seeded) moments, again and again.

Nothing leaks: /dev/shm holds no segment of any of the processes once the survivor
closes, and the survivor's file descriptors and RSS stay flat across rounds."""

from __future__ import annotations

import os
import random
from typing import Any

import anyio
import pytest
import torch

from omniwire.endpoint import Endpoint
from omniwire.errors import OmniwireError
from omniwire.testing import PeerProcess
from omniwire.testing.conformance import ipc_address

from conftest import omniwire_segments

ROUNDS = 6
SEED = 20261129


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.asyncio
async def test_random_kills_lose_nothing_acknowledged_and_leak_nothing() -> None:
    rng = random.Random(SEED)
    address = ipc_address("victim")
    pids: list[int] = []
    fds: list[int] = []
    rss: list[float] = []
    acknowledged = transfers = 0
    echoes: list[tuple[int, bool]] = []

    def check(d: Any) -> None:
        """An echo that made it back is intact (a kill never delivers half a payload)."""
        if d.kind in ("payload", "stream_chunk"):
            i, t = d.payload["i"], d.payload["t"]
            echoes.append((i, bool((t == i % 127).all())))
        d.release()

    async with Endpoint(
        "survivor",
        address=ipc_address("survivor"),
        routes={"victim": "shm"},
        ack_timeout=15,
        handshake_timeout=30,
        peer_timeout=2,
    ) as ep:
        for round_ in range(ROUNDS):
            args = ["--zero-copy"] if round_ % 2 else []
            peer = PeerProcess("victim", address, *args)
            pids.append(peer.proc.pid)
            if round_ == 0:
                ep.add_peer("victim", peer.address)
            await ep.wait_peer("victim", 30)
            kill_at = rng.randint(200, 500)
            receipts = []
            try:
                for i in range(kill_at + 50):
                    n = rng.choice([16, 1000, 50_000, 400_000])
                    payload = {"i": i, "t": torch.full((n,), i % 127, dtype=torch.uint8)}
                    if rng.random() < 0.5:
                        receipts.append(
                            await ep.send("victim", payload, request_id=f"r{round_}-{i}")
                        )
                    else:
                        receipts.append(await ep.stream("victim", payload, request_id=f"s{round_}"))
                    transfers += 1
                    if i == kill_at:
                        peer.kill()  # mid-stream, with transfers in flight both ways
                    while ep.queued():  # take the echoes that are already here
                        check(await ep.receive())
            except OmniwireError:
                pass  # sends to the dead peer fail: that is the point
            if peer.proc.poll() is None:
                peer.kill()
            for r in receipts:
                try:
                    await r.wait(30)
                    acknowledged += 1
                except OmniwireError:
                    pass
            with anyio.fail_after(30):
                while ep.in_flight().get("victim", (0, 0)) != (0, 0):
                    await anyio.sleep(0.05)
            assert ep.backend("shm").stats().exports == 0
            while ep.queued():
                check(await ep.receive())
            fds.append(_fds())
            rss.append(_rss_mib())
    assert transfers > 1000
    assert acknowledged > 0
    assert len(echoes) > 100
    assert all(ok for _, ok in echoes), [i for i, ok in echoes if not ok]
    # flat: the first round warms pools and arenas; later rounds add nothing
    assert max(fds[1:]) - fds[1] <= 4, fds
    assert max(rss[1:]) - rss[1] < 64, rss
    leaked = {
        s
        for s in omniwire_segments()
        if any(s.startswith(f"omniwire-{p}-") for p in [*pids, os.getpid()])
    }
    assert not leaked, leaked
