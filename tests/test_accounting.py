"""Every byte accounted (spec §7.2, §7.6): what travels without a backend — inline
payloads and chunks, stream ends, metadata, aborts — is lost by nobody, bounded by a
window, shared fairly, and dispatched at bounded cost. Each test was written against
the failure it names before the mechanism was fixed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from multiprocessing import shared_memory
from typing import Any

import anyio
import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omniwire import codec, wire
from omniwire.endpoint import Endpoint
from omniwire.errors import AckTimeoutError, FrameTooLargeError, RequestAbortedError
from omniwire.ring import RingWriter
from omniwire.routing import PreferenceOrderPolicy
from omniwire.testing import PeerProcess
from omniwire.testing.conformance import ipc_address
from omniwire.testing.strategies import payloads

from lifecycle_support import clients_come_and_go
from test_endpoint import addr, pair
from test_hostile import Mallory, _still_serves, victim_and_friend


def _sink(*args: str) -> PeerProcess:
    return PeerProcess("sink", ipc_address("sink"), "--mode", "sink", *args)


async def _done(peer: PeerProcess, timeout: float) -> str:
    """The sink's exit line once it has handled ``--exit-after`` deliveries."""
    with anyio.move_on_after(timeout):
        while peer.proc.poll() is None:
            await anyio.sleep(0.05)
    code = peer.stop()
    return f"exit {code}: {peer.output.strip()}"


# -- 1. nothing accepted is lost ---------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(("count", "size"), [(32, 1 << 20), (200, 100 << 10), (18, 1 << 20)])
async def test_a_burst_of_tensorless_payloads_all_arrive(count: int, size: int) -> None:
    """Was: 1 of 32 (1 of 200, 1 of 18) arrived, every receipt said complete."""
    peer = _sink("--exit-after", str(count))
    try:
        async with Endpoint("src", address=ipc_address("src"), peers={"sink": peer.address}) as ep:
            await ep.wait_peer("sink", 30)
            for i in range(count):
                receipt = await ep.send("sink", {"blob": b"x" * size, "i": i}, request_id=f"q{i}")
                assert receipt.error is None
            assert f"DONE {count}" in await _done(peer, 60)
    finally:
        if peer.proc.poll() is None:
            peer.kill()


@pytest.mark.asyncio
async def test_a_header_too_large_for_any_frame_fails_its_own_send() -> None:
    async with pair(sender={"routes": {"b": "inline"}}) as (a, b):
        with pytest.raises(FrameTooLargeError, match="16 MiB"):
            await a.send("b", {"blob": b"x" * (17 << 20)}, request_id="big", metadata=None)
        receipt = await a.send("b", {"blob": b"y" * 10}, request_id="small")
        await receipt.wait(10)
        assert (await b.receive(10)).payload == {"blob": b"y" * 10}


# -- 2. inline data, metadata and stream ends take a window --------------------------------


@pytest.mark.asyncio
async def test_a_slow_consumer_makes_an_inline_sender_wait() -> None:
    """Was: 61,000+ chunks queued at a receiver taking none; the sender never waited."""
    window = 64 << 10
    async with pair(receive_window=window, sender={"routes": {"b": "inline"}}) as (a, b):
        sent = 0
        with anyio.move_on_after(2):
            while True:
                await a.stream("b", torch.ones(256), request_id="s")  # 1 KiB inline
                sent += 1
        assert a.counters["window_waits"] >= 1
        # what b holds is bounded by its window, whatever the sender wanted
        assert b.queued() <= window // 1024 + 1
        assert sent == b.queued()
        for _ in range(sent):
            await b.receive(5)
        # the window reopened: the sender goes on, and everything arrives in order
        await a.stream("b", torch.ones(256), request_id="s")
        await a.end_stream("b", request_id="s")
        d = await b.receive(10)
        assert d.kind == "stream_chunk" and d.chunk_id == sent
        assert (await b.receive(10)).kind == "stream_end"


@pytest.mark.asyncio
async def test_concurrent_streams_wait_for_the_window_once_per_reopening_not_per_chunk() -> None:
    """Was: once the window had filled, every chunk of every one of several concurrent
    streams waited for it (a task granted the window went to the back of the queue
    behind the others, woken but not yet run: a convoy), so a loaded sender paid a
    wait — a cancel scope, an event, a trip around the loop — per message."""
    producers, chunks = 8, 300
    async with pair(receive_window=1 << 20, sender={"routes": {"b": "inline"}}) as (a, b):
        got: dict[str, list[int]] = {}

        async def consume() -> None:
            for _ in range(producers * chunks):
                d = await b.receive(30)
                got.setdefault(d.request_id, []).append(d.chunk_id)

        async def produce(j: int) -> None:
            for _ in range(chunks):
                await a.stream("b", torch.ones(256), request_id=f"s{j}")  # 1 KiB inline

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for j in range(producers):
                tg.start_soon(produce, j)
        assert got == {f"s{j}": list(range(chunks)) for j in range(producers)}
        waits = a.counters["window_waits"]
        assert 1 <= waits <= producers * chunks // 10, waits


