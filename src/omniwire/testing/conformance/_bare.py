"""Checks on two bare backend instances in this process: close semantics, error
mapping, and each declared capability against what the backend really does."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from ... import packing
from ...backends._peermem import SEALING
from ...backends.base import (
    BackendBase,
    BackendContext,
    BackendStats,
    ByteBackend,
    Export,
    Locality,
    ObjectBackend,
    PeerInfo,
)
from ...errors import BackendClosedError, BackendError
from ._harness import Configured

__all__ = ["BareChecks"]


class BareChecks(Configured):
    """A closed backend refuses work; bad references are ``BackendError``; handles are
    counted and released once; bytes, sides, devices and lent tensors behave as the
    capabilities declare."""

    # -- bare backend instances: close semantics, error mapping, declared capabilities ----

    def _ctx(self, name: str) -> BackendContext:
        return BackendContext(
            endpoint=name,
            instance=secrets.randbits(32),
            options=self.backend_options.get(self.backend, {}),
        )

    def _export_device(self) -> str:
        return "cuda:0" if self.device == "cuda" else "cpu"

    @contextlib.asynccontextmanager
    async def _bare(self, backend_class: type[Any]) -> AsyncIterator[Bare]:
        """A sender and a receiver instance that know each other (as after a Hello)."""
        caps = backend_class.capabilities
        locality = (
            Locality.SAME_HOST if Locality.SAME_HOST in caps.localities else min(caps.localities)
        )
        a = backend_class(self._ctx("bare-a-" + secrets.token_hex(2)))
        b = backend_class(self._ctx("bare-b-" + secrets.token_hex(2)))
        try:
            with anyio.fail_after(60):
                await a.start()
                await b.start()

                def peer(x: BackendBase) -> PeerInfo:
                    # as an omniwire endpoint's Hello describes it (it reads sealed
                    # segments where the platform has them: spec §9.2, §11.2)
                    return PeerInfo(
                        x.ctx.endpoint,
                        x.ctx.instance,
                        os.getpid(),
                        "h",
                        "t",
                        locality,
                        x.hello(),
                        features=("sealed",) if SEALING else (),
                    )

                pair = Bare(a, b, peer(a), peer(b), self._export_device())
                await a.connect(pair.to_b)
                await b.connect(pair.to_a)
            with anyio.fail_after(120):
                yield pair
        finally:
            with anyio.CancelScope(shield=True):
                await a.aclose()
                await b.aclose()

    def test_closed_backend_refuses_work(self, backend_class: type[Any]) -> None:
        async def run() -> None:
            b = backend_class(self._ctx("closing"))
            await b.start()
            await b.aclose()
            await b.aclose()  # idempotent
            peer = PeerInfo("x", 1, os.getpid(), "h", "t", Locality.SAME_HOST, b.hello())
            with pytest.raises(BackendClosedError):
                if isinstance(b, ByteBackend):
                    await b.export(peer, 64, self._export_device())
                elif isinstance(b, ObjectBackend):
                    b.export_object(peer, {"x": 1})
            with pytest.raises(BackendClosedError):
                await b.import_(peer, b"", 64)

        anyio.run(run)

    @pytest.mark.parametrize(
        "info", [b"", b"\xc1garbage", b"\x93\xa1x\x00\x00", bytes(range(64))], ids=str
    )
    def test_bad_references_are_backend_errors(self, backend_class: type[Any], info: bytes) -> None:
        async def run() -> None:
            async with self._bare(backend_class) as p:
                with pytest.raises(BackendError):
                    imp = await p.b.import_(p.to_a, info, 64)
                    await imp.fetch(0, 64)
                assert p.b.stats().idle

        anyio.run(run)

    def test_declares_valid_capabilities(self, backend_class: type[Any]) -> None:
        caps = backend_class.capabilities
        assert caps.devices and caps.localities
        assert isinstance(backend_class.availability().available, bool)
        assert backend_class.name == self.backend
        if issubclass(backend_class, ObjectBackend):  # the byte path's promises do not apply
            assert not (caps.progressive or caps.two_sided or caps.mapped)

    def test_handles_are_counted_and_release_once(self, backend_class: type[Any]) -> None:
        async def run() -> None:
            async with self._bare(backend_class) as p:
                exp = await p.export_bytes(4096, 1)
                assert p.a.stats().exports == 1 and p.b.stats().imports == 0
                imp = await p.b.import_(p.to_a, exp.ref, exp.nbytes)
                assert p.b.stats().imports == 1
                if isinstance(p.b, ByteBackend):
                    await imp.fetch(0, exp.nbytes, p.dest(exp.nbytes))
                for _ in range(2):  # idempotent
                    imp.close()
                    exp.release()
                assert imp.closed and exp.released
                assert p.a.stats().idle and p.b.stats().idle
                for stats in (p.a.stats(), p.b.stats()):
                    assert isinstance(stats, BackendStats)
                    assert all(isinstance(v, int) for v in stats.detail.values()), stats

        anyio.run(run)

    def test_bytes_arrive_as_the_capabilities_declare(self, backend_class: type[Any]) -> None:
        """In ranges published one by one when ``progressive``; viewable without a
        destination when ``zero_copy``; viewable right after import when ``mapped``."""
        if not issubclass(backend_class, ByteBackend):
            self.test_declares_valid_capabilities(backend_class)
            return
        caps = backend_class.capabilities
        n = 300_000

        async def run() -> None:
            async with self._bare(backend_class) as p:
                exp = await p.export_bytes(n, 7, publish=not caps.progressive)
                data = p.pattern(n, 7)
                dest = p.dest(n)
                imp = await p.b.import_(p.to_a, exp.ref, n)
                if caps.progressive:  # the first half is readable before the second is out
                    await exp.publish(0, n // 2)
                    await imp.fetch(0, n // 2, dest)
                    assert torch.equal(dest[: n // 2].cpu(), data[: n // 2])
                    await exp.publish(n // 2, n)
                    await imp.fetch(n // 2, n, dest)
                else:
                    await imp.fetch(0, n, dest)
                assert torch.equal(dest.cpu(), data)
                imp.close()
                exp.release()
                if caps.zero_copy or caps.mapped:
                    exp = await p.export_bytes(n, 8)
                    data = p.pattern(n, 8)
                    imp = await p.b.import_(p.to_a, exp.ref, n)
                    if caps.mapped:  # the sender's memory, mapped: no fetch needed to see it
                        assert imp.buffer is not None and torch.equal(imp.buffer.cpu(), data)
                    await imp.fetch(0, n)
                    if caps.zero_copy:
                        assert imp.buffer is not None and torch.equal(imp.buffer[:n].cpu(), data)
                    imp.close()
                    exp.release()
                assert p.a.stats().idle and p.b.stats().idle

        anyio.run(run)

    def test_two_sided_as_declared(self, backend_class: type[Any]) -> None:
        """``two_sided``: an import closed unfetched still consumes its object, and the
        next one arrives intact. Otherwise: an export never imported is simply
        released, and the next one arrives intact."""
        if not issubclass(backend_class, ByteBackend):
            self.test_declares_valid_capabilities(backend_class)
            return
        two_sided = backend_class.capabilities.two_sided

        async def run() -> None:
            async with self._bare(backend_class) as p:
                skipped = await p.export_bytes(70_000, 1)
                kept = await p.export_bytes(50_000, 2)
                if two_sided:
                    (await p.b.import_(p.to_a, skipped.ref, skipped.nbytes)).close()
                imp = await p.b.import_(p.to_a, kept.ref, kept.nbytes)
                dest = p.dest(kept.nbytes)
                await imp.fetch(0, kept.nbytes, dest)
                assert torch.equal(dest.cpu(), p.pattern(kept.nbytes, 2))
                imp.close()
                skipped.release()
                kept.release()
                assert p.a.stats().idle and p.b.stats().idle

        anyio.run(run)

    def test_exports_on_the_declared_devices(self, backend_class: type[Any]) -> None:
        if not issubclass(backend_class, ByteBackend):
            self.test_declares_valid_capabilities(backend_class)
            return
        caps = backend_class.capabilities

        async def run() -> None:
            async with self._bare(backend_class) as p:
                assert isinstance(p.a, ByteBackend)
                kinds = [k for k in sorted(caps.devices) if k == "cpu" or torch.cuda.is_available()]
                assert kinds, f"{self.backend} declares no device this machine has"
                for kind in kinds:
                    exp = await p.a.export(p.to_b, 4096, "cuda:0" if kind == "cuda" else kind)
                    assert exp.layout == "packed" and exp.nbytes == 4096
                    assert exp.buffer is not None and exp.buffer.numel() >= 4096
                    assert exp.buffer.device.type in caps.devices, exp.buffer.device
                    exp.release()
                if caps.max_nbytes is not None:
                    with pytest.raises(BackendError):
                        await p.a.export(p.to_b, caps.max_nbytes + 1, p.device)
                assert p.a.stats().idle

        anyio.run(run)

    def test_lent_tensors_arrive_as_their_packed_image(self, backend_class: type[Any]) -> None:
        """``export_tensors(..., lent=True)`` either declines (None: the endpoint packs)
        or carries the tensors so that the peer gets exactly what packing would give."""
        if not issubclass(backend_class, ByteBackend):
            self.test_declares_valid_capabilities(backend_class)
            return
        device = self._export_device()
        ts = [
            torch.arange(20_000, dtype=torch.float32, device=device),
            torch.empty(0, device=device),
            torch.arange(77, dtype=torch.int16, device=device),
        ]
        layout = packing.plan(ts)

        async def run() -> None:
            async with self._bare(backend_class) as p:
                assert isinstance(p.a, ByteBackend)
                exp = await p.a.export_tensors(p.to_b, ts, lent=True)
                if exp is None:
                    assert p.a.stats().idle
                    return
                assert exp.nbytes == layout.nbytes
                if exp.layout == "packed":
                    await exp.publish(0, exp.nbytes)
                imp = await p.b.import_(p.to_a, exp.ref, exp.nbytes)
                if exp.layout == "per_tensor":
                    await imp.fetch(0, exp.nbytes)
                    got = list(imp.tensors or [])
                else:
                    dest = p.dest(layout.nbytes)
                    await imp.fetch(0, layout.nbytes, dest)
                    got = packing.unpack(dest, layout.metas, copy=True)
                assert len(got) == len(ts)
                assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(ts, got, strict=True))
                imp.close()
                exp.release()
                assert p.a.stats().idle and p.b.stats().idle

        anyio.run(run)


class Bare:
    """Two bare instances: ``a`` sends to ``b``; ``to_a`` is ``a`` as ``b`` sees it."""

    def __init__(
        self, a: BackendBase, b: BackendBase, to_a: PeerInfo, to_b: PeerInfo, device: str
    ) -> None:
        self.a = a
        self.b = b
        self.to_a = to_a
        self.to_b = to_b
        self.device = device

    @staticmethod
    def pattern(n: int, seed: int) -> torch.Tensor:
        return ((torch.arange(n, dtype=torch.int64) * 31 + seed) % 251).to(torch.uint8)

    def dest(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, device=self.device)

    async def export_bytes(self, n: int, seed: int, *, publish: bool = True) -> Export:
        """An export of ``n`` pattern bytes (an object, for an object backend)."""
        if isinstance(self.a, ObjectBackend):
            return self.a.export_object(self.to_b, {"seed": seed, "n": n})
        assert isinstance(self.a, ByteBackend)
        exp = await self.a.export(self.to_b, n, self.device)
        assert exp.buffer is not None and exp.buffer.numel() >= n
        exp.buffer[:n].copy_(self.pattern(n, seed).to(exp.buffer.device))
        if publish:
            await exp.publish(0, n)
        return exp
