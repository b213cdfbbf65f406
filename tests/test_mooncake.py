"""The mooncake backend: the conformance suite over tcp on 127.0.0.1, plus focused checks
of reference validation, slot reuse, objects beyond the pool, lent tensors and
zero-copy delivery — with the real engine, and through the engine seam with a fake."""

from __future__ import annotations

import gc
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest
import torch

from omniwire import packing
from omniwire.backends.base import BackendContext, Export, Locality, PeerInfo
from omniwire.backends.support import TransferAbandonedError
from omniwire.endpoint import Endpoint
from omniwire.errors import BackendClosedError, BackendError
from omniwire.rawbench import pattern
from omniwire.testing import BackendConformance, PeerProcess, require_backend

pytestmark = pytest.mark.engine

POOL = 1 << 20  # small pools in the focused tests, so "beyond the pool" is cheap


class TestMooncake(BackendConformance):
    backend = "mooncake"
    transport = "tcp"


# -- two bare backends in this process --------------------------------------------------


def _peer_info(b: Any) -> PeerInfo:
    return PeerInfo(
        b.ctx.endpoint, b.ctx.instance, os.getpid(), "h", "t", Locality.SAME_HOST, b.hello()
    )


@asynccontextmanager
async def _pair(
    engine: Any = None, **options: Any
) -> AsyncIterator[tuple[Any, Any, PeerInfo, PeerInfo]]:
    """A sender and a receiver backend that know each other (as after a Hello).

    Both use this process's engine (one per process), so their reads go through the
    engine's own tcp listener on 127.0.0.1, exactly as between two processes."""
    cls = require_backend("mooncake")
    opts = {"pool_size": POOL, **options}
    a = cls(BackendContext("a", secrets.randbits(32), opts), engine=engine)
    b = cls(BackendContext("b", secrets.randbits(32), opts), engine=engine)
    try:
        await a.start()
        await b.start()
        peer_a, peer_b = _peer_info(a), _peer_info(b)
        await a.connect(peer_b)
        await b.connect(peer_a)
        yield a, b, peer_a, peer_b
    finally:
        with anyio.CancelScope(shield=True):
            await a.aclose()
            await b.aclose()


async def _send(a: Any, peer_b: PeerInfo, data: torch.Tensor) -> Export:
    out = await a.export(peer_b, data.numel(), "cpu")
    out.buffer.copy_(data)
    await out.publish(0, data.numel())
    return out


def _hello(b: Any) -> dict[str, Any]:
    return msgspec.msgpack.decode(b.hello())


def _ref(a: Any, **change: Any) -> bytes:
    """A reference to ``a``'s pool, with fields changed."""
    ref = {"session": _hello(a)["session"], "offset": 0, "length": 64, "dedicated": 0, **change}
    return msgspec.msgpack.encode(ref)


@pytest.mark.asyncio
async def test_hello_info_names_session_and_pool() -> None:
    async with _pair() as (a, b, _pa, _pb):
        hello = _hello(a)
        host, port = hello["session"].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert hello["protocol"] == "tcp" and hello["pieces"] is True
        assert hello["pool_size"] == POOL and hello["pool_addr"] > 0
        # one engine per process, shared: same session, separate pools
        assert _hello(b)["session"] == hello["session"]
        assert _hello(b)["pool_addr"] != hello["pool_addr"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"offset": POOL - 32}, "outside"),  # runs past the end of the pool
        ({"offset": POOL}, "outside"),
        ({"offset": 2**64 - 64}, "outside"),  # offset + length overflows
        ({"session": "127.0.0.1:1"}, "session"),  # somebody else's engine
        ({"length": 65}, "length"),  # not the announced object length
        ({"offset": -1}, "malformed"),
        ({"dedicated": 0, "offset": "0"}, "malformed"),
        ({"pieces": [[0, 1 << 40, 64]], "offset": 64}, "mixes"),
        ({"pieces": [[0, 1 << 40, 0]]}, "empty"),
        ({"pieces": [[0, 1 << 40, 40], [32, 1 << 41, 8]]}, "overlaps"),
        ({"pieces": [[40, 1 << 40, 40]]}, "outside the 64-byte"),
    ],
    ids=[
        "past-end",
        "at-end",
        "overflow",
        "foreign-session",
        "length",
        "negative",
        "type",
        "pieces-and-offset",
        "empty-piece",
        "overlapping-pieces",
        "piece-past-end",
    ],
)
@pytest.mark.asyncio
async def test_bad_references_are_refused(change: dict[str, Any], message: str) -> None:
    async with _pair() as (a, b, peer_a, _pb):
        with pytest.raises(BackendError, match=message):
            await b.import_(peer_a, _ref(a, **change), 64)
        assert b.stats().imports == 0


