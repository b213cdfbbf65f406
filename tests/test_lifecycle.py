"""Lifecycle rules of the endpoint (issue 10, BEHAVIOR-v2): close is cancel-safe,
aborts cancel pending sends and travel down a pipeline, a peer's death or clean
close ends its streams at the receiving application, and configuration mistakes
are clear errors at construction or ``start()`` that leave nothing behind."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from typing import Any

import anyio
import pytest
import torch

from omniwire.delivery import Delivery
from omniwire.endpoint import Endpoint
from omniwire.errors import (
    AddressError,
    AddressInUseError,
    ConfigurationError,
    EndpointClosedError,
    EndpointNotStartedError,
    NameClashError,
    OmniwireError,
    PeerClosedError,
    PeerNameMismatchError,
    RequestAbortedError,
    UnknownNameError,
)
from omniwire.testing import PeerProcess, _warm
from omniwire.testing.conformance import ipc_address

from lifecycle_support import (
    counter,
    existing,
    next_delivery,
    own_segments,
    socket_files,
    wait_until,
)


def _cause(d: Delivery) -> Any:
    return getattr(d, "cause", None)  # a v2 field


async def _stop(peer: PeerProcess) -> int:
    """SIGTERM the peer without blocking the event loop; returns its exit code."""
    return await anyio.to_thread.run_sync(peer.stop)


def _cleanup(*peers: PeerProcess) -> None:
    for p in peers:
        if p.proc.poll() is None:
            p.kill()


def _remove_leftovers(segments_before: set[str], address: str) -> None:
    """After a failed check: remove what a broken close left, so the session-wide
    /dev/shm check does not blame a later test."""
    for name in own_segments() - segments_before:
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{name}")
    for path in socket_files(address):
        with contextlib.suppress(OSError):
            os.unlink(path)


# ---------------------------------------------------------------- cancel-safe close


@pytest.mark.slow
@pytest.mark.asyncio
async def test_cancelling_the_owner_task_leaves_no_segment_and_no_socket_file() -> None:
    """The task holding ``async with Endpoint`` is cancelled while it has an shm edge
    (so an arena exists): its segments are unlinked and its socket files removed."""
    rx = PeerProcess("rx", ipc_address("rx"), "--mode", "sink")
    address = ipc_address("owner")
    before = own_segments()
    try:

        async def owner(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
            async with Endpoint(
                "owner", address=address, peers={"rx": rx.address}, routes={"rx": "shm"}
            ) as ep:
                await ep.wait_peer("rx", 30)
                await (await ep.send("rx", {"t": torch.ones(1 << 16)}, request_id="w")).wait(10)
                task_status.started()
                await anyio.sleep_forever()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await tg.start(owner)
                assert own_segments() - before, "the owner should have an arena by now"
                assert existing(socket_files(address)) == socket_files(address)
                tg.cancel_scope.cancel()
        assert not own_segments() - before, "segments left by the cancelled owner"
        assert not existing(socket_files(address))
    finally:
        _cleanup(rx)
        _remove_leftovers(before, address)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_aclose_inside_fail_after_closes_and_cleans_up() -> None:
    rx = PeerProcess("rx", ipc_address("rx"), "--mode", "sink")
    address = ipc_address("owner")
    before = own_segments()
    try:
        ep = Endpoint("owner", address=address, peers={"rx": rx.address}, routes={"rx": "shm"})
        await ep.start()
        try:
            await ep.wait_peer("rx", 30)
            await (await ep.send("rx", {"t": torch.ones(1 << 16)}, request_id="w")).wait(10)
            assert own_segments() - before, "the endpoint should have an arena by now"
        finally:
            with anyio.fail_after(5):
                await ep.aclose()
        assert not own_segments() - before
        assert not existing(socket_files(address))
        await ep.aclose()  # idempotent
    finally:
        _cleanup(rx)
        _remove_leftovers(before, address)


# ---------------------------------------------------------------- aborts


@pytest.mark.asyncio
async def test_abort_cancels_a_send_that_waits_for_the_handshake() -> None:
    """The peer is not up yet; ``abort(rid)`` fails the send waiting for its Hello at
    once, and when the peer comes up later nothing of rid reaches it."""
    late_address = ipc_address("late")
    async with Endpoint(
        "early",
        address=ipc_address("early"),
        peers={"late": late_address},
        routes={"late": "shm"},
        handshake_timeout=30,
    ) as ep:
        outcome: list[Any] = []
        done = anyio.Event()

        async def sender() -> None:
            try:
                await ep.send("late", {"t": torch.ones(1000)}, request_id="rid")
                outcome.append("sent")
            except Exception as exc:
                outcome.append(exc)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(sender)
            await anyio.sleep(0.5)  # the send is waiting for the handshake now
            await ep.abort("rid", reason="user gave up")
            with anyio.move_on_after(5):
                await done.wait()
            assert outcome, "send(rid) still waits for the handshake 5 s after abort(rid)"
        assert isinstance(outcome[0], RequestAbortedError), outcome
        assert "rid" in str(outcome[0])

        async with Endpoint("late", address=late_address) as late:
            await ep.wait_peer("late", 10)
            receipt = await ep.send("late", {"t": torch.zeros(10)}, request_id="after")
            # frames to one peer keep their order: rid, had it been sent, comes first
            d, skipped = await next_delivery(late, lambda d: d.kind != "aborted", 10)
            assert d.request_id == "after", d
            assert not [s for s in skipped if s.request_id == "rid" and s.kind != "aborted"]
            await receipt.wait(10)


@pytest.mark.asyncio
async def test_abort_travels_down_a_pipeline_without_a_direct_link() -> None:
    """a → b → c, c has no link to a; b's application forwards a's payloads to c under
    the same request id. ``a.abort(rid)``: c sees one ``aborted`` delivery naming a,
    c's in-flight objects of rid are released, and b forwards the abort once."""
    async with (
        Endpoint("c", address=ipc_address("c"), zero_copy=True) as c,
        Endpoint("b", address=ipc_address("b"), peers={"c": c.address}, routes={"c": "shm"}) as b,
        Endpoint("a", address=ipc_address("a"), peers={"b": b.address}, routes={"b": "shm"}) as a,
    ):
        await a.wait_peer("b", 10)
        await b.wait_peer("c", 10)

        async def forward() -> None:  # b's application
            async for d in b:
                if d.kind == "payload":
                    try:
                        await b.send("c", d.payload, request_id=d.request_id)
                    except OmniwireError:
                        pass
                d.release()

        async with anyio.create_task_group() as tg:
            tg.start_soon(forward)
            for i in range(2):
                await a.send("b", {"i": i, "t": torch.full((1000,), i)}, request_id="rid")
            # c holds both objects (zero-copy, its application has not taken them)
            await wait_until(
                lambda: c.in_flight().get("b", (0, 0))[1] == 2, 10, "c holds 2 objects of rid"
            )
            await a.abort("rid", reason="user cancelled")
            # the abort travels a → b → c: once c has heard of it, nothing of rid is handed out
            await wait_until(lambda: counter(c, "aborts") >= 1, 5, "c heard of the abort")
            d, skipped = await next_delivery(c, lambda d: d.kind == "aborted", 5)
            assert (d.request_id, d.from_stage, d.error) == ("rid", "a", "user cancelled")
            assert not [s for s in skipped if s.request_id == "rid"], "data of rid delivered"
            await wait_until(
                lambda: (
                    c.in_flight().get("b", (0, 0)) == (0, 0)
                    and b.in_flight().get("c", (0, 0)) == (0, 0)
                ),
                10,
                "c's objects of rid released (and b's credits back)",
            )
            more: list[Delivery] = []
            with anyio.move_on_after(1):
                while True:
                    more.append(await c.receive())
            assert not [m for m in more if m.request_id == "rid"], more
            assert counter(b, "aborts_forwarded") == 1
            tg.cancel_scope.cancel()