@pytest.mark.asyncio
@pytest.mark.parametrize("waiting", ["chunk", "end"])
async def test_a_chunk_sent_while_another_waits_for_the_window_does_not_overtake_its_id(
    waiting: str,
) -> None:
    """The window lets a waiting chunk (or the stream's end) go, and before its task
    runs another task sends a chunk of the same stream (it does not wait: the window
    has room). That one leaves first, so it must carry the earlier id: a chunk, and
    an end, take their id when they leave, not when their send was called (which
    put 4 before 3 on the wire, or a chunk 0 after the end)."""
    chunk = torch.ones(256)  # 1 KiB: inline, ~1.4 KiB of charge
    async with pair(receive_window=16 << 10, sender={"routes": {"b": "inline"}}) as (a, b):
        window = a._peers.get("b").window
        charge = wire.CHARGE_BASE + 1024 + wire.CHARGE_PER_TENSOR + len(codec.dumps(chunk).header)
        queued = 0
        while window.available >= charge:  # chunks until the next one must wait
            await a.stream("b", chunk, request_id="s")
            queued += 1
        with anyio.fail_after(10):
            while b.queued() < queued:
                await anyio.sleep(0.01)
        assert queued >= 1
        raced: list[BaseException | None] = []
        reopen = window.reopen

        def reopen_then_race(increment: int) -> None:
            reopen(increment)  # lets the waiting chunk go; its task has not run yet
            if not raced:
                coro = a.stream("b", chunk, request_id="s")
                try:
                    coro.send(None)  # the fast path: sent without suspending
                except StopIteration:
                    raced.append(None)
                else:  # it had to wait after all: the test proves nothing
                    coro.close()
                    raced.append(AssertionError("the racing send waited"))

        window.reopen = reopen_then_race  # type: ignore[method-assign]
        if waiting == "chunk":
            wait = functools.partial(a.stream, "b", chunk, request_id="s")
        else:  # an end charged more than a chunk: it waits where a chunk still fits
            wait = functools.partial(a.end_stream, "b", request_id="s", metadata={"p": "x" * 2000})
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.sleep(0.05)
            assert a.counters["window_waits"] == 1
            got = [await b.receive(10) for _ in range(queued + 2)]  # the first reopen it
        assert raced == [None]
        assert [d.chunk_id for d in got] == list(range(queued + 2))
        assert [d.kind for d in got][-1] == ("stream_end" if waiting == "end" else "stream_chunk")


@pytest.mark.asyncio
async def test_a_slow_consumer_in_another_process_bounds_what_the_sender_gets_out() -> None:
    """Two processes: B takes one delivery per 10 ms. What A gets out in 3 s is bounded
    by B's window plus what B can have taken (at most 100 a second), whatever A's speed."""
    peer = _sink("--delay", "0.01")
    try:
        async with Endpoint("src", address=ipc_address("src"), peers={"sink": peer.address}) as ep:
            await ep.wait_peer("sink", 30)
            chunk = torch.ones(256)  # 1 KiB: inline
            sent = 0
            with anyio.move_on_after(3):
                while True:
                    await ep.stream("sink", chunk, request_id="slow")
                    sent += 1
            charge = 256 + 1024 + 64 + len(codec.dumps(chunk).header)
            assert ep.counters["window_waits"] >= 1
            assert sent <= (4 << 20) // charge + 1 + 3 * 100 + 50, sent
    finally:
        if peer.proc.poll() is None:
            peer.kill()


@pytest.mark.asyncio
async def test_a_peer_that_ignores_the_window_ends_its_own_session() -> None:
    """Was: 24 stream ends with 15 MiB of metadata each grew a paused receiver by 0.5 GiB."""
    async with victim_and_friend() as (victim, friend):
        m = Mallory(victim.address)
        try:
            await m.send(wire.encode(m.hello()))
            await anyio.sleep(0.5)
            meta = codec.dumps({"pad": b"m" * (15 << 20)}).header
            for i in range(24):
                end = wire.DataReadyMessage(
                    request_id=f"e{i}",
                    from_stage="mallory",
                    to_stage="victim",
                    is_done=True,
                    metadata=meta,
                )
                await m.send(wire.encode(end))
            with anyio.fail_after(20):
                while victim.counters["window_exceeded"] < 1:
                    await anyio.sleep(0.05)
            # at most one window's worth (one oversized message) was kept
            assert victim.queued() <= 2
            await _still_serves(victim, friend, "after-flood")
        finally:
            m.close()


# -- 3. fair shares: a stalled progressive object holds only what is ready ------------------


@pytest.mark.asyncio
async def test_a_stalled_progressive_object_does_not_hold_the_receive_budget() -> None:
    """Was: an object with ready=0 took receive_buffer_bytes up front; every other peer's
    objects waited for it until ack_timeout."""
    budget = 4 << 20
    async with (
        Endpoint(
            "victim", address=addr("victim"), receive_buffer_bytes=budget, ack_timeout=60
        ) as victim,
        Endpoint(
            "friend",
            address=addr("friend"),
            peers={"victim": victim.address},
            routes={"victim": "shm"},
        ) as friend,
    ):
        await friend.wait_peer("victim", 10)
        m = Mallory(victim.address)
        seg = shared_memory.SharedMemory(name=f"{m.prefix}-1", create=True, size=budget)
        try:
            await m.send(wire.encode(m.hello()))
            await anyio.sleep(0.5)
            info = msgspec.msgpack.encode({"segment": seg.name, "offset": 0, "size": budget})
            ref = wire.DataRef(
                object_id=1,
                kind="payload",
                backend="shm",
                layout="packed",
                ref=wire.BackendRef(backend="shm", info=info, length=budget),
                ready=0,
            )
            await m.send(
                wire.encode(
                    wire.DataReadyMessage(
                        request_id="stall", from_stage="mallory", to_stage="victim", data_ref=ref
                    )
                )
            )
            await anyio.sleep(0.3)
            t = torch.arange(1 << 18)  # 2 MiB through shm: needs a share of the budget
            receipt = await friend.send("victim", {"t": t}, request_id="fair")
            with anyio.fail_after(15):  # well inside victim's 60 s ack_timeout
                d = await victim.receive(request_id="fair")
                await receipt.wait()
            assert torch.equal(d.payload["t"], t)
        finally:
            m.close()
            seg.close()
            seg.unlink()


# -- 4. bounded work per loop turn -------------------------------------------------------


