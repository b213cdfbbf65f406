"""The ``nixl`` backend: the conformance suite over NIXL/UCX (two processes, tcp control
plane), and checks of its own on bare backend instances (two agents in this process)."""

from __future__ import annotations

import dataclasses
import gc
import os
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from omniwire import packing
from omniwire.backends.base import BackendContext, Export, Locality, PeerInfo
from omniwire.backends.nixl import NixlAgent
from omniwire.backends.nixl import _blobs as blobs
from omniwire.backends.nixl import _engine as engine_mod
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

    async def settled() -> Any:
        with anyio.fail_after(30):
            await small_pool.ep.drain()
            while any(a or b for a, b in small_pool.ep.in_flight().values()):
                await anyio.sleep(0.05)
        return small_pool.ep.backend("nixl").stats()

    stats = small_pool.call(settled)
    assert stats.idle, stats
    assert stats.detail["pool_dedicated"] == 0, stats
    assert stats.detail["pool_bytes_in_use"] == 0, stats


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
        backend.hello() if info is None else info,
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


async def _send(pair: _Pair, data: torch.Tensor) -> Export:
    out = await pair.a.export(pair.peer_b, data.numel(), "cpu")
    assert out.buffer is not None
    out.buffer.copy_(data)
    await out.publish(0, data.numel())
    return out


async def _receive(
    pair: _Pair, info: bytes, n: int, *, copy: bool, chunk: int | None = None
) -> torch.Tensor:
    imp = await pair.b.import_(pair.peer_a, info, n)
    try:
        dest = torch.empty(n, dtype=torch.uint8) if copy else None
        step = chunk or max(n, 1)
        for lo in range(0, n, step):
            await imp.fetch(lo, min(n, lo + step), dest)
        if dest is not None:
            return dest
        assert imp.buffer is not None
        return imp.buffer.clone()
    finally:
        imp.close()