# ---------------------------------------------------------------- peer death and close


@pytest.mark.slow
@pytest.mark.asyncio
async def test_sender_dying_mid_stream_ends_the_stream_with_peer_lost() -> None:
    """The peer echoes our stream back, then is SIGKILLed: its open stream to us ends
    with an ``error`` delivery, cause ``peer_lost``, naming it."""
    peer = PeerProcess("echoer", ipc_address("echoer"))
    try:
        async with Endpoint(
            "src",
            address=ipc_address("src"),
            peers={"echoer": peer.address},
            routes={"echoer": "shm"},
        ) as ep:
            await ep.wait_peer("echoer", 30)
            for i in range(3):
                await ep.stream("echoer", {"i": i, "t": torch.full((1 << 16,), i)}, request_id="s")
            first, _ = await next_delivery(ep, lambda d: d.kind == "stream_chunk", 20)
            assert first.request_id == "s"
            peer.kill()
            d, _ = await next_delivery(ep, lambda d: d.kind not in ("stream_chunk",), 15)
            assert (d.kind, d.request_id, d.from_stage) == ("error", "s", "echoer"), d
            assert _cause(d) == "peer_lost", d
            assert "echoer" in (d.error or "")
    finally:
        _cleanup(peer)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_clean_close_is_reported_as_closed_and_fails_pending_receipts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The receiver closes cleanly (SIGTERM → aclose → Goodbye) while our objects are
    in flight with it: counted as closed, not lost; no "lost" log line; pending
    receipts fail with PeerClosedError."""
    caplog.set_level(logging.INFO, logger="omniwire")
    sink = PeerProcess(
        "sink",
        ipc_address("sink"),
        *("--mode", "sink", "--zero-copy", "--delay", "30", "--receive-buffer", "1"),
    )
    try:
        async with Endpoint(
            "src",
            address=ipc_address("src"),
            peers={"sink": sink.address},
            routes={"sink": "shm"},
            ack_timeout=30,
        ) as ep:
            await ep.wait_peer("sink", 30)
            receipts = [
                await ep.send("sink", {"t": torch.ones(1 << 14)}, request_id=f"r{i}")
                for i in range(3)
            ]
            mark = len(caplog.records)
            assert await _stop(sink) == 0
            await wait_until(
                lambda: counter(ep, "peers_closed") + counter(ep, "peers_lost") >= 1,
                10,
                "the sink's close noticed",
            )
            outcomes: list[BaseException | None] = []
            for r in receipts:
                try:
                    await r.wait(10)
                    outcomes.append(None)  # the sink's application released it on its way out
                except Exception as exc:
                    outcomes.append(exc)
            failed = [o for o in outcomes if o is not None]
            assert failed, "the sink held objects it never took"
            assert all(isinstance(o, PeerClosedError) for o in failed), outcomes
            assert (counter(ep, "peers_closed"), counter(ep, "peers_lost")) == (1, 0)
            lost_lines = [
                r.getMessage()
                for r in caplog.records[mark:]
                if r.name.startswith("omniwire") and re.search(r"\blost\b", r.getMessage())
            ]
            assert not lost_lines
    finally:
        _cleanup(sink)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_clean_close_ends_an_open_stream_with_peer_closed() -> None:
    peer = PeerProcess("echoer", ipc_address("echoer"))
    try:
        async with Endpoint(
            "src", address=ipc_address("src"), peers={"echoer": peer.address}
        ) as ep:
            await ep.wait_peer("echoer", 30)
            await ep.stream("echoer", {"t": torch.arange(16)}, request_id="s")
            first, _ = await next_delivery(ep, lambda d: d.kind == "stream_chunk", 20)
            assert first.request_id == "s"
            assert await _stop(peer) == 0
            d, _ = await next_delivery(ep, lambda d: d.kind != "stream_chunk", 10)
            assert (d.kind, d.request_id, d.from_stage) == ("error", "s", "echoer"), d
            assert _cause(d) == "peer_closed", d
            assert (counter(ep, "peers_closed"), counter(ep, "peers_lost")) == (1, 0)
    finally:
        _cleanup(peer)


# ---------------------------------------------------------------- names and addresses


@pytest.mark.asyncio
async def test_a_second_endpoint_with_the_same_name_gets_name_clash() -> None:
    async with (
        Endpoint("hub", address=ipc_address("hub")) as hub,
        Endpoint("worker", address=ipc_address("worker1"), peers={"hub": hub.address}) as first,
    ):
        await first.wait_peer("hub", 10)
        async with Endpoint(
            "worker", address=ipc_address("worker2"), peers={"hub": hub.address}
        ) as second:
            with anyio.fail_after(10), pytest.raises(NameClashError) as info:
                await second.wait_peer("hub", 5)  # the contract: within 3 s of contact
            assert "worker" in str(info.value) and "hub" in str(info.value)
        # the first keeps working
        receipt = await first.send("hub", {"t": torch.arange(5)}, request_id="still-here")
        d, _ = await next_delivery(hub, lambda d: d.kind == "payload", 10)
        assert (d.request_id, d.from_stage) == ("still-here", "worker")
        assert torch.equal(d.payload["t"], torch.arange(5))
        await receipt.wait(10)


def _ipc_dir_listing() -> set[str]:
    base = os.path.join(tempfile.gettempdir(), f"owt-{os.getuid()}")
    return set(os.listdir(base)) if os.path.isdir(base) else set()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["ipc", "tcp"])
async def test_binding_a_served_address_is_address_in_use(kind: str) -> None:
    live_address = ipc_address("live") if kind == "ipc" else "tcp://127.0.0.1:0"
    shm_only = ["local", "shm"]  # no engines for tcp: this is about the address
    async with Endpoint("live", address=live_address, backends=shm_only) as live:
        files_before = _ipc_dir_listing()
        segments_before = own_segments()
        other = Endpoint("other", address=live.address, backends=shm_only)
        try:
            with anyio.fail_after(10), pytest.raises(AddressInUseError) as info:
                await other.start()
        finally:
            await other.aclose()  # nothing to do once start() refused
        assert live.address in str(info.value)
        assert _ipc_dir_listing() == files_before
        assert own_segments() == segments_before
        # the live endpoint is unharmed: a newcomer reaches it at its address
        async with Endpoint(
            "friend", address=ipc_address("friend"), peers={"live": live.address}
        ) as f:
            await f.wait_peer("live", 10)
            receipt = await f.send("live", {"x": 1}, request_id="hi")
            d, _ = await next_delivery(live, lambda d: d.kind == "payload", 10)
            assert d.payload == {"x": 1}
            await receipt.wait(10)


@pytest.mark.asyncio
async def test_a_peers_key_that_is_not_the_remote_name_is_a_name_mismatch() -> None:
    async with (
        Endpoint("ystage", address=ipc_address("ystage")) as y,
        Endpoint("me", address=ipc_address("me"), peers={"xstage": y.address}) as me,
    ):
        with anyio.fail_after(10), pytest.raises(PeerNameMismatchError) as info:
            await me.wait_peer("xstage", 5)  # the contract: within 3 s of contact
        assert "xstage" in str(info.value) and "ystage" in str(info.value)


_LONG_IPC = f"ipc://{tempfile.gettempdir()}/owt-{os.getuid()}/" + "a" * 120
_MALFORMED = ["ipc:/x", "tpc://h:1", _LONG_IPC, "tcp://127.0.0.1:99999"]


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["address", "peers"])
@pytest.mark.parametrize("bad", _MALFORMED, ids=["ipc-one-slash", "tpc", "ipc-too-long", "port"])
async def test_a_malformed_address_is_an_address_error_at_construction(
    where: str, bad: str
) -> None:
    own = ipc_address("own")
    files_before = _ipc_dir_listing()
    kwargs: dict[str, Any] = (
        {"address": bad} if where == "address" else {"address": own, "peers": {"p": bad}}
    )
    with pytest.raises(AddressError) as info:
        Endpoint("me", **kwargs)
    named = bad[len("ipc://") :] if bad.startswith("ipc://") else bad  # with or without scheme
    assert named[:30] in str(info.value)
    assert _ipc_dir_listing() == files_before
    assert not existing(["/x"])


@pytest.mark.asyncio
async def test_calls_before_start_say_not_started_and_after_close_say_closed() -> None:
    ep = Endpoint("early", address=ipc_address("early"))
    calls = {
        "send": lambda: ep.send("x", {"a": 1}, request_id="r"),
        "stream": lambda: ep.stream("x", {"a": 1}, request_id="r"),
        "end_stream": lambda: ep.end_stream("x", request_id="r"),
        "wait_peer": lambda: ep.wait_peer("x", 1),
        "abort": lambda: ep.abort("r"),
    }
    for name, call in calls.items():
        with anyio.fail_after(5), pytest.raises(EndpointNotStartedError, match="start") as info:
            await call()
        assert "early" in str(info.value), name
    await ep.start()
    await ep.aclose()
    with anyio.fail_after(5), pytest.raises(EndpointClosedError) as closed:
        await ep.send("x", {"a": 1}, request_id="r")
    assert not isinstance(closed.value, EndpointNotStartedError)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("backends", ["shmm"], "shmm"),
        ("policy", "nope", "nope"),
        ("routes", {"b": "nixll"}, "nixll"),
    ],
)
async def test_an_unknown_backend_policy_or_route_is_unknown_name_at_construction(
    option: str, value: Any, named: str
) -> None:
    address = ipc_address("me")
    with pytest.raises(UnknownNameError) as info:
        Endpoint("me", address=address, **{option: value})
    assert named in str(info.value)
    registered = "default" if option == "policy" else "local"
    assert registered in str(info.value), "the message lists the registered names"
    assert not existing(socket_files(address))


def test_trio_is_refused_at_start_saying_asyncio() -> None:
    address = ipc_address("t")

    async def main() -> None:
        with anyio.fail_after(10):
            async with Endpoint("t", address=address):
                pass

    with pytest.raises(ConfigurationError, match="asyncio"):
        anyio.run(main, backend="trio")
    assert not existing(socket_files(address))


# ---------------------------------------------------------------- start-up


@pytest.mark.slow
@pytest.mark.asyncio
async def test_three_processes_started_at_once_reach_every_peer() -> None:
    """Issue 47 item 5: three stages started at the same moment — some connect
    before the next one listens — each naming only its downstream stage (the last
    names the first, which it answers): each completes its handshake with both
    neighbours, the downstream by its address, the upstream by the Hello it sent.
    No timing is asserted (README "Start-up" says what to expect, and
    scripts/startup_time.py measures it); the bound catches a hang."""
    names = ["encoder", "thinker", "talker"]
    addrs = {n: ipc_address(n) for n in names}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: list[Any] = []
    try:
        for i, name in enumerate(names):
            down, up = names[(i + 1) % len(names)], names[i - 1]
            argv = ["-m", "omniwire.peer", "--name", name, "--address", addrs[name]]
            argv += [f"--peer={down}={addrs[down]}", f"--wait-peer={down}", f"--wait-peer={up}"]
            procs.append(_warm.start(argv, env))
        said: list[list[str]] = []
        with anyio.fail_after(120):
            for proc in procs:
                lines = []
                for _ in range(2):
                    line = await anyio.to_thread.run_sync(
                        proc.stdout.readline, abandon_on_cancel=True
                    )
                    lines.append(line.strip())
                said.append(lines)
        for name, lines, i in zip(names, said, range(3), strict=True):
            down, up = names[(i + 1) % len(names)], names[i - 1]
            assert lines[0].startswith("READY "), (name, lines)
            assert lines[1] == f"PEERS {down},{up}", (name, lines)
        for proc in procs:
            proc.terminate()
        with anyio.fail_after(60):
            codes = [await anyio.to_thread.run_sync(proc.wait) for proc in procs]
        assert codes == [0, 0, 0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