class _Turns:
    """The value of ``ep.counters[counter]`` at every turn of the event loop, from
    :meth:`run` (a task) until :meth:`until` has seen the counter reach ``end``."""

    def __init__(self, ep: Endpoint, counter: str) -> None:
        self.ep, self.counter = ep, counter
        self.seen: list[int] = []
        self.start = ep.counters.get(counter, 0)
        self._stop = False

    async def run(self) -> None:
        while not self._stop:
            self.seen.append(self.ep.counters.get(self.counter, 0))
            await asyncio.sleep(0)

    async def until(self, end: int, timeout: float) -> None:
        with anyio.fail_after(timeout):
            while self.ep.counters.get(self.counter, 0) < end:
                await anyio.sleep(0.01)
        self._stop = True

    def between(self, end: int) -> set[int]:
        """The values seen strictly between the start and ``end``."""
        return {s for s in self.seen if self.start < s < end}


@pytest.mark.asyncio
async def test_one_peers_backlog_does_not_hold_the_event_loop() -> None:
    """Was: 100,000 one-chunk requests in 100 batch frames were applied without a pause."""
    async with victim_and_friend() as (victim, _friend):
        m = Mallory(victim.address)
        try:
            hello = m.hello()
            hello = msgspec.structs.replace(hello, wire_max=(1, 1))
            await m.send(wire.encode(hello))
            await anyio.sleep(0.5)
            frames = []
            for f in range(20):
                msgs = tuple(
                    wire.DataReadyMessage(
                        request_id=f"r{f}-{i}",
                        from_stage="mallory",
                        to_stage="victim",
                        is_done=True,
                    )
                    for i in range(1000)
                )
                frames.append(wire.encode(wire.BatchMessage(messages=msgs), version=(1, 1)))
            turns = _Turns(victim, "frames_received")
            async with anyio.create_task_group() as tg:
                tg.start_soon(turns.run)
                for frame in frames:
                    await m.send(frame)
                await turns.until(turns.start + len(frames), 60)
            between = turns.between(turns.start + len(frames))
            # the loop turned between frames of the backlog, not once after all of them
            assert len(between) >= 5, sorted(between)
        finally:
            m.close()


@contextlib.asynccontextmanager
async def _on_a_ring() -> AsyncIterator[tuple[Endpoint, RingWriter]]:
    """Endpoint ``b`` and the ring writer of ``a``, an endpoint of this process that
    has switched its frames to ``b`` onto a control ring (spec §3.6)."""
    async with (
        Endpoint("b", address=ipc_address("b")) as b,
        Endpoint("a", address=ipc_address("a"), peers={"b": b.address}) as a,
    ):
        await a.wait_peer("b", 10)
        await a.send("b", {"x": 1}, request_id="warm")
        assert (await b.receive(timeout=10)).request_id == "warm"
        with anyio.fail_after(10):
            while a.control_channel("b") != "ring":
                await anyio.sleep(0.01)
        writer = a._peers.get("b").ring_writer
        assert writer is not None
        yield b, writer


@pytest.mark.asyncio
async def test_a_ring_peers_backlog_does_not_hold_the_event_loop() -> None:
    """The same over a same-host control ring (spec §3.6). Was: the ring's reader
    bounds a turn to 512 records and 1 MiB, but every record may be a batch of
    thousands of messages, and all of them were applied in that one turn (14 frames
    of 500 requests: the loop did not turn between them)."""
    async with _on_a_ring() as (b, writer):
        frames = [
            wire.encode(
                wire.BatchMessage(
                    messages=tuple(
                        wire.DataReadyMessage(
                            request_id=f"r{f}-{i}", from_stage="a", to_stage="b", is_done=True
                        )
                        for i in range(500)
                    )
                ),
                version=(1, 1),
            )
            for f in range(14)  # about 0.9 MiB: the ring holds them all
        ]
        turns = _Turns(b, "frames_received")
        async with anyio.create_task_group() as tg:
            tg.start_soon(turns.run)
            await asyncio.sleep(0)
            for frame in frames:  # all in the ring before its reader wakes
                assert writer.send_nowait(frame)
            await turns.until(turns.start + len(frames), 60)
        between = turns.between(turns.start + len(frames))
        # the loop turned between frames of the backlog, not once after all of them
        assert len(between) >= 5, sorted(between)
        assert b.counters["protocol_errors"] == 0


@pytest.mark.asyncio
async def test_a_flood_of_aborts_does_not_hold_the_event_loop() -> None:
    """Was: the abort channel's loop applied every abort frame queued at its SUB socket
    without giving the event loop a turn (pyzmq hands a queued frame back without
    suspending), so a peer publishing aborts as fast as it could held the endpoint."""
    import zmq

    async with victim_and_friend() as (victim, _friend):
        m = Mallory(victim.address)
        pub = m.ctx.socket(zmq.PUB)
        pub.bind(addr("mallory-aborts"))
        try:
            hello = m.hello()
            where = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            hello = msgspec.structs.replace(hello, wire_max=(1, 1), abort_address=where)
            await m.send(wire.encode(hello))
            await anyio.sleep(1.0)  # subscribed (a SUB misses what comes before)
            n = 800  # under the high-water marks: none dropped
            frames = [
                wire.encode(wire.AbortMessage(request_id=f"flood-{i}", from_stage="mallory"))
                for i in range(n)
            ]
            turns = _Turns(victim, "aborts")
            for frame in frames:  # all queued while the victim's loop cannot run
                zmq.Socket.send(pub, frame)
            time.sleep(0.5)  # noqa: ASYNC251 (the loop must not run: ZeroMQ queues them)
            async with anyio.create_task_group() as tg:
                tg.start_soon(turns.run)
                await turns.until(turns.start + n, 30)
            between = turns.between(turns.start + n)
            # the loop turned between the aborts (at least every 512 of them, sooner
            # after 2 ms: 9 turns here), not once after all of them
            assert len(between) >= n // 512, sorted(between)
        finally:
            pub.close(0)
            m.close()


