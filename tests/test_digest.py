"""The optional per-object digest (``Endpoint(digest=True)``, spec §7.7), against a
mock backend that flips a bit on the way (``MockHooks.flip_bit``)."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest
import torch
import xxhash

from omniwire.digest import digest_of
from omniwire.endpoint import Endpoint
from omniwire.errors import BackendError
from omniwire.testing import MockHooks, PeerProcess, register_mock_backend
from omniwire.testing.conformance import ipc_address

from foreign_peer import ForeignPeer, TensorIndex

WAIT = 10.0


def _address(name: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/owt-{os.getuid()}/{name}-{secrets.token_hex(3)}"


@asynccontextmanager
async def pair(
    hooks: MockHooks, name: str, *, digest: bool
) -> AsyncIterator[tuple[Endpoint, Endpoint]]:
    tag = secrets.token_hex(3)
    na, nb = f"a-{tag}", f"b-{tag}"
    kw: dict[str, Any] = {"backends": [name], "backend_options": {name: {"hooks": hooks}}}
    async with (
        Endpoint(nb, address=ipc_address(nb), routes={na: name}, **kw) as b,
        Endpoint(
            na, address=ipc_address(na), peers={nb: b.address}, routes={nb: name}, digest=digest,
            **kw,
        ) as a,
    ):  # fmt: skip
        await a.wait_peer(nb, 30)
        yield a, b


@pytest.mark.asyncio
async def test_a_flipped_bit_is_nacked_and_delivered_as_an_error() -> None:
    hooks = MockHooks()
    with register_mock_backend() as name:
        async with pair(hooks, name, digest=True) as (a, b):
            t = torch.arange(1 << 16, dtype=torch.int32)
            hooks.flip_bit(at=4096 + 3)
            with anyio.fail_after(30):
                receipt = await a.send(b.name, {"t": t, "n": 1}, request_id="bad")
                d = await b.receive()
                assert d.kind == "error" and d.request_id == "bad", d
                assert "corrupted on the way" in (d.error or "")
                with pytest.raises(BackendError, match="digest_mismatch"):
                    await receipt.wait()
                assert await receipt.settled() == "refused"
                assert b.counters["receive_errors"] == 1
                # the next object (no flip) passes the check
                receipt = await a.send(b.name, {"t": t}, request_id="good")
                d = await b.receive()
                await receipt.wait()
            assert d.kind == "payload" and torch.equal(d.payload["t"], t)
            assert a.backend(name).stats().idle and b.backend(name).stats().idle


@pytest.mark.asyncio
async def test_off_by_default_a_flipped_bit_goes_through() -> None:
    """What the option is for: without it the corrupted object is delivered."""
    hooks = MockHooks()
    with register_mock_backend() as name:
        async with pair(hooks, name, digest=False) as (a, b):
            t = torch.zeros(1 << 14, dtype=torch.uint8)
            hooks.flip_bit(at=100)
            with anyio.fail_after(30):
                receipt = await a.send(b.name, {"t": t}, request_id="r")
                d = await b.receive()
                await receipt.wait()
            assert d.kind == "payload" and int(d.payload["t"][100]) == 1


# -- against the foreign peer (written from the spec alone) -----------------------------


@pytest.fixture
def reference() -> Iterator[PeerProcess]:
    """An echo stage that sends digests (shm, so the foreign peer reads it)."""
    peer = PeerProcess("ref", _address("ref"), "--backends", "shm", "--digest")
    yield peer
    assert peer.stop() == 0, peer.output


@pytest.mark.parametrize("checks", [True, False], ids=["with-digest", "without"])
def test_digests_go_only_to_peers_with_the_feature(reference: PeerProcess, checks: bool) -> None:
    """A peer that advertises "digest" gets XXH3-64 of the tensor bytes; one that
    does not (an older peer) gets nil and reads the object all the same."""
    foreign = ForeignPeer(f"foreign-{checks}", _address("foreign"), features=("digest",) * checks)
    try:
        foreign.handshake("ref", reference.address)
        big = np.arange(32 * 1024, dtype=np.float32)
        small = np.array([1.5, -2.0], dtype=np.float64)
        ref = foreign.shm_object(1, [big, small], {"big": TensorIndex(0), "s": TensorIndex(1)})
        foreign.send(foreign.data_ready("req", data_ref=ref))
        echo = foreign.seen(
            lambda b: b["type"] == "data_ready" and b["request_id"] == "req", WAIT, "the echo"
        )
        want = xxhash.xxh3_64(big.tobytes() + small.tobytes()).intdigest()
        assert echo["data_ref"].get("digest") == (want if checks else None)
        value = foreign.read_object(echo["data_ref"])
        assert np.array_equal(value["big"], big)
        foreign.send(foreign.ack(echo["data_ref"]["object_id"]))
    finally:
        foreign.close()


def test_a_wrong_digest_from_a_foreign_sender_is_nacked(reference: PeerProcess) -> None:
    foreign = ForeignPeer("foreign-wrong-digest", _address("foreign"), features=("digest",))
    try:
        foreign.handshake("ref", reference.address)
        data = np.arange(32 * 1024, dtype=np.float32)
        ref = foreign.shm_object(1, [data], {"d": TensorIndex(0)})
        ref["digest"] = xxhash.xxh3_64(data.tobytes()).intdigest() ^ 1
        foreign.send(foreign.data_ready("bad", data_ref=ref))
        ack = foreign.expect(lambda b: b["type"] == "data_ack", WAIT, "the NACK")
        assert (ack["object_id"], ack["success"], ack["reason"]) == (1, False, "digest_mismatch")
        # its error delivery is echoed back as an error stream end (omniwire.peer)
        end = foreign.seen(
            lambda b: b["type"] == "data_ready" and b["request_id"] == "bad", WAIT, "the error"
        )
        assert "corrupted" in (end["error"] or ""), end
    finally:
        foreign.close()


def test_the_digest_is_xxh3_64_of_the_tensor_bytes_in_table_order() -> None:
    a = torch.arange(10, dtype=torch.int64)
    b = torch.ones(3, 5, dtype=torch.float16).t()  # not contiguous: hashed as laid out (§5)
    want = xxhash.xxh3_64(a.numpy().tobytes() + b.contiguous().numpy().tobytes()).intdigest()
    assert digest_of([a, b]) == want
    assert digest_of([]) == xxhash.xxh3_64(b"").intdigest()
    assert digest_of([torch.empty(0), a]) == xxhash.xxh3_64(a.numpy().tobytes()).intdigest()
