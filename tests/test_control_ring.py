"""The same-host control ring at the endpoint level (spec §3.6): peers switch to it after
the handshake, frames keep their order across the switch, it can be turned off, a
dead peer's ring ends its session, and an idle endpoint on a ring uses no CPU."""

from __future__ import annotations

import gc
import os
import resource
import time

import anyio
import pytest
import torch

from omniwire.endpoint import Endpoint
from omniwire.testing import PeerProcess
from omniwire.testing.conformance import ipc_address

pytestmark = pytest.mark.asyncio


async def _until(cond: object, timeout: float, what: str) -> None:
    with anyio.fail_after(timeout):
        while not cond():  # type: ignore[operator]
            await anyio.sleep(0.01)


async def test_same_host_peers_switch_to_the_ring_and_keep_order_across_the_switch() -> None:
    """Chunks streamed from the first moment (some leave by ZeroMQ before the switch,
    the rest through the ring) all arrive, in order; both directions end up on rings."""
    n = 3000
    async with (
        Endpoint("b", address=ipc_address("b")) as b,
        Endpoint(
            "a", address=ipc_address("a"), peers={"b": b.address}, routes={"b": "inline"}
        ) as a,
    ):
        await a.wait_peer("b", 10)
        got: list[tuple[int, int, int]] = []

        async def consume() -> None:
            async for d in b.deliveries(request_id="s"):
                if d.kind == "stream_chunk":
                    got.append((d.chunk_id, d.payload["i"], int(d.payload["t"][0])))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                for i in range(n):
                    await a.stream("b", {"i": i, "t": torch.full((8,), i)}, request_id="s")
                await a.end_stream("b", request_id="s")
        assert got == [(i, i, i) for i in range(n)]
        await _until(lambda: a.control_channel("b") == "ring", 10, "a writes to b's ring")
        await b.send("a", {"back": torch.ones(4)}, request_id="r")
        assert (await a.receive(timeout=10)).payload["back"].sum() == 4
        await _until(lambda: b.control_channel("a") == "ring", 10, "b writes to a's ring")
        assert a.counters["protocol_errors"] == b.counters["protocol_errors"] == 0


async def test_control_ring_false_stays_on_zeromq() -> None:
    async with (
        Endpoint("b", address=ipc_address("b"), control_ring=False) as b,
        Endpoint("a", address=ipc_address("a"), peers={"b": b.address}) as a,
    ):
        await a.wait_peer("b", 10)
        await (await a.send("b", {"t": torch.ones(4)}, request_id="r")).wait(10)
        assert (await b.receive(timeout=10)).request_id == "r"
        await anyio.sleep(0.2)
        assert a.control_channel("b") == b.control_channel("a") == "zmq"


@pytest.mark.slow
async def test_a_killed_ring_peer_is_lost_and_the_ring_released() -> None:
    peer = PeerProcess("echo", ipc_address("echo"))
    try:
        async with Endpoint(
            "src", address=ipc_address("src"), peers={"echo": peer.address}, peer_timeout=30
        ) as ep:
            await ep.wait_peer("echo", 30)
            await ep.send("echo", {"t": torch.ones(4)}, request_id="r")
            assert (await ep.receive(timeout=20)).request_id == "r"
            await _until(lambda: ep.control_channel("echo") == "ring", 10, "the ring is up")
            peer.kill()
            await _until(lambda: ep.counters["peers_lost"] >= 1, 10, "the peer lost")
            gc.collect()  # earlier tests' garbage (views of their arenas) is not this one's
            links = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    links.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:  # the listing's own descriptor, gone already
                    pass
            assert not [f for f in links if "omniwire-" in f], links  # FIFOs closed
    finally:
        if peer.proc.poll() is None:
            peer.kill()


async def test_an_idle_endpoint_on_a_ring_uses_no_cpu() -> None:
    async with (
        Endpoint("b", address=ipc_address("b")) as b,
        Endpoint("a", address=ipc_address("a"), peers={"b": b.address}) as a,
    ):
        await a.wait_peer("b", 10)
        await b.send("a", {"x": 1}, request_id="r")  # both directions on rings
        await a.receive(timeout=10)
        await a.send("b", {"x": 1}, request_id="r")
        await b.receive(timeout=10)
        await _until(
            lambda: a.control_channel("b") == b.control_channel("a") == "ring", 10, "rings"
        )
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.monotonic()
        await anyio.sleep(1.5)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        # two endpoints' housekeeping ticks (a few per second) and nothing else
        assert cpu < 0.15 * (time.monotonic() - started), f"{cpu:.3f} s of CPU while idle"