def _large_table_frame(n: int, from_stage: str, to_stage: str) -> bytes:
    """A valid DataReady whose tensor table has ``n`` entries (shm info the receiver
    refuses: it NACKs the object once the frame is decoded)."""
    ref = wire.DataRef(
        object_id=7,
        kind="payload",
        backend="shm",
        layout="packed",
        ref=wire.BackendRef(backend="shm", info=b"\x80", length=64 * n),
        tensors=tuple(
            wire.TensorMeta(dtype="float32", shape=(2, 3), offset=64 * i, nbytes=24, path=f"t{i}")
            for i in range(n)
        ),
    )
    return wire.encode(
        wire.DataReadyMessage(
            request_id="big", from_stage=from_stage, to_stage=to_stage, data_ref=ref
        )
    )


async def _turns_while_decoded(ep: Endpoint, send: Callable[[], Awaitable[None]]) -> int:
    """Turns of the event loop between ``ep`` counting the frame ``send`` sends and its
    NACK of the object in it."""
    start = ep.counters.get("frames_received", 0)
    nacks = ep.counters.get("nacks_sent", 0)
    during = 0
    await send()
    with anyio.fail_after(60):
        while ep.counters.get("nacks_sent", 0) == nacks:
            if ep.counters.get("frames_received", 0) > start:
                during += 1  # the loop turned while the frame was being decoded
            await asyncio.sleep(0)
    return during


@pytest.mark.asyncio
async def test_a_frame_of_large_tensor_tables_does_not_hold_the_event_loop() -> None:
    """Was: a valid 4 MiB DataReady with a 65,535-entry table was validated on the event
    loop, entry by entry, in one go (three 15 MiB frames stalled it 2-6.5 s)."""
    frame = _large_table_frame(65535, "mallory", "victim")
    async with victim_and_friend() as (victim, _friend):
        m = Mallory(victim.address)
        try:
            await m.send(wire.encode(m.hello()))
            await anyio.sleep(0.5)
            during = await _turns_while_decoded(victim, lambda: m.send(frame))
            assert during >= 3, during
        finally:
            m.close()


@pytest.mark.asyncio
async def test_a_large_frame_on_a_ring_does_not_hold_the_event_loop() -> None:
    """The same over a same-host control ring. Was: a ring's frames were all decoded
    on the event loop, whatever their size."""
    frame = _large_table_frame(40000, "a", "b")  # about 2.4 MiB, within the 4 MiB window
    async with _on_a_ring() as (b, writer):

        async def send() -> None:
            assert writer.send_nowait(frame)  # in fragments, as the reader frees room

        during = await _turns_while_decoded(b, send)
        assert during >= 3, during
        assert b.counters["protocol_errors"] == 0


# -- 5. requests at scale ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_requests_dispatch_is_not_quadratic_in_a_burst() -> None:
    """Was: each new request scanned the whole queue (4,096 in one frame: 12.6 s)."""
    async with pair(sender={"routes": {"b": "inline"}}) as (a, b):
        n = 2048
        for i in range(n):
            await a.stream("b", torch.ones(1), request_id=f"r{i}")
        with anyio.fail_after(30):
            while b.queued() < n:
                await anyio.sleep(0.01)
        before = b.counters.get("deliveries_scanned", 0)
        streams = []
        async for request in b.requests():
            streams.append(request)
            if len(streams) == n:
                break
        assert [s.request_id for s in streams] == [f"r{i}" for i in range(n)]
        # O(1) per request: no scan of the queue for an unheld request
        assert b.counters.get("deliveries_scanned", 0) - before <= 4 * n
        for s in streams:
            s.close()


@pytest.mark.asyncio
async def test_a_held_backlog_does_not_make_every_other_receive_scan_it() -> None:
    """Was: with one request held (its stream open, not read) and 10,000 of its
    deliveries queued, every receive() of anything else scanned past all of them:
    1.1 ms per receive (1,000 receives: 10,001,000 deliveries scanned)."""
    backlog, others = 2000, 200
    room = {"receive_buffer": 4096, "receive_window": 64 << 20}
    async with pair(**room, sender={"routes": {"b": "inline"}}) as (a, b):
        held = b.deliveries(request_id="slow")  # holds the request; read later
        for _ in range(backlog):
            await a.stream("b", torch.ones(1), request_id="slow")
        for i in range(others):
            await a.stream("b", torch.ones(1), request_id=f"other{i}")
        with anyio.fail_after(30):
            while b.queued() < backlog + others:
                await anyio.sleep(0.01)
        before = b.counters.get("deliveries_scanned", 0)
        got = [(await b.receive(10)).request_id for _ in range(others)]
        assert got == [f"other{i}" for i in range(others)]  # oldest first, none held
        assert b.counters.get("deliveries_scanned", 0) - before <= 3 * (backlog + others)
        held.close()  # released: the backlog is anybody's now, oldest first
        assert (await b.receive(10)).request_id == "slow"
        assert b.queued() == backlog - 1


