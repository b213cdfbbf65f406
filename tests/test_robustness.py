"""Robust against any peer (issue 10, BEHAVIOR-v2): hostile Hellos and frames from
a raw ZeroMQ socket never stop the receive loop, floods and lost peers release
their sockets, a Hello cannot take over a live peer's name or another sender's
shm prefix, and every wait a caller can be in ends within its timeout."""

from __future__ import annotations

import logging
import os
import random
import secrets
import tempfile
from typing import Any

import anyio
import msgspec
import pytest
import torch

from omniwire import codec, packing, wire
from omniwire.endpoint import Endpoint
from omniwire.errors import AckTimeoutError, DrainTimeoutError
from omniwire.testing import PeerProcess
from omniwire.testing.conformance import ipc_address

from lifecycle_support import (
    DrainedMallory,
    counter,
    fds,
    inline_chunk_frame,
    message_body,
    own_segments,
    raw_frame,
    still_serves,
    wait_until,
)
from test_hostile import _ready, _shm_ref, addr, victim_and_friend

# A hang in a close that cannot be cancelled (a shielded close) fails here, not at
# the suite's 120 s.
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

_LONG_IPC = f"ipc://{tempfile.gettempdir()}/owt-{os.getuid()}/" + "m" * 120


def _omniwire_records(caplog: pytest.LogCaptureFixture, start: int = 0) -> list[str]:
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records[start:]
        if r.name.startswith("omniwire")
    ]


async def _connected_mallory(victim: Endpoint, m: DrainedMallory) -> None:
    """Mallory says a valid Hello and the victim takes it as a peer."""
    await m.send(wire.encode(m.hello()))
    await wait_until(lambda: "mallory" in victim.peer_names(), 10, "mallory is a peer")


# ---------------------------------------------------------------- hostile Hellos and shapes


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("address", "not-an-endpoint"),
        ("address", "tcp://"),
        ("address", _LONG_IPC),
        ("abort_address", "not-an-endpoint"),
    ],
    ids=["address-garbage", "address-tcp-empty", "address-ipc-too-long", "abort-address-garbage"],
)
async def test_a_hello_with_an_unusable_address_is_refused_and_the_endpoint_keeps_serving(
    field: str, value: str
) -> None:
    async with victim_and_friend() as (victim, friend):
        m = DrainedMallory(victim.address)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(m.drain)
                hello = msgspec.structs.replace(m.hello(), endpoint="stranger", **{field: value})
                await m.send(wire.encode(hello))
                await still_serves(victim, friend, f"after-bad-{field}")
                assert counter(victim, "internal_errors") == 0
                await wait_until(
                    lambda: counter(victim, "hellos_refused") >= 1, 10, "the Hello refused"
                )
                assert "stranger" not in victim.peer_names()
                if field == "abort_address":  # its address works: it is told why
                    refusal = await m.wait_for(lambda b: b.get("type") == "refusal", 5)
                    assert refusal["code"] == "bad_hello", refusal
                tg.cancel_scope.cancel()
        finally:
            m.close()


@pytest.mark.parametrize(
    "shape",
    [(2**63, 0), (2**64 - 1, 0), (0, 2**63), (2**32, 2**32, 0), (2**62, 4, 0)],
    ids=["2^63x0", "u64maxx0", "0x2^63", "2^32x2^32x0", "2^62x4x0"],
)
async def test_an_inline_chunk_with_an_overflowing_shape_is_refused(shape: tuple[int, ...]) -> None:
    async with victim_and_friend() as (victim, friend):
        m = DrainedMallory(victim.address)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(m.drain)
                await _connected_mallory(victim, m)
                before = counter(victim, "decode_errors") + counter(victim, "protocol_errors")
                await m.send(inline_chunk_frame(shape))
                await still_serves(victim, friend, "after-shape")
                assert counter(victim, "internal_errors") == 0
                refused = counter(victim, "decode_errors") + counter(victim, "protocol_errors")
                assert refused > before, "the chunk was neither refused nor counted"
                tg.cancel_scope.cancel()
        finally:
            m.close()


