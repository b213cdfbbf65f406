"""Session resumption (spec §10.7), sans-I/O and between two endpoints in one process.

The blip itself (a real partition between namespace hosts) is in
``tests/test_cluster.py``; here: the numbering rules of :class:`wire.Resumption`,
the session tokens of :class:`wire.Session`, and that two endpoints negotiate the
feature (and that ``resume_window=0`` opts out).
"""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omniwire import Endpoint, OmniwireError, wire
from omniwire.errors import RemoteProtocolError


def _hello(name: str, *, resume: bool = True, token: int = 5, **kw: object) -> wire.HelloMessage:
    return wire.HelloMessage(
        endpoint=name,
        wire_min=(1, 0),
        wire_max=wire.WIRE_VERSION,
        features=("resume",) if resume else (),
        host_id="h",
        pid=1,
        process_token="p",
        instance=kw.pop("instance", 7),  # type: ignore[arg-type]
        address="tcp://127.0.0.1:1",
        session=token if resume else 0,
        **kw,  # type: ignore[arg-type]
    )


def test_frames_apply_once_in_order_and_acks_release_what_is_retained() -> None:
    r = wire.Resumption(token=11, peer_token=22)
    assert [r.sent(b"x" * 10) for _ in range(3)] == [1, 2, 3]
    assert [s for s, _ in r.retained] == [1, 2, 3] and r.retained_bytes == 30
    r.on_ack(2)
    assert [s for s, _ in r.retained] == [3] and r.retained_bytes == 10
    r.on_ack(1)  # an older ack changes nothing
    assert r.acked == 2
    with pytest.raises(RemoteProtocolError):
        r.on_ack(4)  # never sent
    # receiving: only this session's next number
    assert not r.accept(22, 1)  # another token: a frame of an ended session
    assert r.accept(11, 1) and r.accept(11, 2)
    assert not r.accept(11, 2)  # a duplicate
    assert not r.accept(11, 4)  # past a gap (3 comes again, then 4)
    assert r.accept(11, 3) and r.accept(11, 4)
    assert r.accept(11, 0)  # an ack alone
    assert r.received == 4


@given(st.lists(st.integers(1, 40), max_size=200))
def test_whatever_arrives_only_the_next_number_applies(arrivals: list[int]) -> None:
    """Any order of arrivals, duplicates included: what is applied is 1, 2, 3, …
    with no number twice."""
    r = wire.Resumption(token=1, peer_token=2)
    applied = [seq for seq in arrivals if r.accept(1, seq)]
    assert applied == list(range(1, len(applied) + 1))


def test_a_session_token_changes_whenever_the_session_ends() -> None:
    s: wire.Session[wire.OutboundObject, wire.InboundObject] = wire.Session(
        local_name="b", peer_name="a", resumes=True
    )
    first = s.token
    assert s.on_hello(_hello("a"))[0] is wire.HelloOutcome.NEW
    assert s.resumption is not None and s.resumption.token == first
    assert s.resumption.peer_token == 5
    # the same instance again (a reconnect): the session and its numbers go on
    s.resumption.accept(first, 1)
    assert s.on_hello(_hello("a", token=6))[0] is wire.HelloOutcome.DUPLICATE
    assert s.resumption.received == 1 and s.resumption.peer_token == 6
    # a restart of the peer: a new token, numbering from 1
    assert s.on_hello(_hello("a", instance=8))[0] is wire.HelloOutcome.RESTART
    assert s.token != first and s.resumption.received == 0
    second = s.token
    s.reset()  # lost
    assert s.token not in (first, second) and s.resumption is None


def test_no_resumption_unless_both_sides_offer_it() -> None:
    ours: wire.Session[wire.OutboundObject, wire.InboundObject] = wire.Session(
        local_name="b", peer_name="a", resumes=True
    )
    ours.on_hello(_hello("a", resume=False))
    assert ours.resumption is None
    theirs_only: wire.Session[wire.OutboundObject, wire.InboundObject] = wire.Session(
        local_name="b", peer_name="a", resumes=False
    )
    theirs_only.on_hello(_hello("a"))
    assert theirs_only.resumption is None


