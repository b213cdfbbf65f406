"""The mooncake backend: the conformance suite over tcp on 127.0.0.1, plus focused checks
of reference validation, slot reuse, objects beyond the pool and zero-copy delivery."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest
import torch

from omniwire.backends.base import BackendContext, Locality, PeerInfo
from omniwire.endpoint import Endpoint
from omniwire.errors import BackendClosedError, BackendError
from omniwire.testing import BackendConformance, PeerProcess, require_backend

pytestmark = pytest.mark.engine

POOL = 1 << 20  # small pools in the focused tests, so "beyond the pool" is cheap


class TestMooncake(BackendConformance):
    backend = "mooncake"
    transport = "tcp"


# -- two bare backends in this process --------------------------------------------------


def _peer_info(b: Any) -> PeerInfo:
    return PeerInfo(
        b.ctx.endpoint, b.ctx.instance, os.getpid(), "h", "t", Locality.SAME_HOST, b.local_info()
    )


@asynccontextmanager
async def _pair(**options: Any) -> AsyncIterator[tuple[Any, Any, PeerInfo, PeerInfo]]:
    """A sender and a receiver backend that know each other (as after a Hello).

    Both use this process's engine (one per process), so their reads go through the
    engine's own tcp listener on 127.0.0.1, exactly as between two processes."""
    cls = require_backend("mooncake")
    opts = {"pool_size": POOL, **options}
    a = cls(BackendContext("a", secrets.randbits(32), opts))
    b = cls(BackendContext("b", secrets.randbits(32), opts))
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


async def _send(a: Any, peer_b: PeerInfo, data: torch.Tensor) -> Any:
    out = await a.allocate(peer_b, data.numel(), "cpu")
    out.buffer.copy_(data)
    await a.publish(out, 0, data.numel())
    return out


def _ref(a: Any, **change: Any) -> bytes:
    """A reference to ``a``'s pool, with fields changed."""
    hello = msgspec.msgpack.decode(a.local_info())
    ref = {"session": hello["session"], "offset": 0, "length": 64, "dedicated": 0, **change}
    return msgspec.msgpack.encode(ref)


def _run(fn: Callable[[], Awaitable[None]]) -> None:
    anyio.run(fn)


def test_hello_info_names_session_and_pool() -> None:
    async def run() -> None:
        async with _pair() as (a, b, _pa, _pb):
            hello = msgspec.msgpack.decode(a.local_info())
            host, port = hello["session"].rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0
            assert hello["protocol"] == "tcp"
            assert hello["pool_size"] == POOL and hello["pool_addr"] > 0
            # one engine per process, shared: same session, separate pools
            hello_b = msgspec.msgpack.decode(b.local_info())
            assert hello_b["session"] == hello["session"]
            assert hello_b["pool_addr"] != hello["pool_addr"]

    _run(run)


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
    ],
    ids=["past-end", "at-end", "overflow", "foreign-session", "length", "negative", "type"],
)
def test_bad_references_are_refused(change: dict[str, Any], message: str) -> None:
    async def run() -> None:
        async with _pair() as (a, b, peer_a, _pb):
            with pytest.raises(BackendError, match=message):
                await b.open(peer_a, _ref(a, **change), 64)
            assert b.stats()["open"] == 0

    _run(run)


def test_dedicated_reference_inside_the_pool_is_refused() -> None:
    async def run() -> None:
        async with _pair() as (a, b, peer_a, _pb):
            hello = msgspec.msgpack.decode(a.local_info())
            inside = _ref(a, dedicated=hello["pool_addr"] + 4096)
            with pytest.raises(BackendError, match="dedicated"):
                await b.open(peer_a, inside, 64)
            straddling = _ref(a, dedicated=hello["pool_addr"] - 32)
            with pytest.raises(BackendError, match="dedicated"):
                await b.open(peer_a, straddling, 64)

    _run(run)


def test_reference_from_an_unknown_peer_is_refused() -> None:
    async def run() -> None:
        async with _pair() as (a, b, peer_a, _pb):
            stranger = PeerInfo("stranger", 7, os.getpid(), "h", "t", Locality.SAME_HOST, b"")
            with pytest.raises(BackendError, match="did not announce"):
                await b.open(stranger, _ref(a), 64)
            await b.disconnect(peer_a)
            with pytest.raises(BackendError, match="did not announce"):
                await b.open(peer_a, _ref(a), 64)

    _run(run)