def _inline_body(request_id: str) -> dict[str, Any]:
    """A valid inline chunk from mallory (16 float32s) as an editable dict."""
    t = torch.arange(16, dtype=torch.float32)
    layout = packing.plan([t])
    msg = wire.DataReadyMessage(
        request_id=request_id,
        from_stage="mallory",
        to_stage="victim",
        inline=wire.InlineStreamChunkRef(
            header=codec.dumps(t).header,
            tensors=layout.metas,
            data=packing.pack_bytes([t], layout),
        ),
    )
    return message_body(msg)


def _bad_table(edit: str) -> bytes:
    body = _inline_body("bad-" + edit)
    inline, meta = body["inline"], body["inline"]["tensors"][0]
    if edit == "misaligned":
        meta["offset"], inline["data"] = 4, bytes(4) + inline["data"]
    elif edit == "beyond the data":
        inline["data"] = inline["data"][:32]
    elif edit == "on cuda":
        meta["device"] = "cuda:0"
    elif edit == "nbytes not the shape's":
        meta["nbytes"] = 32
    elif edit == "unknown dtype":
        meta["dtype"] = "float7"
    elif edit == "data too long":
        inline["data"] = inline["data"] + bytes(wire.INLINE_MAX_TENSOR_BYTES + 64)
    return raw_frame(body)


@pytest.mark.parametrize(
    "edit",
    [
        "misaligned",
        "beyond the data",
        "on cuda",
        "nbytes not the shape's",
        "unknown dtype",
        "data too long",
    ],
)
async def test_an_inline_chunk_with_a_bad_table_is_refused_before_it_is_unpacked(
    edit: str,
) -> None:
    """Inline tables are checked once, when the frame is decoded, and the take path
    trusts that check: each bad table from a raw socket is refused and counted, the
    application sees nothing of it, and the next good chunk arrives intact."""
    async with victim_and_friend() as (victim, friend):
        m = DrainedMallory(victim.address)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(m.drain)
                await _connected_mallory(victim, m)
                before = counter(victim, "decode_errors")
                await m.send(_bad_table(edit))
                await m.send(raw_frame(_inline_body("good")))
                with anyio.fail_after(10):
                    d = await victim.receive(from_stage="mallory")
                assert (d.request_id, d.kind) == ("good", "stream_chunk"), d
                assert torch.equal(d.payload, torch.arange(16, dtype=torch.float32))
                d.release()
                assert counter(victim, "decode_errors") == before + 1
                assert counter(victim, "internal_errors") == 0
                await still_serves(victim, friend, "after-" + edit)
                tg.cancel_scope.cancel()
        finally:
            m.close()