def _ref(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(blobs.PiecesRef(**fields))


def test_pool_slots_are_reused_and_bytes_arrive(pair: _Pair) -> None:
    async def run() -> tuple[list[bytes], Any, Any]:
        infos = []
        # small (read into an own slot, then copied) and large (dest registered) objects,
        # zero-copy and copy mode, whole and in ranges
        cases = [(3000, True, None), (3000, False, None), (1 << 20, True, 256 << 10)]
        cases += [(1 << 20, False, 300_000), (1 << 20, True, None)]
        for seed, (n, copy, chunk) in enumerate(cases * 2):
            data = _pattern(n, seed)
            out = await _send(pair, data)
            info = out.ref
            infos.append(info)
            got = await _receive(pair, info, n, copy=copy, chunk=chunk)
            out.release()
            out.release()  # idempotent
            assert torch.equal(got, data), (n, copy, chunk)
        return infos, pair.a.stats(), pair.b.stats()

    infos, stats_a, stats_b = pair.call(run)
    refs = [msgspec.msgpack.decode(i, type=blobs.Ref) for i in infos]
    assert all(r.pool == 0 and r.region is None for r in refs)  # no dedicated buffer
    half = len(refs) // 2
    assert [r.offset for r in refs[:half]] == [r.offset for r in refs[half:]]  # slots reused
    assert stats_a.idle and stats_a.detail["pool_bytes_in_use"] == 0, stats_a
    assert stats_b.idle and stats_b.detail["pool_bytes_in_use"] == 0, stats_b
    assert stats_a.detail["pool_dedicated_created"] == 0
    assert stats_b.detail["pool_dedicated_created"] == 0
    assert stats_b.detail["dest_registrations"] >= 2, stats_b  # large copy-mode objects


def test_objects_beyond_the_pool_use_dedicated_registrations(pair: _Pair) -> None:
    async def run() -> list[tuple[int, Any]]:
        seen = []
        for seed, n in enumerate([6 << 20, 6 << 20, 5 << 20, 9 << 20]):
            data = _pattern(n, 100 + seed)
            out = await _send(pair, data)
            ref = msgspec.msgpack.decode(out.ref, type=blobs.Ref)
            assert ref.pool == -1 and ref.region is not None and ref.metadata
            held = pair.a.stats().detail["pool_dedicated"]
            for copy in (True, False):
                got = await _receive(pair, out.ref, n, copy=copy, chunk=2 << 20)
                assert torch.equal(got, data), (n, copy)
            out.release()
            seen.append((held, pair.a.stats()))
        return seen

    for held, after in pair.call(run):
        assert held == 1
        assert after.detail["pool_dedicated"] == 0 and after.idle, after
    assert pair.b.stats().idle


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"pool": 0, "offset": (4 << 20) - 10, "length": 64}, "outside"),
        ({"pool": 0, "offset": 1 << 40, "length": 64}, "outside"),
        ({"pool": 3, "offset": 0, "length": 64}, "pool 3"),
        ({"pool": 0, "offset": 0, "length": 65}, "length"),
        ({"pool": -1, "offset": 0, "length": 64}, "no region"),
        ({"pool": -2, "offset": 0, "length": 64}, "mixes"),
        ({"pool": -4, "offset": 0, "length": 64}, "malformed"),
        ({"pool": -3, "offset": 0, "length": 64}, "not the one lent to it"),
        (
            {
                "pool": -2,
                "offset": 0,
                "length": 64,
                "lent": [blobs.Lent(blobs.Region(1 << 40, 64), b"")],
                "pieces": [blobs.Piece(0, 1 << 40, 64, 1)],
            },
            "names region 1",
        ),
        (
            {
                "pool": -2,
                "offset": 0,
                "length": 64,
                "lent": [blobs.Lent(blobs.Region(1 << 40, 64), b"")],
                "pieces": [blobs.Piece(0, (1 << 40) + 8, 64, 0)],
            },
            "outside its region",
        ),
        (
            {
                "pool": -2,
                "offset": 0,
                "length": 64,
                "lent": [blobs.Lent(blobs.Region(1 << 40, 64), b"")],
                "pieces": [blobs.Piece(0, 1 << 40, 40, 0), blobs.Piece(32, 1 << 40, 8, 0)],
            },
            "overlaps",
        ),
    ],
    ids=[
        "straddles-end",
        "far-outside",
        "unknown-pool",
        "wrong-length",
        "no-region",
        "no-pieces",
        "unknown-form",
        "landed-in-no-landing",
        "piece-names-no-region",
        "piece-outside-region",
        "overlapping-pieces",
    ],
)
def test_references_outside_the_peers_memory_are_backend_errors(
    pair: _Pair, fields: dict[str, Any], why: str
) -> None:
    async def run() -> None:
        with pytest.raises(BackendError, match=why):
            await pair.b.import_(pair.peer_a, _ref(**fields), 64)

    pair.call(run)
    assert pair.b.stats().idle


def test_dedicated_references_are_checked(pair: _Pair) -> None:
    async def run() -> None:
        out = await _send(pair, _pattern(6 << 20, 7))  # a dedicated registration of a
        try:
            ref = msgspec.msgpack.decode(out.ref, type=blobs.Ref)
            assert ref.region is not None
            # metadata of another agent (b's own) for a's region: refused before loading
            b_hello = msgspec.msgpack.decode(pair.b.hello(), type=blobs.HelloInfo)
            forged = _ref(
                pool=-1, offset=0, length=64, region=ref.region, metadata=b_hello.metadata
            )
            with pytest.raises(BackendError, match="names agent"):
                await pair.b.import_(pair.peer_a, forged, 64)
            # a's genuine metadata, but a region a never registered: NIXL refuses the read
            elsewhere = blobs.Region(16 * 4096, 4096)  # never mapped in any process
            bogus = _ref(pool=-1, offset=0, length=64, region=elsewhere, metadata=ref.metadata)
            imp = await pair.b.import_(pair.peer_a, bogus, 64)
            try:
                with pytest.raises(BackendError, match="READ"):
                    await imp.fetch(0, 64, torch.empty(64, dtype=torch.uint8))
            finally:
                imp.close()
            # a region inside a's pool, described as dedicated: refused
            pool = msgspec.msgpack.decode(pair.a.hello(), type=blobs.HelloInfo).pools[0]
            inside = _ref(pool=-1, offset=0, length=64, region=pool, metadata=ref.metadata)
            with pytest.raises(BackendError, match="inside its own pool"):
                await pair.b.import_(pair.peer_a, inside, 64)
        finally:
            out.release()

    pair.call(run)
    assert pair.b.stats().idle


