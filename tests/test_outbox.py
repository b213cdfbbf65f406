"""The outbox under contention: several tasks waiting for room in one peer's queue
are all woken when there is room (none waits for the ACK timeout)."""

from __future__ import annotations

import anyio
import pytest
import torch

from omniwire.endpoint import Endpoint
from omniwire.testing.conformance import ipc_address

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("control_ring", [False, True], ids=["zmq", "ring"])
async def test_several_streams_waiting_for_room_all_go_on(control_ring: bool) -> None:
    tasks, chunks = 3, 300  # each task alone fills the peer's queue past its limit
    async with (
        Endpoint("b", address=ipc_address("b"), control_ring=control_ring) as b,
        Endpoint(
            "a",
            address=ipc_address("a"),
            peers={"b": b.address},
            routes={"b": "inline"},
            ack_timeout=30,
            control_ring=control_ring,
        ) as a,
    ):
        await a.wait_peer("b", 10)
        got: dict[str, list[int]] = {f"s{k}": [] for k in range(tasks)}

        async def produce(rid: str) -> None:
            for i in range(chunks):
                await a.stream("b", {"i": torch.tensor(i)}, request_id=rid)

        async def consume() -> None:
            while sum(map(len, got.values())) < tasks * chunks:
                d = await b.receive()
                got[d.request_id].append(int(d.payload["i"]))

        with anyio.fail_after(15):  # the ACK timeout (30 s) must never be what frees them
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                for rid in got:
                    tg.start_soon(produce, rid)
        assert all(v == list(range(chunks)) for v in got.values())