def _hostile_frames(rng: random.Random, n: int, stranger_address: str) -> list[bytes]:
    """``n`` mixed hostile frames, seeded: garbage, truncations, foreign majors,
    messages from strangers, bad ACKs, bad refs, bad Hellos, overflowing shapes."""
    valid_abort = wire.encode(wire.AbortMessage(request_id="r", from_stage="mallory"))
    hello = message_body(
        wire.HelloMessage(
            endpoint="stranger",
            wire_min=(1, 0),
            wire_max=(1, 0),
            host_id="h",
            pid=1,
            process_token="t",
            instance=1,
            address=stranger_address,
        )
    )

    def bad_hello() -> bytes:
        body = dict(hello)
        body["endpoint"] = f"stranger-{rng.randrange(4)}"
        body[rng.choice(["address", "abort_address"])] = rng.choice(
            ["not-an-endpoint", "tcp://", _LONG_IPC, "ipc://", "tcp://*:-1"]
        )
        return raw_frame(body)

    def foreign_ready() -> bytes:
        return _ready(
            rng.randrange(1, 2**40),
            _shm_ref("omniwire-1-dead-0", 0, 64),
            request=f"x{rng.random()}",
        )

    makers = [
        lambda: os.urandom(rng.randrange(0, 300)),
        lambda: valid_abort[: rng.randrange(0, len(valid_abort))],
        lambda: b"OWIR" + bytes([rng.randrange(2, 256), 0, 0, 0]) + valid_abort[8:],
        lambda: raw_frame({"type": rng.choice(["data_ack", "data_ready", "hello", "nope"])}),
        lambda: raw_frame(
            {"type": "data_ack", "object_id": -1, "from_stage": "m", "to_stage": "v"}
        ),
        lambda: wire.encode(
            wire.DataAckMessage(
                object_id=rng.randrange(2**63), from_stage="mallory", to_stage="victim"
            )
        ),
        lambda: wire.encode(
            wire.DataProgressMessage(
                object_id=rng.randrange(2**63), from_stage="mallory", to_stage="victim", ready=10
            )
        ),
        lambda: wire.encode(
            wire.DataAckMessage(
                object_id=1, from_stage=f"ghost-{rng.randrange(10)}", to_stage="victim"
            )
        ),
        foreign_ready,
        bad_hello,
        lambda: inline_chunk_frame(
            rng.choice([(2**63, 0), (0, 2**64 - 1), (2**40, 2**40, 0)]),
            request_id=f"s{rng.random()}",
        ),
    ]
    return [rng.choice(makers)() for _ in range(n)]


async def test_five_thousand_hostile_frames_leave_the_endpoint_serving_and_the_log_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="omniwire")
    frames = _hostile_frames(random.Random(20261130), 5000, addr("stranger"))
    async with victim_and_friend() as (victim, friend):
        m = DrainedMallory(victim.address)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(m.drain)
                await _connected_mallory(victim, m)
                mark = len(caplog.records)
                received = counter(victim, "frames_received")
                for f in frames:
                    await m.send(f)
                await wait_until(
                    lambda: counter(victim, "frames_received") - received >= len(frames),
                    30,
                    f"the victim read all {len(frames)} frames",
                )
                await still_serves(victim, friend, "after-5000")
                assert counter(victim, "internal_errors") == 0
                records = _omniwire_records(caplog, mark)
                assert len(records) < 100, (len(records), records[:5])
                tg.cancel_scope.cancel()
        finally:
            m.close()


# ---------------------------------------------------------------- floods and fd leaks


async def test_a_hello_flood_is_bounded_and_gives_its_file_descriptors_back() -> None:
    """~400 Hellos under new names with addresses nobody serves: the peer table stays
    bounded while they arrive, and once the handshake/peer timeouts have passed the
    file descriptors are back near the baseline; the endpoint still serves."""
    n = 400
    async with (
        Endpoint("victim", address=addr("victim"), handshake_timeout=3, peer_timeout=3) as victim,
        Endpoint(
            "friend",
            address=addr("friend"),
            peers={"victim": victim.address},
            routes={"victim": "shm"},
        ) as friend,
    ):
        await friend.wait_peer("victim", 10)
        await still_serves(victim, friend, "warm")  # arenas and pools exist before the baseline
        m = DrainedMallory(victim.address)
        await m.send(wire.encode(m.hello()))  # mallory's own sockets are up and counted
        await wait_until(lambda: "mallory" in victim.peer_names(), 10, "mallory said Hello")
        baseline = fds()
        try:
            received = counter(victim, "frames_received")
            base = m.hello()
            for i in range(n):
                hello = msgspec.structs.replace(
                    base,
                    endpoint=f"flood-{i}",
                    instance=i + 1,
                    address=addr(f"nobody-{i}"),
                    backends=(),
                )
                await m.send(wire.encode(hello))
            await wait_until(
                lambda: counter(victim, "frames_received") - received >= n, 20, "all Hellos read"
            )
            await anyio.sleep(0.5)
            during = fds() - baseline
            # at most max_peers (256) peers at a few descriptors each (3 today: a PUSH
            # socket and its monitor pair), not some for every Hello
            assert during < 4 * 256 + 64, f"{during} more descriptors during the flood"
            await wait_until(
                lambda: fds() - baseline <= 8, 30, f"descriptors back near {baseline} (now {fds()})"
            )
            await still_serves(victim, friend, "after-flood")
            assert counter(victim, "internal_errors") == 0
        finally:
            m.close()


