"""The backend conformance suite. Any backend — omniwire's or a third party's — runs it
by subclassing :class:`BackendConformance` in a test module::

    from omniwire.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend = "my_backend"
        backend_options = {"my_backend": {"port": 0}}

It checks, through real endpoints:

- put/get round trips of Hypothesis payloads (every dtype and shape), bit-exact,
  between this process and a peer process (``two_process = True``, the default)
  or an endpoint in this process (``two_process = False``, for ``local``);
- stream chunks arrive in order; large objects (progressive announce) arrive whole;
- ACK and release: after round trips nothing is left in flight, and the backends
  of *both* endpoints hold no handle (the typed :class:`BackendStats` contract:
  ``stats().idle``, filled by the base class for every backend);
- credits: a slow consumer makes the sender wait; nothing is dropped;
- abort: an aborted request's sends end, and its handles are released on both
  sides (the peer is asked for its backends' stats);
- declared capabilities against what the backend really does, on two bare
  instances in this process: the byte layout round trip (in ranges when it
  declares ``progressive``), ``zero_copy`` (the bytes viewable without a
  destination), ``mapped`` (viewable right after import), ``two_sided`` (an
  import closed unfetched keeps later objects paired) or its absence (an export
  never imported is released cleanly), ``devices`` (export buffers on a declared
  device), ``max_nbytes``, lent tensors (``export_tensors(..., lent=True)`` yields
  the packed image), and idempotent, counted handles;
- close semantics and error mapping: a closed backend refuses export and import
  with ``BackendClosedError``; a malformed or foreign reference is a
  ``BackendError``, never a crash.

A backend that cannot run here is skipped with its reason — or fails, when
``OMNIWIRE_REQUIRE_ENGINES=1`` (CI sets it), unless the backend needs a GPU
(``needs_gpu = True`` on its class) and none is present.

Needs the ``test`` extra (pytest, hypothesis).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings

from .. import packing, registry
from ..backends.base import (
    BackendBase,
    BackendContext,
    BackendStats,
    ByteBackend,
    Export,
    Locality,
    ObjectBackend,
    PeerInfo,
)
from ..endpoint import Endpoint
from ..errors import BackendClosedError, BackendError, OmniwireError, RequestAbortedError
from ..peer import backend_stats
from .strategies import assert_payload_equal, payloads

__all__ = ["BackendConformance", "PeerProcess", "require_backend", "to_device"]


def to_device(value: Any, device: str) -> Any:
    """``value`` with every tensor moved to ``device`` (containers rebuilt). Off the
    CPU, numpy arrays become tensors there too: a GPU-only backend carries nothing
    else, and a payload holding a CPU array would route elsewhere."""
    if device == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value)).to(device)
    if type(value) is list:
        return [to_device(v, device) for v in value]
    if type(value) is tuple:
        return tuple(to_device(v, device) for v in value)
    if type(value) is dict:
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def require_backend(name: str) -> type[Any]:
    """The backend class, or skip (fail under OMNIWIRE_REQUIRE_ENGINES=1) with the reason."""
    try:
        entry = registry.backend_status(name)
    except KeyError:
        pytest.fail(f"backend {name!r} is not registered (is its package installed?)")
    if entry.status == "available" and entry.cls is not None:
        return entry.cls
    reason = f"backend {name!r} is {entry.status}: {entry.error}"
    needs_gpu = bool(getattr(entry.cls, "needs_gpu", False))
    if os.environ.get("OMNIWIRE_REQUIRE_ENGINES") == "1" and not needs_gpu:
        pytest.fail(reason + " (OMNIWIRE_REQUIRE_ENGINES=1: engines that run on a CPU must load)")
    pytest.skip(reason)


def ipc_address(name: str) -> str:
    base = os.path.join(tempfile.gettempdir(), f"owt-{os.getuid()}")
    return f"ipc://{base}/{name}-{secrets.token_hex(4)}"


class PeerProcess:
    """``python -m omniwire.peer`` in a child process; its exit code is checked."""

    def __init__(
        self, name: str, address: str, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        cmd = [
            sys.executable,
            "-m",
            "omniwire.peer",
            "--name",
            name,
            "--address",
            address,
            *args,
        ]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=full_env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(
                f"peer {name} did not start (said {line!r}, exit {self.proc.wait()})"
            )
        self.address = line.split(" ", 1)[1]
        self.output = ""

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM the peer and return its exit code (killing it after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = -9
        self._close_pipe()
        return code

    def kill(self) -> None:
        """SIGKILL the peer (a crash, as far as its peers can tell)."""
        self.proc.kill()
        self.proc.wait()
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.output = self.proc.stdout.read()
            self.proc.stdout.close()


class _Harness:
    """The endpoint under test, living in a portal's event loop, and its peer (an
    endpoint of this process, or a peer process)."""

    def __init__(
        self, portal: BlockingPortal, endpoint: Endpoint, peer: str, peer_ep: Endpoint | None
    ) -> None:
        self.portal = portal
        self.ep = endpoint
        self.peer = peer
        self.peer_ep = peer_ep

    def call(self, fn: Any, *args: Any) -> Any:
        return self.portal.call(fn, *args)

    async def peer_stats(self, backend: str) -> tuple[int, int]:
        """(exports, imports) alive in the peer's backend ``backend`` (a peer process
        is asked, see :mod:`omniwire.peer`)."""
        if self.peer_ep is not None:
            stats = self.peer_ep.backend(backend).stats()
            return stats.exports, stats.imports
        rid = "stats-" + secrets.token_hex(3)
        with anyio.fail_after(60):
            receipt = await self.ep.send(
                self.peer, {"q": 1}, request_id=rid, metadata={"stats": True}
            )
            while True:
                d = await self.ep.receive()
                d.release()
                if d.request_id == rid and isinstance(d.payload, dict) and "stats" in d.payload:
                    await receipt.wait()
                    exports, imports = d.payload["stats"][backend]
                    return int(exports), int(imports)

    async def settled(self, backend: str) -> tuple[BackendStats, tuple[int, int]]:
        """Wait (bounded) until nothing is in flight and both backends hold no handle;
        returns both sides' stats as they are then."""
        with anyio.fail_after(60):
            await self.ep.drain()
            while True:
                mine = self.ep.backend(backend).stats()
                theirs = await self.peer_stats(backend)
                idle = not any(a or b for a, b in self.ep.in_flight().values())
                if idle and mine.idle and theirs == (0, 0):
                    return mine, theirs
                await anyio.sleep(0.05)

    async def round_trip(self, payload: Any, request_id: str, kind: str = "payload") -> Any:
        with anyio.fail_after(60):
            if kind == "payload":
                receipt = await self.ep.send(self.peer, payload, request_id=request_id)
            else:
                receipt = await self.ep.stream(self.peer, payload, request_id=request_id)
            d = await self.ep.receive()
            await receipt.wait()
            return d