@pytest.mark.asyncio
@pytest.mark.parametrize("window", [30.0, 0.0])
async def test_two_endpoints_number_their_frames_only_when_both_resume(window: float) -> None:
    async with (
        Endpoint("r", backends=["local"], resume_window=window) as r,
        Endpoint("s", backends=["local"], peers={"r": r.address}) as s,
    ):
        with anyio.fail_after(20):
            await s.wait_peer("r", 10)
            for i in range(50):
                await s.send("r", {"i": i}, request_id=f"q{i}")
            got = []
            for _ in range(50):
                d = await r.receive(timeout=10)
                got.append(d.payload["i"])
                d.release()
        assert got == list(range(50))
        peer = s._peers.get("r")  # the session's own state
        assert peer is not None
        resumption = peer.session.resumption
        if window:
            assert resumption is not None and resumption.next_seq > 1
        else:
            assert resumption is None  # r did not offer "resume": 1.1 as before


@pytest.mark.asyncio
async def test_a_peer_still_numbering_frames_of_a_session_we_ended_is_told_at_once() -> None:
    """The receiver ended its session with the sender (a loss only it noticed) while
    the sender's connection to it stayed up: the sender's numbered frames carry the
    ended session's token and are dropped. The receiver must make itself known (its
    Hello, with its higher epoch, spec §10.6), so the sender fails what it had in
    flight at once — not an ack_timeout later — and a new session carries the next
    send. (Was: the frames were dropped silently until the sender's ACK deadlines.)"""
    async with (
        Endpoint("r", backends=["local", "shm"], control_ring=False) as r,
        Endpoint(
            "s",
            backends=["local", "shm"],
            peers={"r": r.address},
            ack_timeout=60,
            control_ring=False,
        ) as s,
    ):
        with anyio.fail_after(30):
            await s.wait_peer("r", 10)
            await s.send("r", {"i": 0}, request_id="q0")
            (await r.receive(timeout=10)).release()
            peer = r._peers.get("s")  # the receiver declares the sender lost: its side only
            assert peer is not None
            r._peers.lose(peer, "a loss only the receiver noticed (test)")
            big = torch.ones(1 << 18)  # 1 MiB over shm: an object in flight, ACK awaited
            receipt = await s.send("r", {"x": big}, request_id="q1")
            with pytest.raises(OmniwireError, match="declared us lost"):
                await receipt.wait(timeout=20)
            assert r.counters["frames_stale"] >= 1
            await s.wait_peer("r", 10)
            again = await s.send("r", {"x": big}, request_id="q2")
            d = await r.receive(timeout=10, request_id="q2")
            assert torch.equal(d.payload["x"], big)
            d.release()
            await again.wait(timeout=10)


def test_a_callback_waits_for_the_ack_of_its_frame_and_none_outlives_the_session() -> None:
    r = wire.Resumption(token=1, peer_token=2)
    called: list[int] = []
    for _ in range(3):
        r.sent(b"x")
    r.when_acked(2, lambda: called.append(2))
    r.when_acked(3, lambda: called.append(3))
    r.on_ack(1)
    assert called == []
    r.on_ack(2)
    assert called == [2]
    r.when_acked(1, lambda: called.append(1))  # already acknowledged: at once
    assert called == [2, 1]
    s: wire.Session[wire.OutboundObject, wire.InboundObject] = wire.Session(
        local_name="b", peer_name="a", resumes=True
    )
    s.on_hello(_hello("a"))
    assert s.resumption is not None
    s.resumption.when_acked(1, lambda: called.append(99))
    s.reset()  # the session ends: the callback is dropped with it
    assert 99 not in called