@pytest.mark.slow
async def test_sockets_of_lost_peers_are_released() -> None:
    """A sender with 5 receiver processes that are killed: its descriptors return to
    the baseline (one warm-up round first, so arenas and pools already exist). The
    receivers connect to the sender (learned peers), so nothing asks the sender to
    keep dialling them."""
    async with Endpoint("src", address=ipc_address("src"), peer_timeout=2) as ep:

        async def round_(k: int) -> None:
            peers = [
                PeerProcess(
                    f"rx{k}-{i}",
                    ipc_address(f"rx{k}-{i}"),
                    *("--mode", "sink", "--peer", f"src={ep.address}"),
                )
                for i in range(5 if k else 1)
            ]
            try:
                for p in peers:
                    await wait_until(
                        lambda n=p.name: n in ep.peer_names(), 30, f"{p.name} said Hello"
                    )
                    receipt = await ep.send(p.name, {"t": torch.ones(1 << 14)}, request_id=p.name)
                    await receipt.wait(10)
                lost = counter(ep, "peers_lost")
                for p in peers:
                    p.kill()
                await wait_until(
                    lambda: counter(ep, "peers_lost") - lost >= len(peers), 15, "all declared lost"
                )
            finally:
                for p in peers:
                    if p.proc.poll() is None:
                        p.kill()

        await round_(0)
        await anyio.sleep(0.5)
        baseline = fds()
        await round_(1)
        await wait_until(
            lambda: fds() - baseline <= 2, 15, f"descriptors back near {baseline} (now {fds()})"
        )


# ---------------------------------------------------------------- impersonation


async def test_a_hello_cannot_take_over_a_live_peers_name_without_a_key() -> None:
    async with (
        Endpoint("victim", address=addr("victim"), zero_copy=True) as victim,
        Endpoint(
            "friend",
            address=addr("friend"),
            peers={"victim": victim.address},
            routes={"victim": "shm"},
            max_inflight=2,
        ) as friend,
    ):
        await friend.wait_peer("victim", 10)
        pending = await friend.send("victim", {"t": torch.arange(100)}, request_id="real")
        await wait_until(lambda: victim.in_flight().get("friend", (0, 0))[1] == 1, 10, "held")
        m = DrainedMallory(victim.address)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(m.drain)
                impostor = msgspec.structs.replace(m.hello(), endpoint="friend", backends=())
                await m.send(wire.encode(impostor))
                refusal = await m.wait_for(lambda b: b.get("type") == "refusal", 5)
                assert refusal["code"] == "name_in_use", refusal
                tg.cancel_scope.cancel()
        finally:
            m.close()
        # the real friend's object is still in flight and completes
        with anyio.fail_after(10):
            d = await victim.receive()
        assert (d.kind, d.from_stage, d.request_id) == ("payload", "friend", "real")
        assert torch.equal(d.payload["t"], torch.arange(100))
        d.release()
        await pending.wait(10)
        # its credits are intact: max_inflight objects go out and come back
        receipts = [
            await friend.send("victim", {"i": i}, request_id=f"after-{i}") for i in range(2)
        ]
        for _ in receipts:
            with anyio.fail_after(10):
                (await victim.receive()).release()
        for r in receipts:
            await r.wait(10)
        assert friend.in_flight()["victim"] == (0, 0)
        assert counter(victim, "internal_errors") == 0