@pytest.mark.asyncio
async def test_one_stages_backlog_does_not_make_another_stages_consumers_scan_it() -> None:
    """Was: a consumer filtering on a stage — the README's ``requests(from_stage=…)``,
    or ``receive(from_stage=…)`` — walked every queued delivery of every other stage
    nobody took, for each request or delivery it took: with 5,000 inline payloads of
    another stage queued, 5,351 deliveries scanned (1.7 ms of CPU) per request
    dispatched. A peer the application does not read could slow every other one."""
    backlog, n = 2000, 60
    room = {"receive_buffer": 4096, "receive_window": 64 << 20}
    async with (
        Endpoint("srv", address=addr("srv"), **room) as srv,
        Endpoint("x", address=addr("x"), peers={"srv": srv.address}, routes={"srv": "inline"}) as x,
        Endpoint("enc", address=addr("enc"), peers={"srv": srv.address}) as enc,
    ):
        await x.wait_peer("srv", 10)
        await enc.wait_peer("srv", 10)
        for i in range(backlog):  # nobody reads x's
            await x.send("srv", {"i": i}, request_id=f"x{i}")
        for i in range(2 * n):
            await enc.send("srv", {"i": i}, request_id=f"e{i}")
        with anyio.fail_after(30):
            while srv.queued() < backlog + 2 * n:
                await anyio.sleep(0.01)
        before = srv.counters["deliveries_scanned"]
        got = []
        async for request in srv.requests(from_stage="enc"):
            async with request:
                got.append((await request.__anext__()).payload["i"])
            if len(got) == n:
                break
        got += [(await srv.receive(10, from_stage="enc")).payload["i"] for _ in range(n)]
        assert got == list(range(2 * n))  # oldest first
        # each index is built once (one walk of the queue), then O(1) a take
        assert srv.counters["deliveries_scanned"] - before <= 2 * (backlog + 2 * n) + 6 * n
        assert srv.queued() == backlog


_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["put", "put", "put", "hold", "release", "take", "take_scoped", "take_stage", "next"]
        ),
        st.sampled_from(["r0", "r1", "r2"]),
        st.sampled_from([None, None, "s0", "s1"]),
        st.sampled_from(["stream_chunk", "stream_chunk", "aborted"]),
    ),
    min_size=20,
    max_size=80,
)


@settings(max_examples=120, deadline=None)
@given(ops=_OPS)
def test_consumers_take_the_oldest_delivery_they_may_whatever_is_held(
    ops: list[tuple[str, str, str | None, str]],
) -> None:
    """The queue against a list: an unscoped consumer takes the oldest delivery of a
    request nobody holds (an ``aborted`` one whatever stage holds it; with a stage
    filter, one from that stage or ``aborted``), a scoped one the oldest of its
    request, and ``requests(from_stage=…)`` finds the first request in line whose
    first delivery is that stage's or ``aborted`` — through holds and releases in any
    order (the heaps and indexes must agree with walks of the queue)."""
    from omniwire.delivery import Delivery
    from omniwire.endpoint._deliveries import Deliveries, _Consumer

    core = Endpoint("q", address=addr("q"))._core
    queue = Deliveries(core)
    model: list[Delivery] = []
    holds: dict[str, list[str | None]] = {}

    def held(d: Delivery) -> bool:
        h = holds.get(d.request_id)
        return bool(h) and (None in h or d.from_stage in h or d.kind == "aborted")

    for op, rid, stage, kind in ops:
        if op == "put":
            d = Delivery(kind, rid, stage or "s0")
            model.append(d)
            queue.put(d)
        elif op == "hold":
            holds.setdefault(rid, []).append(stage)
            queue._hold(rid, stage)
        elif op == "release" and stage in holds.get(rid, []):
            holds[rid].remove(stage)
            queue._release(rid, stage)
        elif op == "next":
            line = [r for r in queue._unheld if r in queue._by_request]
            firsts = [next(iter(queue._by_request[r].values())) for r in line]
            want = stage or "s0"
            may_r = [d.request_id for d in firsts if d.from_stage == want or d.kind == "aborted"]
            assert queue._unheld_request(want) == (may_r[0] if may_r else None)
        elif op in ("take", "take_scoped", "take_stage"):
            scoped, want = op == "take_scoped", (stage or "s0") if op == "take_stage" else None
            consumer = _Consumer(rid if scoped else None, want)
            may = [
                d
                for d in model
                if (d.request_id == rid if scoped else not held(d))
                and (want is None or d.from_stage == want or d.kind == "aborted")
            ]
            found = queue._find(consumer)
            assert (found[1] if found else None) is (may[0] if may else None)
            if found is not None:
                queue._take(*found)
                model.remove(found[1])
    assert list(queue._all.values()) == model


@pytest.mark.asyncio
async def test_the_queues_taken_oldest_first_keep_their_head_after_deletions() -> None:
    """Was: the ids of unheld requests were a plain dict read as a FIFO. A dict finds
    its first key by skipping the holes that deleting its earlier keys left, so each
    dispatch of a burst cost O(requests dispatched before it), in C, where the
    ``deliveries_scanned`` counter above cannot see it: 1.7 µs per request in a burst
    of 4,000 and 10.9 µs in one of 48,000 (``scripts/burst_dispatch.py``). Every
    queue whose oldest entry is taken must find it in O(1) after deletions: an
    OrderedDict (a linked list under the table), not a dict."""
    async with pair(sender={"routes": {"b": "inline"}}) as (a, b):
        for i in range(3):
            await a.stream("b", torch.ones(1), request_id=f"r{i}")
        with anyio.fail_after(30):
            while b.queued() < 3:
                await anyio.sleep(0.01)
        queue = b._receiver.deliveries
        assert len(queue._by_request) == 3
        heads = {
            "all": queue._all,
            "unheld": queue._unheld,
            "tombstones": queue._tombstones,
            "open streams": b._peers.get("a").open_streams,  # the idle check's oldest first
            **{f"request {rid}": q for rid, q in queue._by_request.items()},
        }
        plain = [name for name, q in heads.items() if not isinstance(q, OrderedDict)]
        assert plain == []
        request = await anext(b.requests())
        assert request.request_id == "r0"  # the oldest, and the others stay in order
        assert list(queue._unheld) == ["r1", "r2"]
        request.close()


