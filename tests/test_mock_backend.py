"""omniwire.testing.MockBackend: the public mock transport for tests of the byte path."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from omniwire import Endpoint, registry
from omniwire.errors import BackendError, OmniwireError
from omniwire.testing import BackendConformance, MockHooks, register_mock_backend
from omniwire.testing.conformance import ipc_address


@asynccontextmanager
async def _pair(
    hooks: MockHooks, name: str, **a_kw: Any
) -> AsyncIterator[tuple[Endpoint, Endpoint]]:
    tag = secrets.token_hex(3)
    na, nb = f"a-{tag}", f"b-{tag}"
    opts = {name: {"hooks": hooks}}
    async with (
        Endpoint(
            nb, address=ipc_address(nb), backends=[name], routes={na: name}, backend_options=opts
        ) as b,
        Endpoint(
            na,
            address=ipc_address(na),
            peers={nb: b.address},
            backends=[name],
            routes={nb: name},
            backend_options=opts,
            **a_kw,
        ) as a,
    ):
        await a.wait_peer(nb, 30)
        await b.wait_peer(na, 30)
        yield a, b


@pytest.mark.asyncio
async def test_round_trip_records_every_call() -> None:
    hooks = MockHooks()
    with register_mock_backend() as name:
        async with _pair(hooks, name) as (a, b):
            t = torch.arange(1000)
            with anyio.fail_after(30):
                receipt = await a.send(b.name, {"t": t}, request_id="r")
                d = await b.receive()
                await receipt.wait()
            assert d.backend == name and torch.equal(d.payload["t"], t)
            assert [c.op for c in hooks.calls] == [
                "export",
                "publish",
                "import",
                "fetch",
                "close",
                "release",
            ]
            assert a.backend(name).stats().idle and b.backend(name).stats().idle
    with pytest.raises(KeyError):
        registry.backend_status(name)  # unregistered again


@pytest.mark.asyncio
async def test_a_peer_lost_between_the_pieces_of_a_progressive_announce() -> None:
    """The receiver goes away while the sender's second piece is held at publish."""
    hooks = MockHooks()
    tag = secrets.token_hex(3)
    na, nb = f"a-{tag}", f"b-{tag}"
    with register_mock_backend() as name:
        gate = hooks.pause("publish", when=lambda call: call.lo > 0)  # the second piece
        opts = {name: {"hooks": hooks}}
        b_address: list[str] = []
        b_up, b_stop, b_down = anyio.Event(), anyio.Event(), anyio.Event()

        async def run_b() -> None:  # b lives in its own task, so it can close mid-send
            async with Endpoint(
                nb,
                address=ipc_address(nb),
                backends=[name],
                routes={na: name},
                backend_options=opts,
            ) as b:
                b_address.append(b.address)
                b_up.set()
                await b_stop.wait()
            b_down.set()

        outcome: list[BaseException | None] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_b)
            await b_up.wait()
            async with Endpoint(
                na,
                address=ipc_address(na),
                peers={nb: b_address[0]},
                backends=[name],
                routes={nb: name},
                backend_options=opts,
                progressive_chunk=1 << 20,
            ) as a:
                await a.wait_peer(nb, 30)

                async def send() -> None:
                    try:
                        r = await a.send(nb, {"t": torch.ones(1 << 20)}, request_id="p")
                        await r.wait(30)
                        outcome.append(None)
                    except OmniwireError as exc:
                        outcome.append(exc)

                tg.start_soon(send)
                call = await gate.wait()
                assert call.op == "publish" and call.lo == 1 << 20 and call.hi > call.lo
                b_stop.set()  # the receiver goes away between the pieces
                await b_down.wait()
                gate.open()
                with anyio.fail_after(60):
                    while not outcome:
                        await anyio.sleep(0.05)
                    while not a.backend(name).stats().idle:
                        await anyio.sleep(0.05)
        assert isinstance(outcome[0], OmniwireError), outcome
        assert [c.op for c in hooks.calls].count("release") == 1


@pytest.mark.asyncio
async def test_a_failed_fetch_is_a_nack_and_the_next_object_still_flows() -> None:
    hooks = MockHooks()
    with register_mock_backend() as name:
        hooks.fail("fetch", BackendError("mock: the wire broke"))
        async with _pair(hooks, name) as (a, b):
            with anyio.fail_after(30):
                bad = await a.send(b.name, {"t": torch.ones(10)}, request_id="bad")
                d = await b.receive()
                assert d.kind == "error" and "the wire broke" in (d.error or "")
                with pytest.raises(BackendError, match="the wire broke"):
                    await bad.wait()
                good = await a.send(b.name, {"t": torch.ones(10)}, request_id="good")
                assert (await b.receive()).kind == "payload"
                await good.wait()
            assert len(hooks.of("fetch")) == 2


def test_capabilities_can_be_changed_per_registration() -> None:
    with register_mock_backend("mock2", two_sided=True, progressive=False) as name:
        cls = registry.load_backend(name)
        assert cls.name == "mock2" and cls.capabilities.two_sided
        assert not cls.capabilities.progressive


class TestMockConformance(BackendConformance):
    """The mock passes the conformance suite itself (endpoints in one process)."""

    backend = "mock"
    two_process = False

    @pytest.fixture(scope="class")
    @classmethod
    def backend_class(cls) -> Any:
        with register_mock_backend() as name:
            yield registry.load_backend(name)


@pytest.mark.asyncio
async def test_a_peer_whose_object_is_slow_to_read_does_not_hold_another_peers_frames() -> None:
    """While the receiver reads a's object (its fetch held), b's inline payload and a
    reply's ACK still come through: one peer's engine transfer does not stop the
    receiver reading every other peer's frames."""
    hooks = MockHooks()
    with register_mock_backend() as name:
        # three "hosts": no control ring, every frame comes through the PULL socket
        async with (
            _pair(hooks, name, host_id="host-a") as (a, r),
            Endpoint(
                "other", address=ipc_address("other"), peers={r.name: r.address}, host_id="host-o"
            ) as other,
        ):
            await other.wait_peer(r.name, 30)
            gate = hooks.pause("fetch")
            slow = await a.send(r.name, {"t": torch.arange(1000)}, request_id="slow")
            with anyio.fail_after(10):
                await gate.wait()  # the receiver is reading a's object now
            await other.send(r.name, {"hello": 1}, request_id="quick")
            got = None
            with anyio.move_on_after(3):
                got = await r.receive(request_id="quick")
            gate.open()
            assert got is not None, "b's payload waited for a's object to be read"
            assert got.payload == {"hello": 1}
            with anyio.fail_after(10):
                d = await r.receive(request_id="slow")
                await slow.wait()
            assert torch.equal(d.payload["t"], torch.arange(1000))
