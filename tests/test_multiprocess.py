"""Two-process behaviour: peer death, leaks, cleanup of /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio
import pytest
import torch

from omniwire.backends.shm import sweep_stale_segments
from omniwire.endpoint import Endpoint
from omniwire.errors import PeerLostError
from omniwire.testing import PeerProcess
from omniwire.testing.conformance import ipc_address

from conftest import omniwire_segments


def _segments_of(pid: int) -> set[str]:
    return {s for s in omniwire_segments() if s.startswith(f"omniwire-{pid}-")}


@pytest.mark.asyncio
async def test_sigkilled_sender_mid_stream_leaves_no_segments() -> None:
    """The peer echoes our stream back (so it owns an arena); it is SIGKILLed mid-stream.
    We notice, drop what was half-received, and sweep its segments."""
    peer = PeerProcess("echoer", ipc_address("echoer"), "--zero-copy")
    try:
        async with Endpoint(
            "src",
            address=ipc_address("src"),
            peers={"echoer": peer.address},
            routes={"echoer": "shm"},
            ack_timeout=10,
            handshake_timeout=1,
        ) as ep:
            await ep.wait_peer("echoer", 30)
            for i in range(4):
                await ep.stream("echoer", torch.full((1 << 18,), i), request_id="s")
            with anyio.fail_after(30):
                first = await ep.receive()
            assert first.kind == "stream_chunk" and first.backend == "shm"
            assert _segments_of(peer.proc.pid), "the peer should own an arena by now"
            peer.kill()
            with anyio.fail_after(15):
                while ep.counters.get("peers_lost", 0) < 1:
                    await anyio.sleep(0.05)
            with pytest.raises(PeerLostError, match="died"):
                await ep.stream("echoer", torch.ones(4), request_id="s2")
        assert not _segments_of(peer.proc.pid)
    finally:
        if peer.proc.poll() is None:
            peer.kill()


@pytest.mark.asyncio
async def test_sigkilled_receiver_fails_pending_sends_and_returns_buffers() -> None:
    """A receiver that holds our buffers dies: pending sends fail within the ACK timeout,
    buffers and credits come back, and the endpoint keeps serving its other peers."""
    slow = PeerProcess(
        "slow",
        ipc_address("slow"),
        "--mode",
        "sink",
        "--zero-copy",
        "--delay",
        "30",
        "--receive-buffer",
        "1",
    )
    good = PeerProcess("good", ipc_address("good"))
    try:
        async with Endpoint(
            "src",
            address=ipc_address("src"),
            ack_timeout=20,
            max_inflight=4,
            peers={"slow": slow.address, "good": good.address},
            routes={"slow": "shm", "good": "shm"},
        ) as ep:
            await ep.wait_peer("slow", 30)
            await ep.wait_peer("good", 30)
            receipts = [
                await ep.send("slow", {"t": torch.ones(1 << 16)}, request_id=f"r{i}")
                for i in range(3)
            ]
            assert ep.backend("shm").stats().exports == 3
            started = anyio.current_time()
            slow.kill()
            for r in receipts:
                with pytest.raises(PeerLostError, match="slow"):
                    await r.wait(20)
            assert anyio.current_time() - started < 20
            assert ep.backend("shm").stats().exports == 0
            assert ep.in_flight()["slow"] == (0, 0)
            r = await ep.send("good", {"t": torch.arange(10)}, request_id="after")
            d = await ep.receive()
            assert torch.equal(d.payload["t"], torch.arange(10))
            await r.wait(10)
    finally:
        for p in (slow, good):
            if p.proc.poll() is None:
                assert p.stop() == 0


def test_startup_sweep_removes_segments_of_dead_processes() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    name = f"omniwire-{pid}-deadbeef-0"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"x" * 4096)
    live = f"omniwire-{os.getpid()}-cafebabe-0"
    with open(f"/dev/shm/{live}", "wb") as f:
        f.write(b"x")
    try:
        removed = sweep_stale_segments()
        assert name in removed
        assert live not in removed  # our own pid is alive: never swept
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        for n in (name, live):
            if os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")