@pytest.mark.asyncio
async def test_open_streams_per_peer_are_capped_and_refused_with_a_reason() -> None:
    async with pair(max_open_streams=8, sender={"routes": {"b": "inline"}}) as (a, b):
        for i in range(8):
            await a.stream("b", torch.ones(1), request_id=f"r{i}")
        await a.stream("b", torch.ones(1), request_id="r8")
        with anyio.fail_after(10):
            while not a._core.aborts.is_aborted("r8"):
                await anyio.sleep(0.02)
        with pytest.raises(RequestAbortedError, match="too_many_streams"):
            await a.stream("b", torch.ones(1), request_id="r8")
        assert b.counters["streams_refused"] == 1


@pytest.mark.asyncio
async def test_an_idle_stream_ends_with_an_error_delivery() -> None:
    async with pair(stream_idle_timeout=0.5, sender={"routes": {"b": "inline"}}) as (a, b):
        await a.stream("b", torch.ones(1), request_id="idle")
        first = await b.receive(10, request_id="idle")
        assert first.kind == "stream_chunk"
        with anyio.fail_after(10):
            d = await b.receive(request_id="idle")
        assert d.kind == "error" and d.cause == "stream_idle"


# -- 6. stray aborts ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_aborts_of_unseen_requests_queue_nothing() -> None:
    """Was: 2,000 aborts of other stages' requests became 2,000 queued deliveries."""
    async with victim_and_friend() as (victim, friend):
        await _still_serves(victim, friend, "warm")
        for i in range(500):  # (PUB/SUB drops what exceeds its high-water mark at once)
            await friend.abort(f"elsewhere-{i}")
            if i % 100 == 99:
                await anyio.sleep(0.1)
        with anyio.fail_after(20):
            while victim.counters.get("aborts", 0) < 500:
                await anyio.sleep(0.05)
        assert victim.queued() == 0
        assert victim._core.aborts.is_aborted("elsewhere-3")  # remembered all the same
        await _still_serves(victim, friend, "after")


@pytest.mark.asyncio
async def test_an_abort_of_a_request_never_seen_looks_at_no_peer() -> None:
    """Was: every abort walked every peer of the table twice (the sender's streams and
    receipts, the receiver's inboxes), seen or not: with 252 peers an abort cost 142 µs
    of the event loop, so a batch of 4,096 aborts of made-up ids (255 KiB) held it
    583 ms. An abort now looks only at the peers that saw its request."""
    async with pair() as (a, b):
        walks: list[str] = []
        real = a._peers.all

        def counted() -> list[Any]:
            caller = sys._getframe(1).f_code.co_name
            if caller == "on_abort":
                walks.append(caller)
            return real()

        a._peers.all = counted  # type: ignore[method-assign]
        await (await a.send("b", {"i": 1}, request_id="seen")).wait(10)
        for i in range(50):
            await b.abort(f"never-{i}")
        await b.abort("seen")
        with anyio.fail_after(10):
            while not a._core.aborts.is_aborted("seen"):
                await anyio.sleep(0.02)
        assert walks == []


def test_remembered_aborts_and_requests_are_bounded_in_bytes_and_keep_the_active() -> None:
    """Was: the remembered aborts were bounded in count only (65,536), each with its
    origin and reason in full: a peer sending aborts of 1 KiB ids with 4 KiB reasons
    made an endpoint hold 343 MiB. And the requests → peers index forgot the oldest
    request first, even one still streaming: after 65,536 newer requests its abort
    no longer reached its peers."""
    from omniwire.endpoint._aborts import ABORT_MEMORY_BYTES, Aborts

    aborts = Aborts()
    for i in range(4000):
        aborts.remember(f"{i:04d}" + "x" * 1020, "o" * 256, "r" * 4096)
    assert aborts.is_aborted(f"{3999:04d}" + "x" * 1020)
    held = sum(len(k) + len(v) for k, v in aborts._aborted.items())
    assert held <= ABORT_MEMORY_BYTES
    assert "r" * 100 in str(aborts.error(f"{3999:04d}" + "x" * 1020))  # the why, shortened
    small = Aborts(memory=4)
    for rid in ("r0", "r1", "r2", "r3"):
        small.note_peer(rid, "p")
    small.note_peer("r0", "p")  # still active
    small.note_peer("r4", "p")
    assert small.seen("r0")
    assert not small.seen("r1")


class _Queued:
    """An inbox item that counts how often its request id is read."""

    reads = 0

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id

    @property
    def request_id(self) -> str:
        _Queued.reads += 1
        return self._request_id


@pytest.mark.asyncio
async def test_an_abort_looks_only_at_the_queued_items_of_its_request() -> None:
    """Was: every abort scanned the whole inbox of every peer for items of its request.
    With 16,000 items queued, an abort of a request never seen cost 433 µs of the event
    loop (measured with a probe), and a loop turn applies up to 512 messages."""
    async with pair() as (_a, b):
        peer = b._peers.get("a")
        assert peer is not None
        peer.busy = True  # nothing takes from the inbox meanwhile
        try:
            doomed = wire.DataReadyMessage(
                request_id="doomed", from_stage="a", to_stage="b", is_done=True
            )
            queued: list[Any] = [_Queued(f"queued-{i}") for i in range(1000)]
            queued.insert(500, doomed)
            for item in queued:
                peer.inbox.append(item)
            b._core.aborts.note_peer("doomed", "a")  # as on_data_ready notes what it queues
            before = _Queued.reads
            for k in range(100):
                b._receiver.on_abort(f"stray-{k}", "c", "", notify=True)
            b._receiver.on_abort("doomed", "c", "", notify=True)
            assert _Queued.reads - before == 0  # no item of another request was looked at
            assert list(peer.inbox) == [q for q in queued if q is not doomed]  # in order
        finally:
            peer.inbox.clear()
            peer.busy = False