def test_hello_naming_another_agent_is_refused(pair: _Pair) -> None:
    async def run() -> None:
        a_hello = msgspec.msgpack.decode(pair.a.hello(), type=blobs.HelloInfo)
        impostor = blobs.HelloInfo("someone-else", a_hello.metadata, a_hello.pools)
        peer = PeerInfo("mallory", 7, os.getpid(), "h", "t", Locality.CROSS_HOST, b"")
        for info in (msgspec.msgpack.encode(impostor), pair.a.hello(), b"\x00junk"):
            # the metadata names another agent / the agent already belongs to alpha / junk
            with pytest.raises(BackendError):
                await pair.b.connect(dataclasses.replace(peer, info=info))

    pair.call(run)
    assert pair.b.stats().detail["remotes"] == 1


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
            out = await a.export(_peer_info(b), 100, "cpu")
            assert out.buffer is not None
            out.buffer.fill_(5)
            info = out.ref
            imp = await b.import_(peer_a, info, 100)
            await imp.fetch(0, 100, None)
            assert imp.buffer is not None and bool((imp.buffer == 5).all())
            await b.disconnect(peer_a)
            assert b.stats().detail["remotes"] == 0
            with pytest.raises(BackendError):
                await imp.fetch(0, 100, None)  # its object can no longer be read
            imp.close()
            with pytest.raises(BackendError, match="did not announce"):
                await b.import_(peer_a, info, 100)
            assert b.stats().idle and b.stats().detail["pool_bytes_in_use"] == 0
            out.release()
        finally:
            await a.aclose()
            await b.aclose()
        with pytest.raises(BackendClosedError):
            await b.import_(peer_a, info, 100)

    anyio.run(run)


def test_missing_library_is_unavailable_with_an_install_hint() -> None:
    with pytest.raises(ImportError, match="omniwire_no_such_nixl"):
        engine_mod.load_api(("omniwire_no_such_nixl._api",))
    cls = require_backend("nixl")
    assert engine_mod.load_api() is not None  # the real one is still found and cached
    assert cls.install_hint == 'pip install "omniwire[nixl]"'


def test_metadata_agent_name_parser() -> None:
    head = b"nixlSerDes|Agent"
    good = head + (5).to_bytes(8, "little") + b"agent|Conns..."
    assert blobs.md_agent(good) == "agent"
    assert blobs.md_agent(head + (50).to_bytes(8, "little") + b"agent|") is None
    assert blobs.md_agent(head + (2**63).to_bytes(8, "little") + b"x|") is None
    assert blobs.md_agent(b"\x80\x04pickle") is None
    assert blobs.md_agent(b"") is None


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "zero-copy"])
def test_lent_tensors_are_read_in_place_with_cached_registrations(pair: _Pair, copy: bool) -> None:
    ts = [torch.randn(70_000), torch.empty(0), torch.arange(33, dtype=torch.int64)]
    layout = packing.plan(ts)

    async def run() -> Any:
        assert await pair.a.export_tensors(pair.peer_b, ts, lent=False) is None
        before = pair.a.stats().detail["registrations"]
        outs = []
        for _ in range(3):  # in flight together: one registration each, shared
            out = await pair.a.export_tensors(pair.peer_b, ts, lent=True)
            assert out is not None and out.buffer is None and out.nbytes == layout.nbytes
            await out.publish(0, out.nbytes)
            outs.append(out)
        for out in outs:
            ref = msgspec.msgpack.decode(out.ref, type=blobs.PiecesRef)
            assert ref.pool == -2 and len(ref.lent) == 2 and len(ref.pieces) == 2
            got = await _receive(pair, out.ref, layout.nbytes, copy=copy)
            back = packing.unpack(got, layout.metas, copy=True)
            assert all(torch.equal(x, y) for x, y in zip(ts, back, strict=True))
            out.release()
        assert pair.a.stats().detail["registrations"] == before + 2
        return pair.a.stats(), pair.b.stats()

    sa, sb = pair.call(run)
    assert sa.idle and sb.idle and sa.detail["pool_bytes_in_use"] == 0