async def test_a_hello_cannot_claim_another_senders_shm_prefix() -> None:
    """A stranger (same pid, so the pid check passes) declares friend's shm prefix and
    announces an object in friend's arena: refused (bad_hello) or NACKed, never
    delivered as the stranger's data."""
    async with victim_and_friend() as (victim, friend):
        await still_serves(victim, friend, "warm")  # friend's arena holds data now
        prefix = friend.backend("shm").prefix
        arena = sorted(s for s in own_segments() if s.startswith(prefix + "-"))[0]
        m = DrainedMallory(victim.address)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(m.drain)
                info = msgspec.msgpack.encode({"prefix": prefix})
                hello = msgspec.structs.replace(
                    m.hello(), endpoint="thief", backends=(wire.BackendInfo(name="shm", info=info),)
                )
                await m.send(wire.encode(hello))
                await anyio.sleep(0.5)  # the Hello is handled first
                enc = codec.dumps({"t": torch.zeros(16, dtype=torch.int32)})
                layout = packing.plan(enc.tensors, enc.paths)
                ref = wire.DataRef(
                    object_id=7,
                    kind="payload",
                    backend="shm",
                    layout="packed",
                    ref=wire.BackendRef(
                        backend="shm", info=_shm_ref(arena, 0, layout.nbytes), length=layout.nbytes
                    ),
                    header=enc.header,
                    tensors=layout.metas,
                )
                await m.send(
                    wire.encode(
                        wire.DataReadyMessage(
                            request_id="stolen", from_stage="thief", to_stage="victim", data_ref=ref
                        )
                    )
                )
                from_thief: list[Any] = []
                with anyio.move_on_after(2):
                    while True:
                        d = await victim.receive()
                        if d.from_stage == "thief":
                            from_thief.append(d)
                assert not [d for d in from_thief if d.kind == "payload"], from_thief
                refused = [b for b in m.refusals() if b.get("code") == "bad_hello"]
                nacked = [
                    b
                    for b in m.inbox
                    if b.get("type") == "data_ack" and b.get("object_id") == 7 and not b["success"]
                ]
                assert refused or nacked, m.inbox
                tg.cancel_scope.cancel()
        finally:
            m.close()
        await still_serves(victim, friend, "after-thief")


# ---------------------------------------------------------------- bounded waits


async def test_a_credit_wait_ends_with_ack_timeout_naming_the_peer() -> None:
    """A zero-copy receiver that never releases: the send beyond max_inflight fails
    within ack_timeout with AckTimeoutError naming the peer."""
    async with (
        Endpoint("rx", address=ipc_address("rx"), zero_copy=True) as rx,
        Endpoint(
            "tx",
            address=ipc_address("tx"),
            peers={"rx": rx.address},
            routes={"rx": "shm"},
            max_inflight=2,
            ack_timeout=3,
        ) as tx,
    ):
        await tx.wait_peer("rx", 10)
        held = []
        for i in range(2):
            await tx.send("rx", {"t": torch.ones(1000)}, request_id=f"r{i}")
            with anyio.fail_after(10):
                held.append(await rx.receive())  # taken, never released
        with anyio.fail_after(15), pytest.raises(AckTimeoutError) as info:
            await tx.send("rx", {"t": torch.ones(1000)}, request_id="r2")
        assert "rx" in str(info.value)
        for d in held:
            d.release()


async def test_drain_with_a_timeout_raises_drain_timeout_naming_the_peer() -> None:
    async with (
        Endpoint("rx", address=ipc_address("rx"), zero_copy=True) as rx,
        Endpoint(
            "tx",
            address=ipc_address("tx"),
            peers={"rx": rx.address},
            routes={"rx": "shm"},
            ack_timeout=30,
        ) as tx,
    ):
        await tx.wait_peer("rx", 10)
        await tx.send("rx", {"t": torch.ones(1000)}, request_id="held")
        with anyio.fail_after(10):
            held = await rx.receive()
        with anyio.fail_after(10), pytest.raises(DrainTimeoutError) as info:
            await tx.drain(1)
        assert "rx" in str(info.value)
        held.release()