@pytest.mark.asyncio
async def test_aborted_streams_leave_no_state_on_their_sender() -> None:
    """Was: the sender kept each stream's next chunk id until end_stream, so a stream
    aborted before its end (by its sender, its receiver, an idle or open-streams
    refusal) kept an entry for the life of the session: a long-running stage whose
    clients cancel grew without bound."""
    async with pair(max_open_streams=4, sender={"routes": {"b": "inline"}}) as (a, b):
        peer = a._peers.get("b")
        assert peer is not None
        for i in range(20):
            await a.stream("b", torch.ones(1), request_id=f"mine{i}")
            await a.abort(f"mine{i}")  # aborted here
        for i in range(8):  # 4 more than b keeps open: refused, aborted back to a
            await a.stream("b", torch.ones(1), request_id=f"many{i}")
        with anyio.fail_after(10):
            while not all(a._core.aborts.is_aborted(f"many{i}") for i in range(4, 8)):
                await anyio.sleep(0.02)
        for i in range(4):
            await b.abort(f"many{i}")  # aborted by the receiver
        with anyio.fail_after(10):
            while not all(a._core.aborts.is_aborted(f"many{i}") for i in range(4)):
                await anyio.sleep(0.02)
        assert peer.chunk_ids == {}
        await a.stream("b", torch.ones(1), request_id="open")
        assert peer.chunk_ids == {"open": 1}  # a stream still open keeps its place


@pytest.mark.asyncio
async def test_first_chunks_that_never_left_leave_no_state_on_their_sender() -> None:
    """Was: a stream whose first chunk never left kept its entry for the life of the
    session: an object chunk that waited for a credit was accounted before the wait
    and never given back when the wait was cancelled or timed out (its stream's next
    chunk then went out as chunk 1, a gap at 0); an inline chunk cancelled in its
    window wait, or too large for a frame, gave its id back as an entry of 0."""
    async with pair(receive_buffer=1, sender={"max_inflight": 1, "ack_timeout": 0.3}) as (a, _b):
        peer = a._peers.get("b")
        assert peer is not None
        for rid in ("x0", "x1"):  # one delivered (b's budget is 1), one unacknowledged
            await a.send("b", torch.ones(256), request_id=rid)
        assert peer.credits.count == 1  # no credit left: a chunk by a backend waits
        for i in range(6):
            with anyio.move_on_after(0.02):  # its client gives up
                await a.stream("b", torch.ones(256), request_id=f"gave-up{i}")
        with pytest.raises(AckTimeoutError):
            await a.stream("b", torch.ones(256), request_id="timed-out")
        assert peer.chunk_ids == {}
    inline_first = {"policy": PreferenceOrderPolicy(["inline", "shm"])}
    async with pair(receive_window=4096, sender=inline_first) as (a, _b):
        peer = a._peers.get("b")
        assert peer is not None
        while peer.window.available > 300:  # fill b's window (its application takes nothing)
            await a.send("b", torch.ones(256), request_id="fill")
        for i in range(6):
            with anyio.move_on_after(0.02):
                await a.stream("b", torch.ones(256), request_id=f"gave-up{i}")
        with pytest.raises(FrameTooLargeError):
            await a.stream("b", {"blob": b"x" * (17 << 20)}, request_id="too-large")
        assert peer.chunk_ids == {}


