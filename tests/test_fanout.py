"""Fan-out: ``send([a, b, c], payload)`` encodes once, packs once into one shared
buffer on a backend with ``shared_refs`` (shm), and releases it with the last ACK."""

from __future__ import annotations

import dataclasses
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, ClassVar

import anyio
import pytest
import torch

from omniwire import codec, registry
from omniwire.backends.base import Capabilities
from omniwire.backends.shm import ShmBackend
from omniwire.endpoint import Endpoint
from omniwire.errors import OmniwireError

pytestmark = pytest.mark.asyncio


def addr(name: str) -> str:
    return f"ipc://{tempfile.gettempdir()}/owt-{os.getuid()}/{name}-{secrets.token_hex(3)}"


@asynccontextmanager
async def star(
    targets: tuple[str, ...], routes: dict[str, str], **receiver_kw: Any
) -> AsyncIterator[tuple[Endpoint, list[Endpoint]]]:
    """A sender ``src`` and one endpoint per target, all in this process."""
    async with AsyncExitStack() as stack:
        receivers = [
            await stack.enter_async_context(Endpoint(t, address=addr(t), **receiver_kw))
            for t in targets
        ]
        src = await stack.enter_async_context(
            Endpoint(
                "src",
                address=addr("src"),
                peers={r.name: r.address for r in receivers},
                routes=routes,
            )
        )
        for r in receivers:
            await src.wait_peer(r.name, 10)
        yield src, receivers


def shm_exports(ep: Endpoint, name: str = "shm") -> int:
    return ep.backend(name).stats().exports


async def test_fan_out_packs_once_and_the_last_ack_releases_the_shared_buffer() -> None:
    targets = ("b", "c", "d")
    hidden = torch.randn(256, 1024)  # 1 MiB
    async with star(targets, dict.fromkeys(targets, "shm"), zero_copy=True) as (src, rs):
        receipts = await src.send(list(targets), {"h": hidden}, request_id="r")
        assert [r.peer for r in receipts] == list(targets)
        assert {r.backend for r in receipts} == {"shm"}
        assert len({r.object_id for r in receipts}) == 3  # one object per target
        assert shm_exports(src) == 1  # one pack, one buffer, three readers
        with anyio.fail_after(10):
            got = [await r.receive() for r in rs]
        for d in got:
            assert d.zero_copy and torch.equal(d.payload["h"], hidden)
        # every target views the very same memory: a write through one view shows in all
        got[0].payload["h"][0, 0] = 12345.0
        assert all(d.payload["h"][0, 0].item() == 12345.0 for d in got)
        got[0].release()
        got[1].release()
        with anyio.fail_after(10):
            await receipts[0].wait()
            await receipts[1].wait()
        assert not receipts[2].done()
        assert shm_exports(src) == 1  # d still reads it
        got[2].release()
        with anyio.fail_after(10):
            await receipts[2].wait()
        assert shm_exports(src) == 0
        assert src.backend("shm").stats().idle
        # for comparison: three separate sends make three buffers
        singles = [await src.send(t, {"h": hidden}, request_id="s") for t in targets]
        assert shm_exports(src) == 3
        for r in rs:
            with anyio.fail_after(10):
                (await r.receive()).release()
        for s in singles:
            await s.wait(10)
        assert shm_exports(src) == 0


async def test_each_target_has_its_own_route_and_receipt_and_local_its_own_containers() -> None:
    async with star(("b", "c", "near"), {"b": "shm", "c": "shm"}) as (src, (b, c, near)):
        payload: dict[str, Any] = {"t": torch.arange(8.0), "ids": [1, 2]}
        receipts = await src.send(["b", "near", "c"], payload, request_id="r")
        assert [(r.peer, r.backend) for r in receipts] == [
            ("b", "shm"),
            ("near", "local"),
            ("c", "shm"),
        ]
        with anyio.fail_after(10):
            for r in receipts:
                await r.wait()
            got = {ep.name: await ep.receive() for ep in (b, c, near)}
        for d in got.values():
            assert torch.equal(d.payload["t"], payload["t"])
        got["near"].payload["ids"].append(3)  # local: containers are the target's own
        assert payload["ids"] == [1, 2]
        assert src.route_stats[("b", "payload", "shm")].count == 1
        assert src.route_stats[("near", "payload", "local")].count == 1


