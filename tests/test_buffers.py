"""Tensors born in transport memory (``Endpoint.empty``): sending one copies nothing on
the sender; the lifetime rules of omniwire.endpoint._buffers hold."""

from __future__ import annotations

import anyio
import pytest
import torch

from omniwire.errors import BufferReleasedError

from test_endpoint import pair

pytestmark = pytest.mark.asyncio

SHM = {"sender": {"routes": {"b": "shm"}}}


async def test_a_born_tensor_travels_by_reference_and_can_be_refilled() -> None:
    async with pair(zero_copy=True, **SHM) as (a, b):
        shm = a.backend("shm")
        buf = await a.empty("b", (1024, 64), torch.float32)
        assert buf.backend == "shm"
        exports = shm.stats().exports  # the buffer's own slot
        buf.tensor.fill_(1.5)
        receipt = await a.send("b", {"h": buf.tensor}, request_id="r0")
        assert shm.stats().exports == exports  # no slot packed for the send
        d = await b.receive(10)
        assert d.zero_copy and torch.equal(d.payload["h"], torch.full((1024, 64), 1.5))
        # the receiver's view is the sender's memory, not a copy of it
        assert buf.in_flight == 1
        d.release()
        await receipt.wait(10)
        await buf.settled(10)
        buf.tensor.fill_(2.5)  # reused after its receipt
        receipt = await a.send("b", buf.tensor, request_id="r1")
        d = await b.receive(10)
        assert torch.equal(d.payload, torch.full((1024, 64), 2.5))
        d.release()
        await receipt.wait(10)
        buf.release()
        assert shm.stats().exports == exports - 1  # its slot is back
        with pytest.raises(BufferReleasedError):
            await a.send("b", buf.tensor, request_id="r2")


async def test_a_copy_mode_receiver_gets_one_copy_and_the_buffer_waits_for_it() -> None:
    async with pair(**SHM) as (a, b):
        async with await a.empty("b", (1 << 16,), torch.int32) as t:
            t.copy_(torch.arange(1 << 16, dtype=torch.int32))
            await a.send("b", t, request_id="c")
            d = await b.receive(10)
        assert not d.zero_copy and torch.equal(d.payload, torch.arange(1 << 16, dtype=torch.int32))


async def test_a_part_of_a_born_tensor_or_another_payload_shape_is_packed_as_usual() -> None:
    async with pair(**SHM) as (a, b):
        shm = a.backend("shm")
        buf = await a.empty("b", (4096,), torch.float32)
        buf.tensor.fill_(3.0)
        exports = shm.stats().exports
        receipt = await a.send("b", {"x": buf.tensor[:2048], "y": 1}, request_id="part")
        assert shm.stats().exports == exports + 1  # packed into a slot of its own
        d = await b.receive(10)
        assert torch.equal(d.payload["x"], torch.full((2048,), 3.0))
        await receipt.wait(10)
        buf.release()


async def test_an_abort_while_in_flight_leaves_the_buffer_to_its_owner() -> None:
    async with pair(zero_copy=True, **SHM) as (a, b):
        buf = await a.empty("b", (1 << 14,), torch.float32)
        receipt = await a.send("b", buf.tensor, request_id="ab")
        d = await b.receive(10)
        await a.abort("ab")
        with anyio.fail_after(10):
            while not receipt.done():
                await anyio.sleep(0.02)
        d.release()
        await buf.settled(10)
        assert not buf.released  # still the owner's, usable for the next request
        receipt = await a.send("b", buf.tensor, request_id="next")
        d = await b.receive(10, request_id="next")
        d.release()
        await receipt.wait(10)
        buf.release()


async def test_a_lazily_conjugated_or_negated_view_of_a_born_tensor_arrives_as_its_values() -> None:
    """``buf.tensor.conj()`` is the born tensor's memory with a conjugate bit: those
    bytes are not its values, so it is packed (resolved), never sent by reference."""
    async with pair(**SHM) as (a, b):
        buf = await a.empty("b", (4096,), torch.complex64)
        buf.tensor.copy_(torch.complex(torch.arange(4096.0), torch.ones(4096)))
        for rid, view in (("conj", buf.tensor.conj()), ("neg", torch._neg_view(buf.tensor))):
            receipt = await a.send("b", view, request_id=rid)
            d = await b.receive(10)
            assert torch.equal(d.payload, view.resolve_conj().resolve_neg()), rid
            await receipt.wait(10)
        await buf.settled(10)
        buf.release()


@pytest.mark.asyncio
async def test_a_buffer_dropped_without_release_gives_its_memory_back_with_its_tensor() -> None:
    """Was: a transport buffer the application dropped without ``release()`` (or kept
    only as ``buf.tensor``) stayed referenced by its endpoint for good, its slot
    with it: 60 rounds of a 4 MiB buffer filled the 64 MiB shm arena, then every
    send waited out ``arena_wait`` (1 s) and /dev/shm grew by a segment a round. The
    memory now comes back once the buffer and its tensor (every view of it) are
    gone; a tensor whose buffer was dropped is sent packed, as any tensor."""
    import gc

    async with pair(sender={"routes": {"b": "shm"}}) as (a, b):
        pool = a.backend("shm").pool  # type: ignore[attr-defined]
        for i in range(24):  # 96 MiB in all: more than the arena
            t = (await a.empty("b", (1 << 20,), torch.float32)).tensor  # 4 MiB
            t.fill_(i)
            receipt = await a.send("b", t, request_id=f"r{i}")
            got = await b.receive(10)
            assert torch.equal(got.payload, t)
            got.release()
            await receipt.wait(10)
            del t, got
            gc.collect()
        assert len(a._sender.buffers.born) == 0
        with anyio.fail_after(5):
            while pool.bytes_in_use:
                await anyio.sleep(0.01)
        assert pool.dedicated_created == 0
