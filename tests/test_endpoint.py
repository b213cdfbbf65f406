"""Endpoint behaviour with endpoints in one process (shm forced where buffers matter)."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch
import zmq
import zmq.asyncio

from omniwire import wire
from omniwire.endpoint import Endpoint
from omniwire.errors import (
    AckTimeoutError,
    EndpointClosedError,
    HandshakeError,
    NoRouteError,
    RequestAbortedError,
)
from omniwire.routing import PreferenceOrderPolicy, StrictDefaultPolicy

pytestmark = pytest.mark.asyncio


def addr(name: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/owt-{os.getuid()}/{name}-{secrets.token_hex(3)}"


@asynccontextmanager
async def pair(**receiver_kw: Any) -> AsyncIterator[tuple[Endpoint, Endpoint]]:
    """``a`` sends to ``b``; ``sender_kw`` via ``receiver_kw.pop('sender', {})``."""
    sender_kw = receiver_kw.pop("sender", {})
    async with (
        Endpoint("b", address=addr("b"), **receiver_kw) as b,
        Endpoint("a", address=addr("a"), peers={"b": b.address}, **sender_kw) as a,
    ):
        await a.wait_peer("b", 10)
        yield a, b


async def test_same_process_uses_local_and_swapping_the_policy_changes_the_backend() -> None:
    async with pair() as (a, b):
        await (await a.send("b", {"x": torch.ones(4)}, request_id="r")).wait(10)
        d = await b.receive()
        assert d.backend == "local"
        assert a.route_stats[("b", "payload", "local")].reason.startswith("same process")
    policy = PreferenceOrderPolicy(["shm"])
    async with pair(sender={"policy": policy}) as (a, b):
        route = a.route("b", {"x": torch.ones(4)})
        assert route.backend == "shm"
        assert route.policy == policy.name
        assert "first fit in preference order" in route.reason
        assert dict(route.rejected)["local"] == "after shm in the preference order"
        await (await a.send("b", {"x": torch.ones(4)}, request_id="r")).wait(10)
        d = await b.receive()
        assert d.backend == "shm"
        assert torch.equal(d.payload["x"], torch.ones(4))


async def test_policy_by_entry_point_name_and_strict_failure() -> None:
    async with pair(sender={"policy": "strict", "routes": {"b:stream_chunk": "nixl"}}) as (a, _):
        assert isinstance(a.policy.fallback, StrictDefaultPolicy)  # type: ignore[attr-defined]
        with pytest.raises(NoRouteError, match="'nixl' is not run by both"):
            await a.stream("b", torch.ones(2), request_id="r")


async def test_fan_out_to_local_targets_copies_containers_not_tensors() -> None:
    async with Endpoint("c", address=addr("c")) as c, pair() as (a, b):
        a.add_peer("c", c.address)
        await a.wait_peer("c", 10)
        t = torch.arange(4.0)
        payload = {"t": t, "meta": {"ids": [1, 2]}}
        await a.send("b", payload, request_id="r")
        await a.send("c", payload, request_id="r")
        got_b, got_c = (await b.receive()).payload, (await c.receive()).payload
        got_b["meta"]["ids"].append(3)
        assert got_c["meta"]["ids"] == [1, 2] and payload["meta"]["ids"] == [1, 2]
        assert got_b["t"] is t and got_c["t"] is t


async def test_payload_errors_name_the_path() -> None:
    async with pair() as (a, _):
        with pytest.raises(TypeError, match=r"payload\['x'\]\[1\]: values of type set"):
            await a.send("b", {"x": [1, {2}]}, request_id="r")
        with pytest.raises(
            TypeError, match=r"metadata cannot hold tensors \(found metadata\['t'\]\)"
        ):
            await a.send("b", 1, request_id="r", metadata={"t": torch.ones(1)})
        with pytest.raises(TypeError, match=r"metadata\['m'\]\[0\]: values of type set"):
            await a.end_stream("b", request_id="r", metadata={"m": [{1}]})


async def test_inline_chunks_need_no_ack_and_streams_keep_order() -> None:
    routes = {"b:stream_chunk": "inline"}
    async with pair(sender={"routes": routes}) as (a, b):
        receipts = [
            await a.stream("b", torch.full((4,), i), request_id="s", metadata={"i": i})
            for i in range(5)
        ]
        assert all(r.done() for r in receipts)
        await a.end_stream("b", request_id="s", error="stopped early")
        got = [await b.receive() for _ in range(7)]
        chunks = [d for d in got if d.kind == "stream_chunk"]
        assert [d.metadata["i"] for d in chunks] == [0, 1, 2, 3, 4]
        assert {d.backend for d in chunks} == {"inline"}
        assert [d.kind for d in got[5:]] == ["error", "stream_end"]
        assert got[5].error == "stopped early"


async def test_ack_timeout_names_the_peer_and_the_object() -> None:
    routes = {"b": "shm"}
    async with pair(zero_copy=True, sender={"routes": routes, "ack_timeout": 0.5}) as (a, b):
        receipt = await a.send("b", {"x": torch.ones(8)}, request_id="slow")
        d = await b.receive()  # zero-copy: not released, so never acknowledged
        with pytest.raises(
            AckTimeoutError,
            match=rf"peer 'b' did not acknowledge object {receipt.object_id} \(request 'slow'",
        ):
            await receipt.wait(5)
        d.release()
        with anyio.fail_after(5):
            while a.in_flight()["b"] != (0, 0):
                await anyio.sleep(0.02)
        assert a.backend("shm").stats().exports == 0


async def test_a_receipt_failed_by_timeout_settles_when_the_late_ack_comes() -> None:
    """The timeout says what it knows (the object may still arrive); the late ACK
    settles the receipt as delivered, and a late NACK as refused."""
    routes = {"b": "shm"}
    async with pair(zero_copy=True, sender={"routes": routes, "ack_timeout": 0.5}) as (a, b):
        receipt = await a.send("b", {"x": torch.ones(8)}, request_id="late")
        assert receipt.outcome == "pending"
        d = await b.receive()  # zero-copy: not released, so not acknowledged yet
        with pytest.raises(AckTimeoutError, match="may still be delivered"):
            await receipt.wait(5)
        assert receipt.outcome == "unknown"
        d.release()  # the ACK goes now, after the timeout
        with anyio.fail_after(5):
            assert await receipt.settled() == "delivered"
        assert receipt.outcome == "delivered"
        with pytest.raises(AckTimeoutError):  # what wait() said stays said
            await receipt.wait(1)
        # an aborted object's receipt fails at once; the receiver's NACK settles it
        receipt = await a.send("b", {"x": torch.ones(8)}, request_id="gone")
        await a.abort("gone")
        with pytest.raises(RequestAbortedError):
            await receipt.wait(5)
        with anyio.fail_after(5):
            assert await receipt.settled() in ("refused", "delivered")
        ok = await a.send("b", {"x": torch.ones(8)}, request_id="ok")
        with anyio.fail_after(5):
            while (d := await b.receive()).request_id != "ok":
                d.release()
        d.release()
        await ok.wait(5)
        assert ok.outcome == "delivered" and await ok.settled() == "delivered"


async def test_abort_releases_buffers_on_both_sides() -> None:
    routes = {"b": "shm"}
    async with pair(zero_copy=True, sender={"routes": routes}) as (a, b):
        receipts = [await a.stream("b", torch.ones(1 << 14), request_id="doomed") for _ in range(3)]
        other = await a.send("b", {"keep": torch.ones(4)}, request_id="kept")
        with anyio.fail_after(10):
            while b.queued() < 4:
                await anyio.sleep(0.01)
        assert a.backend("shm").stats().exports == 4
        await b.abort("doomed", "client went away")
        for r in receipts:
            with pytest.raises(RequestAbortedError):
                await r.wait(10)
        kept = await b.receive()
        assert (kept.kind, kept.request_id) == ("payload", "kept")
        kept.release()
        await other.wait(10)
        with anyio.fail_after(10):
            while a.backend("shm").stats().exports or any(any(v) for v in b.in_flight().values()):
                await anyio.sleep(0.01)
        assert b.backend("shm").stats().imports == 0
        with pytest.raises(RequestAbortedError):
            await a.stream("b", torch.ones(2), request_id="doomed")


async def test_abort_from_the_sender_reaches_the_receiver() -> None:
    async with pair(sender={"routes": {"b": "shm"}}) as (a, b):
        await a.stream("b", torch.ones(4), request_id="r1")
        await a.abort("r1", "cancelled")
        with anyio.fail_after(10):
            while True:
                d = await b.receive()
                if d.kind == "aborted":
                    break
        assert (d.request_id, d.from_stage, d.error) == ("r1", "a", "cancelled")


async def test_abort_at_the_receiver_reaches_its_sender_without_the_broadcast() -> None:
    """A sender has seen the request: the abort goes to it on the link, not only by
    PUB/SUB (whose subscription may not be up yet: a late joiner misses it)."""
    async with pair(sender={"routes": {"b": "shm"}}) as (a, b):
        await a.stream("b", torch.ones(4), request_id="r1")
        assert (await b.receive(timeout=10)).kind == "stream_chunk"

        async def lost(frame: bytes) -> None:  # the broadcast reaches nobody
            return None

        b._core.control.publish = lost  # type: ignore[method-assign]
        await b.abort("r1", "client went away")
        d = await a.receive(timeout=10)
        assert (d.kind, d.request_id, d.from_stage) == ("aborted", "r1", "b")
        with pytest.raises(RequestAbortedError):
            await a.stream("b", torch.ones(2), request_id="r1")


async def test_slow_receiver_backpressure_bounds_memory_and_drops_nothing() -> None:
    n, size = 24, 1 << 20
    async with pair(receive_buffer=2, sender={"routes": {"b": "shm"}, "max_inflight": 3}) as (a, b):
        peak_sender = peak_receiver = 0
        got: list[int] = []

        async def consume() -> None:
            while len(got) < n:
                d = await b.receive()
                got.append(d.payload["i"])
                assert d.payload["t"].numel() == size // 4
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for i in range(n):
                await a.send("b", {"i": i, "t": torch.ones(size // 4)}, request_id=f"r{i}")
                peak_sender = max(peak_sender, a.in_flight()["b"][0])
                peak_receiver = max(peak_receiver, b.queued())
        assert got == list(range(n))
        assert peak_sender <= 3
        assert peak_receiver <= 2


async def test_handshake_timeout_names_the_peer() -> None:
    async with Endpoint("lonely", address=addr("lonely"), peers={"ghost": addr("ghost")}) as ep:
        with pytest.raises(HandshakeError, match=r"peer 'ghost' at ipc://.* did not complete"):
            await ep.wait_peer("ghost", 0.3)


async def test_unknown_major_version_is_refused_and_the_endpoint_keeps_serving() -> None:
    async with pair() as (a, b):
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(b.address)
        hello = wire.HelloMessage(
            endpoint="future",
            wire_min=(2, 0),
            wire_max=(2, 0),
            host_id="x",
            pid=1,
            process_token="t",
            instance=1,
            address="ipc:///nowhere",
        )
        await push.send(wire.encode(hello, version=(2, 0)))
        await push.send(b"garbage that is not a frame")
        with anyio.fail_after(5):
            while (
                b.counters.get("version_refused", 0) < 1 or b.counters.get("decode_errors", 0) < 1
            ):
                await anyio.sleep(0.01)
        push.close(0)
        ctx.term()
        await a.send("b", {"still": "works"}, request_id="r")
        assert (await b.receive()).payload == {"still": "works"}


async def test_closed_endpoint_refuses_work_and_close_is_idempotent() -> None:
    ep = Endpoint("short", address=addr("short"))
    async with ep:
        pass
    await ep.aclose()
    with pytest.raises(EndpointClosedError):
        await ep.send("x", 1, request_id="r")
    with pytest.raises(EndpointClosedError):
        await ep.receive()


async def test_a_routes_key_that_names_no_configured_peer_is_warned_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    routes = {"bb": "shm", "b:stream_chunk": "inline", "x->b": "shm", "a->c:payload": "shm"}
    with caplog.at_level("WARNING", logger="omniwire.endpoint"):
        async with Endpoint("a", address=addr("a"), peers={"b": addr("b")}, routes=routes):
            pass
    warned = [r.getMessage() for r in caplog.records if "routes" in r.getMessage()]
    assert any("'bb'" in m and "no configured peer" in m for m in warned), warned
    assert any("'x->b'" in m and "not this endpoint" in m for m in warned), warned
    assert any("'a->c:payload'" in m for m in warned), warned
    assert not any("'b:stream_chunk'" in m for m in warned), warned


async def test_an_emptied_omniwire_socket_directory_is_removed_at_close() -> None:
    base = os.path.join(tempfile.gettempdir(), f"owt-{os.getuid()}")
    ours = os.path.join(base, f"omniwire-t-{secrets.token_hex(3)}")
    theirs = os.path.join(base, f"mine-{secrets.token_hex(3)}")
    async with (
        Endpoint("a", address=f"ipc://{ours}/a") as a,
        Endpoint("b", address=f"ipc://{ours}/b"),
        Endpoint("c", address=f"ipc://{theirs}/c"),
    ):
        await a.aclose()
        assert _entries(ours) == ["b", "b.abort"]  # b's sockets are still in it
    assert _entries(ours) is None  # named omniwire-*: made for omniwire, now empty
    assert _entries(theirs) == []  # the user's own directory stays
    os.rmdir(theirs)


def _entries(directory: str) -> list[str] | None:
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:
        return None