class FakeAgent:
    """An agent whose READs never finish and cannot be cancelled (a wedged NIC)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.registered: list[blobs.Region] = []
        self.released = 0

    def register(self, region: blobs.Region) -> object:
        self.registered.append(region)
        return region

    def deregister(self, registration: object) -> None:
        self.registered.remove(registration)  # type: ignore[arg-type]

    def metadata(self) -> bytes:
        name = self.name.encode()
        return b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name + b"|"

    def partial_metadata(self, registration: object) -> bytes:
        return self.metadata()

    def load(self, metadata: bytes) -> str:
        return blobs.md_agent(metadata) or ""

    def unload(self, agent: str) -> None:
        pass

    def known(self, agent: str) -> bool:
        return True

    def connect(self, agent: str) -> None:
        pass

    def start_read(self, *args: object) -> tuple[object, str]:
        return object(), "PROC"

    def state(self, transfer: object) -> str:
        return "PROC"

    def release(self, transfer: object) -> None:
        self.released += 1
        raise BackendError("nixl: the transfer is still posted")

    def close(self) -> None:
        pass


A = TypeVar("A", bound=FakeAgent)


@asynccontextmanager
async def _agents_pair(agent: type[A], timeout: float) -> AsyncIterator[tuple[Any, Any, list[A]]]:
    """Two started nixl backends that know each other, on fake agents of ``agent``
    (the sender's is ``agents[0]``, the receiver's ``agents[1]``); closed after."""
    agents: list[A] = []

    def factory(name: str) -> A:
        agents.append(agent(name))
        return agents[-1]

    cls = require_backend("nixl")
    opts = {"pool_size": 1 << 20, "timeout": timeout, "agent_factory": factory}
    a, b = cls(_ctx("fa", **opts)), cls(_ctx("fb", **opts))
    await a.start()
    await b.start()
    try:
        await b.connect(_peer_info(a))
        await a.connect(_peer_info(b))
        yield a, b, agents
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.asyncio
async def test_a_read_that_cannot_be_cancelled_quarantines_its_memory() -> None:
    """Through the agent seam: no NIXL, no monkeypatching."""
    async with _agents_pair(FakeAgent, 0.05) as (a, b, agents):
        out = await a.export(_peer_info(b), 4096, "cpu")
        imp = await b.import_(_peer_info(a), out.ref, 4096)
        with pytest.raises(BackendError, match="could not be cancelled"):
            await imp.fetch(0, 4096)
        imp.close()
        out.release()
        assert b.stats().idle and b.stats().detail["pool_quarantined"] == 1
        assert agents[1].released == 1
    assert all(not agent.registered for agent in agents)  # every registration undone


class FirstReadAgent(FakeAgent):
    """Its first READ completes; every later one never ends and cannot be cancelled."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.reads = 0

    def start_read(self, *args: object) -> tuple[object, str]:
        self.reads += 1
        return object(), "DONE" if self.reads == 1 else "PROC"

    def release(self, transfer: object) -> None:
        if self.reads > 1:
            super().release(transfer)


@pytest.mark.asyncio
async def test_a_read_started_on_the_loop_that_cannot_be_cancelled_quarantines_its_memory() -> None:
    """Once the first READ from a peer completed (in a worker thread), later READs start
    on the event loop and end through the completion thread; a stuck one still keeps
    its memory (a block of the registered receive pool) out of reuse."""
    agents: list[FirstReadAgent] = []

    def factory(name: str) -> FirstReadAgent:
        agents.append(FirstReadAgent(name))
        return agents[-1]

    cls = require_backend("nixl")
    opts = {"pool_size": 1 << 20, "timeout": 0.05, "agent_factory": factory}
    a, b = cls(_ctx("fa", **opts)), cls(_ctx("fb", **opts))
    await a.start()
    await b.start()
    try:
        await b.connect(_peer_info(a))
        await a.connect(_peer_info(b))
        n = 1 << 20
        for i in range(2):
            out = await a.export(_peer_info(b), n, "cpu")
            imp = await b.import_(_peer_info(a), out.ref, n)
            dest = await b.delivery_buffer(n)
            assert dest is not None
            if i == 0:
                await imp.fetch(0, n, dest)
                assert b.stats().detail["reads_on_loop"] == 0  # the first: in a thread
            else:
                kept = weakref.ref(dest)
                with pytest.raises(BackendError, match="could not be cancelled"):
                    await imp.fetch(0, n, dest)
                assert b.stats().detail["reads_on_loop"] == 1
            imp.close()
            out.release()
            del dest
            gc.collect()
        stuck = kept()
        assert stuck is not None  # quarantined: referenced, never handed out again
        assert b.stats().detail["quarantined"] == 1
        assert b.stats().detail["recv_pool_registrations"] == 1  # the block was reused once
        again = await b.delivery_buffer(n)
        assert again is not None and again.data_ptr() != stuck.data_ptr()
        assert b.stats().detail["recv_pool_registrations"] == 2
        del again, stuck
    finally:
        await a.aclose()
        await b.aclose()
    assert all(not agent.registered for agent in agents)  # every registration undone


