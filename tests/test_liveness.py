"""Liveness across processes (issue 10, BEHAVIOR-v2): a stopped receiver ends
``stream()`` with PeerUnresponsiveError, a zombie is dead at once, and a peer
dying during ``send()`` is a PeerLostError, never the caller's fault."""

from __future__ import annotations

import os
import signal

import anyio
import pytest
import torch

from omniwire.endpoint import Endpoint
from omniwire.errors import LocalProtocolError, OmniwireError, PeerLostError
from omniwire.testing import PeerProcess
from omniwire.testing.conformance import ipc_address

from lifecycle_support import counter, next_delivery, segments_of, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.timeout(90)]


async def test_a_stopped_receiver_ends_stream_with_peer_unresponsive() -> None:
    """SIGSTOP of a sink while we stream inline chunks to it (ack_timeout 5 s,
    peer_timeout 2 s): ``stream()`` / ``end_stream()`` end with a PeerLostError
    (PeerUnresponsiveError) naming it, within ~20 s."""
    peer = PeerProcess("stopped", ipc_address("stopped"), "--mode", "sink")
    stopped = False
    try:
        async with Endpoint(
            "src",
            address=ipc_address("src"),
            peers={"stopped": peer.address},
            ack_timeout=5,
            peer_timeout=2,
            handshake_timeout=5,
        ) as ep:
            await ep.wait_peer("stopped", 30)
            chunk = {"t": torch.ones(4096)}  # 16 KiB: inline
            assert ep.route("stopped", chunk, "stream_chunk").backend == "inline"
            for _ in range(10):
                await ep.stream("stopped", chunk, request_id="s")
            os.kill(peer.proc.pid, signal.SIGSTOP)
            stopped = True
            error: BaseException | None = None
            sent = 0
            with anyio.move_on_after(25):
                try:
                    while True:
                        await ep.stream("stopped", chunk, request_id="s")
                        sent += 1
                except OmniwireError as exc:
                    error = exc
            assert error is not None, f"stream() still blocked 25 s after SIGSTOP ({sent} sent)"
            assert isinstance(error, PeerLostError), repr(error)
            assert "stopped" in str(error)
            with anyio.fail_after(15), pytest.raises(PeerLostError, match="stopped"):
                await ep.end_stream("stopped", request_id="s")
    finally:
        if stopped:
            os.kill(peer.proc.pid, signal.SIGCONT)
        if peer.proc.poll() is None:
            peer.kill()


async def test_a_zombie_peer_is_lost_at_once_and_its_segments_are_swept() -> None:
    """SIGKILL without reaping leaves a zombie: with peer_timeout 30 s the endpoint
    still declares it lost within a few seconds and sweeps its segments."""
    peer = PeerProcess("zombie", ipc_address("zombie"), "--zero-copy")
    pid = peer.proc.pid
    try:
        async with Endpoint(
            "src",
            address=ipc_address("src"),
            peers={"zombie": peer.address},
            routes={"zombie": "shm"},
            peer_timeout=30,
        ) as ep:
            await ep.wait_peer("zombie", 30)
            for i in range(3):
                await ep.stream("zombie", torch.full((1 << 18,), i), request_id="s")
            await next_delivery(ep, lambda d: d.kind == "stream_chunk", 20)
            assert segments_of(pid), "the peer should own an arena by now"
            os.kill(pid, signal.SIGKILL)  # no wait(): it stays a zombie
            await wait_until(lambda: counter(ep, "peers_lost") >= 1, 10, "the zombie lost")
            await wait_until(lambda: not segments_of(pid), 10, "the zombie's segments swept")
    finally:
        peer.kill()  # SIGKILL again (harmless) and reap


async def test_a_peer_dying_during_send_is_peer_lost_never_local_protocol_error() -> None:
    """Three rounds: a receiver process is SIGKILLed while we send 4 MiB payloads to
    it as fast as we can; the send that fails raises PeerLostError."""
    address = ipc_address("victim")
    seen: list[BaseException] = []
    async with Endpoint(
        "src",
        address=ipc_address("src"),
        routes={"victim": "shm"},
        peer_timeout=2,
        handshake_timeout=10,
    ) as ep:
        for round_ in range(3):
            peer = PeerProcess("victim", address, "--mode", "sink")
            try:
                if round_ == 0:
                    ep.add_peer("victim", peer.address)
                await ep.wait_peer("victim", 30)
                payload = {"t": torch.ones(1 << 20)}  # 4 MiB: packed on a thread
                error: BaseException | None = None

                async def killer(p: PeerProcess = peer) -> None:
                    await anyio.sleep(0.3)
                    p.kill()

                with anyio.fail_after(30):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(killer)
                        try:
                            i = 0
                            while True:
                                await ep.send("victim", payload, request_id=f"r{round_}-{i}")
                                i += 1
                        except OmniwireError as exc:
                            error = exc
                assert error is not None
                seen.append(error)
                await wait_until(
                    lambda n=round_: counter(ep, "peers_lost") >= n + 1, 15, "the victim lost"
                )
            finally:
                if peer.proc.poll() is None:
                    peer.kill()
    assert not [e for e in seen if isinstance(e, LocalProtocolError)], seen
    assert all(isinstance(e, PeerLostError) for e in seen), seen