def test_peer_with_another_protocol_is_refused() -> None:
    async def run() -> None:
        async with _pair() as (a, b, _pa, _pb):
            hello = msgspec.msgpack.decode(a.local_info())
            hello["protocol"] = "rdma"
            other = PeerInfo(
                "o", 9, os.getpid(), "h", "t", Locality.CROSS_HOST, msgspec.msgpack.encode(hello)
            )
            with pytest.raises(BackendError, match="rdma"):
                await b.connect(other)

    _run(run)


def test_read_of_unregistered_memory_fails_cleanly() -> None:
    """A reference inside the announced pool, but the peer's engine no longer serves it."""

    async def run() -> None:
        async with _pair() as (a, b, peer_a, _pb):
            engine = a._engine
            pool = a._pool
            await anyio.to_thread.run_sync(engine.unregister, pool.addr)
            try:
                inb = await b.open(peer_a, _ref(a), 64)
                with pytest.raises(BackendError, match="failed"):
                    await b.fetch(inb, 0, 64)
                b.close(inb)
            finally:
                await anyio.to_thread.run_sync(engine.register, pool.addr, pool.size)
            assert b.stats()["open"] == 0 and b.stats()["reads_in_flight"] == 0

    _run(run)


@pytest.mark.parametrize("register_dest", [True, False], ids=["register-dest", "staged"])
def test_slot_is_reused_across_transfers(register_dest: bool) -> None:
    async def run() -> None:
        async with _pair(register_dest=register_dest) as (a, b, peer_a, peer_b):
            offsets = []
            for i in range(4):
                data = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
                out = await _send(a, peer_b, data)
                ref = msgspec.msgpack.decode(a.describe(out))
                offsets.append((ref["offset"], ref["dedicated"]))
                inb = await b.open(peer_a, a.describe(out), data.numel())
                dest = torch.zeros(data.numel(), dtype=torch.uint8)
                # progressive: two ranges, as the endpoint fetches them
                await b.fetch(inb, 0, 40_000, dest)
                await b.fetch(inb, 40_000, data.numel(), dest)
                assert torch.equal(dest, data), f"transfer {i} corrupted"
                b.close(inb)
                b.close(inb)  # idempotent
                a.free(out)
                a.free(out)  # idempotent
                assert a.stats()["leases"] == 0 and b.stats()["open"] == 0
                assert b.stats()["pool_bytes_in_use"] == 0
            assert len(set(offsets)) == 1 and offsets[0][1] == 0, offsets
            assert a.stats()["dedicated_allocs"] == 0

    _run(run)


def test_zero_copy_reads_into_own_pool_and_frees_on_close() -> None:
    async def run() -> None:
        async with _pair() as (a, b, peer_a, peer_b):
            data = torch.randint(0, 256, (200_000,), dtype=torch.uint8)
            out = await _send(a, peer_b, data)
            inb = await b.open(peer_a, a.describe(out), data.numel())
            await b.fetch(inb, 0, data.numel())
            assert torch.equal(inb.buffer, data)
            pool = b._pool
            assert pool.addr <= inb.buffer.data_ptr() < pool.addr + pool.size
            assert b.stats()["pool_bytes_in_use"] > 0
            b.close(inb)
            a.free(out)
            assert b.stats()["pool_bytes_in_use"] == 0 and a.stats()["pool_bytes_in_use"] == 0

    _run(run)