async def test_stream_fan_out_numbers_chunks_per_target() -> None:
    async with star(("b", "c"), {"b": "shm", "c": "shm"}) as (src, (b, c)):
        await src.stream(["b", "c"], torch.ones(1 << 16), request_id="s")
        await src.stream("b", torch.ones(1 << 16), request_id="s")
        await src.stream(["b", "c"], torch.ones(1 << 16), request_id="s")
        await src.end_stream(["b", "c"], request_id="s")
        with anyio.fail_after(10):
            got_b = [d async for d in b.deliveries(request_id="s")]
            got_c = [d async for d in c.deliveries(request_id="s")]
        assert [d.chunk_id for d in got_b if d.kind == "stream_chunk"] == [0, 1, 2]
        assert [d.chunk_id for d in got_c if d.kind == "stream_chunk"] == [0, 1]
        assert got_b[-1].kind == got_c[-1].kind == "stream_end"


@pytest.mark.asyncio
async def test_a_fan_out_end_stream_ends_every_target_it_can() -> None:
    """Was: ``end_stream([gone, alive])`` stopped at the first target that failed:
    ``alive``'s stream was never ended (its consumer waited until its
    ``stream_idle_timeout``, 300 s by default), though ``end_stream`` ends each
    target. Every target is now ended; the first failure is raised after."""
    async with (
        Endpoint("b", address=addr("b")) as b,
        Endpoint(
            "src",
            address=addr("src"),
            peers={"b": b.address, "gone": addr("gone")},  # nobody there
            handshake_timeout=0.5,
        ) as src,
    ):
        await src.wait_peer("b", 10)
        await src.stream("b", torch.ones(4), request_id="s")
        with pytest.raises(OmniwireError):
            await src.end_stream(["gone", "b"], request_id="s")
        with anyio.fail_after(10):
            kinds = [d.kind async for d in b.deliveries(request_id="s")]
        assert kinds == ["stream_chunk", "stream_end"]


class _ShmOnePerTarget(ShmBackend):
    """shm without shared references: a fan-out must make one export per target."""

    name: ClassVar[str] = "shm_single"
    capabilities: ClassVar[Capabilities] = dataclasses.replace(
        ShmBackend.capabilities, shared_refs=False
    )


@pytest.fixture
def shm_single() -> Iterator[str]:
    registry.register_backend("shm_single", _ShmOnePerTarget)
    try:
        yield "shm_single"
    finally:
        registry.unregister_backend("shm_single")


async def test_without_shared_refs_one_export_per_target_but_one_encoding(
    shm_single: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded = []
    dumps = codec.dumps

    def counting_dumps(value: Any, **kw: Any) -> codec.Encoded:
        encoded.append(value)
        return dumps(value, **kw)

    monkeypatch.setattr(codec, "dumps", counting_dumps)
    async with star(("b", "c"), {"b": shm_single, "c": shm_single}, zero_copy=True) as (src, rs):
        payload = {"h": torch.randn(1024)}
        receipts = await src.send(["b", "c"], payload, request_id="r")
        assert [r.backend for r in receipts] == [shm_single, shm_single]
        assert sum(v is payload for v in encoded) == 1  # encoded once for both
        assert shm_exports(src, shm_single) == 2  # but one buffer each
        for r in rs:
            with anyio.fail_after(10):
                d = await r.receive()
            assert torch.equal(d.payload["h"], payload["h"])
            d.release()
        for receipt in receipts:
            await receipt.wait(10)
        assert shm_exports(src, shm_single) == 0


async def test_fan_out_refuses_no_target_and_a_target_twice() -> None:
    async with star(("b",), {}) as (src, _):
        with pytest.raises(ValueError, match="at least one target"):
            await src.send([], 1, request_id="r")
        with pytest.raises(ValueError, match="more than once: 'b'"):
            await src.send(["b", "b"], 1, request_id="r")
