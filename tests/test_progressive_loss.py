"""A receiver killed while a large object is announced in pieces (spec §5.2).

The sender is paused, deterministically, between the first piece and the next
(its backend's ``publish`` of a later piece waits for the test), the receiver
process is SIGKILLed there, and then the sender goes on. The object must be
released exactly once (its credit too), and a restarted receiver of the same
name must be served normally — once, a second release of the credit wedged the
sender's receive loop on the next ACK.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import anyio
import pytest
import torch

from omniwire import registry
from omniwire.backends.base import Export, PeerInfo
from omniwire.backends.shm import ShmBackend
from omniwire.endpoint import Endpoint
from omniwire.errors import PeerLostError
from omniwire.testing import PeerProcess
from omniwire.testing.conformance import ipc_address

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

MiB = 1 << 20


class _PausedExport(Export):
    """An shm export whose later pieces wait for the test before they are published."""

    def __init__(self, backend: PausingShm, inner: Export) -> None:
        super().__init__(backend, inner.nbytes, inner.buffer, layout=inner.layout)
        self.inner = inner
        self.pauser = backend

    @property
    def ref(self) -> bytes:
        return self.inner.ref

    async def publish(self, lo: int, hi: int) -> None:
        if lo > 0:
            self.pauser.reached.set()
            await self.pauser.resume.wait()
        await self.inner.publish(lo, hi)

    def _release(self) -> None:
        PausingShm.releases += 1
        self.inner.release()


class PausingShm(ShmBackend):
    name: ClassVar[str] = "shm"
    reached: ClassVar[anyio.Event]
    resume: ClassVar[anyio.Event]
    releases: ClassVar[int] = 0

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        return _PausedExport(self, await super().export(peer, nbytes, device))


@pytest.fixture
def pausing_shm() -> Iterator[type[PausingShm]]:
    PausingShm.reached = anyio.Event()
    PausingShm.resume = anyio.Event()
    PausingShm.releases = 0
    registry.register_backend("shm", PausingShm, replace=True)
    try:
        yield PausingShm
    finally:
        registry.unregister_backend("shm")  # the built-in entry comes back
    assert registry.load_backend("shm") is ShmBackend


async def test_receiver_killed_between_pieces_releases_once(pausing_shm: Any) -> None:
    address = ipc_address("rx")
    receiver = PeerProcess("rx", address, "--mode", "sink")
    restarted: PeerProcess | None = None
    try:
        async with Endpoint(
            "tx",
            address=ipc_address("tx"),
            peers={"rx": receiver.address},
            routes={"rx": "shm"},
            backends=["shm"],
            progressive_chunk=16 * MiB,
            max_inflight=1,  # a leaked credit would block every later send
            ack_timeout=10,
        ) as tx:
            await tx.wait_peer("rx", 30)
            big = torch.ones(40 * MiB // 4)

            async def send_big() -> BaseException | None:
                try:
                    receipt = await tx.send("rx", {"t": big}, request_id="big")
                    await receipt.wait(30)
                except PeerLostError as exc:
                    return exc
                return None

            async with anyio.create_task_group() as tg:
                outcome: list[BaseException | None] = []

                async def run() -> None:
                    outcome.append(await send_big())

                tg.start_soon(run)
                with anyio.fail_after(30):
                    await pausing_shm.reached.wait()  # piece 1 announced, piece 2 paused
                assert tx.in_flight()["rx"][0] == 1
                receiver.kill()
                with anyio.fail_after(15):
                    while tx.counters.get("peers_lost", 0) < 1:
                        await anyio.sleep(0.02)
                pausing_shm.resume.set()
            assert isinstance(outcome[0], PeerLostError), outcome
            assert pausing_shm.releases == 1
            assert tx.in_flight()["rx"] == (0, 0)
            assert tx.backend("shm").stats().idle
            # The stage comes back under the same name and address: served normally.
            restarted = PeerProcess("rx", address, "--mode", "sink")
            await tx.wait_peer("rx", 30)
            for i in range(3):
                receipt = await tx.send("rx", {"t": torch.ones(1024)}, request_id=f"after-{i}")
                await receipt.wait(30)
            assert tx.counters.get("internal_errors", 0) == 0
            assert tx.in_flight()["rx"] == (0, 0)
        assert restarted.stop() == 0
    finally:
        for proc in (receiver, restarted):
            if proc is not None and proc.proc.poll() is None:
                proc.kill()