class BackendConformance:
    """Subclass and set ``backend``. See the module docstring for what is checked."""

    #: The registered name of the backend under test.
    backend: ClassVar[str]
    #: ``{backend name: {option: value}}`` for both ends.
    backend_options: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Run the peer in another process (False for same-process backends like local).
    two_process: ClassVar[bool] = True
    #: Control-plane transport: "ipc" or "tcp" (127.0.0.1).
    transport: ClassVar[str] = "ipc"
    #: Hypothesis examples for the payload round trip.
    max_examples: ClassVar[int] = 12
    #: Size of the "large" object test (announced progressively where supported).
    large_nbytes: ClassVar[int] = 24 << 20
    #: Where the payloads' tensors live ("cuda" for GPU backends).
    device: ClassVar[str] = "cpu"

    # -- fixtures ------------------------------------------------------------------

    @classmethod
    def _address(cls, name: str) -> str:
        if cls.transport == "tcp":
            return "tcp://127.0.0.1:0"
        return ipc_address(name)

    @pytest.fixture(scope="class")
    @classmethod
    def backend_class(cls) -> type[Any]:
        return require_backend(cls.backend)

    @pytest.fixture(scope="class")
    @classmethod
    def harness(cls, backend_class: type[Any]) -> Iterator[_Harness]:
        yield from cls._make_harness(mode="echo")

    @classmethod
    def _make_harness(cls, mode: str, **ep_kw: Any) -> Iterator[_Harness]:
        self = cls
        tag = secrets.token_hex(3)
        me, other = f"tester-{tag}", f"peer-{tag}"
        routes = {other: self.backend}
        with start_blocking_portal() as portal:
            peer_proc: PeerProcess | None = None
            peer_ctx = None
            peer_ep: Endpoint | None = None
            if self.two_process:
                peer_proc = PeerProcess(
                    other,
                    self._address(other),
                    "--mode",
                    mode,
                    "--backends",
                    self.backend,
                    "--backend-options",
                    json.dumps(self.backend_options),
                    "--routes",
                    json.dumps({me: self.backend}),
                    *(["--delay", "0.2", "--receive-buffer", "1"] if mode == "sink" else []),
                )
                peer_address = peer_proc.address
            else:
                peer_ctx = portal.wrap_async_context_manager(
                    Endpoint(
                        other,
                        address=self._address(other),
                        backends=[self.backend],
                        backend_options=self.backend_options,
                        routes={me: self.backend},
                        receive_buffer=1 if mode == "sink" else 64,
                    )
                )
                peer_ep = peer_ctx.__enter__()
                peer_address = peer_ep.address
                portal.start_task_soon(self._in_process_peer, peer_ep, mode)
            ep = Endpoint(
                me,
                address=self._address(me),
                peers={other: peer_address},
                backends=[self.backend],
                backend_options=self.backend_options,
                routes=routes,
                **ep_kw,
            )
            try:
                with portal.wrap_async_context_manager(ep):
                    portal.call(ep.wait_peer, other, 30.0)
                    yield _Harness(portal, ep, other, peer_ep)
            finally:
                if peer_ctx is not None:
                    peer_ctx.__exit__(None, None, None)
                if peer_proc is not None:
                    code = peer_proc.stop()
                    assert code == 0, f"peer process exited with {code}"

    @staticmethod
    async def _in_process_peer(ep: Endpoint, mode: str) -> None:
        from ..peer import _answer

        async for d in ep:
            async with d:
                if isinstance(d.metadata, dict) and d.metadata.get("stats"):
                    stats = {"stats": backend_stats(ep)}
                    await ep.send(d.from_stage, stats, request_id=d.request_id)
                    continue
                if mode == "sink":
                    await anyio.sleep(0.2)
                else:
                    await _answer(ep, d)

    # -- end-to-end checks -----------------------------------------------------------

    def test_payload_round_trips(self, harness: _Harness) -> None:
        counter = iter(range(10**9))

        @settings(
            max_examples=self.max_examples,
            deadline=None,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.function_scoped_fixture,
            ],
        )
        @given(payloads(max_leaves=8))
        def check(value: Any) -> None:
            if self.device != "cpu":  # an anchor tensor makes every payload the backend's
                value = {"v": value, "anchor": torch.ones(1)}
            value = to_device(value, self.device)
            d = harness.call(harness.round_trip, value, f"rt-{next(counter)}")
            assert d.kind == "payload", d
            assert d.backend == self.backend
            assert_payload_equal(value, d.payload)

        check()

    def test_stream_chunks_arrive_in_order(self, harness: _Harness) -> None:
        async def run() -> list[Any]:
            rid = "stream-" + secrets.token_hex(2)
            for i in range(8):
                await harness.ep.stream(
                    harness.peer,
                    {"i": i, "t": torch.full((i + 1,), i, device=self.device)},
                    request_id=rid,
                )
            await harness.ep.end_stream(harness.peer, request_id=rid)
            got = []
            with anyio.fail_after(60):
                while True:
                    d = await harness.ep.receive()
                    got.append(d)
                    if d.kind == "stream_end":
                        return got

        got = harness.call(run)
        chunks = [d for d in got if d.kind == "stream_chunk"]
        assert [d.payload["i"] for d in chunks] == list(range(8))
        assert [d.chunk_id for d in chunks] == list(range(8))
        assert all(d.backend == self.backend for d in chunks)
        assert all(
            torch.equal(d.payload["t"].cpu(), torch.full((i + 1,), i)) for i, d in enumerate(chunks)
        )

    def test_large_object_round_trips(self, harness: _Harness) -> None:
        t = torch.randint(-(2**31), 2**31 - 1, (self.large_nbytes // 4,), dtype=torch.int32)
        value = to_device({"big": t, "small": torch.ones(3)}, self.device)
        d = harness.call(harness.round_trip, value, "large")
        assert torch.equal(d.payload["big"].cpu(), t)

    def test_nothing_left_in_flight_after_round_trips(self, harness: _Harness) -> None:
        for i in range(5):
            value = {"x": torch.arange(1000 + i, device=self.device)}
            harness.call(harness.round_trip, value, f"flight-{i}")
        mine, theirs = harness.call(harness.settled, self.backend)
        assert isinstance(mine, BackendStats) and mine.idle, mine
        assert all(isinstance(v, int) for v in mine.detail.values()), mine.detail
        assert theirs == (0, 0), f"the peer's {self.backend} holds handles: {theirs}"

    # -- flow control and abort, against a slow consumer ------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def slow(cls, backend_class: type[Any]) -> Iterator[_Harness]:
        yield from cls._make_harness(mode="sink", max_inflight=2)

    def test_credits_make_the_sender_wait(self, slow: _Harness) -> None:
        async def run() -> tuple[int, float]:
            peak = 0
            receipts = []
            started = time.monotonic()
            for i in range(6):
                receipts.append(
                    await slow.ep.send(
                        slow.peer,
                        {"i": torch.ones(256, device=self.device)},
                        request_id=f"credit-{i}",
                    )
                )
                peak = max(peak, slow.ep.in_flight()[slow.peer][0])
            with anyio.fail_after(60):
                for r in receipts:
                    await r.wait()
            return peak, time.monotonic() - started

        peak, elapsed = slow.call(run)
        assert peak <= 2
        assert elapsed >= 0.2  # six sends through two credits to a 0.2 s/delivery consumer

    def test_abort_releases_buffers_on_both_sides(self, slow: _Harness) -> None:
        async def run() -> tuple[list[BaseException | None], BackendStats, tuple[int, int]]:
            rid = "abort-" + secrets.token_hex(2)
            receipts = [
                await slow.ep.send(
                    slow.peer, {"t": torch.ones(1 << 16, device=self.device)}, request_id=rid
                )
                for _ in range(3)
            ]
            await slow.ep.abort(rid, "test")
            ends: list[BaseException | None] = []
            for r in receipts:
                try:
                    await r.wait(30)
                    ends.append(None)
                except OmniwireError as exc:
                    ends.append(exc)
            with pytest.raises(OmniwireError):
                await slow.ep.send(
                    slow.peer, {"t": torch.ones(4, device=self.device)}, request_id=rid
                )
            mine, theirs = await slow.settled(self.backend)
            return ends, mine, theirs

        ends, mine, theirs = slow.call(run)
        assert any(isinstance(e, RequestAbortedError) for e in ends), ends
        assert mine.idle, f"{self.backend} still holds handles after abort: {mine}"
        assert theirs == (0, 0), f"the peer's {self.backend} holds handles after abort: {theirs}"

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
    async def _bare(self, backend_class: type[Any]) -> AsyncIterator[_Bare]:
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
                    return PeerInfo(
                        x.ctx.endpoint, x.ctx.instance, os.getpid(), "h", "t", locality, x.hello()
                    )

                pair = _Bare(a, b, peer(a), peer(b), self._export_device())
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


class _Bare:
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