@pytest.mark.asyncio
async def test_peers_that_come_and_go_leave_no_route_statistics_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Was: a stage kept the route statistics (up to 1,000 latencies each) of every peer
    it ever answered, long after the peer table had forgotten it: a server whose
    clients come and go under new names (or a peer that reconnects under ever new
    names) grew without bound. Only the peers the table remembers keep theirs."""
    monkeypatch.setattr("omniwire.endpoint._peers._TOMBSTONES", 2)
    async with Endpoint("srv", address=addr("srv")) as srv:
        await clients_come_and_go(srv, 8, remembered=2)
        remembered = {p.name for p in srv._peers.all()}
        assert {peer for peer, _kind, _backend in srv.route_stats} <= remembered
        assert {peer for peer, _kind, _backend in srv._sender.routes._seen} <= remembered
        assert {(f"c{i}", "payload") for i in (6, 7)} <= {k[:2] for k in srv.route_stats}


@pytest.mark.asyncio
async def test_a_held_request_still_gets_its_aborted_delivery() -> None:
    async with pair() as (a, b):
        async with anyio.create_task_group() as tg:
            got: list[str] = []

            async def wait() -> None:
                got.append((await b.receive(10, request_id="held")).kind)

            tg.start_soon(wait)
            await anyio.sleep(0.2)
            await a.abort("held")
        assert got == ["aborted"]


@pytest.mark.asyncio
async def test_aborts_of_requests_served_earlier_stay_out_of_the_queue() -> None:
    """Was: the talker aborting requests the thinker had already served left one
    ``aborted`` delivery per request in the thinker's queue for ever: the README's
    ``requests(from_stage="encoder")`` took no request whose first delivery came from
    another stage (and each later dispatch walked past them). Then each came back
    from ``requests()`` as a new request (issue 47, item 2). Now a request whose
    stream was served and closed is over: its later abort is not queued at all."""
    n = 12
    async with (
        Endpoint("talker", address=addr("talker")) as talker,
        Endpoint("thinker", address=addr("thinker"), peers={"talker": talker.address}) as th,
        Endpoint("enc", address=addr("enc"), peers={"thinker": th.address}) as enc,
    ):
        await enc.wait_peer("thinker", 10)
        await th.wait_peer("talker", 10)
        served: list[str] = []

        async def serve(request: Any) -> None:
            async with request:
                async for d in request:
                    served.append(f"{d.kind} {d.request_id}")
                    if d.kind == "payload":
                        await th.send("talker", {"x": torch.ones(4)}, request_id=d.request_id)
                    return

        async def server() -> None:
            async with anyio.create_task_group() as tg:
                async for request in th.requests(from_stage="enc"):
                    tg.start_soon(serve, request)

        async with anyio.create_task_group() as tg:
            tg.start_soon(server)
            for i in range(n):
                await enc.send("thinker", {"x": torch.ones(4)}, request_id=f"r{i}")
                assert (await talker.receive(10, request_id=f"r{i}")).kind == "payload"
                await talker.abort(f"r{i}", "its client went away")
            with anyio.fail_after(10):
                while not enc._core.aborts.is_aborted(f"r{n - 1}"):  # it passed the thinker
                    await anyio.sleep(0.02)
            await anyio.sleep(0.1)
            assert th.queued() == 0
            tg.cancel_scope.cancel()
        assert served == [f"payload r{i}" for i in range(n)]


@pytest.mark.asyncio
async def test_notices_of_requests_nobody_holds_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Was: every ``aborted`` (and peer-loss or idle-stream ``error``) delivery of a
    request nobody holds stayed queued until some consumer took it: they hold no
    budget and no window, so nothing else bounds them, and an endpoint that reads
    only its own requests' replies grew by one per request a peer aborted. Now the
    newest few are kept; a request that is held gets its own whatever the count, and
    one that ends deliveries still queued stays with them."""
    monkeypatch.setattr("omniwire.endpoint._deliveries._NOTICES", 8)
    async with pair(sender={"stream_idle_timeout": 0.3}) as (a, b):
        got: list[str] = []
        await b.stream("a", torch.ones(1), request_id="idle")  # a reads nothing of it
        with anyio.fail_after(10):
            while not a.counters["streams_idle"]:
                await anyio.sleep(0.02)

        async def wait_held() -> None:
            got.append((await a.receive(10, request_id="held")).kind)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_held)
            await (await a.send("b", {"i": -1}, request_id="held")).wait(10)
            await b.abort("held")
            for i in range(20):
                await (await a.send("b", {"i": i}, request_id=f"r{i}")).wait(10)
                await b.abort(f"r{i}")
            with anyio.fail_after(10):
                while not a._core.aborts.is_aborted("r19"):
                    await anyio.sleep(0.02)
        assert got == ["aborted"]
        assert a.counters["notices_dropped"] == 12
        queued = [(d.request_id, d.kind) for d in a._receiver.deliveries._all.values()]
        # the idle stream's error ends its chunk, still queued: kept (or it never ends)
        ended = [("idle", "stream_chunk"), ("idle", "error")]
        assert queued == [*ended, *((f"r{i}", "aborted") for i in range(12, 20))]


# -- 7. a hung peer that keeps missing ACK deadlines --------------------------------------


@pytest.mark.asyncio
async def test_a_peer_that_keeps_missing_ack_deadlines_is_declared_unresponsive() -> None:
    """Was: its objects stayed reserved forever while libzmq answered heartbeats."""
    async with pair(
        zero_copy=True,
        sender={"routes": {"b": "shm"}, "ack_timeout": 0.3, "max_ack_timeouts": 2},
    ) as (a, b):
        held = []
        for i in range(3):
            r = await a.send("b", {"t": torch.ones(1 << 16)}, request_id=f"h{i}")
            held.append(r)
            # b's application holds every zero-copy delivery: no ACK ever comes
        with anyio.fail_after(10):
            while a.counters.get("peers_lost", 0) < 1:
                await anyio.sleep(0.05)
        assert sum(out for out, _ in a.in_flight().values()) == 0  # every buffer released
        kinds = [(await b.receive(5)).kind for _ in range(3)]
        assert kinds == ["payload"] * 3


# -- 8. depth counts keys ------------------------------------------------------------------


def test_nesting_in_map_keys_counts_against_the_depth_limit() -> None:
    deep: object = 1
    for _ in range(500):
        deep = (deep,)
    with pytest.raises(ValueError, match="deeper"):
        codec.dumps({deep: 1})
    # and a reader refuses such a header from a foreign writer
    body = b"\x81" + b"\x91" * 100 + b"\x01" + b"\x01"  # {[[[...1...]]]: 1}
    from omniwire.errors import WireFormatError

    with pytest.raises(WireFormatError, match="deep"):
        codec.loads(body, [])


# -- the sender's charge is the spec's -------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    payload=payloads(max_leaves=6),
    meta=st.binary(max_size=300),
    kind=st.sampled_from(["payload", "stream_chunk"]),
    trace=st.sampled_from(["", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"]),
)
def test_the_charge_an_inline_message_is_sent_with_is_the_one_its_receiver_computes(
    payload: object, meta: bytes, kind: str, trace: str
) -> None:
    """The sender computes an inline DataReady's charge from its parts (not from the
    message): it must be what spec §7.6 says, and what the receiver computes from the
    decoded message — else the two sides' windows drift apart."""
    from types import SimpleNamespace

    from omniwire import packing
    from omniwire.endpoint._inline import inline_message

    enc = codec.dumps(payload)
    layout = packing.plan(enc.tensors, enc.paths)
    if (
        any(t.device.type != "cpu" for t in enc.tensors)
        or layout.nbytes > wire.INLINE_MAX_TENSOR_BYTES
    ):
        return
    peer = SimpleNamespace(name="b")
    msg, charge = inline_message("a", peer, enc, layout, "r1", kind, 3, meta, trace)  # type: ignore[arg-type]
    assert charge == wire.charge(msg)
    assert charge == wire.charge(wire.decode(wire.encode(msg)))  # type: ignore[arg-type]
