"""Forwarding by reference (spec §9.2 "Forwarding"): a stage that received a tensor
zero-copy and sends it on with ``lend=True`` moves no payload byte; its upstream
object stays unacknowledged until the downstream ACK, and the creator of the memory
reuses it only once no reader downstream still holds it — whoever dies."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from omniwire import Endpoint
from omniwire.backends import _peermem
from omniwire.backends.shm import Segment
from omniwire.errors import BadReferenceError, PeerLostError
from omniwire.testing import PeerProcess, require_backend
from omniwire.testing.conformance import ipc_address

from conftest import omniwire_segments

pytestmark = pytest.mark.asyncio

N = 1 << 20  # float32 elements: 4 MiB


def _of(pid: int) -> set[str]:
    return {s for s in omniwire_segments() if s.startswith(f"omniwire-{pid}-")}


async def _ask(ep: Endpoint, peer: str, what: str) -> dict[str, Any]:
    await ep.send(peer, {}, request_id=f"ask-{what}", metadata={what: True})
    d = await ep.receive(20, request_id=f"ask-{what}")
    answer: dict[str, Any] = d.payload[what]
    return answer


@asynccontextmanager
async def chain(
    downstream: list[str], *b_args: str
) -> AsyncIterator[tuple[Endpoint, PeerProcess, list[Endpoint]]]:
    """``a`` (here) → ``b`` (a process, forward mode, zero-copy) → each of
    ``downstream`` (here, zero-copy: a real forward between processes, since b is
    another one)."""
    async with Endpoint(
        "a", address=ipc_address("a"), routes={"b": "shm", "c": "shm"}, ack_timeout=30
    ) as a:
        cs = [Endpoint(n, address=ipc_address(n), zero_copy=True) for n in downstream]
        for c in cs:
            await c.start()
        peers = [f"--peer={c.name}={c.address}" for c in cs]
        routes = "{" + ",".join(f'"{c.name}": "shm"' for c in cs) + "}"
        b = PeerProcess(
            "b",
            ipc_address("b"),
            "--mode=forward",
            "--zero-copy",
            f"--forward-to={','.join(downstream)}",
            f"--peer=a={a.address}",
            *peers,
            f"--routes={routes}",
            *b_args,
        )
        try:
            a.add_peer("b", b.address)
            await a.wait_peer("b", 30)
            for c in cs:
                await c.wait_peer("b", 30)
            yield a, b, cs
        finally:
            if b.proc.poll() is None:
                b.stop()
            for c in cs:
                await c.aclose()


async def test_a_forward_moves_no_byte_and_the_upstream_ack_waits_for_the_last_reader() -> None:
    async with chain(["c"]) as (a, _, (c,)):
        x = torch.randn(N)
        receipt = await a.send("b", x, request_id="r1")
        d = await c.receive(30)
        assert d.zero_copy and d.backend == "shm" and d.from_stage == "b"
        assert torch.equal(d.payload, x)  # bit-exact
        counters = await _ask(a, "b", "counters")
        assert counters.get("objects_forwarded") == 1
        assert counters.get("bytes_forwarded") == x.nbytes
        assert counters.get("bytes_packed", 0) == 0  # b packed nothing
        assert counters.get("bytes_copied", 0) == 0
        await anyio.sleep(0.3)
        assert not receipt.done()  # c still reads a's slot: a may not reuse it
        d.release()
        await receipt.wait(20)  # c's ACK → b's hold ends → b's ACK
        assert (await _ask(a, "b", "stats"))["shm"][0] == 0  # b's forward is over


async def test_the_reader_sees_the_creators_memory_itself() -> None:
    """A born tensor of a's, forwarded by b: c's view is a's memory (a write there,
    which the rules forbid while in flight, shows through — there is no copy)."""
    async with chain(["c"]) as (a, _, (c,)):
        buf = await a.empty("b", (N,), torch.float32)
        buf.tensor.fill_(1.0)
        receipt = await a.send("b", buf.tensor, request_id="born")
        d = await c.receive(30)
        assert torch.equal(d.payload, torch.ones(N))
        buf.tensor[7] = 42.0  # only to prove it is the same memory
        assert float(d.payload[7]) == 42.0
        d.release()
        await receipt.wait(20)
        await buf.settled(10)
        buf.release()


async def test_a_fan_out_forward_holds_until_every_reader_is_done() -> None:
    async with chain(["c1", "c2"]) as (a, _, (c1, c2)):
        x = torch.arange(N, dtype=torch.float32)
        receipt = await a.send("b", x, request_id="fan")
        d1, d2 = await c1.receive(30), await c2.receive(30)
        assert torch.equal(d1.payload, x) and torch.equal(d2.payload, x)
        d1.release()
        await anyio.sleep(0.3)
        assert not receipt.done()
        d2.release()
        await receipt.wait(20)


async def test_a_copy_mode_forwarder_or_a_part_of_a_payload_is_packed() -> None:
    async with chain(["c"], "--receive-buffer=64") as (a, _, (c,)):
        x = torch.randn(N)
        # a payload of two tensors is packed by b (as before), not forwarded
        receipt = await a.send("b", {"x": x, "y": torch.ones(3)}, request_id="two")
        d = await c.receive(30)
        assert torch.equal(d.payload["x"], x)
        d.release()
        await receipt.wait(20)
        counters = await _ask(a, "b", "counters")
        assert counters.get("objects_forwarded", 0) == 0
        assert counters["bytes_packed"] >= x.nbytes


async def test_forwarder_killed_while_a_reader_holds_the_bytes() -> None:
    """b dies after forwarding: a's receipt fails (no ACK), yet a does not reuse the
    slot while c still holds its delivery (c's read lock); nothing of b's is left."""
    async with chain(["c"]) as (a, b, (c,)):
        x = torch.randn(N)
        receipt = await a.send("b", x, request_id="k1")
        d = await c.receive(30)
        assert torch.equal(d.payload, x)
        bpid = b.proc.pid
        b.kill()
        with pytest.raises(PeerLostError):
            await receipt.wait(30)
        shm = a.backend("shm")
        assert shm.stats().detail["arena_deferred"] == 1  # kept out of use
        # a sends more of the same size (to c directly): the held slot is not among them
        a.add_peer("c", c.address)
        await a.wait_peer("c", 30)
        for i in range(3):
            r = await a.send("c", torch.full((N,), float(i)), request_id=f"more{i}")
            e = await c.receive(30, request_id=f"more{i}")
            assert e.backend == "shm"
            e.release()
            await r.wait(20)
        assert torch.equal(d.payload, x)  # c's view is intact
        d.release()
        r = await a.send("c", torch.zeros(N), request_id="after")  # reclaims the slot
        (await c.receive(30, request_id="after")).release()
        await r.wait(20)
        assert shm.stats().detail["arena_deferred"] == 0
        with anyio.fail_after(20):
            while _of(bpid):  # swept by a and c on b's loss
                await anyio.sleep(0.05)


async def test_reader_killed_mid_forward_ends_the_forwarders_hold() -> None:
    """c (a process holding the forwarded delivery) dies: b's forward fails, its
    hold ends, a's receipt completes; nothing of c's or of the forward is left."""
    async with Endpoint("a", address=ipc_address("a"), routes={"b": "shm"}) as a:
        c = PeerProcess("c", ipc_address("c"), "--mode=bench", "--zero-copy")
        b = PeerProcess(
            "b",
            ipc_address("b"),
            "--mode=forward",
            "--zero-copy",
            "--forward-to=c",
            f"--peer=a={a.address}",
            f"--peer=c={c.address}",
            '--routes={"c": "shm"}',
            "--ack-timeout=60",
        )
        try:
            a.add_peer("b", b.address)
            await a.wait_peer("b", 30)
            receipt = await a.send("b", torch.randn(N), request_id="h", metadata={"hold": True})
            with anyio.fail_after(30):
                while (await _ask(a, "b", "counters")).get("objects_forwarded", 0) < 1:
                    await anyio.sleep(0.05)
            await anyio.sleep(0.3)
            assert not receipt.done()  # c holds it
            cpid = c.proc.pid
            c.kill()
            await receipt.wait(30)  # b let go when c was lost: its ACK came
            assert (await _ask(a, "b", "stats"))["shm"][0] == 0
            with anyio.fail_after(20):
                while _of(cpid):
                    await anyio.sleep(0.05)
        finally:
            for p in (b, c):
                if p.proc.poll() is None:
                    p.stop()


async def test_creator_killed_the_forward_still_reads_and_nothing_is_left() -> None:
    """src (here) → a (a process; copy mode: it packs into its own arena) → b (a
    process, forwarding by reference) → c (here). a dies while c holds the bytes:
    b's descriptor keeps the memory, c reads it whole; once c is done nothing of
    a's, nor b's forward link, is left in /dev/shm."""
    async with Endpoint("c", address=ipc_address("c"), zero_copy=True) as c:
        b = PeerProcess(
            "b",
            ipc_address("b"),
            "--mode=forward",
            "--zero-copy",
            "--forward-to=c",
            f"--peer=c={c.address}",
            '--routes={"c": "shm"}',
        )
        a = PeerProcess(
            "a",
            ipc_address("a"),
            "--mode=forward",
            "--forward-to=b",
            f"--peer=b={b.address}",
            '--routes={"b": "shm"}',
        )
        try:
            c.add_peer("a", a.address)
            await c.wait_peer("a", 30)
            await c.wait_peer("b", 30)
            x = torch.randn(N)
            await c.send("a", x, request_id="from-src")
            d = await c.receive(30, request_id="from-src")
            assert d.from_stage == "b" and d.zero_copy
            apid, bpid = a.proc.pid, b.proc.pid
            assert _of(apid) and _of(bpid)  # a's arena, b's link to it
            a.kill()
            with anyio.fail_after(20):
                while _of(apid):  # a's names swept (the memory lives on in b's fd)
                    await anyio.sleep(0.05)
            assert torch.equal(d.payload, x)
            d.release()
            with anyio.fail_after(20):
                while _of(bpid):  # b let its link go: a is lost and the forward is over
                    await anyio.sleep(0.05)
        finally:
            for p in (a, b):
                if p.proc.poll() is None:
                    p.stop()


async def test_an_old_reader_refuses_a_forward_and_a_new_one_only_a_declared_one(
    tmp_path: Any,
) -> None:
    """The check of 1.1 (memfd named after the segment) still refuses a forward link;
    the amended check accepts it only when the reference names the memfd's creator
    segment (``origin``), sealed, of our uid, through the announcing pid's fd table."""
    directory = str(tmp_path)
    creator = Segment.create(f"omniwire-{os.getpid()}-aaaaaaaa-0", 1 << 16, directory)
    try:
        assert creator.fd is not None
        dup = os.dup(creator.fd)
        link = f"omniwire-{os.getpid()}-bbbbbbbb-0"
        os.symlink(f"/proc/{os.getpid()}/fd/{dup}", os.path.join(directory, link))
        with pytest.raises(BadReferenceError, match="not one named"):
            _peermem.open_shared(directory, link, os.getpid())  # the 1.1 check
        with pytest.raises(BadReferenceError, match="not one named"):
            _peermem.open_shared(directory, link, os.getpid(), origin=link)
        opened = _peermem.open_shared(directory, link, os.getpid(), origin=creator.name)
        assert opened.sealed and opened.memfd == creator.name
        opened.close()
        with pytest.raises(BadReferenceError, match="not to a descriptor of process"):
            _peermem.open_shared(directory, link, os.getpid() + 1, origin=creator.name)
        # an unsealed memfd behind a forward link is refused as before
        raw = os.memfd_create(creator.name, os.MFD_CLOEXEC)
        os.ftruncate(raw, 4096)
        bad = f"omniwire-{os.getpid()}-bbbbbbbb-1"
        os.symlink(f"/proc/{os.getpid()}/fd/{raw}", os.path.join(directory, bad))
        with pytest.raises(BadReferenceError, match="not sealed"):
            _peermem.open_shared(directory, bad, os.getpid(), origin=creator.name)
        os.close(raw)
        os.close(dup)
        # a reader's read lock keeps the creator from reusing the range
        assert creator.fd is not None
        hold = _peermem.read_lock(creator.fd, 4096, 4096)
        assert _peermem.range_read_locked(creator.fd, 0, 8192)
        assert not _peermem.range_read_locked(creator.fd, 8192, 4096)
        os.close(hold)
        assert not _peermem.range_read_locked(creator.fd, 0, 8192)
    finally:
        creator.unlink(directory)
        creator.close()


async def test_a_lazily_conjugated_view_of_a_delivery_is_packed_not_forwarded() -> None:
    """``delivery.conj()`` lies in the delivery's memory, which holds the unconjugated
    values: forwarded by reference, the reader would get those."""
    async with (
        Endpoint("c", address=ipc_address("c"), zero_copy=True) as c,
        Endpoint(
            "b",
            address=ipc_address("b"),
            zero_copy=True,
            peers={"c": c.address},
            routes={"c": "shm"},
        ) as b,
        Endpoint("a", address=ipc_address("a"), peers={"b": b.address}, routes={"b": "shm"}) as a,
    ):
        await a.wait_peer("b", 10)
        await b.wait_peer("c", 10)
        z = torch.complex(torch.arange(1 << 16, dtype=torch.float32), torch.ones(1 << 16))
        upstream = await a.send("b", z, request_id="z")
        d = await b.receive(10)
        assert d.zero_copy
        forwarded = []
        for rid, view in (("as-is", d.payload), ("conj", d.payload.conj())):
            receipt = await b.send("c", view, request_id=rid, lend=True)
            e = await c.receive(10)
            assert torch.equal(e.payload, view.resolve_conj()), rid
            forwarded.append(b._core.counters.get("objects_forwarded", 0))
            e.release()
            await receipt.wait(10)
        assert forwarded == [1, 1]  # the view as it is went by reference, the conj was packed
        d.release()
        await upstream.wait(10)


# -- every pair of backends (issue 45) -------------------------------------------------

PAIR_ENGINES = ("shm", "mooncake", "nixl", "nccl")
os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.mark.engine
@pytest.mark.parametrize("outgoing", PAIR_ENGINES)
@pytest.mark.parametrize("incoming", PAIR_ENGINES)
async def test_a_lent_forward_over_any_pair_of_backends_arrives_and_holds_upstream(
    incoming: str, outgoing: str
) -> None:
    """a → b over ``incoming``, b → c over ``outgoing``: b takes the delivery zero-copy
    and sends it on with ``lend=True``, then releases it at once. The forward is made
    by reference where the pair allows (b packs nothing: c reads b's view, or b's
    engine writes from it into c's landing), else packed once (into shm, which shares
    only its own memory) — never a BackendError (mooncake → mooncake registered b's
    whole landing again: "overlapped memory region"); c gets the bytes intact, and
    a's object stays held until c's bytes no longer need b's view (c is done, or they
    landed in c's memory)."""
    by_reference = outgoing != "shm" or incoming == "shm"
    await _relay(incoming, outgoing, by_reference)


@pytest.mark.engine
@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
async def test_a_forward_from_a_landing_to_a_peer_that_lends_none_is_read_there(
    engine: str,
) -> None:
    """c lends b no landing: c reads the object where it landed in b's memory (b's
    landing, not registered again), and a's object waits until c is done."""
    await _relay(engine, engine, True, c_options={"landing_size": 0})


async def _relay(
    incoming: str, outgoing: str, by_reference: bool, c_options: dict[str, Any] | None = None
) -> None:
    for engine in {incoming, outgoing}:
        require_backend(engine)
    tag = os.urandom(3).hex()
    na, nb, nc = (f"fw{x}-{tag}" for x in "abc")
    # shm needs one host; the engines between hosts (nccl serves no same-host edge)
    host_b = "h1" if incoming == "shm" else "h2"
    host_c = host_b if outgoing == "shm" else "h3"
    small = {"landing_size": 4 << 20, "pool_size": 4 << 20}

    def endpoint(name: str, host: str, engines: set[str], **kw: Any) -> Endpoint:
        options = {e: small for e in ("mooncake", "nixl") if e in engines}
        if name == nc and c_options:
            options = {e: {**small, **c_options} for e in options}
        return Endpoint(
            name,
            address=ipc_address(name),
            host_id=host,
            backends=sorted(engines),
            backend_options=options,
            **kw,
        )

    c = endpoint(nc, host_c, {outgoing}, zero_copy=True)
    b = endpoint(nb, host_b, {incoming, outgoing}, zero_copy=True, routes={nc: outgoing})
    a = endpoint(na, "h1", {incoming}, routes={nb: incoming})
    async with c, b, a:
        b.add_peer(nc, c.address)
        a.add_peer(nb, b.address)
        with anyio.fail_after(60):
            await a.wait_peer(nb)
            await b.wait_peer(nc)
            x = torch.randn(1 << 16)  # 256 KiB: an object, not inline
            upstream = await a.send(nb, x, request_id="up")
            d = await b.receive()
            assert d.backend == incoming and torch.equal(d.payload, x)
            sent = await b.send(nc, d.payload, request_id="on", lend=True)
            d.release()  # at once: the forward's hold keeps a's bytes
            e = await c.receive()
            assert e.backend == outgoing and torch.equal(e.payload, x)
            counters = b.counters
            forwarded = counters.get("objects_forwarded", 0)
            packed = counters.get("bytes_packed", 0)
            assert (forwarded, packed) == ((1, 0) if by_reference else (0, x.nbytes)), counters
            if forwarded and sent.outcome != "landed":  # c reads b's view of a's memory
                await anyio.sleep(0.2)
                assert upstream.outcome != "delivered"  # a's object waits for c
            e.release()
            assert await sent.settled() == "delivered"
            assert await upstream.settled() == "delivered"
        if c_options:
            assert b.backend(outgoing).stats().detail["landed"] == 0
            assert c.backend(outgoing).stats().detail["reads"] == 1
