"""Wire messages: round trips, validation, versions, the per-peer state table."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import omniwire
from omniwire import wire
from omniwire.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    UnsupportedVersionError,
    WireFormatError,
)

from wire_strategies import acks, data_readies, goodbyes, hellos, messages, progresses, refusals


def test_public_version_names() -> None:
    assert omniwire.WIRE_VERSION == (1, 1)
    assert issubclass(omniwire.WireFormatError, omniwire.OmniwireError)
    assert issubclass(UnsupportedVersionError, WireFormatError)


@given(messages)
def test_every_message_round_trips(msg: wire.Message) -> None:
    frame = wire.encode(msg)
    assert frame[:4] == b"OWIR"
    assert frame[4:6] == bytes(wire.WIRE_VERSION)
    assert wire.decode(frame) == msg
    assert wire.encode(wire.decode(frame)) == frame


def _hello(**overrides: object) -> wire.HelloMessage:
    fields: dict[str, object] = dict(
        endpoint="a",
        wire_min=(1, 0),
        wire_max=(1, 0),
        host_id="h",
        pid=1,
        process_token="t",
        instance=7,
        address="ipc:///tmp/a",
    )
    fields.update(overrides)
    return wire.HelloMessage(**fields)  # type: ignore[arg-type]


def test_unknown_major_is_refused_with_its_number() -> None:
    frame = wire.encode(_hello(), version=(2, 0))
    with pytest.raises(UnsupportedVersionError, match=r"wire version 2\.0 is not supported") as e:
        wire.decode(frame)
    assert (e.value.major, e.value.minor) == (2, 0)


def test_newer_minor_with_unknown_fields_is_read() -> None:
    body = msgspec.msgpack.encode(
        {"type": "abort", "request_id": "r", "from_stage": "s", "reason": "", "future": [1, 2]}
    )
    frame = b"OWIR" + bytes([1, 9, 0, 0]) + body
    assert wire.decode(frame) == wire.AbortMessage(request_id="r", from_stage="s")


def test_unknown_message_type_is_rejected() -> None:
    frame = b"OWIR\x01\x00\x00\x00" + msgspec.msgpack.encode({"type": "gossip"})
    with pytest.raises(WireFormatError, match="gossip"):
        wire.decode(frame)


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"", "prefix"),
        (b"OWI", "prefix"),
        (b"XXXX\x01\x00\x00\x00\x80", "magic"),
        (b"OWIR\x01\x00\x00\x00", "malformed"),
        (b"OWIR\x01\x00\x00\x00\xc1", "malformed"),
        (b"OWIR\x01\x00\x00\x00" + b"\x91" * 5000 + b"\x90", "nested too deeply|invalid message"),
    ],
)
def test_malformed_frames(frame: bytes, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        wire.decode(frame)


def test_oversized_frame_rejected_both_ways() -> None:
    big = wire.DataReadyMessage(
        request_id="r",
        from_stage="a",
        to_stage="b",
        error=None,
        is_done=True,
        metadata=bytes(wire.MAX_FRAME_SIZE),
    )
    with pytest.raises(WireFormatError, match="limit"):
        wire.encode(big)
    with pytest.raises(WireFormatError, match="limit"):
        wire.decode(b"OWIR\x01\x00\x00\x00" + bytes(wire.MAX_FRAME_SIZE))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: wire.TensorMeta(dtype="float7", shape=(1,), offset=0, nbytes=1), "float7"),
        (lambda: wire.TensorMeta(dtype="float32", shape=(2,), offset=0, nbytes=4), "needs 8"),
        (lambda: wire.TensorMeta(dtype="int8", shape=(-1,), offset=0, nbytes=0), "outside"),
        (lambda: wire.TensorMeta(dtype="int8", shape=(2**63,), offset=0, nbytes=0), "outside"),
        (
            lambda: wire.TensorMeta(dtype="int8", shape=(2**32, 2**32, 0), offset=0, nbytes=0),
            "exceeds",
        ),
        (lambda: wire.TensorMeta(dtype="int8", shape=(1,), offset=-1, nbytes=1), "offset"),
        (
            lambda: wire.DataRef(
                object_id=1,
                kind="payload",
                backend="shm",
                layout="packed",
                ref=wire.BackendRef(backend="shm", length=10),
                tensors=(wire.TensorMeta(dtype="int8", shape=(4,), offset=8, nbytes=4),),
            ),
            "aligned",
        ),
        (
            lambda: wire.DataRef(
                object_id=1,
                kind="payload",
                backend="shm",
                layout="packed",
                ref=wire.BackendRef(backend="shm", length=10),
                tensors=(wire.TensorMeta(dtype="int8", shape=(64,), offset=0, nbytes=64),),
            ),
            "beyond",
        ),
        (
            lambda: wire.InlineStreamChunkRef(
                tensors=(wire.TensorMeta(dtype="uint8", shape=(20000,), offset=0, nbytes=20000),),
                data=bytes(20000),
            ),
            "16384",
        ),
        (lambda: wire.DataReadyMessage(request_id="r", from_stage="a", to_stage="b"), "no data"),
        (lambda: _hello(endpoint=""), "endpoint"),
        (lambda: _hello(wire_min=(2, 0), wire_max=(1, 0)), "wire_min"),
        (lambda: wire.DataAckMessage(object_id=2**64, from_stage="a", to_stage="b"), "object_id"),
        (
            lambda: wire.DataAckMessage(
                object_id=1, from_stage="a", to_stage="b", success=True, reason="aborted"
            ),
            "no reason",
        ),
        (lambda: wire.BatchMessage(messages=()), "carries 0"),
        (
            lambda: wire.BatchMessage(
                messages=(wire.AbortMessage(request_id="r", from_stage="a"),)
                * (wire.MAX_BATCH_MESSAGES + 1)
            ),
            "carries 4097",
        ),
        (lambda: wire.RefusalMessage(from_stage="a", code=""), "code"),
        (lambda: wire.GoodbyeMessage(from_stage="a", instance=-1), "instance"),
    ],
)
def test_invalid_messages_cannot_be_built(build: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()  # type: ignore[operator]


def test_inline_limit_counts_tensor_bytes_not_overhead() -> None:
    metas = tuple(
        wire.TensorMeta(dtype="uint8", shape=(4096,), offset=i * 4096, nbytes=4096)
        for i in range(4)
    )
    chunk = wire.InlineStreamChunkRef(header=b"x" * 1000, tensors=metas, data=bytes(16384))
    assert (
        wire.decode(
            wire.encode(
                wire.DataReadyMessage(request_id="r", from_stage="a", to_stage="b", inline=chunk)
            )
        ).inline
        == chunk
    )  # type: ignore[union-attr]


def test_checked_entries_are_remembered_but_never_an_invalid_one() -> None:
    """A stream carries the same tensor table in every chunk: an entry equal to one
    checked before is not checked again (a bounded memo); what differs in any checked
    value is checked, so an invalid entry is refused however often a valid one came."""
    from omniwire.wire import _messages

    good = dict(dtype="float32", shape=(256,), offset=0, nbytes=1024)
    for _ in range(2):  # the second time from the memo
        meta = wire.TensorMeta(**good)  # type: ignore[arg-type]
        assert meta in _messages._VALID_METAS.keys
        with pytest.raises(ValueError, match="needs 1024"):
            wire.TensorMeta(**{**good, "nbytes": 1000})  # type: ignore[arg-type]
        chunk = dict(tensors=(meta,), data=bytes(1024))
        wire.InlineStreamChunkRef(**chunk)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="beyond the 1000-byte buffer"):
            wire.InlineStreamChunkRef(tensors=(meta,), data=bytes(1000))
        frame = wire.encode(
            wire.DataReadyMessage(
                request_id="r",
                from_stage="a",
                to_stage="b",
                inline=wire.InlineStreamChunkRef(**chunk),  # type: ignore[arg-type]
            )
        )
        assert wire.decode(frame).inline.tensors == (meta,)  # type: ignore[union-attr]
    # bounded: ever new valid entries empty it when full
    limit = _messages._VALID_METAS.limit
    for i in range(limit + 10):
        wire.TensorMeta(dtype="uint8", shape=(i,), offset=0, nbytes=i)
    assert len(_messages._VALID_METAS.keys) <= limit
    # unhashable values (lists) are checked, not remembered
    with pytest.raises(ValueError, match="needs 1024"):
        wire.TensorMeta(dtype="float32", shape=[256], offset=0, nbytes=1000)  # type: ignore[arg-type]
    listed = wire.TensorMeta(dtype="float32", shape=[256], offset=0, nbytes=1024)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beyond"):
        wire.InlineStreamChunkRef(tensors=[listed], data=bytes(10))  # type: ignore[arg-type]
    # long paths are checked every time, not remembered
    long = wire.TensorMeta(**{**good, "path": "p" * 300})  # type: ignore[arg-type]
    assert long not in _messages._VALID_METAS.keys
    table = ((long,), 1024)
    wire.InlineStreamChunkRef(tensors=table[0], data=bytes(1024))
    assert table not in _messages._VALID_INLINE.keys


def test_the_inline_table_memo_is_bounded_by_tensor_entries_not_by_tables() -> None:
    """A stream of chunks of many sizes (a one-tensor table per size) is checked once
    per size, for as many sizes as 1,024 tables of 16 entries hold; a peer sending
    ever new 16-entry tables still costs at most that many entries."""
    from omniwire.wire import _messages

    memo = _messages._VALID_INLINE
    memo.keys.clear()
    memo.weight = 0
    one = [
        ((wire.TensorMeta(dtype="uint8", shape=(n,), offset=0, nbytes=n),), n)
        for n in range(1, 4001)
    ]
    for tensors, n in one:
        wire.InlineStreamChunkRef(tensors=tensors, data=bytes(n))
    assert all(key in memo.keys for key in one)  # 4,000 sizes: all remembered
    assert memo.weight == 4000
    for i in range(memo.limit // 16 + 10):  # ever new 16-entry tables
        metas = tuple(
            wire.TensorMeta(dtype="uint8", shape=(1,), offset=64 * j, nbytes=1, path=f"{i}.{j}")
            for j in range(16)
        )
        wire.InlineStreamChunkRef(tensors=metas, data=bytes(64 * 15 + 1))
        assert memo.weight <= memo.limit
    assert len(memo.keys) <= memo.limit // 16


def test_invalid_field_in_a_frame_names_the_field() -> None:
    body = msgspec.msgpack.encode(
        {"type": "data_ack", "object_id": -5, "from_stage": "a", "to_stage": "b"}
    )
    with pytest.raises(WireFormatError, match="object_id"):
        wire.decode(b"OWIR\x01\x00\x00\x00" + body)
    body = msgspec.msgpack.encode(
        {"type": "data_ack", "object_id": "five", "from_stage": "a", "to_stage": "b"}
    )
    with pytest.raises(WireFormatError, match="object_id"):
        wire.decode(b"OWIR\x01\x00\x00\x00" + body)


# -- the state table -------------------------------------------------------------


Session = wire.Session[wire.OutboundObject, wire.InboundObject]


def _session() -> Session:
    return wire.Session(local_name="b", peer_name="a")


def test_data_before_hello_is_a_remote_protocol_error() -> None:
    s = _session()
    msg = wire.DataReadyMessage(request_id="r", from_stage="a", to_stage="b", is_done=True)
    with pytest.raises(RemoteProtocolError, match="before its Hello"):
        s.check(msg)
    with pytest.raises(LocalProtocolError):
        s.announce(wire.OutboundObject(1, "r", 10, 10))
    s.check(wire.RefusalMessage(from_stage="a", code="version"))  # legal before a Hello


@pytest.mark.parametrize(
    ("theirs", "expected"),
    [
        (((1, 0), (1, 0)), (1, 0)),
        (((1, 0), (1, 1)), (1, 1)),
        (((1, 0), (1, 9)), (1, 1)),  # a newer minor: ours is the highest common
        (((1, 1), (3, 0)), (1, 1)),
        (((0, 5), (1, 0)), (1, 0)),
        (((2, 0), (3, 0)), None),  # no common major
        (((0, 0), (0, 9)), None),
    ],
)
def test_negotiate_picks_the_highest_common_version(
    theirs: tuple[tuple[int, int], tuple[int, int]], expected: tuple[int, int] | None
) -> None:
    assert wire.negotiate(_hello(wire_min=theirs[0], wire_max=theirs[1])) == expected


def test_session_records_the_negotiated_version() -> None:
    s = _session()
    s.on_hello(_hello(wire_max=(1, 0)))
    assert s.version == (1, 0)
    s.on_hello(_hello(wire_max=(1, 5), instance=8))
    assert s.version == (1, 1)


def test_goodbye_closes_the_session_and_returns_every_object() -> None:
    s = _session()
    s.on_hello(_hello())
    s.announce(wire.OutboundObject(1, "r", 10, 10))
    s.on_data_ready(_ref_ready(3), wire.InboundObject(3, "r", 100, 100))
    with pytest.raises(RemoteProtocolError, match="instance 6"):
        s.on_goodbye(wire.GoodbyeMessage(from_stage="a", instance=6))
    assert s.state is wire.PeerState.ACTIVE
    out, inb = s.on_goodbye(wire.GoodbyeMessage(from_stage="a", instance=7))
    assert ([o.object_id for o in out], [i.object_id for i in inb]) == ([1], [3])
    assert s.state is wire.PeerState.CLOSED and not s.outbound and not s.inbound
    with pytest.raises(RemoteProtocolError, match="after its Goodbye"):
        s.check(wire.DataAckMessage(object_id=1, from_stage="a", to_stage="b"))
    with pytest.raises(LocalProtocolError):
        s.announce(wire.OutboundObject(2, "r", 10, 10))
    assert s.on_hello(_hello())[0] is wire.HelloOutcome.NEW  # a new session


def test_reset_after_loss_returns_every_object_and_awaits_a_hello() -> None:
    s = _session()
    s.on_hello(_hello())
    s.announce(wire.OutboundObject(1, "r", 10, 10))
    out, inb = s.reset()
    assert [o.object_id for o in out] == [1] and inb == []
    assert s.state is wire.PeerState.AWAITING_HELLO and s.hello is None
    assert s.on_hello(_hello())[0] is wire.HelloOutcome.NEW


def _ref_ready(object_id: int, ready: int | None = None) -> wire.DataReadyMessage:
    ref = wire.DataRef(
        object_id=object_id,
        kind="payload",
        backend="shm",
        layout="packed",
        ref=wire.BackendRef(backend="shm", length=100),
        ready=ready,
    )
    return wire.DataReadyMessage(request_id="r", from_stage="a", to_stage="b", data_ref=ref)


def test_hello_outcomes_and_restart_returns_old_objects() -> None:
    s = _session()
    outcome, _, _ = s.on_hello(_hello())
    assert outcome is wire.HelloOutcome.NEW
    s.announce(wire.OutboundObject(1, "r", 10, 10))
    assert s.on_hello(_hello())[0] is wire.HelloOutcome.DUPLICATE
    outcome, lost_out, _ = s.on_hello(_hello(instance=8))
    assert outcome is wire.HelloOutcome.RESTART
    assert [o.object_id for o in lost_out] == [1]
    assert s.outbound == {}


def test_a_higher_epoch_from_the_same_instance_ends_the_session() -> None:
    """The peer declared us lost (we did not notice) and says Hello again: its epoch
    went up, so what was in flight with it is gone (spec §10.6)."""
    s = _session()
    assert s.on_hello(_hello())[0] is wire.HelloOutcome.NEW
    s.announce(wire.OutboundObject(1, "r", 10, 10))
    assert s.on_hello(_hello(epoch=0))[0] is wire.HelloOutcome.DUPLICATE  # a reconnect
    outcome, lost_out, _ = s.on_hello(_hello(epoch=1))
    assert outcome is wire.HelloOutcome.RESTART
    assert [o.object_id for o in lost_out] == [1] and s.outbound == {}
    assert s.on_hello(_hello(epoch=1))[0] is wire.HelloOutcome.DUPLICATE  # settled
    s.reset()  # we declared it lost ourselves: its next Hello starts anew
    assert s.on_hello(_hello(epoch=2))[0] is wire.HelloOutcome.NEW


def test_hello_with_no_common_major_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match=r"speaks wire 2\.0"):
        _session().on_hello(_hello(wire_min=(2, 0), wire_max=(3, 0)))


def test_acks_must_match_objects_in_flight() -> None:
    s = _session()
    s.on_hello(_hello())
    s.announce(wire.OutboundObject(5, "r", 10, 10))
    ack = wire.DataAckMessage(object_id=5, from_stage="a", to_stage="b")
    assert s.on_ack(ack).object_id == 5
    with pytest.raises(RemoteProtocolError, match="not in flight"):
        s.on_ack(ack)  # duplicate
    with pytest.raises(RemoteProtocolError, match="addressed to"):
        s.check(wire.DataAckMessage(object_id=5, from_stage="a", to_stage="c"))


def test_progress_must_move_forward_within_length() -> None:
    s = _session()
    s.on_hello(_hello())
    s.on_data_ready(_ref_ready(3, ready=10), wire.InboundObject(3, "r", 100, 10))
    prog = wire.DataProgressMessage(object_id=3, from_stage="a", to_stage="b", ready=50)
    assert s.on_progress(prog).ready == 50
    for bad in (40, 101):
        with pytest.raises(RemoteProtocolError, match="moves ready"):
            s.on_progress(
                wire.DataProgressMessage(object_id=3, from_stage="a", to_stage="b", ready=bad)
            )
    with pytest.raises(RemoteProtocolError, match="unknown object"):
        s.on_progress(wire.DataProgressMessage(object_id=4, from_stage="a", to_stage="b", ready=1))
    with pytest.raises(RemoteProtocolError, match="twice"):
        s.on_data_ready(_ref_ready(3), wire.InboundObject(3, "r", 100, 100))


def _apply(s: Session, msg: wire.Message) -> None:
    if isinstance(msg, wire.HelloMessage):
        s.on_hello(msg)
    elif isinstance(msg, wire.DataReadyMessage):
        ref = msg.data_ref
        record = (
            None
            if ref is None
            else wire.InboundObject(
                ref.object_id,
                msg.request_id,
                ref.ref.length,
                ref.ref.length if ref.ready is None else ref.ready,
            )
        )
        s.on_data_ready(msg, record)
    elif isinstance(msg, wire.DataAckMessage):
        s.on_ack(msg)
    elif isinstance(msg, wire.DataProgressMessage):
        s.on_progress(msg)
    elif isinstance(msg, wire.GoodbyeMessage):
        s.on_goodbye(msg)
    else:
        s.check(msg)


@given(
    hellos,
    st.lists(st.one_of(data_readies(), acks, progresses, goodbyes, refusals, hellos), max_size=8),
)
def test_state_table_is_total(hello: wire.HelloMessage, msgs: list[wire.Message]) -> None:
    """Every (state, message) pair either applies or raises a protocol error;
    an error leaves the state unchanged."""
    s: Session = wire.Session(local_name="b", peer_name=hello.endpoint)
    for msg in msgs:
        if isinstance(msg, wire.HelloMessage):
            msg = msgspec.structs.replace(msg, endpoint=hello.endpoint)
        elif isinstance(msg, wire.GoodbyeMessage) and s.hello is not None:
            msg = msgspec.structs.replace(msg, instance=s.hello.instance)
        before = (s.state, dict(s.inbound), dict(s.outbound))
        try:
            _apply(s, msg)
        except RemoteProtocolError:
            assert (s.state, dict(s.inbound), dict(s.outbound)) == before
    s.on_hello(hello)
    assert s.state is wire.PeerState.ACTIVE


def test_a_batch_cannot_carry_a_hello_goodbye_refusal_or_batch() -> None:
    ack = {"type": "data_ack", "object_id": 1, "from_stage": "a", "to_stage": "b"}
    for inner in (
        msgspec.to_builtins(_hello()) | {"type": "hello"},
        {"type": "goodbye", "from_stage": "a", "instance": 1},
        {"type": "refusal", "from_stage": "a", "code": "version"},
        {"type": "batch", "messages": [ack]},
    ):
        body = msgspec.msgpack.encode({"type": "batch", "messages": [ack, inner]})
        with pytest.raises(WireFormatError, match="invalid message"):
            wire.decode(b"OWIR\x01\x01\x00\x00" + body)
    body = msgspec.msgpack.encode({"type": "batch", "messages": [ack]})
    assert wire.decode(b"OWIR\x01\x01\x00\x00" + body) == wire.BatchMessage(
        messages=(wire.DataAckMessage(object_id=1, from_stage="a", to_stage="b"),)
    )


def test_1_1_fields_default_when_a_1_0_writer_omits_them() -> None:
    hello = {k: v for k, v in msgspec.to_builtins(_hello()).items() if k != "to_endpoint"}
    frame = b"OWIR\x01\x00\x00\x00" + msgspec.msgpack.encode({"type": "hello", **hello})
    assert wire.decode(frame) == _hello()
    body = {"type": "data_ack", "object_id": 1, "from_stage": "a", "to_stage": "b"}
    body |= {"success": False, "error": "x"}
    msg = wire.decode(b"OWIR\x01\x00\x00\x00" + msgspec.msgpack.encode(body))
    assert isinstance(msg, wire.DataAckMessage) and msg.reason is None


def test_messages_are_not_tracked_by_the_cycle_collector() -> None:
    """Wire messages hold only immutable values (no cycle can pass through one), so
    they are ``gc=False`` structs: a burst of them, built or decoded, adds nothing to
    the collector's work — its full collections were a tail-latency spike of 50–80 ms."""
    import gc

    meta = wire.TensorMeta(dtype="uint8", shape=(3,), offset=0, nbytes=3)
    built = wire.DataReadyMessage(
        request_id="r",
        from_stage="a",
        to_stage="b",
        inline=wire.InlineStreamChunkRef(tensors=(meta,), data=b"abc"),
    )
    decoded = wire.decode(wire.encode(wire.BatchMessage(messages=[built, built])))
    assert isinstance(decoded, wire.BatchMessage)
    for msg in (meta, built, built.inline, decoded, *decoded.messages):
        assert not gc.is_tracked(msg), type(msg).__name__
