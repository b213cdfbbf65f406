"""The ``nccl`` backend: the conformance suite (gloo on CPU, both channels) and the
pairing properties a two-sided engine needs.

- concurrent sends on one edge never cross;
- an object refused early (an abort NACKs queued objects out of order) or closed
  before it was fetched is still consumed, so later objects are not stalled;
- peer loss fails pending work at once; a reconnect or a restarted peer gets a new
  process group;
- the global default process group is never initialized.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest
import torch
import torch.distributed

from omniwire import Endpoint, packing
from omniwire.backends.base import BackendContext, Locality, PeerInfo
from omniwire.errors import BackendError, OmniwireError, RequestAbortedError
from omniwire.testing import BackendConformance, PeerProcess, require_backend
from omniwire.testing.conformance import ipc_address

pytestmark = pytest.mark.engine

ORDERED = {"nccl": {"ordered": True}}


class TestNccl(BackendConformance):
    """CPU objects on the tagged gloo channel."""

    backend = "nccl"


class TestNcclOrdered(BackendConformance):
    """CPU objects on the ordered channel: the code path NCCL takes for CUDA objects."""

    backend = "nccl"
    backend_options = ORDERED
    max_examples = 6


@pytest.fixture(scope="module")
def nccl_class() -> type[Any]:
    return require_backend("nccl")


def _pattern(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# -- bare backend instances in one process ------------------------------------------------


@asynccontextmanager
async def _bare_pair(cls: type[Any], options: dict[str, Any]) -> AsyncIterator[tuple[Any, ...]]:
    """Two connected backend instances; yields (a, b, b as a's peer, a as b's peer)."""
    tag = secrets.token_hex(3)
    a = cls(BackendContext(f"bare-a-{tag}", secrets.randbits(32), options))
    b = cls(BackendContext(f"bare-b-{tag}", secrets.randbits(32), options))
    await a.start()
    await b.start()

    def peer_of(x: Any) -> PeerInfo:
        return PeerInfo(
            x.ctx.endpoint,
            x.ctx.instance,
            os.getpid(),
            "h",
            "t",
            Locality.SAME_HOST,
            x.hello(),
        )

    pb, pa = peer_of(b), peer_of(a)
    await a.connect(pb)
    await b.connect(pa)
    try:
        yield a, b, pb, pa
    finally:
        await a.aclose()
        await b.aclose()


async def _publish(a: Any, peer: PeerInfo, seed: int, n: int) -> tuple[Any, bytes, torch.Tensor]:
    out = await a.export(peer, n, "cpu")
    data = _pattern(seed, n)
    out.buffer.copy_(data)
    info = out.ref
    await out.publish(0, n)
    return out, info, data


async def _settle(a: Any, b: Any, sends: int, consumed: int) -> None:
    """Wait until ``a`` saw ``sends`` sends complete and ``b`` received every byte ``a``
    sent (``consumed`` objects of them into scratch); nothing is left held."""

    def settled() -> bool:
        sa, sb = a.stats(), b.stats()
        return (
            sa.detail["sends_completed"] >= sends
            and sb.detail["objects_consumed"] >= consumed
            and sb.detail["bytes_received"] == sa.detail["bytes_sent"]
            and sa.idle
            and sb.idle
        )

    with anyio.move_on_after(30):
        while not settled():
            await anyio.sleep(0.02)
    assert settled(), (a.stats(), b.stats())


@pytest.mark.parametrize("options", [{}, {"ordered": True}], ids=["tagged", "ordered"])
def test_refused_and_unfetched_objects_do_not_stall_later_ones(
    nccl_class: type[Any], options: dict[str, Any]
) -> None:
    """Published 0..4; the receiver refuses 2 before importing 0 (as an abort does: an
    import closed at once), closes 1 unfetched, then fetches 0, 3 and 4: each intact,
    and every send completes."""

    async def run() -> None:
        async with _bare_pair(nccl_class, options) as (a, b, pb, pa):
            sizes = [1000, 3 << 20, 5000, 70_000, 2 << 20]
            sent = [await _publish(a, pb, i, n) for i, n in enumerate(sizes)]
            (await b.import_(pa, sent[2][1], sizes[2])).close()
            got = {}
            for i in (0, 1, 3, 4):
                imp = await b.import_(pa, sent[i][1], sizes[i])
                if i != 1:
                    dest = torch.empty(sizes[i], dtype=torch.uint8)
                    with anyio.fail_after(30):
                        await imp.fetch(0, sizes[i], dest)
                    got[i] = dest
                imp.close()
            for i, dest in got.items():
                assert torch.equal(dest, sent[i][2]), f"object {i} arrived corrupted"
            for out, _, _ in sent:
                out.release()
            await _settle(a, b, sends=5, consumed=2)
            assert not torch.distributed.is_initialized()

    anyio.run(run)


def test_zero_copy_fetch_and_partial_ranges(nccl_class: type[Any]) -> None:
    async def run() -> None:
        async with _bare_pair(nccl_class, {}) as (a, b, pb, pa):
            out, info, data = await _publish(a, pb, 7, 1 << 20)
            imp = await b.import_(pa, info, 1 << 20)
            with anyio.fail_after(30):
                await imp.fetch(0, 1 << 20)  # no dest: into imp.buffer
            assert torch.equal(imp.buffer, data)
            dest = torch.zeros(1 << 20, dtype=torch.uint8)
            await imp.fetch(100, 5000, dest)  # later ranges come from the same bytes
            assert torch.equal(dest[100:5000], data[100:5000])
            imp.close()
            imp.close()  # idempotent
            out.release()
            out.release()
            await _settle(a, b, sends=1, consumed=0)

    anyio.run(run)


@pytest.mark.parametrize("options", [{}, {"ordered": True}], ids=["tagged", "ordered"])
def test_a_fetch_cancelled_while_it_waits_leaves_the_receive_to_a_later_fetch(
    nccl_class: type[Any], options: dict[str, Any]
) -> None:
    """The wait is not shielded (a shield costs a turn of the loop per object): a
    cancelled fetch must leave the receive going and a later fetch able to wait."""

    async def run() -> None:
        async with _bare_pair(nccl_class, options) as (a, b, pb, pa):
            n = 1 << 16
            out = await a.export(pb, n, "cpu")
            data = _pattern(3, n)
            out.buffer.copy_(data)
            imp = await b.import_(pa, out.ref, n)
            dest = torch.zeros(n, dtype=torch.uint8)
            with anyio.move_on_after(0.3) as scope:
                await imp.fetch(0, n, dest)  # nothing sent yet: it waits
            assert scope.cancelled_caught
            await out.publish(0, n)
            with anyio.fail_after(30):
                await imp.fetch(0, n, dest)
            assert torch.equal(dest, data)
            imp.close()
            out.release()
            await _settle(a, b, sends=1, consumed=0)

    anyio.run(run)


def test_disconnect_fails_pending_fetch_and_reconnect_builds_a_new_group(
    nccl_class: type[Any],
) -> None:
    async def run() -> None:
        async with _bare_pair(nccl_class, {}) as (a, b, pb, pa):
            out, info, _ = await _publish(a, pb, 1, 4096)
            imp = await b.import_(pa, info, 4096)
            dest = torch.empty(4096, dtype=torch.uint8)
            await imp.fetch(0, 4096, dest)
            imp.close()
            out.release()
            # An object the sender never publishes: its fetch waits — until the peer is lost.
            lost = await a.export(pb, 512, "cpu")
            imp = await b.import_(pa, lost.ref, 512)
            failure: list[BaseException] = []

            async def fetch() -> None:
                try:
                    await imp.fetch(0, 512, torch.empty(512, dtype=torch.uint8))
                except BackendError as exc:
                    failure.append(exc)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(fetch)
                    await anyio.sleep(0.2)
                    await b.disconnect(pa)
            assert failure, "the pending fetch did not fail when the peer was lost"
            imp.close()
            lost.release()
            await a.disconnect(pb)
            with pytest.raises(BackendError):
                await a.export(pb, 8, "cpu")
            # Both sides meet again: a fresh generation of the group carries data.
            await a.connect(pb)
            await b.connect(pa)
            out, info, data = await _publish(a, pb, 2, 3 << 20)
            imp = await b.import_(pa, info, 3 << 20)
            dest = torch.empty(3 << 20, dtype=torch.uint8)
            with anyio.fail_after(30):
                await imp.fetch(0, 3 << 20, dest)
            assert torch.equal(dest, data)
            assert a.stats().detail["links_built"] >= 2
            imp.close()
            out.release()

    anyio.run(run)


def test_malformed_hello_info_is_a_backend_error(nccl_class: type[Any]) -> None:
    async def run() -> None:
        b = nccl_class(BackendContext("hello-b", 1, {}))
        await b.start()
        try:
            for info in (b"", b"\xc1", b"\x81\xa4host\xa1x"):
                peer = PeerInfo("x", 2, os.getpid(), "h", "t", Locality.SAME_HOST, info)
                with pytest.raises(BackendError):
                    await b.connect(peer)
        finally:
            await b.aclose()

    anyio.run(run)


@pytest.mark.parametrize("dest", [True, False], ids=["copy", "zero-copy"])
def test_lent_tensors_are_sent_as_they_are(nccl_class: type[Any], dest: bool) -> None:
    """One gloo message per tensor, received into place; refused ones still consumed."""
    ts = [torch.randn(50_000), torch.empty(0), torch.arange(99, dtype=torch.int16)]
    layout = packing.plan(ts)

    async def run() -> None:
        async with _bare_pair(nccl_class, {}) as (a, b, pb, pa):
            assert await a.export_tensors(pb, ts, lent=False) is None
            refused = await a.export_tensors(pb, ts, lent=True)
            out = await a.export_tensors(pb, ts, lent=True)
            assert refused is not None and out is not None and out.buffer is None
            assert msgspec.msgpack.decode(out.ref)["pieces"] == [
                [m.offset, m.nbytes] for m in layout.metas if m.nbytes
            ]
            for x in (refused, out):
                await x.publish(0, x.nbytes)
            (await b.import_(pa, refused.ref, layout.nbytes)).close()  # consumed
            imp = await b.import_(pa, out.ref, layout.nbytes)
            target = torch.zeros(layout.nbytes, dtype=torch.uint8) if dest else None
            with anyio.fail_after(30):
                await imp.fetch(0, layout.nbytes, target)
            got = packing.unpack(
                target if target is not None else imp.buffer, layout.metas, copy=True
            )
            assert all(torch.equal(x, y) for x, y in zip(ts, got, strict=True))
            imp.close()
            refused.release()
            out.release()
            await _settle(a, b, sends=2, consumed=1)
            assert a.stats().detail["lent"] == 2

    anyio.run(run)


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ({"pieces": [[0, 0]]}, "empty"),
        ({"pieces": [[0, 60], [50, 10]]}, "overlaps"),
        ({"pieces": [[0, 60], [60, 10]]}, "outside"),
        ({"pieces": [[0, 64]], "ordered": True}, "ordered"),
        ({"tag": 2**31 - 2, "pieces": [[0, 32], [32, 32]]}, "tag"),
    ],
    ids=["empty-piece", "overlap", "past-end", "ordered", "tag-overflow"],
)
def test_bad_pieces_are_refused(nccl_class: type[Any], ref: dict[str, Any], why: str) -> None:
    async def run() -> None:
        async with _bare_pair(nccl_class, {}) as (_a, b, _pb, pa):
            fields = {"gen": 0, "tag": 5, "nbytes": 64, "device": "cpu", "ordered": False, **ref}
            with pytest.raises(BackendError, match=why):
                await b.import_(pa, msgspec.msgpack.encode(fields), 64)

    anyio.run(run)


# -- endpoints --------------------------------------------------------------------------


@asynccontextmanager
async def _endpoints(options: dict[str, Any], **b_kw: Any) -> AsyncIterator[tuple[Endpoint, ...]]:
    """Two endpoints in this process, told they are on different hosts (nccl does not
    serve same-process edges), with every edge routed over nccl."""
    tag = secrets.token_hex(3)
    na, nb = f"ep-a-{tag}", f"ep-b-{tag}"
    b = Endpoint(
        nb,
        address=ipc_address(nb),
        backends=["nccl"],
        backend_options=options,
        routes={na: "nccl"},
        host_id=f"host-b-{tag}",
        **b_kw,
    )
    async with b:
        a = Endpoint(
            na,
            address=ipc_address(na),
            peers={nb: b.address},
            backends=["nccl"],
            backend_options=options,
            routes={nb: "nccl"},
            host_id=f"host-a-{tag}",
        )
        async with a:
            await a.wait_peer(nb, 30)
            await b.wait_peer(na, 30)
            yield a, b


@pytest.mark.parametrize("options", [{}, ORDERED], ids=["tagged", "ordered"])
def test_abort_refuses_queued_objects_out_of_order_without_stalling(
    nccl_class: type[Any], options: dict[str, Any]
) -> None:
    """The receiver holds one delivery; r2a waits for room, r3 and r2b queue behind it.
    Aborting r2 refuses r2b at once and r2a next — before r3, which was published
    between them. r3 and a later r4 still arrive intact."""

    async def run() -> None:
        async with _endpoints(options, receive_buffer=1) as (a, b):
            nb = b.name
            r1 = await a.send(nb, {"t": _pattern(1, 300_000)}, request_id="r1")
            await r1.wait(30)
            doomed = [await a.send(nb, {"t": _pattern(2, 200_000)}, request_id="r2")]
            r3 = await a.send(nb, {"t": _pattern(3, 1 << 20)}, request_id="r3")
            doomed.append(await a.send(nb, {"t": _pattern(4, 100_000)}, request_id="r2"))
            with anyio.fail_after(30):
                while b.in_flight()[a.name][1] < 3:
                    await anyio.sleep(0.02)
            await a.abort("r2", "test")
            for receipt in doomed:  # they fail at once, here: the abort is ours
                with pytest.raises(RequestAbortedError):
                    await receipt.wait(30)
            with anyio.fail_after(30):  # and b applies it when its abort message comes
                while b.counters.get("aborts", 0) < 1:
                    await anyio.sleep(0.01)
            got: dict[str, Any] = {}
            with anyio.fail_after(30):
                while "r3" not in got:
                    d = await b.receive()
                    if d.kind == "payload":
                        got[d.request_id] = d.payload["t"].clone()
                    d.release()
                await r3.wait(30)
                r4 = await a.send(nb, {"t": _pattern(5, 2 << 20)}, request_id="r4")
                d = await b.receive()
                while d.kind == "aborted" and d.request_id == "r2":  # may come after r3
                    d.release()
                    d = await b.receive()
                assert (d.kind, d.request_id) == ("payload", "r4"), d
                assert torch.equal(d.payload["t"], _pattern(5, 2 << 20))
                d.release()
                await r4.wait(30)
            assert torch.equal(got["r1"], _pattern(1, 300_000))
            assert torch.equal(got["r3"], _pattern(3, 1 << 20))
            assert "r2" not in got
            # Every byte of the refused objects was received too: b applied the abort
            # while r2a waited for room, so both went into scratch; every send completed.
            await _settle(a.backend("nccl"), b.backend("nccl"), sends=5, consumed=2)
        assert not torch.distributed.is_initialized()

    anyio.run(run)


def test_zero_copy_endpoint(nccl_class: type[Any]) -> None:
    async def run() -> None:
        async with _endpoints({}, zero_copy=True) as (a, b):
            value = {"x": _pattern(9, 5 << 20), "y": torch.arange(10.0)}
            receipt = await a.send(b.name, value, request_id="zc")
            with anyio.fail_after(30):
                d = await b.receive()
                assert torch.equal(d.payload["x"], value["x"])
                assert torch.equal(d.payload["y"], value["y"])
                assert b.backend("nccl").stats().imports == 1  # until released
                d.release()
                await receipt.wait(30)
            assert b.backend("nccl").stats().imports == 0

    anyio.run(run)


# -- two processes -------------------------------------------------------------------------


@asynccontextmanager
async def _with_peer(options: dict[str, Any]) -> AsyncIterator[tuple[Endpoint, PeerProcess]]:
    tag = secrets.token_hex(3)
    me, other = f"tester-{tag}", f"peer-{tag}"
    args = ["--mode", "echo", "--backends", "nccl"]
    args += ["--backend-options", json.dumps(options), "--routes", json.dumps({me: "nccl"})]
    proc = PeerProcess(other, ipc_address(other), *args)
    try:
        ep = Endpoint(
            me,
            address=ipc_address(me),
            peers={other: proc.address},
            backends=["nccl"],
            backend_options=options,
            routes={other: "nccl"},
        )
        async with ep:
            await ep.wait_peer(other, 30)
            yield ep, proc
    finally:
        code = proc.stop()
        assert code == 0, f"peer process exited with {code}: {proc.output}"


@pytest.mark.parametrize("options", [{}, ORDERED], ids=["tagged", "ordered"])
def test_concurrent_sends_on_one_edge_never_cross(
    nccl_class: type[Any], options: dict[str, Any]
) -> None:
    sizes = [17, 4096, 1 << 20, 100, 3 << 20, 65_536, 1, 2 << 20, 999, 300_000] * 3

    async def run() -> None:
        async with _with_peer(options) as (ep, proc):
            peer = proc.name

            async def one(i: int) -> None:
                await ep.send(peer, {"i": i, "t": _pattern(i, sizes[i])}, request_id=f"c{i}")

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(len(sizes)):
                        tg.start_soon(one, i)
                seen = set()
                while len(seen) < len(sizes):
                    d = await ep.receive()
                    assert d.kind == "payload", d
                    i = d.payload["i"]
                    assert d.request_id == f"c{i}"
                    assert torch.equal(d.payload["t"], _pattern(i, sizes[i])), f"object {i} crossed"
                    seen.add(i)
                    d.release()

    anyio.run(run)


def test_restarted_peer_gets_a_new_process_group(nccl_class: type[Any]) -> None:
    """A peer killed and restarted under the same name and address is a new instance:
    the old group is torn down and a new one carries the next object."""
    tag = secrets.token_hex(3)
    me, other = f"tester-{tag}", f"peer-{tag}"
    address = ipc_address(other)
    args = ["--mode", "echo", "--backends", "nccl", "--backend-options", "{}"]
    args += ["--routes", json.dumps({me: "nccl"})]

    async def round_trip(ep: Endpoint, rid: str, seed: int) -> None:
        while True:  # until the (new) peer completed its Hello
            try:
                receipt = await ep.send(other, {"t": _pattern(seed, 2 << 20)}, request_id=rid)
                break
            except OmniwireError:
                await anyio.sleep(0.1)
        d = await ep.receive()
        assert d.request_id == rid
        assert torch.equal(d.payload["t"], _pattern(seed, 2 << 20))
        d.release()
        await receipt.wait(30)

    async def run(procs: list[PeerProcess]) -> None:
        ep = Endpoint(
            me,
            address=ipc_address(me),
            peers={other: procs[0].address},
            backends=["nccl"],
            routes={other: "nccl"},
        )
        async with ep:
            with anyio.fail_after(60):
                await ep.wait_peer(other, 30)
                await round_trip(ep, "before", 1)
                procs[0].kill()  # a crash: its process group dies with it
                procs.append(PeerProcess(other, address, *args))
                await round_trip(ep, "after", 2)
            assert ep.backend("nccl").stats().detail["links_built"] >= 2

    procs = [PeerProcess(other, address, *args)]
    try:
        anyio.run(run, procs)
    finally:
        # (PeerProcess.stop() after kill() would read the pipe kill() closed.)
        codes = [p.stop() if p.proc.poll() is None else p.proc.returncode for p in procs]
    assert len(procs) == 2 and codes[1] == 0, f"restarted peer exited with {codes[1]}"


def test_a_peer_that_restarts_leaves_one_generation_entry(nccl_class: type[Any]) -> None:
    """Was: the backend kept the last link generation of every (name, instance) it
    ever connected, for ever: a peer restarted N times left N entries. A generation
    only matters for an instance that may come back (after a partition), so only a
    name's latest instance keeps one."""

    async def run() -> None:
        tag = secrets.token_hex(3)
        other = f"peer-{tag}"
        address = ipc_address(other)
        async with Endpoint(
            f"tester-{tag}",
            address=ipc_address(f"tester-{tag}"),
            backends=["nccl"],
            peers={other: address},
        ) as ep:
            nccl = ep.backend("nccl")
            instances = []
            for _ in range(4):
                async with Endpoint(other, address=address, backends=["nccl"]) as peer:
                    await ep.wait_peer(other, 20)
                    instances.append(peer._core.instance)
                with anyio.fail_after(10):
                    while other in ep.peer_names():
                        await anyio.sleep(0.02)
            assert len(nccl._gens) == 1
            assert nccl._gens[other][0] == instances[-1]

    anyio.run(run)


def test_the_bare_gloo_baseline_checks_the_first_transfer_of_each_size(
    nccl_class: type[Any],
) -> None:
    """``omniwire bench``'s bare-gloo baseline (two processes): bytes checked on the
    first transfer of each size (corruption is an error), not after every transfer;
    the peer exits cleanly."""
    from omniwire import rawbench

    size = 1 << 20
    with rawbench.open_session("nccl", size) as session:
        assert session.once(size) > 0  # checked
        session.data[:4096] += 1  # what later transfers send is wrong now
        assert session.once(size) > 0  # not checked again
        with pytest.raises(BackendError, match="corrupted"):
            session.once(4096)  # a new size: checked
        assert session.once(4096) > 0
