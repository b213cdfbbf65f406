"""The ``nixl`` backend: the conformance suite over NIXL/UCX (two processes, tcp control
plane), and checks of its own on bare backend instances (two agents in this process)."""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from omniwire.backends import nixl as nixl_mod
from omniwire.backends.base import BackendContext, InboundBuffer, Locality, PeerInfo
from omniwire.errors import BackendClosedError, BackendError
from omniwire.testing import BackendConformance, require_backend

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", autouse=True)
def _ucx_on_loopback() -> Iterator[None]:
    """UCX stays on the loopback device, here and in the peer processes (inherited)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCX_NET_DEVICES", "lo")
        yield


class TestNixl(BackendConformance):
    backend = "nixl"
    transport = "tcp"


# -- an endpoint pair whose pools are smaller than the objects ---------------------------


class _SmallPool(BackendConformance):
    backend = "nixl"
    transport = "tcp"
    backend_options = {"nixl": {"pool_size": 2 << 20}}  # noqa: RUF012


@pytest.fixture(scope="module")
def small_pool() -> Iterator[Any]:
    require_backend("nixl")
    yield from _SmallPool._make_harness(mode="echo")


def test_objects_larger_than_the_pool_round_trip_between_processes(small_pool: Any) -> None:
    """12 MiB objects through 2 MiB pools: dedicated registrations on both sides, read
    progressively; the same sizes again (addresses get reused), then a smaller one."""
    for i, n in enumerate([12 << 20, 12 << 20, 12 << 20, 5 << 20]):
        t = torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32)
        d = small_pool.call(small_pool.round_trip, {"t": t, "i": i}, f"big-{i}")
        assert d.backend == "nixl"
        assert d.payload["i"] == i
        assert torch.equal(d.payload["t"], t)

    async def settled() -> dict[str, int]:
        with anyio.fail_after(30):
            await small_pool.ep.drain()
            while any(a or b for a, b in small_pool.ep.in_flight().values()):
                await anyio.sleep(0.05)
        stats: dict[str, int] = small_pool.ep.backend("nixl").stats()
        return stats

    stats = small_pool.call(settled)
    assert stats["leases"] == 0 and stats["open"] == 0, stats
    assert stats["dedicated"] == 0, stats
    assert stats["pool_bytes_in_use"] == 0, stats


# -- bare backend instances --------------------------------------------------------------


class _Pair:
    def __init__(self, portal: BlockingPortal, a: Any, b: Any) -> None:
        self.portal = portal
        self.a = a  # the sender
        self.b = b  # the receiver
        self.peer_a = _peer_info(a)  # a, as b sees it
        self.peer_b = _peer_info(b)

    def call(self, fn: Any, *args: Any) -> Any:
        return self.portal.call(fn, *args)


def _ctx(name: str, **options: Any) -> BackendContext:
    return BackendContext(endpoint=name, instance=secrets.randbits(32), options=options)


def _peer_info(backend: Any, info: bytes | None = None) -> PeerInfo:
    return PeerInfo(
        backend.ctx.endpoint,
        backend.ctx.instance,
        os.getpid(),
        "h",
        "t",
        Locality.SAME_HOST,
        backend.local_info() if info is None else info,
    )


@pytest.fixture(scope="module")
def pair() -> Iterator[_Pair]:
    cls = require_backend("nixl")
    with start_blocking_portal() as portal:

        async def make() -> tuple[Any, Any]:
            a = cls(_ctx("alpha", pool_size=4 << 20))
            b = cls(_ctx("beta", pool_size=4 << 20))
            await a.start()
            await b.start()
            await b.connect(_peer_info(a))
            await a.connect(_peer_info(b))
            return a, b

        a, b = portal.call(make)
        try:
            yield _Pair(portal, a, b)
        finally:
            portal.call(a.aclose)
            portal.call(b.aclose)


def _pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


async def _send(pair: _Pair, data: torch.Tensor) -> Any:
    out = await pair.a.allocate(pair.peer_b, data.numel(), "cpu")
    out.buffer.copy_(data)
    await pair.a.publish(out, 0, data.numel())
    return out


async def _receive(
    pair: _Pair, info: bytes, n: int, *, copy: bool, chunk: int | None = None
) -> torch.Tensor:
    inb: InboundBuffer = await pair.b.open(pair.peer_a, info, n)
    try:
        dest = torch.empty(n, dtype=torch.uint8) if copy else None
        step = chunk or max(n, 1)
        for lo in range(0, n, step):
            await pair.b.fetch(inb, lo, min(n, lo + step), dest)
        if dest is not None:
            return dest
        assert inb.buffer is not None
        return inb.buffer.clone()
    finally:
        pair.b.close(inb)


def _ref(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(nixl_mod._Ref(**fields))


def test_pool_slots_are_reused_and_bytes_arrive(pair: _Pair) -> None:
    async def run() -> tuple[list[bytes], dict[str, int], dict[str, int]]:
        infos = []
        # small (read into an own slot, then copied) and large (dest registered) objects,
        # zero-copy and copy mode, whole and in ranges
        cases = [(3000, True, None), (3000, False, None), (1 << 20, True, 256 << 10)]
        cases += [(1 << 20, False, 300_000), (1 << 20, True, None)]
        for seed, (n, copy, chunk) in enumerate(cases * 2):
            data = _pattern(n, seed)
            out = await _send(pair, data)
            info = pair.a.describe(out)
            infos.append(info)
            got = await _receive(pair, info, n, copy=copy, chunk=chunk)
            pair.a.free(out)
            pair.a.free(out)  # idempotent
            assert torch.equal(got, data), (n, copy, chunk)
        return infos, pair.a.stats(), pair.b.stats()

    infos, stats_a, stats_b = pair.call(run)
    refs = [msgspec.msgpack.decode(i, type=nixl_mod._Ref) for i in infos]
    assert all(r.pool == 0 and r.region is None for r in refs)  # no dedicated buffer
    half = len(refs) // 2
    assert [r.offset for r in refs[:half]] == [r.offset for r in refs[half:]]  # slots reused
    assert stats_a["leases"] == 0 and stats_a["pool_bytes_in_use"] == 0, stats_a
    assert stats_b["open"] == 0 and stats_b["pool_bytes_in_use"] == 0, stats_b
    assert stats_a["dedicated"] == 0 and stats_b["dedicated"] == 0
    assert stats_b["dest_registrations"] >= 2, stats_b  # large copy-mode objects


def test_objects_beyond_the_pool_use_dedicated_registrations(pair: _Pair) -> None:
    async def run() -> list[tuple[int, dict[str, int]]]:
        seen = []
        for seed, n in enumerate([6 << 20, 6 << 20, 5 << 20, 9 << 20]):
            data = _pattern(n, 100 + seed)
            out = await _send(pair, data)
            ref = msgspec.msgpack.decode(pair.a.describe(out), type=nixl_mod._Ref)
            assert ref.pool == -1 and ref.region is not None and ref.metadata
            held = pair.a.stats()["dedicated"]
            for copy in (True, False):
                got = await _receive(pair, pair.a.describe(out), n, copy=copy, chunk=2 << 20)
                assert torch.equal(got, data), (n, copy)
            pair.a.free(out)
            seen.append((held, pair.a.stats()))
        return seen

    for held, after in pair.call(run):
        assert held == 1
        assert after["dedicated"] == 0 and after["leases"] == 0, after
    assert pair.b.stats()["open"] == 0


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"pool": 0, "offset": (4 << 20) - 10, "length": 64}, "outside"),
        ({"pool": 0, "offset": 1 << 40, "length": 64}, "outside"),
        ({"pool": 3, "offset": 0, "length": 64}, "pool 3"),
        ({"pool": 0, "offset": 0, "length": 65}, "length"),
        ({"pool": -1, "offset": 0, "length": 64}, "no region"),
    ],
    ids=["straddles-end", "far-outside", "unknown-pool", "wrong-length", "no-region"],
)
def test_references_outside_the_peers_memory_are_backend_errors(
    pair: _Pair, fields: dict[str, Any], why: str
) -> None:
    async def run() -> None:
        with pytest.raises(BackendError, match=why):
            await pair.b.open(pair.peer_a, _ref(**fields), 64)

    pair.call(run)
    assert pair.b.stats()["open"] == 0


def test_dedicated_references_are_checked(pair: _Pair) -> None:
    async def run() -> None:
        out = await _send(pair, _pattern(6 << 20, 7))  # a dedicated registration of a
        try:
            ref = msgspec.msgpack.decode(pair.a.describe(out), type=nixl_mod._Ref)
            assert ref.region is not None
            # metadata of another agent (b's own) for a's region: refused before loading
            b_hello = msgspec.msgpack.decode(pair.b.local_info(), type=nixl_mod._HelloInfo)
            forged = _ref(
                pool=-1, offset=0, length=64, region=ref.region, metadata=b_hello.metadata
            )
            with pytest.raises(BackendError, match="names agent"):
                await pair.b.open(pair.peer_a, forged, 64)
            # a's genuine metadata, but a region a never registered: NIXL refuses the read
            elsewhere = nixl_mod._Region(16 * 4096, 4096)  # never mapped in any process
            bogus = _ref(pool=-1, offset=0, length=64, region=elsewhere, metadata=ref.metadata)
            inb = await pair.b.open(pair.peer_a, bogus, 64)
            try:
                with pytest.raises(BackendError, match="READ"):
                    await pair.b.fetch(inb, 0, 64, torch.empty(64, dtype=torch.uint8))
            finally:
                pair.b.close(inb)
            # a region inside a's pool, described as dedicated: refused
            pool = msgspec.msgpack.decode(pair.a.local_info(), type=nixl_mod._HelloInfo).pools[0]
            inside = _ref(pool=-1, offset=0, length=64, region=pool, metadata=ref.metadata)
            with pytest.raises(BackendError, match="inside its own pool"):
                await pair.b.open(pair.peer_a, inside, 64)
        finally:
            pair.a.free(out)

    pair.call(run)
    assert pair.b.stats()["open"] == 0


def test_hello_naming_another_agent_is_refused(pair: _Pair) -> None:
    async def run() -> None:
        a_hello = msgspec.msgpack.decode(pair.a.local_info(), type=nixl_mod._HelloInfo)
        impostor = nixl_mod._HelloInfo("someone-else", a_hello.metadata, a_hello.pools)
        peer = PeerInfo("mallory", 7, os.getpid(), "h", "t", Locality.CROSS_HOST, b"")
        for info in (msgspec.msgpack.encode(impostor), pair.a.local_info(), b"\x00junk"):
            # the metadata names another agent / the agent already belongs to alpha / junk
            with pytest.raises(BackendError):
                await pair.b.connect(dataclasses.replace(peer, info=info))

    pair.call(run)
    assert pair.b.stats()["remotes"] == 1


def test_disconnect_forgets_the_peer() -> None:
    cls = require_backend("nixl")

    async def run() -> None:
        a = cls(_ctx("gamma", pool_size=1 << 20))
        b = cls(_ctx("delta", pool_size=1 << 20))
        await a.start()
        await b.start()
        try:
            peer_a = _peer_info(a)
            await b.connect(peer_a)
            out = await a.allocate(_peer_info(b), 100, "cpu")
            out.buffer.fill_(5)
            info = a.describe(out)
            inb = await b.open(peer_a, info, 100)
            await b.fetch(inb, 0, 100, None)
            assert inb.buffer is not None and bool((inb.buffer == 5).all())
            await b.disconnect(peer_a)
            assert b.stats()["remotes"] == 0
            with pytest.raises(BackendError):
                await b.fetch(inb, 0, 100, None)  # its object can no longer be read
            b.close(inb)
            with pytest.raises(BackendError, match="did not announce"):
                await b.open(peer_a, info, 100)
            assert b.stats()["open"] == 0 and b.stats()["pool_bytes_in_use"] == 0
            a.free(out)
        finally:
            await a.aclose()
            await b.aclose()
        with pytest.raises(BackendClosedError):
            await b.open(peer_a, info, 100)

    anyio.run(run)


def test_missing_library_is_unavailable_with_an_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nixl_mod, "_api", None)
    monkeypatch.setattr(nixl_mod, "_api_error", None)
    monkeypatch.setattr(nixl_mod, "_API_MODULES", ("omniwire_no_such_nixl._api",))
    av = nixl_mod.NixlBackend.availability()
    assert not av.available
    assert "omniwire_no_such_nixl" in av.reason
    assert av.hint == 'pip install "omniwire[nixl]"'


def test_metadata_agent_name_parser() -> None:
    head = b"nixlSerDes|Agent"
    good = head + (5).to_bytes(8, "little") + b"agent|Conns..."
    assert nixl_mod._md_agent(good) == "agent"
    assert nixl_mod._md_agent(head + (50).to_bytes(8, "little") + b"agent|") is None
    assert nixl_mod._md_agent(head + (2**63).to_bytes(8, "little") + b"x|") is None
    assert nixl_mod._md_agent(b"\x80\x04pickle") is None
    assert nixl_mod._md_agent(b"") is None


def test_raw_bench_moves_bytes_between_two_processes() -> None:
    require_backend("nixl")
    result = nixl_mod.raw_bench([4096, 1 << 20], 2)
    assert set(result) == {4096, 1 << 20}
    assert all(v > 0 for v in result.values())