def test_copy_mode_reads_start_on_the_loop_into_the_registered_receive_pool(pair: _Pair) -> None:
    """After a peer's first READ, copy-mode READs of large objects start on the event
    loop (no worker thread) into blocks of the registered receive pool (no
    registration of the destination per object)."""

    async def run() -> tuple[Any, Any]:
        n = 1 << 20
        start = pair.b.stats().detail
        for seed in range(4):
            data = _pattern(n, 100 + seed)
            out = await _send(pair, data)
            imp = await pair.b.import_(pair.peer_a, out.ref, n)
            dest = await pair.b.delivery_buffer(n)
            assert dest is not None
            await imp.fetch(0, n // 2, dest)
            await imp.fetch(n // 2, n, dest)
            assert torch.equal(dest, data), seed
            imp.close()
            out.release()
            del dest
            gc.collect()
        return start, pair.b.stats().detail

    start, end = pair.call(run)
    assert end["dest_registrations"] == start["dest_registrations"]  # none per object
    assert end["recv_pool_registrations"] - start["recv_pool_registrations"] <= 1
    assert end["reads_on_loop"] - start["reads_on_loop"] >= 7  # all but the first, maybe


def test_agent_seam_is_what_nixl_agent_implements() -> None:
    names = [n for n in dir(engine_mod.Agent) if not n.startswith("_")]
    assert all(callable(getattr(NixlAgent, n, None)) for n in names if n != "name"), names


# -- the agent's progress thread ---------------------------------------------------------


class _FakeBind:
    """What ``nixl._api`` takes from its native module when it builds an agent."""

    class nixlAgentConfig:
        pthrDelay = 0

    DRAM_SEG = "dram"

    def __init__(self) -> None:
        self.configs: list[Any] = []


def _fake_api(bind: Any) -> Any:
    """A stand-in for ``nixl._api`` whose ``nixl_agent`` builds its native config as
    the real wrapper does: from the module's ``nixlBind``, with ``pthrDelay = 0``."""

    api = type("api", (), {})()
    api.nixlBind = bind

    class nixl_agent:
        def __init__(self, name: str, conf: Any) -> None:
            config = api.nixlBind.nixlAgentConfig()
            config.pthrDelay = 0
            bind.configs.append(config)
            self.segment = api.nixlBind.DRAM_SEG  # the other names still resolve

    api.nixl_agent = nixl_agent
    return api


def test_the_progress_thread_waits_for_events_instead_of_spinning() -> None:
    """NIXL's wrapper hard-codes a progress-thread delay of 0 (a busy loop); the agent
    is built with ``PROGRESS_POLL_US`` instead, and the wrapper's module is restored."""
    bind = _FakeBind()
    api = _fake_api(bind)
    agent = engine_mod._new_agent(api, "a", None, engine_mod.PROGRESS_POLL_US)
    assert bind.configs[0].pthrDelay == engine_mod.PROGRESS_POLL_US > 0
    assert agent.segment == "dram"
    assert api.nixlBind is bind
    # a delay of 0 asks for the wrapper's own behaviour
    engine_mod._new_agent(api, "b", None, 0)
    assert bind.configs[1].pthrDelay == 0
    assert api.nixlBind is bind


def test_a_wrapper_without_a_native_module_still_builds_agents() -> None:
    bind = _FakeBind()
    api = _fake_api(bind)
    api.nixlBind = None  # nothing to adjust: the wrapper builds it as it likes

    class plain:
        def __init__(self, name: str, conf: Any) -> None:
            self.name = name

    api.nixl_agent = plain
    assert engine_mod._new_agent(api, "c", None, 1000).name == "c"
    assert api.nixlBind is None


def test_an_idle_agent_leaves_the_cores_alone() -> None:
    """A real agent, idle for a second, uses a few percent of a core (the spinning
    progress thread of NIXL's default took a whole one)."""
    require_backend("nixl")
    agent = NixlAgent(engine_mod.agent_name("idle"))
    try:
        cpu, wall = time.thread_time(), time.monotonic()
        start = time.process_time()
        time.sleep(1.0)
        used = (time.process_time() - start) - (time.thread_time() - cpu)
        elapsed = time.monotonic() - wall
    finally:
        agent.close()
    assert used < 0.3 * elapsed, f"an idle agent used {used:.2f} s of CPU in {elapsed:.2f} s"


def test_reads_over_tcp_are_served_by_the_targets_progress_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over UCX's tcp transport (no shared memory, as between hosts without RDMA) the
    sender's agent must answer each READ itself: its progress thread, which sleeps
    until an event, wakes for them."""
    cls = require_backend("nixl")
    monkeypatch.setenv("UCX_TLS", "tcp")

    async def run() -> None:
        a = cls(_ctx("tcp-alpha", pool_size=8 << 20))
        b = cls(_ctx("tcp-beta", pool_size=8 << 20))
        await a.start()
        await b.start()
        try:
            await b.connect(_peer_info(a))
            await a.connect(_peer_info(b))
            pair = _Pair(None, a, b)  # type: ignore[arg-type]
            with anyio.fail_after(60):
                for seed, n in enumerate([4 << 20, 3000, 1 << 20, 4 << 20]):
                    data = _pattern(n, seed)
                    out = await _send(pair, data)
                    got = await _receive(pair, out.ref, n, copy=seed % 2 == 0)
                    out.release()
                    assert torch.equal(got, data), n
        finally:
            await a.aclose()
            await b.aclose()

    anyio.run(run)


class GatedAgent(FakeAgent):
    """An agent whose READs end (landing nothing) once ``gate`` is set."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate = threading.Event()
        self.reads = 0

    def start_read(self, *args: object) -> tuple[object, str]:
        self.reads += 1
        return object(), "PROC"

    def state(self, transfer: object) -> str:
        return "DONE" if self.gate.is_set() else "PROC"

    def release(self, transfer: object) -> None:
        self.released += 1


@pytest.mark.asyncio
async def test_a_fetch_cancelled_natively_returns_only_once_its_read_ended() -> None:
    """Was: a fetch whose READ waits in a worker thread, cancelled with a plain
    ``Task.cancel()``, returned at once while the READ went on writing the caller's
    tensor (up to 88 MiB of a 256 MiB read landed after the fetch had ended), and its
    backend's close did not wait for it. It now returns when the READ ended."""
    import asyncio

    async with _agents_pair(GatedAgent, 30) as (a, b, agents):
        out = await a.export(_peer_info(b), 4096, "cpu")
        imp = await b.import_(_peer_info(a), out.ref, 4096)
        task = asyncio.ensure_future(imp.fetch(0, 4096, torch.empty(4096, dtype=torch.uint8)))
        with anyio.fail_after(5):
            while agents[1].reads == 0:
                await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.3)
        assert not task.done()  # the READ may still write into the caller's tensor
        assert b.stats().detail["reads_in_flight"] == 1
        agents[1].gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert b.stats().detail["reads_in_flight"] == 0
        imp.close()
        out.release()


class SlowRegisterAgent(FakeAgent):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.closed = False

    def register(self, region: blobs.Region) -> object:
        time.sleep(0.2)
        return super().register(region)

    def close(self) -> None:
        self.closed = True


@pytest.mark.asyncio
async def test_a_start_cancelled_natively_leaves_no_agent_behind() -> None:
    """Was: ``asyncio.wait_for(backend.start(), …)`` giving up while the agent was
    made in a worker thread left it running and its pool registered after
    ``aclose()`` (5 rounds: 8 more threads, +88 MiB)."""
    import asyncio

    agents: list[SlowRegisterAgent] = []

    def factory(name: str) -> SlowRegisterAgent:
        agents.append(SlowRegisterAgent(name))
        return agents[-1]

    cls = require_backend("nixl")
    b = cls(_ctx("sb", pool_size=1 << 20, agent_factory=factory))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(b.start(), 0.05)
    await b.aclose()  # while the agent is still being made
    await asyncio.sleep(0.4)
    assert agents and all(a.closed and not a.registered for a in agents)
