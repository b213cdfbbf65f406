"""The scenarios of specs/foreign-peer.md, run by a peer written from the spec alone
(tests/foreign_peer.py: pyzmq, msgpack, numpy; no omniwire code) against the
reference endpoint (``omniwire peer``, an echo stage) in another process.

Every frame the foreign peer receives or sends is validated against
specs/wire-v1.cddl. The harness below may use omniwire to start the reference;
the peer may not (checked by ``test_the_foreign_peer_imports_no_omniwire``).
"""

from __future__ import annotations

import ast
import errno
import fcntl
import mmap
import os
import pathlib
import re
import secrets
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from omniwire.testing import PeerProcess

from foreign_peer import ForeignPeer, TensorIndex, Timeout, read_header, unpack

REFERENCE = "ref"
WAIT = 10.0  # seconds any one expected frame may take


def _address(name: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/owt-{os.getuid()}/{name}-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def reference() -> Iterator[PeerProcess]:
    """One echo stage for the scenarios that do not stop it."""
    os.makedirs(f"{tempfile.gettempdir()}/owt-{os.getuid()}", exist_ok=True)
    peer = PeerProcess(REFERENCE, _address(REFERENCE), "--backends", "shm", "--ack-timeout", "10")
    yield peer
    assert peer.stop() == 0, peer.output


@pytest.fixture
def foreign(request: pytest.FixtureRequest) -> Iterator[ForeignPeer]:
    """The foreign peer; ``resume`` (indirect parameter): it offers "resume" (§2.9)."""
    name = "foreign-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[-40:].strip("-")
    peer = ForeignPeer(name, _address("foreign"), resume=getattr(request, "param", False))
    yield peer
    peer.close()


#: a scenario played twice: by a peer of the earlier 1.1 text, and by one that resumes
both_ways = pytest.mark.parametrize("foreign", [False, True], indirect=True, ids=["", "resume"])


def _frames_of(peer: ForeignPeer, kind: str) -> list[dict[str, object]]:
    return [b for d, b in peer.log if d.startswith("received") and b["type"] == kind]


def test_the_foreign_peer_imports_no_omniwire() -> None:
    here = pathlib.Path(__file__).parent
    for module in ("foreign_peer.py", "wire_cddl.py"):
        tree = ast.parse((here / module).read_text())
        imported = {
            (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        assert not {m for m in imported if m.split(".")[0] == "omniwire"}, module


def test_omniwire_peer_runs_the_reference_endpoint() -> None:
    """``omniwire peer`` (foreign-peer.md §1): READY <address>, then a clean exit on SIGTERM."""
    address = _address("cli-peer")
    proc = subprocess.Popen(
        [sys.executable, "-m", "omniwire.cli", "peer", "--name", "cli", "--address", address],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"READY {address}"
        proc.terminate()
        assert proc.wait(60) == 0
        assert proc.stdout.read().strip() == "DONE 0"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# -- handshake (foreign-peer.md §2.1) ---------------------------------------------------


def test_handshake(reference: PeerProcess, foreign: ForeignPeer) -> None:
    hello = foreign.handshake(REFERENCE, reference.address)
    # The reference also says its own Hello once its PUSH to us is up; we answered it.
    foreign.own_hello(WAIT)
    foreign.seen(lambda b: b["type"] == "hello" and b["is_reply"], WAIT, "the reference's reply")
    hellos = _frames_of(foreign, "hello")
    assert {h["is_reply"] for h in hellos} == {True, False}
    assert tuple(hello["wire_min"]) <= (1, 1) <= tuple(hello["wire_max"])
    prefix = foreign.peer_backend_info("shm")["prefix"]
    assert re.fullmatch(rf"omniwire-{hello['pid']}-[0-9a-f]{{8,32}}", prefix)
    assert hello["host_id"] == foreign.hello()["host_id"]  # §4.1: derivation matches


def test_the_reference_hello_addresses_us_by_name(
    reference: PeerProcess, foreign: ForeignPeer
) -> None:
    """1.1: its own Hello names the stage it addresses (to_endpoint)."""
    foreign.handshake(REFERENCE, reference.address)
    own = foreign.own_hello(WAIT)
    assert own["to_endpoint"] == foreign.name


# -- inline (§2.2) ----------------------------------------------------------------------


@both_ways
def test_inline_stream_chunks_both_ways(reference: PeerProcess, foreign: ForeignPeer) -> None:
    foreign.handshake(REFERENCE, reference.address)
    chunk = np.arange(6, dtype=np.int32).reshape(2, 3)
    foreign.send(
        foreign.data_ready(
            "req-inline",
            chunk_id=0,
            inline=foreign.inline([chunk], {"ids": TensorIndex(0), "n": 6}),
            metadata=msgpack.packb({"step": 0}),
        )
    )
    foreign.send(foreign.data_ready("req-inline", chunk_id=1, is_done=True))
    echo = foreign.expect(
        lambda b: b["type"] == "data_ready" and b["inline"] is not None, WAIT, "the echoed chunk"
    )
    assert echo["request_id"] == "req-inline" and echo["chunk_id"] == 0
    assert echo["inline"]["kind"] == "stream_chunk"
    value = read_header(
        echo["inline"]["header"], unpack(echo["inline"]["data"], echo["inline"]["tensors"])
    )
    assert value["n"] == 6 and np.array_equal(value["ids"], chunk)
    assert msgpack.unpackb(echo["metadata"]) == {"step": 0}
    end = foreign.expect(lambda b: b["type"] == "data_ready" and b["is_done"], WAIT, "stream end")
    assert end["request_id"] == "req-inline"


def test_inline_payload(reference: PeerProcess, foreign: ForeignPeer) -> None:
    """1.1: an inline body with kind "payload" is a payload (echoed as one, no ACK)."""
    foreign.handshake(REFERENCE, reference.address)
    ids = np.array([7, 8], dtype=np.int64)
    foreign.send(
        foreign.data_ready(
            "req-inline-payload", inline=foreign.inline([ids], {"ids": TensorIndex(0)}, "payload")
        )
    )
    echo = foreign.expect(
        lambda b: b["type"] == "data_ready" and b["request_id"] == "req-inline-payload",
        WAIT,
        "the echoed payload",
    )
    if echo["inline"] is not None:
        assert echo["inline"]["kind"] == "payload"
        body = echo["inline"]
        value = read_header(body["header"], unpack(body["data"], body["tensors"]))
    else:
        assert echo["data_ref"] is not None and echo["data_ref"]["kind"] == "payload"
        value = foreign.read_object(echo["data_ref"])
        foreign.send(foreign.ack(echo["data_ref"]["object_id"]))
    assert np.array_equal(value["ids"], ids)


# -- shared memory (§2.3) ---------------------------------------------------------------


@both_ways
def test_shm_both_ways(reference: PeerProcess, foreign: ForeignPeer) -> None:
    foreign.handshake(REFERENCE, reference.address)
    big = np.arange(32 * 1024, dtype=np.float32)  # 128 KiB: too large to go inline
    small = np.array([1.5, -2.0], dtype=np.float64)
    ref = foreign.shm_object(1, [big, small], {"big": TensorIndex(0), "small": [TensorIndex(1)]})
    foreign.send(foreign.data_ready("req-shm", data_ref=ref))
    ack = foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the ACK of our object")
    assert (ack["object_id"], ack["success"], ack["to_stage"]) == (1, True, foreign.name)
    segment = next(iter(foreign.segments.values()))
    assert os.path.exists(segment.path)  # the receiver never unlinks what it does not own
    segment.close()  # ours: unlinked once, after the ACK

    echo = foreign.seen(  # the echo may overtake the ACK: both come from the reference
        lambda b: b["type"] == "data_ready" and b["request_id"] == "req-shm", WAIT, "the echo"
    )
    data_ref = echo["data_ref"]
    assert data_ref is not None and data_ref["backend"] == "shm"
    info = msgpack.unpackb(data_ref["ref"]["info"])
    path = f"/dev/shm/{info['segment']}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    fd = os.open(path, os.O_RDONLY)
    try:  # its creator holds an exclusive flock for the segment's life
        with pytest.raises(BlockingIOError) as locked:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert locked.value.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    value = foreign.read_object(data_ref)
    assert np.array_equal(value["big"], big) and np.array_equal(value["small"][0], small)
    foreign.send(foreign.ack(data_ref["object_id"]))


def _read_nofollow(info: dict[str, object], length: int) -> bytes:
    """How a reader of the earlier 1.1 text may open a segment: by name, hardened with
    ``O_NOFOLLOW`` (a link fails with ELOOP), mapped whole."""
    fd = os.open(f"/dev/shm/{info['segment']}", os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        start = int(info["offset"])  # type: ignore[call-overload]
        assert start + length <= size
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            return bytes(m[start : start + length])
    finally:
        os.close(fd)


@pytest.mark.parametrize("sealed", [False, True], ids=["earlier-reader", "sealed-reader"])
def test_segments_a_reader_can_open(reference: PeerProcess, sealed: bool) -> None:
    """A peer whose Hello lacks the feature "sealed" (§11.2; every peer of the earlier
    1.1 text) is sent plain segments, which an ``O_NOFOLLOW`` open reads as before;
    one that says "sealed" gets sealed memfds behind links (§9.2)."""
    peer = ForeignPeer(
        f"foreign-sealed-{sealed}".lower(),
        _address("foreign"),
        features=("sealed",) if sealed else (),
    )
    try:
        peer.handshake(REFERENCE, reference.address)
        big = np.arange(32 * 1024, dtype=np.float32)  # 128 KiB: in a segment, not inline
        ref = peer.shm_object(1, [big], TensorIndex(0))
        peer.send(peer.data_ready("req-sealed", data_ref=ref))
        echo = peer.seen(
            lambda b: b["type"] == "data_ready" and b["request_id"] == "req-sealed",
            WAIT,
            "the echo",
        )
        data_ref = echo["data_ref"]
        assert data_ref is not None and data_ref["backend"] == "shm"
        info = msgpack.unpackb(data_ref["ref"]["info"], raw=False)
        mode = os.lstat(f"/dev/shm/{info['segment']}").st_mode
        assert stat.S_ISLNK(mode) == sealed
        if not sealed:
            raw = _read_nofollow(info, data_ref["ref"]["length"])
            assert np.array_equal(unpack(raw, data_ref["tensors"])[0], big)
        assert np.array_equal(peer.read_object(data_ref), big)
        peer.send(peer.ack(data_ref["object_id"]))
    finally:
        peer.close()


@both_ways
def test_shm_progressive(reference: PeerProcess, foreign: ForeignPeer) -> None:
    """An object announced before all its bytes are valid, then DataProgress (§4.3)."""
    foreign.handshake(REFERENCE, reference.address)
    data = np.arange(64 * 1024, dtype=np.uint8)
    ref = foreign.shm_object(2, [data], TensorIndex(0), ready=0)
    foreign.send(foreign.data_ready("req-progressive", data_ref=ref))
    foreign.send(
        {
            "type": "data_progress",
            "object_id": 2,
            "from_stage": foreign.name,
            "to_stage": REFERENCE,
            "ready": ref["ref"]["length"],
        }
    )
    ack = foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the ACK")
    assert ack["success"] and ack["object_id"] == 2
    echo = foreign.seen(lambda b: b["type"] == "data_ready", WAIT, "the echo")
    assert np.array_equal(foreign.read_object(echo["data_ref"]), data)
    foreign.send(foreign.ack(echo["data_ref"]["object_id"]))


# -- errors (§2.5) ----------------------------------------------------------------------


@both_ways
def test_abort_releases_an_object_in_flight(reference: PeerProcess, foreign: ForeignPeer) -> None:
    """An object announced with no valid byte yet is NACKed "aborted" once we publish
    an abort of its request."""
    foreign.handshake(REFERENCE, reference.address)
    ref = foreign.shm_object(3, [np.zeros(1024, dtype=np.uint8)], TensorIndex(0), ready=0)
    foreign.send(foreign.data_ready("req-abort", data_ref=ref))
    foreign.publish(foreign.abort("req-abort", "client went away"))
    nack = foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the NACK")
    assert (nack["object_id"], nack["success"], nack["reason"]) == (3, False, "aborted")


def test_abort_is_forwarded_with_its_origin(reference: PeerProcess, foreign: ForeignPeer) -> None:
    """The reference sent data of a request to us; another stage aborts the request:
    the reference forwards the abort to us directly, origin kept."""
    foreign.handshake(REFERENCE, reference.address)
    foreign.send(
        foreign.data_ready(
            "req-fwd", inline=foreign.inline([np.ones(2, dtype=np.int8)], TensorIndex(0))
        )
    )
    foreign.expect(lambda b: b["type"] == "data_ready", WAIT, "the echo")
    other = ForeignPeer(foreign.name + "-b", _address("foreign-b"))
    try:
        other.handshake(REFERENCE, reference.address)
        other.publish(other.abort("req-fwd", "cancelled upstream"))
        fwd = foreign.expect(
            lambda b: b["type"] == "abort" and b["request_id"] == "req-fwd", WAIT, "the abort"
        )
        assert (fwd["from_stage"], fwd["origin"]) == (REFERENCE, other.name)
    finally:
        other.close()


def test_misaddressed_data_ready_is_nacked(reference: PeerProcess, foreign: ForeignPeer) -> None:
    foreign.handshake(REFERENCE, reference.address)
    ref = foreign.shm_object(4, [np.zeros(8, dtype=np.uint8)], TensorIndex(0))
    foreign.send(foreign.data_ready("req-misaddressed", data_ref=ref, to_stage="somebody-else"))
    nack = foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the NACK")
    assert (nack["object_id"], nack["success"], nack["reason"]) == (4, False, "misaddressed")


def test_misaddressed_inline_data_is_dropped(reference: PeerProcess, foreign: ForeignPeer) -> None:
    """Misaddressed data without a DataRef has nothing to NACK: it is dropped, never
    delivered (so the echo stage never echoes it)."""
    foreign.handshake(REFERENCE, reference.address)
    inline = foreign.inline([np.ones(2, dtype=np.uint8)], TensorIndex(0))
    foreign.send(foreign.data_ready("req-misaddressed-inline", inline=inline, to_stage="nobody"))
    foreign.send(foreign.data_ready("req-addressed", inline=inline))
    foreign.expect(lambda b: b.get("request_id") == "req-addressed", WAIT, "the echo")
    assert not [
        b
        for d, b in foreign.log
        if b.get("request_id") == "req-misaddressed-inline" and d != "sent"
    ]


def test_unreadable_data_ref_is_nacked(reference: PeerProcess, foreign: ForeignPeer) -> None:
    """A reference to a segment that is not ours: refused with a reason, never read."""
    foreign.handshake(REFERENCE, reference.address)
    ref = foreign.shm_object(5, [np.zeros(8, dtype=np.uint8)], TensorIndex(0))
    info = msgpack.unpackb(ref["ref"]["info"])
    info["segment"] = "omniwire-1-00000000-0"
    ref["ref"]["info"] = msgpack.packb(info)
    foreign.send(foreign.data_ready("req-forged", data_ref=ref))
    nack = foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the NACK")
    assert (nack["object_id"], nack["success"]) == (5, False)
    assert nack["reason"] == "malformed"


def test_unreadable_data_ref_is_nacked_malformed(
    reference: PeerProcess, foreign: ForeignPeer
) -> None:
    """A reference that fails validation is `malformed`, not a backend failure."""
    foreign.handshake(REFERENCE, reference.address)
    ref = foreign.shm_object(6, [np.zeros(8, dtype=np.uint8)], TensorIndex(0))
    info = msgpack.unpackb(ref["ref"]["info"])
    info["segment"] = "omniwire-1-00000000-0"
    ref["ref"]["info"] = msgpack.packb(info)
    foreign.send(foreign.data_ready("req-forged-2", data_ref=ref))
    nack = foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the NACK")
    assert (nack["object_id"], nack["success"], nack["reason"]) == (6, False, "malformed")


# -- refusal (§2.6) ---------------------------------------------------------------------


def test_refusal_no_common_version(reference: PeerProcess, foreign: ForeignPeer) -> None:
    """A Hello offering only 2.x (framed, as every Hello, with major 1) is refused."""
    foreign.connect(reference.address)
    foreign.send(foreign.hello(wire_min=(2, 0), wire_max=(2, 3), to_endpoint=REFERENCE))
    refusal = foreign.expect(lambda b: b["type"] == "refusal", WAIT, "a Refusal")
    assert (refusal["code"], refusal["to_stage"]) == ("version", foreign.name)
    assert not _frames_of(foreign, "hello")


def test_refusal_name_mismatch(reference: PeerProcess, foreign: ForeignPeer) -> None:
    foreign.connect(reference.address)
    foreign.send(foreign.hello(to_endpoint="talker"))
    refusal = foreign.expect(lambda b: b["type"] == "refusal", WAIT, "a Refusal")
    assert (refusal["code"], refusal["addressed"], refusal["from_stage"]) == (
        "name_mismatch",
        "talker",
        REFERENCE,
    )


def test_refusal_of_a_forged_shm_prefix(reference: PeerProcess, foreign: ForeignPeer) -> None:
    """An shm prefix whose pid is not the Hello's pid is a bad Hello."""
    foreign.connect(reference.address)
    hello = foreign.hello(to_endpoint=REFERENCE)
    hello["backends"] = [
        {"name": "shm", "info": msgpack.packb({"prefix": f"omniwire-1-{secrets.token_hex(4)}"})}
    ]
    foreign.send(hello)
    refusal = foreign.expect(lambda b: b["type"] == "refusal", WAIT, "a Refusal")
    assert refusal["code"] == "bad_hello"


def test_refusal_own_name(reference: PeerProcess, foreign: ForeignPeer) -> None:
    foreign.connect(reference.address)
    foreign.send(foreign.hello(name=REFERENCE))
    refusal = foreign.expect(lambda b: b["type"] == "refusal", WAIT, "a Refusal")
    assert (refusal["code"], refusal["to_stage"]) == ("own_name", REFERENCE)


# -- batch and close (§2.4, §2.7) -------------------------------------------------------


@both_ways
def test_batch_is_applied_in_order(reference: PeerProcess, foreign: ForeignPeer) -> None:
    foreign.handshake(REFERENCE, reference.address)
    chunks = [
        foreign.data_ready(
            "req-batch",
            chunk_id=i,
            inline=foreign.inline([np.full(3, i, dtype=np.int16)], TensorIndex(0)),
        )
        for i in range(3)
    ]
    foreign.send(
        {
            "type": "batch",
            "messages": [*chunks, foreign.data_ready("req-batch", chunk_id=3, is_done=True)],
        }
    )
    got = [
        foreign.expect(
            lambda b: b["type"] == "data_ready" and b["request_id"] == "req-batch",
            WAIT,
            f"echoed chunk {i}",
        )
        for i in range(4)
    ]
    assert [g["chunk_id"] for g in got[:3]] == [0, 1, 2] and got[3]["is_done"]


def test_goodbye_on_close(foreign: ForeignPeer) -> None:
    """A reference that closes says Goodbye to every ready 1.1 peer, naming its instance."""
    peer = PeerProcess("ref-closing", _address("ref-closing"), "--backends", "shm")
    try:
        hello = foreign.handshake("ref-closing", peer.address)
        foreign.own_hello(WAIT)
    finally:
        assert peer.stop() == 0, peer.output
    goodbye = foreign.expect(lambda b: b["type"] == "goodbye", WAIT, "a Goodbye")
    assert (goodbye["from_stage"], goodbye["instance"]) == ("ref-closing", hello["instance"])


def test_goodbye_is_the_last_message_after_the_nacks_of_held_objects(
    foreign: ForeignPeer,
) -> None:
    """A reference SIGTERMed while it holds our open object NACKs it
    (`receiver_closed`) and then says Goodbye, its last message (§7.4, §10.5)."""
    peer = PeerProcess("ref-holding", _address("ref-holding"), "--backends", "shm")
    try:
        foreign.handshake("ref-holding", peer.address)
        foreign.own_hello(WAIT)
        ref = foreign.shm_object(11, [np.zeros(1024, dtype=np.uint8)], TensorIndex(0), ready=0)
        foreign.send(foreign.data_ready("req-held", data_ref=ref))
        # frames are read in order: once it answers a later Hello it has opened the object
        replies = len(_frames_of(foreign, "hello"))
        foreign.send(foreign.hello(to_endpoint="ref-holding"))
        foreign.expect(
            lambda b: b["type"] == "hello" and len(_frames_of(foreign, "hello")) > replies,
            WAIT,
            "the answer to a second Hello",
        )
    finally:
        assert peer.stop() == 0, peer.output
    foreign.expect(lambda b: b["type"] == "goodbye", WAIT, "a Goodbye")
    while foreign.recv(1.0) is not None:  # anything after the Goodbye, to be seen below
        pass
    received = [b for d, b in foreign.log if d.startswith("received") and b["type"] != "batch"]
    kinds = [(b["type"], b.get("object_id"), b.get("reason")) for b in received]
    assert kinds[-1][0] == "goodbye", kinds
    assert ("data_ack", 11, "receiver_closed") in kinds, kinds


def test_data_after_our_goodbye_starts_nothing(
    reference: PeerProcess, foreign: ForeignPeer
) -> None:
    """After our Goodbye the reference holds nothing of us; a new Hello starts afresh."""
    foreign.handshake(REFERENCE, reference.address)
    foreign.send(
        {
            "type": "goodbye",
            "from_stage": foreign.name,
            "instance": foreign.instance,
            "reason": "bye",
        }
    )
    foreign.send(
        foreign.data_ready(
            "req-after-bye", inline=foreign.inline([np.ones(1, dtype=np.uint8)], TensorIndex(0))
        )
    )
    with pytest.raises(Timeout):
        foreign.expect(
            lambda b: b["request_id"] == "req-after-bye" if "request_id" in b else False, 3.0
        )
    foreign.send(foreign.hello(to_endpoint=REFERENCE))
    foreign.expect(lambda b: b["type"] == "hello" and b["is_reply"], WAIT, "a new reply")
    foreign.send(
        foreign.data_ready(
            "req-after-hello", inline=foreign.inline([np.ones(1, dtype=np.uint8)], TensorIndex(0))
        )
    )
    foreign.expect(lambda b: b.get("request_id") == "req-after-hello", WAIT, "the echo")


# -- same-host rings (§2.8, optional) ---------------------------------------------------

_RING_ENTRY = re.compile(r"^omniwire-(\d+)-[0-9a-f]{16}-[0-2]$")  # a ring's names (§3.6)


def _ring_entries(pid: int) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if (m := _RING_ENTRY.match(n)) and int(m[1]) == pid}


def test_a_peer_without_the_ring_feature_stays_on_zeromq(
    reference: PeerProcess, foreign: ForeignPeer
) -> None:
    """The reference offers rings, but not to a peer that does not advertise "ring":
    none of its Hellos names one, it creates none, and everything works over ZeroMQ."""
    assert "ring" not in foreign.features
    hello = foreign.handshake(REFERENCE, reference.address)
    before = _ring_entries(hello["pid"])
    assert "ring" in hello["features"]  # it could
    foreign.own_hello(WAIT)
    chunk = np.arange(4, dtype=np.int16)
    foreign.send(foreign.data_ready("req-zmq", inline=foreign.inline([chunk], TensorIndex(0))))
    echo = foreign.expect(lambda b: b.get("request_id") == "req-zmq", WAIT, "the inline echo")
    body = echo["inline"]
    assert np.array_equal(read_header(body["header"], unpack(body["data"], body["tensors"])), chunk)
    big = np.arange(16 * 1024, dtype=np.float32)  # 64 KiB: through shm
    foreign.send(
        foreign.data_ready("req-zmq-shm", data_ref=foreign.shm_object(7, [big], TensorIndex(0)))
    )
    assert foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the ACK")["success"]
    echo = foreign.seen(lambda b: b.get("request_id") == "req-zmq-shm", WAIT, "the shm echo")
    assert np.array_equal(foreign.read_object(echo["data_ref"]), big)
    foreign.send(foreign.ack(echo["data_ref"]["object_id"]))
    hellos = _frames_of(foreign, "hello")
    assert len(hellos) >= 2
    assert all(h["ring"] == "" and h["ring_attached"] == "" for h in hellos)
    assert _ring_entries(hello["pid"]) <= before  # no ring was made for us
    assert not [d for d, _ in foreign.log if d.startswith("sent (ring)")]


@pytest.mark.parametrize("resume", [False, True], ids=["", "resume"])
def test_a_foreign_ring_writer(reference: PeerProcess, resume: bool) -> None:
    """A peer that advertises "ring" is offered one; it attaches as the writer, sends
    the fence Hello on ZeroMQ and everything after through the ring: order holds across
    the switch, the reader unlinks the ring's names, and a Goodbye closes cleanly.
    Resuming, its frames through the ring are numbered as on ZeroMQ (§10.7)."""
    foreign = ForeignPeer(
        f"foreign-ring-writer{'-resume' * resume}",
        _address("foreign"),
        features=("ring", "sealed"),
        resume=resume,
    )
    try:
        foreign.handshake(REFERENCE, reference.address)
        offer = foreign.seen(lambda b: b["type"] == "hello" and b["ring"], WAIT, "a ring offer")
        ring, pid = offer["ring"], offer["pid"]
        assert re.fullmatch(rf"omniwire-{pid}-[0-9a-f]{{16}}", ring)
        for n in range(3):
            mode = os.stat(f"/dev/shm/{ring}-{n}").st_mode
            assert stat.S_IMODE(mode) == 0o600
            assert stat.S_ISFIFO(mode) == (n > 0)

        def chunk(i: int) -> dict[str, object]:
            data = foreign.inline([np.full(2, i, dtype=np.int32)], TensorIndex(0))
            return foreign.data_ready("req-ring", chunk_id=i, inline=data)

        foreign.send(chunk(0))  # by ZeroMQ, before the fence
        foreign.attach_ring()
        for i in range(1, 4):
            foreign.send(chunk(i))  # through the ring
        foreign.send(foreign.data_ready("req-ring", chunk_id=4, is_done=True))
        got = [
            foreign.expect(
                lambda b: b.get("request_id") == "req-ring", WAIT, f"echo {i} of the ring stream"
            )
            for i in range(5)
        ]
        assert [g["chunk_id"] for g in got] == [0, 1, 2, 3, 4] and got[4]["is_done"]
        for g in got[:4]:
            body = g["inline"]
            assert unpack(body["data"], body["tensors"])[0].tolist() == [g["chunk_id"]] * 2
        assert not _ring_entries(pid) & {f"{ring}-{n}" for n in range(3)}  # unlinked

        big = np.arange(16 * 1024, dtype=np.float32)  # an object, announced through the ring
        foreign.send(
            foreign.data_ready(
                "req-ring-shm", data_ref=foreign.shm_object(8, [big], TensorIndex(0))
            )
        )
        ack = foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the ACK")
        assert (ack["object_id"], ack["success"]) == (8, True)
        echo = foreign.seen(lambda b: b.get("request_id") == "req-ring-shm", WAIT, "the echo")
        assert np.array_equal(foreign.read_object(echo["data_ref"]), big)
        foreign.send(foreign.ack(echo["data_ref"]["object_id"]))
        if resume:
            foreign.settle(WAIT)  # acks both ways, ours through the ring
        sent = [(d, b) for d, b in foreign.log if d.startswith("sent")]
        fence = next(i for i, (_, b) in enumerate(sent) if b.get("ring_attached"))
        assert {d for d, _ in sent[: fence + 1]} == {"sent"}  # ZeroMQ up to the fence
        assert {d for d, _ in sent[fence + 1 :]} == {"sent (ring)"}  # the ring after it
        if resume:
            later = [b for _, b in sent[fence + 1 :] if b["type"] != "hello"]
            assert later and all(b["type"] == "batch" and b["session"] for b in later), later
            assert not foreign.errors and not foreign.retained
        foreign.send(
            {
                "type": "goodbye",
                "from_stage": foreign.name,
                "instance": foreign.instance,
                "reason": "",
            }
        )
    finally:
        foreign.close()


def test_a_stalled_progressive_object_is_nacked_timeout(foreign: ForeignPeer) -> None:
    """No progress on an announced object within the receiver's ack_timeout: NACK
    "timeout" (§5.2, §7.4)."""
    peer = PeerProcess(
        "ref-impatient", _address("ref-impatient"), "--backends", "shm", "--ack-timeout", "1"
    )
    try:
        foreign.handshake("ref-impatient", peer.address)
        ref = foreign.shm_object(9, [np.zeros(1024, dtype=np.uint8)], TensorIndex(0), ready=0)
        foreign.send(foreign.data_ready("req-stalled", data_ref=ref))
        nack = foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the NACK")
        assert (nack["object_id"], nack["success"]) == (9, False)
        assert nack["reason"] == "timeout", nack
    finally:
        assert peer.stop() == 0, peer.output


# -- resumption (§2.9, feature "resume") ------------------------------------------------


def _counters(peer: ForeignPeer, request_id: str) -> dict[str, int]:
    """The reference's counters: a payload with metadata ``{"counters": true}`` is
    answered with them (foreign-peer.md §1)."""
    peer.send(
        peer.data_ready(
            request_id,
            inline=peer.inline([], {"q": 1}, "payload"),
            metadata=msgpack.packb({"counters": True}),
        )
    )
    answer = peer.expect(
        lambda b: b["type"] == "data_ready" and b["request_id"] == request_id, WAIT, "counters"
    )
    if answer["inline"] is not None:
        body = answer["inline"]
        value = read_header(body["header"], unpack(body["data"], body["tensors"]))
    else:
        value = peer.read_object(answer["data_ref"])
        peer.send(peer.ack(answer["data_ref"]["object_id"]))
    return dict(value["counters"])


def _chunk(peer: ForeignPeer, request_id: str, i: int) -> dict[str, object]:
    data = peer.inline([np.full(2, i, dtype=np.int32)], TensorIndex(0))
    return peer.data_ready(request_id, chunk_id=i, inline=data)


def _stream_echoes(peer: ForeignPeer, request_id: str) -> list[dict[str, object]]:
    """The echoes of one stream, up to its end (at most 64)."""
    got: list[dict[str, object]] = []
    while not (got and got[-1]["is_done"]) and len(got) < 64:
        got.append(
            peer.expect(
                lambda b: b["type"] == "data_ready" and b["request_id"] == request_id,
                WAIT,
                f"echo {len(got)} of {request_id}",
            )
        )
    return got


def _numbered(peer: ForeignPeer, direction: str) -> list[dict[str, object]]:
    """The numbered frames (and acks alone) sent or received: batches with a session."""
    return [
        b
        for d, b in peer.log
        if d.startswith(direction) and b["type"] == "batch" and b.get("session")
    ]


def test_resume_numbered_frames_both_ways(reference: PeerProcess) -> None:
    """Both Hellos offer "resume" with a token: every frame but Hellos goes numbered,
    both ways, carrying the addressee's token; acks (in frames or alone) trim what each
    side retains (wire-v1.md §10.7)."""
    foreign = ForeignPeer("foreign-resume-both-ways", _address("foreign"), resume=True)
    try:
        hello = foreign.handshake(REFERENCE, reference.address)
        own = foreign.own_hello(WAIT)
        assert "resume" in hello["features"] and hello["session"] != 0
        assert own["session"] == hello["session"]  # one token per session
        assert all(
            b["session"] == foreign.token and "resume" in b["features"]
            for d, b in foreign.log
            if d == "sent" and b["type"] == "hello"
        )
        for i in range(3):
            foreign.send(_chunk(foreign, "req-resume", i))
        foreign.send(foreign.data_ready("req-resume", chunk_id=3, is_done=True))
        big = np.arange(16 * 1024, dtype=np.float32)  # an object: a DataAck both ways
        foreign.send(
            foreign.data_ready(
                "req-resume-shm", data_ref=foreign.shm_object(1, [big], TensorIndex(0))
            )
        )
        echoes = _stream_echoes(foreign, "req-resume")
        assert [e["chunk_id"] for e in echoes] == [0, 1, 2, 3] and echoes[3]["is_done"]
        ack = foreign.seen(lambda b: b["type"] == "data_ack", WAIT, "the ACK")
        assert (ack["object_id"], ack["success"]) == (1, True)
        echo = foreign.seen(lambda b: b.get("request_id") == "req-resume-shm", WAIT, "the echo")
        assert np.array_equal(foreign.read_object(echo["data_ref"]), big)
        foreign.send(foreign.ack(echo["data_ref"]["object_id"]))
        foreign.settle(WAIT)  # everything acknowledged, both ways

        assert not foreign.retained and foreign.acked == foreign.next_seq - 1 == 6
        assert not foreign.errors and foreign.frames_stale == foreign.frames_duplicate == 0
        got = _numbered(foreign, "received")
        frames = [
            b
            for d, b in foreign.log
            if d.startswith("received (control") and not d.endswith("in a batch)")
        ]
        assert {b["type"] for b in frames} <= {"hello", "batch"}, frames
        assert [b for b in frames if b["type"] == "batch" and not b.get("session")] == []
        assert all(b["session"] == foreign.token and b["from_stage"] == REFERENCE for b in got)
        seqs = [b["seq"] for b in got if b["seq"]]
        assert seqs == list(range(1, len(seqs) + 1)) == list(range(1, foreign.received + 1))
        sent = _numbered(foreign, "sent")
        assert [b["seq"] for b in sent if b["seq"]] == list(range(1, 7))
        assert all(b["session"] == hello["session"] for b in sent)
        assert max(b["ack"] for b in sent) == foreign.received  # we acked all we applied
        assert any(not b["seq"] and not b["messages"] for b in got + sent)  # acks alone
    finally:
        foreign.close()


def test_resume_after_a_dropped_connection() -> None:
    """F's connection drops mid-stream: frames 1–3 went out on the old PUSH, 4–6 were
    numbered but lost. F connects a new PUSH, says Hello and sends its retained frames
    again: R applies each message once and in order (its echoes, its count of
    deliveries) and drops the three it had (`frames_duplicate`)."""
    peer = PeerProcess("ref-resume", _address("ref-resume"), "--backends", "shm")
    foreign = ForeignPeer("foreign-resume-dropped", _address("foreign"), resume=True)
    try:
        foreign.handshake("ref-resume", peer.address)
        foreign.own_hello(WAIT)
        for i in range(5):
            foreign.send(_chunk(foreign, "req-dropped", i), lose=i >= 3)
        foreign.send(foreign.data_ready("req-dropped", chunk_id=5, is_done=True), lose=True)
        assert [b["seq"] for d, b in foreign.log if d == "lost"] == [4, 5, 6]
        assert foreign.reconnect(peer.address) == 6  # nothing was acknowledged yet
        echoes = _stream_echoes(foreign, "req-dropped")
        assert [e["chunk_id"] for e in echoes] == [0, 1, 2, 3, 4, 5] and echoes[5]["is_done"]
        for e in echoes[:5]:
            body = e["inline"]
            assert unpack(body["data"], body["tensors"])[0].tolist() == [e["chunk_id"]] * 2
        counters = _counters(foreign, "req-counters")
        assert counters["frames_duplicate"] == 3, counters  # 1–3 came twice
        assert counters["frames_stale"] == 0 and counters["protocol_errors"] == 0, counters
        foreign.settle(WAIT)
        assert not foreign.errors and not foreign.retained
    finally:
        foreign.close()
        assert peer.stop() == 0, peer.output
    assert peer.output.split()[-2:] == ["DONE", "6"], peer.output  # 5 chunks and the end, once


def test_resume_the_reference_sends_again_what_we_did_not_ack(reference: PeerProcess) -> None:
    """R's link to F drops (F binds its PULL anew) while F holds back its acks: R's
    PUSH reconnects, R says Hello and sends again every frame F had not acknowledged,
    which F already applied and drops; what follows is applied once, in order."""
    foreign = ForeignPeer("foreign-resume-rebind", _address("foreign"), resume=True)
    try:
        foreign.handshake(REFERENCE, reference.address)
        foreign.own_hello(WAIT)
        before = _counters(foreign, "req-counters-before")
        foreign.settle(WAIT)
        foreign.acking = False
        for i in range(3):
            foreign.send(_chunk(foreign, "req-rebind", i))
        echoes = [
            foreign.expect(lambda b: b.get("request_id") == "req-rebind", WAIT, f"echo {i}")
            for i in range(3)
        ]
        unacked = foreign.received - foreign.ack_sent
        assert unacked >= 1  # R retains these
        hellos = len(_frames_of(foreign, "hello"))
        foreign.rebind()
        foreign.expect(
            lambda b: b["type"] == "hello" and len(_frames_of(foreign, "hello")) > hellos,
            WAIT,
            "R's Hello on its new connection",
        )
        foreign.acking = True
        foreign.send(_chunk(foreign, "req-rebind", 3))
        foreign.send(foreign.data_ready("req-rebind", chunk_id=4, is_done=True))
        echoes += _stream_echoes(foreign, "req-rebind")
        assert [e["chunk_id"] for e in echoes] == [0, 1, 2, 3, 4]  # each once, in order
        assert foreign.frames_duplicate == unacked and foreign.frames_stale == 0
        after = _counters(foreign, "req-counters-after")
        assert after["frames_resent"] - before["frames_resent"] == unacked, (before, after)
        assert after["sessions_resumed"] == before["sessions_resumed"] + 1
        foreign.settle(WAIT)
        assert not foreign.errors
    finally:
        foreign.close()


def test_resume_a_frame_of_another_session_is_dropped(reference: PeerProcess) -> None:
    """A numbered frame whose token is not R's current one is dropped whole
    (`frames_stale`) and uses up no number: the next frame, with the same number and
    the right token, is applied."""
    foreign = ForeignPeer("foreign-resume-stale", _address("foreign"), resume=True)
    try:
        hello = foreign.handshake(REFERENCE, reference.address)
        foreign.own_hello(WAIT)
        before = _counters(foreign, "req-counters-before")
        wrong = hello["session"] % (2**64 - 1) + 1  # not R's token
        stale = {
            "type": "batch",
            "messages": [_chunk(foreign, "req-stale", 0)],
            "from_stage": foreign.name,
            "session": wrong,
            "seq": foreign.next_seq,
            "ack": foreign.received,
        }
        foreign.transmit(stale)  # as it is: not retained, the number not used up here
        foreign.send(_chunk(foreign, "req-fresh", 0))  # the same number, R's token
        assert _numbered(foreign, "sent")[-1]["seq"] == stale["seq"]
        foreign.expect(lambda b: b.get("request_id") == "req-fresh", WAIT, "the echo")
        after = _counters(foreign, "req-counters-after")
        assert after["frames_stale"] == before["frames_stale"] + 1, (before, after)
        assert after["frames_duplicate"] == before["frames_duplicate"]
        assert not [b for d, b in foreign.log if d != "sent" and b.get("request_id") == "req-stale"]
        foreign.settle(WAIT)
        assert not foreign.errors
    finally:
        foreign.close()


def test_without_resume_no_frame_is_numbered(reference: PeerProcess, foreign: ForeignPeer) -> None:
    """A peer whose Hello lacks "resume" (every peer of the earlier 1.1 text) keeps
    today's behaviour: R, which offers it, sends it no numbered frame and no ack alone."""
    assert "resume" not in foreign.features and not foreign.resume
    hello = foreign.handshake(REFERENCE, reference.address)
    assert "resume" in hello["features"]  # it could
    foreign.own_hello(WAIT)
    foreign.send(
        {
            "type": "batch",
            "messages": [
                *(_chunk(foreign, "req-plain", i) for i in range(3)),
                foreign.data_ready("req-plain", chunk_id=3, is_done=True),
            ],
        }
    )
    big = np.arange(16 * 1024, dtype=np.float32)
    foreign.send(
        foreign.data_ready("req-plain-shm", data_ref=foreign.shm_object(1, [big], TensorIndex(0)))
    )
    assert [e["chunk_id"] for e in _stream_echoes(foreign, "req-plain")] == [0, 1, 2, 3]
    assert foreign.seen(lambda b: b["type"] == "data_ack", WAIT, "the ACK")["success"]
    echo = foreign.seen(lambda b: b.get("request_id") == "req-plain-shm", WAIT, "the echo")
    foreign.send(foreign.ack(echo["data_ref"]["object_id"]))
    for _ in range(10):  # R acks within 0.5 s if it numbered anything: wait that long
        if foreign.recv(0.6) is None:
            break
    batches = [b for d, b in foreign.log if d.startswith("received") and b["type"] == "batch"]
    assert all(
        b["messages"] and not (b.get("session") or b.get("seq") or b.get("ack")) for b in batches
    ), batches
    assert not foreign.errors
    assert all("session" not in b for d, b in foreign.log if d == "sent")