@pytest.mark.asyncio
async def test_references_into_the_pool_that_claim_to_be_elsewhere_are_refused() -> None:
    async with _pair() as (a, b, peer_a, _pb):
        pool = _hello(a)["pool_addr"]
        for change in (
            {"dedicated": pool + 4096},
            {"dedicated": pool - 32},  # straddles the pool's start
            {"pieces": [[0, pool + 64, 64]]},
        ):
            with pytest.raises(BackendError, match="outside its pool"):
                await b.import_(peer_a, _ref(a, **change), 64)


@pytest.mark.asyncio
async def test_reference_from_an_unknown_peer_is_refused() -> None:
    async with _pair() as (a, b, peer_a, _pb):
        stranger = PeerInfo("stranger", 7, os.getpid(), "h", "t", Locality.SAME_HOST, b"")
        with pytest.raises(BackendError, match="did not announce"):
            await b.import_(stranger, _ref(a), 64)
        await b.disconnect(peer_a)
        with pytest.raises(BackendError, match="did not announce"):
            await b.import_(peer_a, _ref(a), 64)


@pytest.mark.asyncio
async def test_peer_with_another_protocol_is_refused() -> None:
    async with _pair() as (a, b, _pa, _pb):
        hello = _hello(a)
        hello["protocol"] = "rdma"
        other = PeerInfo(
            "o", 9, os.getpid(), "h", "t", Locality.CROSS_HOST, msgspec.msgpack.encode(hello)
        )
        with pytest.raises(BackendError, match="rdma"):
            await b.connect(other)


@pytest.mark.asyncio
async def test_read_of_unregistered_memory_fails_cleanly() -> None:
    """A reference inside the announced pool, but the peer's engine no longer serves it."""
    async with _pair() as (a, b, peer_a, _pb):
        hello = _hello(a)
        await anyio.to_thread.run_sync(a.engine.unregister, hello["pool_addr"])
        try:
            imp = await b.import_(peer_a, _ref(a), 64)
            with pytest.raises(BackendError, match="failed"):
                await imp.fetch(0, 64)
            imp.close()
        finally:
            await anyio.to_thread.run_sync(a.engine.register, hello["pool_addr"], POOL)
        assert b.stats().idle and b.stats().detail["reads_in_flight"] == 0


@pytest.mark.parametrize("register_dest", [True, False], ids=["register-dest", "staged"])
@pytest.mark.asyncio
async def test_slot_is_reused_across_transfers(register_dest: bool) -> None:
    async with _pair(register_dest=register_dest) as (a, b, peer_a, peer_b):
        offsets = []
        for i in range(4):
            data = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
            out = await _send(a, peer_b, data)
            ref = msgspec.msgpack.decode(out.ref)
            offsets.append((ref["offset"], ref["dedicated"]))
            imp = await b.import_(peer_a, out.ref, data.numel())
            dest = torch.zeros(data.numel(), dtype=torch.uint8)
            # progressive: two ranges, as the endpoint fetches them
            await imp.fetch(0, 40_000, dest)
            await imp.fetch(40_000, data.numel(), dest)
            assert torch.equal(dest, data), f"transfer {i} corrupted"
            imp.close()
            imp.close()  # idempotent
            out.release()
            out.release()  # idempotent
            assert a.stats().idle and b.stats().idle
            assert b.stats().detail["pool_bytes_in_use"] == 0
        assert len(set(offsets)) == 1 and offsets[0][1] == 0, offsets
        assert a.stats().detail["pool_dedicated_created"] == 0


@pytest.mark.asyncio
async def test_zero_copy_reads_into_own_pool_and_frees_on_close() -> None:
    async with _pair() as (a, b, peer_a, peer_b):
        data = torch.randint(0, 256, (200_000,), dtype=torch.uint8)
        out = await _send(a, peer_b, data)
        imp = await b.import_(peer_a, out.ref, data.numel())
        await imp.fetch(0, data.numel())
        assert imp.buffer is not None and torch.equal(imp.buffer, data)
        pool = _hello(b)["pool_addr"]
        assert pool <= imp.buffer.data_ptr() < pool + POOL
        assert b.stats().detail["pool_bytes_in_use"] > 0
        imp.close()
        out.release()
        assert b.stats().detail["pool_bytes_in_use"] == 0
        assert a.stats().detail["pool_bytes_in_use"] == 0


