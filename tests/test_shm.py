"""shm without the cliff: a large object never waits behind an unrelated small one, and
an endpoint that only receives creates no arena."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from omniwire import Endpoint
from omniwire.backends.base import copy_range
from omniwire.backends.shm import SHM_DIR
from omniwire.testing.conformance import ipc_address

MiB = 1 << 20


def _segments(prefix: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-")]


def _plain_files(prefix: str) -> bool:
    names = _segments(prefix)
    return bool(names) and not any(os.path.islink(f"{SHM_DIR}/{n}") for n in names)


@asynccontextmanager
async def _pair(zero_copy: bool = True, **shm: Any) -> AsyncIterator[tuple[Endpoint, Endpoint]]:
    """A sender and a (by default zero-copy) receiver in this process, over shm."""
    tag = secrets.token_hex(3)
    ntx, nrx = f"tx-{tag}", f"rx-{tag}"
    opts = {"shm": shm}
    rx = Endpoint(
        nrx,
        address=ipc_address(nrx),
        backends=["shm"],
        routes={ntx: "shm"},
        zero_copy=zero_copy,
        backend_options=opts,
    )
    async with rx:
        tx = Endpoint(
            ntx,
            address=ipc_address(ntx),
            peers={nrx: rx.address},
            backends=["shm"],
            routes={nrx: "shm"},
            backend_options=opts,
            ack_timeout=120,
        )
        async with tx:
            await tx.wait_peer(nrx, 30)
            yield tx, rx


@pytest.mark.asyncio
async def test_a_receiving_endpoint_creates_no_arena() -> None:
    async with _pair() as (tx, rx):
        with anyio.fail_after(30):
            receipt = await tx.send(rx.name, {"t": torch.ones(1000)}, request_id="r")
            async with await rx.receive():
                pass
            await receipt.wait()
        assert _segments(tx.backend("shm").prefix)  # type: ignore[attr-defined]
        assert _segments(rx.backend("shm").prefix) == []  # type: ignore[attr-defined]
        assert rx.backend("shm").stats().detail["arena_bytes"] == 0


@pytest.mark.parametrize("size", [33 * MiB, 64 * MiB], ids=["33MiB", "64MiB"])
@pytest.mark.asyncio
async def test_a_large_object_never_waits_behind_a_held_small_one(size: int) -> None:
    """Before: the large object needed the whole 64 MiB arena, waited ``arena_wait``
    for the held 1 KiB slot, then got a fresh segment. Here ``arena_wait`` is 60 s:
    waiting at all would run past the bound."""
    async with _pair(arena_size=64 * MiB, arena_wait=60) as (tx, rx):
        with anyio.fail_after(30):
            small = await tx.send(rx.name, {"s": torch.ones(256)}, request_id="small")
            held = await rx.receive()  # a zero-copy consumer keeps it: its slot stays taken
            for i in range(3):
                big = torch.full((size // 4,), float(i))
                receipt = await tx.send(rx.name, {"b": big}, request_id=f"big{i}")
                async with await rx.receive() as d:
                    assert torch.equal(d.payload["b"], big)
                await receipt.wait()
            held.release()
            await small.wait()
        detail = tx.backend("shm").stats().detail
        assert detail["arena_kept"] == 1  # one kept segment carried all three, warm
        assert detail["arena_dedicated_created"] == 1
        assert tx.backend("shm").stats().idle and rx.backend("shm").stats().idle


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "copy"])
@pytest.mark.asyncio
async def test_plain_segments_are_read_not_mapped(zero_copy: bool) -> None:
    """``sealed=False`` (1.1's plain files): the receiver reads them with ``pread``, so
    a zero-copy receiver gets a copy of its own; small and large (threaded) objects,
    from the arena and from a dedicated segment, arrive whole."""
    opts: dict[str, Any] = {"sealed": False, "arena_size": 16 * MiB}
    async with _pair(zero_copy, **opts) as (tx, rx):
        prefix = tx.backend("shm").prefix  # type: ignore[attr-defined]
        with anyio.fail_after(60):
            for i, n in enumerate((1000, 3 * MiB, 40 * MiB)):  # slot, slot (threaded), dedicated
                t = torch.full((n // 4,), float(i))
                receipt = await tx.send(rx.name, {"t": t}, request_id=f"r{i}")
                async with await rx.receive() as d:
                    assert torch.equal(d.payload["t"], t)
                    assert _plain_files(prefix)
                await receipt.wait()
        assert rx.backend("shm").stats().idle


@pytest.mark.parametrize("nbytes", [4096, 3 * MiB], ids=["on-the-loop", "in-a-thread"])
@pytest.mark.asyncio
async def test_copy_range_copies_exactly_its_range(nbytes: int) -> None:
    """A copy-mode landing (``copy_range``): host bytes go by ``memcpy`` (numpy),
    anything else by ``Tensor.copy_``; either way only ``[lo, hi)`` is written."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dest = torch.zeros(nbytes, dtype=torch.uint8)
    lo, hi = 7, nbytes - 5
    await copy_range(dest, src, lo, hi)
    assert torch.equal(dest[lo:hi], src[lo:hi])
    assert not dest[:lo].any() and not dest[hi:].any()
    floats = torch.zeros(nbytes // 4)  # not bytes: Tensor.copy_
    await copy_range(floats, src[: nbytes // 4].float(), 1, nbytes // 4)
    assert floats[0] == 0 and torch.equal(floats[1:], src[1 : nbytes // 4].float())


@pytest.mark.asyncio
async def test_a_dropped_copy_mode_delivery_gives_its_receive_buffer_back() -> None:
    """A copy-mode receiver lands large objects in pooled (warm) buffers. Once the
    application drops a delivery, nothing of the receiver's keeps it: the next object
    lands in the same block (before, the receiver kept its last delivery, so objects
    alternated between two blocks, and the last payload stayed in memory)."""
    async with _pair(zero_copy=False) as (tx, rx):
        pool = rx._receiver.reader.pool
        for i in range(4):
            with anyio.fail_after(30):
                t = torch.full((MiB,), i, dtype=torch.int32)  # 4 MiB: a pool block
                receipt = await tx.send(rx.name, {"t": t}, request_id=f"r{i}")
                d = await rx.receive()
                assert torch.equal(d.payload["t"], t)
                del d
                await receipt.wait()
        assert pool.blocks_created == 1


@pytest.mark.asyncio
async def test_a_send_cancelled_natively_while_its_segment_is_made_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Was: a send cancelled with a plain ``Task.cancel()`` (``asyncio.wait_for``, a
    ``TaskGroup``) while its arena or dedicated segment was being created in a worker
    thread returned at once; the thread then made the segment, which nobody attached
    or dropped: a 64 MiB memfd left in /dev/shm past both endpoints' close (7 of 10
    such sends in a probe). What a cancelled call makes is now freed."""
    import asyncio
    import threading
    import time

    from omniwire.backends.shm._backend import ShmBackend

    real = ShmBackend._new_segment
    made = threading.Event()

    def slow(self: ShmBackend, size: int) -> Any:
        time.sleep(0.3)  # the caller is cancelled meanwhile
        try:
            return real(self, size)
        finally:
            made.set()

    monkeypatch.setattr(ShmBackend, "_new_segment", slow)
    mine = f"omniwire-{os.getpid()}-"
    before = {p for p in os.listdir(SHM_DIR) if p.startswith(mine)}
    for small_arena in (False, True):  # the arena; then a dedicated segment (8 MiB)
        options = {"shm": {"arena_size": 1 << 20}} if small_arena else {}
        made.clear()
        async with (
            Endpoint("b", address=ipc_address("b")) as b,
            Endpoint(
                "a",
                address=ipc_address("a"),
                peers={"b": b.address},
                routes={"b": "shm"},
                backend_options=options,
            ) as a,
        ):
            await a.wait_peer("b", 10)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(a.send("b", torch.ones(2 << 20), request_id="x"), 0.05)
            await anyio.to_thread.run_sync(made.wait, 10)
            await anyio.sleep(0.1)
        left = {p for p in os.listdir(SHM_DIR) if p.startswith(mine)} - before
        assert left == set(), f"left in /dev/shm ({small_arena=}): {left}"


def _without_sealed(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Endpoint ``name``'s Hellos lack the feature "sealed", as a peer of the earlier
    1.1 text's do (spec §11.2): it is sent plain segments only."""
    import sys

    from omniwire.endpoint import _handshake

    real = _handshake.hello_of

    def hello_of(core: Any, *args: Any, **kw: Any) -> Any:
        hello = real(core, *args, **kw)
        if core.name != name:
            return hello
        import msgspec

        return msgspec.structs.replace(
            hello, features=tuple(f for f in hello.features if f != "sealed")
        )

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("omniwire.endpoint") and (
            getattr(module, "hello_of", None) is real
        ):
            monkeypatch.setattr(module, "hello_of", hello_of)


@pytest.mark.asyncio
async def test_memory_shared_between_a_sealed_and_an_earlier_reader_reaches_each_in_its_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fan-out, and a tensor born in transport memory (``Endpoint.empty``), share one
    export among their targets — but not between a peer that reads sealed segments and
    one whose Hello lacks "sealed" (spec §9.2 "Which form"): that one gets a plain
    file (what each receiver was sent is seen by its backend's import)."""
    tag = secrets.token_hex(3)
    new, old, src = f"new-{tag}", f"old-{tag}", f"src-{tag}"
    _without_sealed(monkeypatch, old)
    kw: dict[str, Any] = {"backends": ["shm"], "zero_copy": True}
    async with (
        Endpoint(new, address=ipc_address(new), routes={src: "shm"}, **kw) as b,
        Endpoint(old, address=ipc_address(old), routes={src: "shm"}, **kw) as c,
    ):
        tx = Endpoint(
            src,
            address=ipc_address(src),
            peers={new: b.address, old: c.address},
            backends=["shm"],
            routes={new: "shm", old: "shm"},
        )
        links: dict[str, list[bool]] = {new: [], old: []}
        for rx in (b, c):
            _watch_forms(monkeypatch, rx, links[rx.name])
        async with tx:
            await tx.wait_peer(new, 30)
            await tx.wait_peer(old, 30)
            hidden = torch.randn(64, 1024)  # 256 KiB: in a segment
            receipts = await tx.send([new, old], {"h": hidden}, request_id="fan")
            with anyio.fail_after(10):
                got_new, got_old = await b.receive(), await c.receive()
            assert torch.equal(got_new.payload["h"], hidden)
            assert torch.equal(got_old.payload["h"], hidden)
            assert links == {new: [True], old: [False]}  # a link to a memfd; a plain file
            got_new.release()
            got_old.release()
            for r in receipts:
                await r.wait(10)

            buf = await tx.empty(new, (64, 1024))
            buf.tensor.copy_(hidden)
            for target, rx in ((new, b), (old, c)):
                receipt = await tx.send(target, buf.tensor, request_id=f"born-{target}")
                with anyio.fail_after(10):
                    d = await rx.receive()
                assert torch.equal(d.payload, hidden)
                d.release()
                await receipt.wait(10)
            buf.release()
            assert links == {new: [True, True], old: [False, False]}


def _is_link(path: str) -> bool:
    return os.path.islink(path)


def _watch_forms(monkeypatch: pytest.MonkeyPatch, rx: Endpoint, seen: list[bool]) -> None:
    """Record, for each shm object ``rx`` imports, whether its segment is a link."""
    import msgspec

    backend = rx.backend("shm")
    real = backend.import_

    async def import_(peer: Any, ref: bytes, nbytes: int) -> Any:
        name = msgspec.msgpack.decode(ref)["segment"]
        seen.append(_is_link(f"{SHM_DIR}/{name}"))
        return await real(peer, ref, nbytes)

    monkeypatch.setattr(backend, "import_", import_)