@pytest.mark.parametrize("dest", [True, False], ids=["copy", "zero-copy"])
def test_object_beyond_the_pool_uses_dedicated_buffers(dest: bool) -> None:
    async def run() -> None:
        async with _pair() as (a, b, peer_a, peer_b):
            data = torch.randint(0, 256, (3 * POOL + 123,), dtype=torch.uint8)
            out = await _send(a, peer_b, data)
            ref = msgspec.msgpack.decode(a.describe(out))
            assert ref["dedicated"] != 0
            assert a.stats()["dedicated_buffers"] == 1
            inb = await b.open(peer_a, a.describe(out), data.numel())
            target = torch.zeros(data.numel(), dtype=torch.uint8) if dest else None
            await b.fetch(inb, 0, data.numel() // 2, target)
            await b.fetch(inb, data.numel() // 2, data.numel(), target)
            got = target if target is not None else inb.buffer
            assert torch.equal(got, data)
            assert b.stats()["dedicated_buffers"] == (0 if dest else 1)
            b.close(inb)
            a.free(out)
            assert a.stats()["dedicated_buffers"] == 0 and b.stats()["dedicated_buffers"] == 0
            assert a.stats()["leases"] == 0 and b.stats()["open"] == 0

    _run(run)


def test_fetch_validates_ranges_and_state() -> None:
    async def run() -> None:
        async with _pair() as (a, b, peer_a, peer_b):
            out = await _send(a, peer_b, torch.ones(64, dtype=torch.uint8))
            inb = await b.open(peer_a, a.describe(out), 64)
            with pytest.raises(BackendError, match="outside"):
                await b.fetch(inb, 0, 65)
            with pytest.raises(BackendError, match="outside"):
                await b.fetch(inb, 10, 5)
            await b.disconnect(peer_a)
            with pytest.raises(BackendError, match="gone"):
                await b.fetch(inb, 0, 64)
            b.close(inb)
            with pytest.raises(BackendError, match="closed"):
                await b.fetch(inb, 0, 64)
            a.free(out)
            with pytest.raises(BackendError, match="freed"):
                a.describe(out)

    _run(run)


def test_aclose_releases_everything_and_refuses_work() -> None:
    async def run() -> None:
        async with _pair() as (a, b, peer_a, peer_b):
            small = await _send(a, peer_b, torch.ones(100, dtype=torch.uint8))
            big = await _send(a, peer_b, torch.ones(2 * POOL, dtype=torch.uint8))
            inb = await b.open(peer_a, a.describe(small), 100)
            await b.fetch(inb, 0, 100)
            await a.aclose()
            await b.aclose()
            assert a.stats()["leases"] == 0 and a.stats()["dedicated_buffers"] == 0
            assert b.stats()["open"] == 0
            a.free(small)  # after close: a no-op
            a.free(big)
            b.close(inb)
            with pytest.raises(BackendClosedError):
                await a.allocate(peer_b, 10, "cpu")
            with pytest.raises(BackendClosedError):
                await b.open(peer_a, _ref(a), 64)

    _run(run)


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
    from omniwire.backends.mooncake import MODULE, _pattern

    size = 1 << 20
    child = subprocess.Popen(
        [sys.executable, "-m", MODULE, "serve", "--size", str(size)],
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
                inb = await b.open(peer, ref, size)
                await b.fetch(inb, 0, size, dest)
                assert torch.equal(dest, _pattern(size))
                b.close(inb)
                child.kill()
                assert child.wait(10) == -9
                inb = await b.open(peer, ref, size)
                with anyio.fail_after(60), pytest.raises(BackendError, match="far"):
                    await b.fetch(inb, 0, size, dest)
                b.close(inb)
                assert b.stats()["open"] == 0 and b.stats()["reads_in_flight"] == 0
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


def test_raw_bench_reads_from_another_process() -> None:
    require_backend("mooncake")
    from omniwire.backends.mooncake import raw_bench

    figures = raw_bench([4096, 1 << 20], 2)  # checks the bytes and the child's exit code
    assert set(figures) == {4096, 1 << 20}
    assert all(g > 0 for g in figures.values()), figures


def test_bad_options_are_refused() -> None:
    cls = require_backend("mooncake")
    for options in ({"pool_size": -1}, {"pool_size": "lots"}, {"protocol": ""}):
        with pytest.raises(BackendError, match="options"):
            cls(BackendContext("x", 1, options))


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
                    assert backend.stats()["open"] == 1  # the view is alive until release
                    d.release()
                    await receipt.wait()
                assert backend.stats()["open"] == 0
            with anyio.fail_after(30):
                await ep.drain()
                while any(a or b for a, b in ep.in_flight().values()):
                    await anyio.sleep(0.05)
            stats = backend.stats()
            assert stats["leases"] == 0 and stats["open"] == 0, stats
            assert stats["dedicated_allocs"] >= 1, stats

    try:
        anyio.run(run)
    finally:
        assert peer.stop() == 0, peer.output