@pytest.mark.parametrize("dest", [True, False], ids=["copy", "zero-copy"])
@pytest.mark.asyncio
async def test_object_beyond_the_pool_uses_dedicated_buffers(dest: bool) -> None:
    async with _pair() as (a, b, peer_a, peer_b):
        data = torch.randint(0, 256, (3 * POOL + 123,), dtype=torch.uint8)
        out = await _send(a, peer_b, data)
        assert msgspec.msgpack.decode(out.ref)["dedicated"] != 0
        assert a.stats().detail["pool_dedicated"] == 1
        imp = await b.import_(peer_a, out.ref, data.numel())
        target = torch.zeros(data.numel(), dtype=torch.uint8) if dest else None
        await imp.fetch(0, data.numel() // 2, target)
        await imp.fetch(data.numel() // 2, data.numel(), target)
        got = target if target is not None else imp.buffer
        assert got is not None and torch.equal(got, data)
        assert b.stats().detail["pool_dedicated"] == (0 if dest else 1)
        imp.close()
        out.release()
        assert a.stats().detail["pool_dedicated"] == 0
        assert b.stats().detail["pool_dedicated"] == 0
        assert a.stats().idle and b.stats().idle


@pytest.mark.parametrize("dest", [True, False], ids=["copy", "zero-copy"])
@pytest.mark.asyncio
async def test_lent_tensors_are_read_in_place_and_registrations_reused(dest: bool) -> None:
    async with _pair() as (a, b, peer_a, peer_b):
        ts = [
            torch.randn(3000),
            torch.empty(0),
            torch.arange(70, dtype=torch.int16),
            torch.randn(2 * POOL // 4),  # larger than the pool: no slot needed
        ]
        layout = packing.plan(ts)
        assert await a.export_tensors(peer_b, ts, lent=False) is None
        assert await a.export_tensors(peer_b, [ts[0].t()[::2]], lent=True) is None
        for round_ in range(3):
            out = await a.export_tensors(peer_b, ts, lent=True)
            assert out is not None and out.buffer is None and out.layout == "packed"
            assert out.nbytes == layout.nbytes
            await out.publish(0, out.nbytes)
            pieces = msgspec.msgpack.decode(out.ref)["pieces"]
            assert [p[0] for p in pieces] == [m.offset for m in layout.metas if m.nbytes]
            assert [p[1] for p in pieces] == [t.data_ptr() for t in ts if t.numel()]
            imp = await b.import_(peer_a, out.ref, layout.nbytes)
            target = torch.zeros(layout.nbytes, dtype=torch.uint8) if dest else None
            await imp.fetch(0, layout.nbytes, target)
            got = packing.unpack(
                target if target is not None else imp.buffer, layout.metas, copy=True
            )
            assert all(torch.equal(x, y) for x, y in zip(ts, got, strict=True)), round_
            imp.close()
            out.release()
            detail = a.stats().detail
            assert detail["registrations"] == 3 and detail["lent"] == round_ + 1
            assert detail["pool_bytes_in_use"] == 0  # nothing was packed
        assert a.stats().idle and b.stats().idle


@pytest.mark.asyncio
async def test_no_lending_to_a_peer_that_cannot_read_pieces() -> None:
    async with _pair() as (a, _b, _pa, peer_b):
        hello = _hello(a)
        del hello["pieces"]  # an older receiver
        old = PeerInfo(
            "old", 5, os.getpid(), "h", "t", Locality.SAME_HOST, msgspec.msgpack.encode(hello)
        )
        await a.connect(old)
        assert await a.export_tensors(old, [torch.ones(100)], lent=True) is None
        assert await a.export_tensors(peer_b, [torch.ones(100)], lent=True) is not None


@pytest.mark.asyncio
async def test_fetch_validates_ranges_and_state() -> None:
    async with _pair() as (a, b, peer_a, peer_b):
        out = await _send(a, peer_b, torch.ones(64, dtype=torch.uint8))
        imp = await b.import_(peer_a, out.ref, 64)
        with pytest.raises(BackendError, match="outside"):
            await imp.fetch(0, 65)
        with pytest.raises(BackendError, match="outside"):
            await imp.fetch(10, 5)
        await b.disconnect(peer_a)
        with pytest.raises(BackendError, match="gone"):
            await imp.fetch(0, 64)
        imp.close()
        with pytest.raises(BackendError, match="closed"):
            await imp.fetch(0, 64)
        out.release()


@pytest.mark.asyncio
async def test_aclose_releases_everything_and_refuses_work() -> None:
    async with _pair() as (a, b, peer_a, peer_b):
        small = await _send(a, peer_b, torch.ones(100, dtype=torch.uint8))
        big = await _send(a, peer_b, torch.ones(2 * POOL, dtype=torch.uint8))
        imp = await b.import_(peer_a, small.ref, 100)
        await imp.fetch(0, 100)
        await a.aclose()
        await b.aclose()
        assert a.stats().detail["pool_dedicated"] == 0
        small.release()  # after close: inert
        big.release()
        imp.close()
        assert a.stats().idle and b.stats().idle
        with pytest.raises(BackendClosedError):
            await a.export(peer_b, 10, "cpu")
        with pytest.raises(BackendClosedError):
            await b.import_(peer_a, _ref(a), 64)


def test_availability_is_cheap_and_reports_ok() -> None:
    cls = require_backend("mooncake")
    av = cls.availability()
    assert av.available, av
    assert cls.install_hint == 'pip install "omniwire[mooncake]"'
    assert cls.auto_start == "tcp" and not cls.needs_gpu
    caps = cls.capabilities
    assert caps.progressive and caps.zero_copy and caps.devices == frozenset({"cpu"})
    assert Locality.SAME_PROCESS not in caps.localities


def test_read_from_a_dead_peer_fails_cleanly() -> None:
    """A peer process that dies: the next read is a BackendError, not a hang or a crash."""
    require_backend("mooncake")
    size = 1 << 20
    child = subprocess.Popen(
        [sys.executable, "-m", "omniwire.rawbench", "serve-mooncake", "--size", str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ready, session, addr = child.stdout.readline().split()
        assert ready == "READY"
        hello = {"session": session, "protocol": "tcp", "pool_addr": int(addr), "pool_size": size}
        peer = PeerInfo(
            "far", 3, child.pid, "h", "t", Locality.SAME_HOST, msgspec.msgpack.encode(hello)
        )
        ref = msgspec.msgpack.encode({"session": session, "offset": 0, "length": size})

        async def run() -> None:
            cls = require_backend("mooncake")
            b = cls(BackendContext("b", secrets.randbits(32), {"pool_size": POOL}))
            await b.start()
            try:
                await b.connect(peer)
                dest = torch.zeros(size, dtype=torch.uint8)
                imp = await b.import_(peer, ref, size)
                await imp.fetch(0, size, dest)
                assert torch.equal(dest, pattern(size))
                imp.close()
                child.kill()
                assert child.wait(10) == -9
                imp = await b.import_(peer, ref, size)
                with anyio.fail_after(60), pytest.raises(BackendError, match="far"):
                    await imp.fetch(0, size, dest)
                imp.close()
                assert b.stats().idle and b.stats().detail["reads_in_flight"] == 0
            finally:
                await b.aclose()

        anyio.run(run)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


def test_bad_options_are_refused() -> None:
    cls = require_backend("mooncake")
    for options in ({"pool_size": -1}, {"pool_size": "lots"}, {"protocol": ""}):
        with pytest.raises(BackendError, match="options"):
            cls(BackendContext("x", 1, options))


# -- the engine seam: a fake engine, no monkeypatching ------------------------------------


class StuckEngine:
    """An engine whose reads never complete (a peer that stopped answering)."""

    session = "fake:1"

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.submitted = 0

    def register(self, addr: int, length: int) -> None:
        self.registered[addr] = length

    def unregister(self, addr: int) -> None:
        del self.registered[addr]

    def submit_read(self, session: str, local: int, remote: int, length: int) -> int:
        self.submitted += 1
        return self.submitted

    def status(self, batch: int) -> int:
        return 0


@pytest.mark.asyncio
async def test_an_abandoned_read_quarantines_its_landing_slot() -> None:
    engine = StuckEngine()
    async with _pair(engine, timeout=0.05, register_dest=False) as (a, b, peer_a, peer_b):
        out = await _send(a, peer_b, torch.ones(4096, dtype=torch.uint8))
        imp = await b.import_(peer_a, out.ref, 4096)
        with pytest.raises(BackendError, match=r"did not finish within 0\.05"):
            await imp.fetch(0, 4096)
        imp.close()
        out.release()
        detail = b.stats().detail
        assert detail["pool_quarantined"] == 1 and detail["pool_bytes_in_use"] == 4096
        assert b.stats().idle  # the handle is gone; the memory stays out of use
    assert engine.registered == {}  # both pools and every buffer unregistered


class GatedEngine(StuckEngine):
    """An engine whose reads complete once ``gate`` is set (they land nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.status_threads: set[str] = set()

    def status(self, batch: int) -> int:
        self.status_threads.add(threading.current_thread().name)
        return 1 if self.gate.is_set() else 0


@pytest.mark.asyncio
async def test_reads_in_flight_are_waited_for_by_one_thread_and_outlive_a_cancellation() -> None:
    """Objects that stream arrive as many reads at once: one completion thread checks
    them all (a polling thread each took the cores from the engine); a fetch cancelled
    meanwhile returns only once its read ended (the engine writes into its memory)."""
    engine = GatedEngine()
    async with _pair(engine, register_dest=False) as (a, b, peer_a, peer_b):
        outs = [await _send(a, peer_b, torch.ones(4096, dtype=torch.uint8)) for _ in range(6)]
        imps = [await b.import_(peer_a, out.ref, 4096) for out in outs]
        ended_at_cancel: list[bool] = []
        done: list[int] = []

        async def fetch(i: int) -> None:
            await imps[i].fetch(0, 4096)
            done.append(i)

        async def cancelled_fetch(scope: anyio.CancelScope) -> None:
            with scope:
                try:
                    await imps[5].fetch(0, 4096)
                finally:
                    ended_at_cancel.append(engine.gate.is_set())

        scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(fetch, i)
            tg.start_soon(cancelled_fetch, scope)
            await anyio.sleep(0.2)  # every read is submitted and polled
            assert engine.submitted == 6 and not done
            scope.cancel()
            await anyio.sleep(0.2)
            assert ended_at_cancel == []  # the cancelled fetch still waits for its read
            engine.gate.set()
        assert sorted(done) == [0, 1, 2, 3, 4] and ended_at_cancel == [True]
        assert engine.status_threads == {"omniwire-mooncake-completions"}
        assert b._completions.waited == 6
        for imp, out in zip(imps, outs, strict=True):
            imp.close()
            out.release()
        assert b.stats().detail["pool_quarantined"] == 0  # every read ended: slots reused


async def _fetch_until_the_peer_is_lost(b: Any, imp: Any, peer_a: PeerInfo, **kw: Any) -> None:
    """Start a read that never completes, then lose its peer (a link gone down)."""
    failure: list[BaseException] = []

    async def fetch() -> None:
        try:
            await imp.fetch(0, 4096, **kw)
        except BackendError as exc:
            failure.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(fetch)
        await anyio.sleep(0.2)  # the read is submitted and polled
        await b.disconnect(peer_a)
    assert failure and isinstance(failure[0], TransferAbandonedError), failure
    assert "was cancelled" in str(failure[0])


@pytest.mark.asyncio
async def test_a_read_abandoned_on_peer_loss_quarantines_its_landing_slot() -> None:
    """The read may still land once the link is back: its slot must not be reused
    (it was, and the next object was delivered with the lost one's bytes in it)."""
    engine = StuckEngine()
    async with _pair(engine, register_dest=False) as (a, b, peer_a, peer_b):
        out = await _send(a, peer_b, torch.ones(4096, dtype=torch.uint8))
        imp = await b.import_(peer_a, out.ref, 4096)
        await _fetch_until_the_peer_is_lost(b, imp, peer_a)
        imp.close()
        out.release()
        detail = b.stats().detail
        assert detail["pool_quarantined"] == 1 and detail["pool_bytes_in_use"] == 4096


@pytest.mark.asyncio
async def test_a_read_abandoned_on_peer_loss_keeps_the_callers_dest() -> None:
    """With ``register_dest`` the read targets the caller's memory: the backend keeps
    it referenced (a receive-pool block is reused only once no tensor holds it) and
    registered until aclose."""
    engine = StuckEngine()
    async with _pair(engine, register_dest=True) as (a, b, peer_a, peer_b):
        out = await _send(a, peer_b, torch.ones(4096, dtype=torch.uint8))
        imp = await b.import_(peer_a, out.ref, 4096)
        dest = torch.zeros(4096, dtype=torch.uint8)
        addr, kept = dest.data_ptr(), weakref.ref(dest)
        await _fetch_until_the_peer_is_lost(b, imp, peer_a, dest=dest)
        imp.close()
        out.release()
        del dest
        gc.collect()
        assert kept() is not None  # still referenced: its memory is not reused
        assert addr in engine.registered  # and still registered
    gc.collect()  # (a cycle elsewhere in the suite may hold a frame that saw it)
    assert kept() is None and engine.registered == {}  # aclose let it go


# -- the registered receive pool --------------------------------------------------------


class CountingEngine:
    """The process's real engine, counting registrations (the engine seam)."""

    def __init__(self) -> None:
        from omniwire.backends.mooncake._engine import shared_engine

        self.engine = shared_engine("127.0.0.1", "tcp", "")
        self.session = self.engine.session
        self.registered: dict[int, int] = {}
        self.registrations = 0

    def register(self, addr: int, length: int) -> None:
        self.engine.register(addr, length)
        self.registered[addr] = length
        self.registrations += 1

    def unregister(self, addr: int) -> None:
        self.engine.unregister(addr)
        del self.registered[addr]

    def submit_read(self, session: str, local: int, remote: int, length: int) -> int:
        return self.engine.submit_read(session, local, remote, length)

    def status(self, batch: int) -> int:
        return self.engine.status(batch)


@pytest.mark.asyncio
async def test_copy_mode_reads_land_in_the_registered_receive_pool_without_a_registration_each() -> (
    None
):
    """Each object used to register its destination before the read and unregister it
    after: now the receive buffer's block is registered once and reused."""
    engine = CountingEngine()
    async with _pair(engine, register_dest=True) as (a, b, peer_a, peer_b):
        n = 300_000
        before = None
        for i in range(4):
            data = torch.randint(0, 256, (n,), dtype=torch.uint8)
            out = await _send(a, peer_b, data)
            imp = await b.import_(peer_a, out.ref, n)
            dest = await b.delivery_buffer(n)
            assert dest is not None and dest.numel() == n
            await imp.fetch(0, n // 3, dest)
            await imp.fetch(n // 3, n, dest)
            assert torch.equal(dest, data), i
            imp.close()
            out.release()
            del dest  # the block goes back to the pool, still registered
            gc.collect()
            if before is None:
                before = engine.registrations  # the pools, and the first block
        assert engine.registrations == before
        detail = b.stats().detail
        assert detail["recv_pool_registrations"] == 1 and detail["pool_bytes_in_use"] == 0
    assert engine.registered == {}  # every block unregistered at aclose


@pytest.mark.asyncio
async def test_a_read_abandoned_into_a_receive_pool_block_keeps_the_block() -> None:
    """A read that may still land keeps its block out of the pool (referenced) until
    aclose: the next object must not get it."""
    engine = StuckEngine()
    async with _pair(engine) as (a, b, peer_a, peer_b):
        out = await _send(a, peer_b, torch.ones(4096, dtype=torch.uint8))
        imp = await b.import_(peer_a, out.ref, 4096)
        dest = await b.delivery_buffer(1 << 20)
        assert dest is not None
        addr, kept = dest.data_ptr(), weakref.ref(dest)
        await _fetch_until_the_peer_is_lost(b, imp, peer_a, dest=dest)
        imp.close()
        out.release()
        del dest
        gc.collect()
        assert kept() is not None and addr in engine.registered
        again = await b.delivery_buffer(1 << 20)
        assert again is not None and again.data_ptr() != addr  # not the abandoned block
        del again
    gc.collect()
    assert kept() is None and engine.registered == {}


class RefusingEngine(StuckEngine):
    """Refuses registrations once ``refuse`` is set (pinned-memory limits, say)."""

    refuse = False

    def register(self, addr: int, length: int) -> None:
        if self.refuse:
            raise BackendError(f"mooncake: register_memory(0x{addr:x}, {length}) failed")
        super().register(addr, length)


@pytest.mark.asyncio
async def test_a_refused_receive_block_falls_back_to_the_endpoints_buffer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = RefusingEngine()
    async with _pair(engine) as (_a, b, _pa, _pb):
        engine.refuse = True
        assert await b.delivery_buffer(1 << 20) is None  # not an error: no pool block
        assert await b.delivery_buffer(1 << 20) is None
        assert b.stats().detail["recv_pool_refused"] == 2
        warned = [r for r in caplog.records if "no registered receive buffer" in r.message]
        assert len(warned) == 1  # said once
        engine.refuse = False
    assert engine.registered == {}


# -- through endpoints, zero-copy on both ends, two processes ---------------------------


def test_zero_copy_endpoints_round_trip_large_progressive_objects() -> None:
    require_backend("mooncake")
    tag = secrets.token_hex(3)
    me, other = f"zc-{tag}", f"zc-peer-{tag}"
    options = {"mooncake": {"pool_size": 8 << 20}}
    peer = PeerProcess(
        other,
        "tcp://127.0.0.1:0",
        "--backends",
        "mooncake",
        "--backend-options",
        json.dumps(options),
        "--routes",
        json.dumps({me: "mooncake"}),
        "--zero-copy",
    )

    async def run() -> None:
        async with Endpoint(
            me,
            address="tcp://127.0.0.1:0",
            peers={other: peer.address},
            backends=["mooncake"],
            backend_options=options,
            routes={other: "mooncake"},
            zero_copy=True,
            progressive_chunk=1 << 20,
        ) as ep:
            await ep.wait_peer(other, 30)
            backend = ep.backend("mooncake")
            # 3 MiB fits the 8 MiB pool; 12 MiB goes through dedicated buffers both ways
            for n in (3 << 20, 12 << 20):
                t = torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32)
                with anyio.fail_after(60):
                    receipt = await ep.send(other, {"t": t, "n": n}, request_id=f"zc-{n}")
                    d = await ep.receive()
                    assert d.backend == "mooncake" and d.payload["n"] == n
                    assert torch.equal(d.payload["t"], t)
                    assert backend.stats().imports == 1  # the view is alive until release
                    d.release()
                    await receipt.wait()
                assert backend.stats().imports == 0
            with anyio.fail_after(30):
                await ep.drain()
                while any(a or b for a, b in ep.in_flight().values()):
                    await anyio.sleep(0.05)
            stats = backend.stats()
            assert stats.idle, stats
            assert stats.detail["pool_dedicated_created"] >= 1, stats

    try:
        anyio.run(run)
    finally:
        assert peer.stop() == 0, peer.output


@pytest.mark.asyncio
async def test_copy_mode_deliveries_reuse_registered_receive_blocks() -> None:
    """Through two endpoints (two "hosts" in this process): each 1 MiB copy-mode
    delivery lands in the receiving backend's registered receive pool, and a block
    whose delivery was dropped takes a later object: the registrations stop growing
    (two blocks alternate: the receiver keeps its last delivery until the next one)."""
    require_backend("mooncake")
    tag = secrets.token_hex(3)
    a_name, b_name = f"rp-a-{tag}", f"rp-b-{tag}"
    b = Endpoint(
        b_name,
        address="tcp://127.0.0.1:0",
        backends=["mooncake"],
        routes={a_name: "mooncake"},
        host_id=f"host-b-{tag}",
    )
    async with (
        b,
        Endpoint(
            a_name,
            address="tcp://127.0.0.1:0",
            peers={b_name: b.address},
            backends=["mooncake"],
            routes={b_name: "mooncake"},
            host_id=f"host-a-{tag}",
        ) as a,
    ):
        await a.wait_peer(b_name, 30)
        registrations = []
        for i in range(6):
            t = torch.randint(0, 2**31 - 1, (1 << 18,), dtype=torch.int32)
            with anyio.fail_after(30):
                receipt = await a.send(b_name, {"t": t}, request_id=f"r{i}", lend=i % 2 == 1)
                d = await b.receive()
                assert d.backend == "mooncake" and torch.equal(d.payload["t"], t)
                del d
                gc.collect()  # the delivered tensor dies: its block returns, registered
                await receipt.wait()
            registrations.append(b.backend("mooncake").stats().detail["recv_pool_registrations"])
        assert 1 <= registrations[1] <= 2 and registrations[-1] == registrations[1], registrations


# -- the TCP transport's slice -----------------------------------------------------------


@pytest.mark.parametrize(
    ("mtu", "timestamps", "slice_size"),
    [
        (1500, True, 45 * 1448),  # Ethernet: 45 whole segments of 1448 bytes
        (1500, False, 44 * 1460),
        (9000, True, 7 * 8948),  # jumbo frames
        (1400, True, 48 * 1348),
        (65536, True, None),  # loopback: the engine's own 64 KiB
        (300, True, None),
    ],
)
def test_the_tcp_slice_is_a_whole_number_of_segments(
    mtu: int, timestamps: bool, slice_size: int | None
) -> None:
    """A slice that ends in a short segment waits for the reader's delayed ACK (Nagle):
    about 60 ms for one 1 MiB read in ten at an MTU of 1500."""
    from omniwire.backends.mooncake._engine import slice_for_mtu

    got = slice_for_mtu(mtu, timestamps)
    assert got == slice_size
    if got is not None:
        assert got <= 64 << 10 and got % (mtu - 40 - 12 * timestamps) == 0


def test_the_tcp_slice_follows_the_interface_that_holds_the_engines_address() -> None:
    from omniwire.backends.mooncake._engine import _interface_mtu, tcp_slice_size

    with open("/sys/class/net/lo/mtu") as f:
        assert _interface_mtu("127.0.0.1") == int(f.read())
    assert tcp_slice_size("127.0.0.1") is None  # loopback keeps the engine's slice
    assert _interface_mtu("198.18.255.254") is None  # no interface of ours holds it
    assert tcp_slice_size("not-an-address") is None


# -- shared references: born tensors and fan-outs ----------------------------------------


@asynccontextmanager
async def _hosts(
    n: int, zero_copy: bool = False, receiver_options: dict[str, dict[str, Any]] | None = None
) -> AsyncIterator[tuple[Endpoint, list[Endpoint]]]:
    """A sender and ``n`` receivers, each told apart as another host, every edge mooncake
    (``receiver_options``: the receivers' mooncake options, added to a small pool)."""
    require_backend("mooncake")
    tag = secrets.token_hex(3)
    a_name = f"sh-a-{tag}"
    names = [f"sh-b{i}-{tag}" for i in range(n)]
    opts = {"mooncake": {"pool_size": 8 << 20}}
    mine = {"mooncake": {**opts["mooncake"], **(receiver_options or {}).get("mooncake", {})}}
    receivers = [
        Endpoint(
            name,
            address="tcp://127.0.0.1:0",
            backends=["mooncake"],
            routes={a_name: "mooncake"},
            host_id=f"host-{name}",
            zero_copy=zero_copy,
            backend_options=mine,
        )
        for name in names
    ]
    for r in receivers:
        await r.start()
    try:
        async with Endpoint(
            a_name,
            address="tcp://127.0.0.1:0",
            peers={r.name: r.address for r in receivers},
            backends=["mooncake"],
            routes=dict.fromkeys(names, "mooncake"),
            host_id=f"host-a-{tag}",
            backend_options=opts,
        ) as a:
            for name in names:
                await a.wait_peer(name, 30)
            yield a, receivers
    finally:
        with anyio.CancelScope(shield=True):
            for r in receivers:
                await r.aclose()


@pytest.mark.asyncio
async def test_a_born_tensor_is_a_slot_of_the_registered_pool_and_sent_in_place() -> None:
    """``Endpoint.empty()`` on a mooncake route is a slot of the registered pool: a send
    of it packs nothing, lends nothing (no registration of its own) — it is written
    from the slot into the peer's landing — and the slot goes back when the buffer is
    released."""
    async with _hosts(1) as (a, (b,)):
        mc = a.backend("mooncake")
        buf = await a.empty(b.name, (1 << 18,), torch.int32)
        assert buf.backend == "mooncake"
        exports, packed = mc.stats().exports, a.counters["bytes_packed"]
        lent, landed = mc.counters["lent"], mc.counters["landed"]
        for i in range(3):  # refilled after each receipt
            want = pattern(1 << 20).view(torch.int32) + i
            buf.tensor.copy_(want)
            with anyio.fail_after(30):
                receipt = await a.send(b.name, {"h": buf.tensor}, request_id=f"r{i}")
                d = await b.receive()
                assert d.backend == "mooncake" and torch.equal(d.payload["h"], want)
                d.release()
                await receipt.wait()
                await buf.settled(30)
                assert await receipt.settled(30) == "delivered"  # its range freed too
        assert mc.counters["landed"] - landed == 3
        assert mc.stats().exports == exports  # no slot was packed for the sends
        assert a.counters["bytes_packed"] == packed
        assert mc.counters["lent"] == lent  # nothing lent: no registration of its own
        buf.release()
        assert mc.stats().exports == exports - 1  # its slot is back


@pytest.mark.asyncio
async def test_a_fan_out_to_two_mooncake_peers_packs_one_buffer_for_both() -> None:
    """One pack; each target's object is written from that buffer into its landing
    (``landing_size=0`` on the receivers: both read the one buffer instead)."""
    for landing in (True, False):
        options = None if landing else {"mooncake": {"landing_size": 0}}
        async with _hosts(2, receiver_options=options) as (a, receivers):
            mc = a.backend("mooncake")
            t = pattern(1 << 20)
            packed, landed = a.counters["bytes_packed"], mc.counters["landed"]
            with anyio.fail_after(30):
                receipts = await a.send([r.name for r in receivers], {"t": t}, request_id="f")
                for r in receivers:
                    d = await r.receive()
                    assert d.backend == "mooncake" and torch.equal(d.payload["t"], t)
                    d.release()
                outcomes = [await receipt.settled() for receipt in receipts]
            assert outcomes == ["delivered", "delivered"]
            assert a.counters["bytes_packed"] - packed == t.nbytes  # once, not per target
            assert mc.counters["landed"] - landed == (2 if landing else 0)
            assert mc.stats().exports == 0  # released with the last ACK


@pytest.mark.asyncio
async def test_a_fetch_cancelled_natively_unregisters_the_callers_memory() -> None:
    """Was: a fetch into the caller's tensor (registered for the read) cancelled with a
    plain ``Task.cancel()`` returned once its read ended — and left the tensor
    registered with the engine for good: 19 of 20 such fetches in a probe, and then
    every fetch into fresh memory at those addresses failed (code -7, overlap). A read
    that ended is unregistered whoever waited for it; one that may still land is
    abandoned (kept referenced) as a timed-out one is."""
    import asyncio

    engine = GatedEngine()
    async with _pair(engine, register_dest=True) as (a, b, peer_a, peer_b):
        out = await _send(a, peer_b, torch.ones(4096, dtype=torch.uint8))
        pools = dict(engine.registered)
        imp = await b.import_(peer_a, out.ref, 4096)
        dest = torch.empty(4096, dtype=torch.uint8)
        task = asyncio.ensure_future(imp.fetch(0, 4096, dest))
        with anyio.fail_after(5):
            while engine.submitted == 0:
                await asyncio.sleep(0.01)
        assert len(engine.registered) == len(pools) + 1  # the caller's tensor
        task.cancel()
        await asyncio.sleep(0.1)
        engine.gate.set()  # the read ends
        with pytest.raises(asyncio.CancelledError):
            await task
        with anyio.fail_after(5):
            while engine.registered != pools:
                await asyncio.sleep(0.01)
        imp.close()
        out.release()


class SlowRegisterEngine(StuckEngine):
    """An engine whose registrations take a while (a large pool being pinned)."""

    def register(self, addr: int, length: int) -> None:
        time.sleep(0.2)
        super().register(addr, length)


@pytest.mark.asyncio
async def test_a_start_cancelled_natively_leaves_no_registered_pool() -> None:
    """Was: ``asyncio.wait_for(backend.start(), …)`` giving up while the pool was being
    registered in a worker thread left the pool registered for good (5 rounds: 320
    MiB), and its memory unmapped by the collector while still registered."""
    import asyncio

    engine = SlowRegisterEngine()
    cls = require_backend("mooncake")
    b = cls(BackendContext("b", secrets.randbits(32), {"pool_size": POOL}), engine=engine)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(b.start(), 0.05)
    await b.aclose()  # while the pool is still being registered
    await asyncio.sleep(0.4)
    assert engine.registered == {}