async def test_a_client_with_the_wrong_key_is_logged_at_a_bounded_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wrong-key client retries its handshake about ten times a second: a few log
    lines, not one per attempt."""
    caplog.set_level(logging.INFO, logger="omniwire")
    key = secrets.token_hex(16)
    async with (
        Endpoint("victim", address=addr("victim"), auth_key=key) as victim,
        Endpoint(
            "intruder", address=addr("intruder"), auth_key="wrong", peers={"victim": victim.address}
        ) as intruder,
    ):
        mark = len(caplog.records)
        await anyio.sleep(4)
        assert counter(intruder, "auth_failed") + counter(victim, "auth_failed") >= 2
        records = _omniwire_records(caplog, mark)
        assert len(records) <= 10, (len(records), records[:3])


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["payload", "stream_chunk"])
@pytest.mark.parametrize("exc_type", [MemoryError, KeyError, AssertionError])
async def test_a_receiving_backend_failing_in_any_way_reaches_the_application(
    monkeypatch: pytest.MonkeyPatch, kind: str, exc_type: type[BaseException]
) -> None:
    """Was: a read that failed with an exception outside the few the receiver knew
    (OmniwireError, TypeError, ValueError, RuntimeError, OSError) was NACKed to its
    sender but never told to the receiving application: a payload's consumer waited
    for ever, and a stream lost the chunk and then ended cleanly, as if nothing was
    missing. Every failure of a read is now an ``error`` delivery of its request."""
    from omniwire.backends.shm._backend import ShmBackend

    real = ShmBackend.import_

    async def failing(self: ShmBackend, *args: Any) -> Any:
        if self.ctx.endpoint == "b":
            raise exc_type("injected")
        return await real(self, *args)

    monkeypatch.setattr(ShmBackend, "import_", failing)
    async with (
        Endpoint("b", address=addr("b")) as b,
        Endpoint("a", address=addr("a"), peers={"b": b.address}, routes={"b": "shm"}) as a,
    ):
        await a.wait_peer("b", 10)
        big = torch.ones(1 << 18)  # 1 MiB: by shm
        if kind == "payload":
            receipt = await a.send("b", big, request_id="r1")
        else:
            receipt = await a.stream("b", big, request_id="r1")
            await a.end_stream("b", request_id="r1")
        with pytest.raises(Exception, match="injected"):
            await receipt.wait(10)
        d = await b.receive(5, request_id="r1")
        assert d.kind == "error"
        assert exc_type.__name__ in (d.error or "")


@pytest.mark.asyncio
async def test_a_progressive_send_cancelled_after_its_announce_does_not_stall_the_edge() -> None:
    """Was: cancelling a send while the later pieces of its progressive object were
    packed left the object announced and never completed. The receiver's take waited
    for progress until ``ack_timeout``, and every later object of that peer waited
    behind it; the sender counted the missed ACK against the peer. Three such cancels
    and a healthy peer was declared lost. An announced object is now finished whatever
    its caller does (its pieces are a bounded copy)."""
    import asyncio

    async with (
        Endpoint("b", address=addr("b"), zero_copy=False, ack_timeout=3) as b,
        Endpoint(
            "a",
            address=addr("a"),
            peers={"b": b.address},
            routes={"b": "shm"},
            ack_timeout=3,
        ) as a,
    ):
        await a.wait_peer("b", 10)
        big = torch.ones(96 << 20, dtype=torch.uint8)

        def publishing() -> bool:  # announced (16 MiB pieces), the later ones not all out
            peer = a._peers.get("b")
            assert peer is not None
            return any(r.ready < r.length for r in peer.session.outbound.values())

        for i in range(2):
            task = asyncio.ensure_future(a.send("b", {"x": big}, request_id=f"big{i}"))
            with anyio.fail_after(10):
                while not publishing():
                    await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        receipt = await a.send("b", {"y": torch.ones(16)}, request_id="small")
        with anyio.fail_after(2):  # not ack_timeout (3 s) behind a stalled object
            await receipt.wait()
            got = []
            while "small" not in got:
                got.append((await b.receive()).request_id)
        assert a.counters["peers_lost"] == 0
