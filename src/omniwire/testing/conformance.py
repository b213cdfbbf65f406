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
- ACK and release: after round trips nothing is left in flight and the backend
  holds no buffer (its ``stats()`` counters return to zero);
- credits: a slow consumer makes the sender wait; nothing is dropped;
- abort: an aborted request's sends fail and its buffers are released on both sides;
- close semantics and error mapping on bare backend instances: a closed backend
  refuses work with ``BackendClosedError``; a malformed or foreign reference is a
  ``BackendError``, never a crash.

A backend that cannot run here is skipped with its reason — or fails, when
``OMNIWIRE_REQUIRE_ENGINES=1`` (CI sets it), unless the backend needs a GPU
(``needs_gpu = True`` on its class) and none is present.

Needs the ``test`` extra (pytest, hypothesis).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings

from .. import registry
from ..backends.base import (
    BackendContext,
    BackendStats,
    ByteBackend,
    Locality,
    ObjectBackend,
    PeerInfo,
)
from ..endpoint import Endpoint
from ..errors import BackendClosedError, BackendError, RequestAbortedError
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
    """The endpoint under test, living in a portal's event loop, and its peer."""

    def __init__(self, portal: BlockingPortal, endpoint: Endpoint, peer: str) -> None:
        self.portal = portal
        self.ep = endpoint
        self.peer = peer

    def call(self, fn: Any, *args: Any) -> Any:
        return self.portal.call(fn, *args)

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
                    yield _Harness(portal, ep, other)
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

        async def settled() -> tuple[dict[str, tuple[int, int]], BackendStats]:
            with anyio.fail_after(30):
                await harness.ep.drain()
                while any(a or b for a, b in harness.ep.in_flight().values()):
                    await anyio.sleep(0.05)
            return harness.ep.in_flight(), harness.ep.backend(self.backend).stats()

        in_flight, stats = harness.call(settled)
        assert all(v == (0, 0) for v in in_flight.values()), in_flight
        assert stats.idle, f"{self.backend} still holds buffers: {stats}"

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
        async def run() -> tuple[list[BaseException | None], BackendStats]:
            rid = "abort-" + secrets.token_hex(2)
            receipts = [
                await slow.ep.send(
                    slow.peer, {"t": torch.ones(1 << 16, device=self.device)}, request_id=rid
                )
                for _ in range(2)
            ]
            await slow.ep.abort(rid, "test")
            errors: list[BaseException | None] = []
            for r in receipts:
                try:
                    await r.wait(30)
                    errors.append(None)
                except RequestAbortedError as exc:
                    errors.append(exc)
            with anyio.fail_after(30):
                while slow.ep.in_flight()[slow.peer] != (0, 0):
                    await anyio.sleep(0.05)
            with pytest.raises(RequestAbortedError):
                await slow.ep.send(
                    slow.peer, {"t": torch.ones(4, device=self.device)}, request_id=rid
                )
            return errors, slow.ep.backend(self.backend).stats()

        errors, stats = slow.call(run)
        assert any(isinstance(e, RequestAbortedError) for e in errors)
        assert stats.idle, f"{self.backend} still holds buffers after abort: {stats}"

    # -- bare backend instances: close semantics, error mapping ---------------------------

    def _ctx(self, name: str) -> BackendContext:
        return BackendContext(
            endpoint=name,
            instance=secrets.randbits(32),
            options=self.backend_options.get(self.backend, {}),
        )

    def test_closed_backend_refuses_work(self, backend_class: type[Any]) -> None:
        async def run() -> None:
            b = backend_class(self._ctx("closing"))
            await b.start()
            await b.aclose()
            await b.aclose()  # idempotent
            peer = PeerInfo("x", 1, os.getpid(), "h", "t", Locality.SAME_HOST, b.hello())
            with pytest.raises(BackendClosedError):
                if isinstance(b, ByteBackend):
                    await b.export(peer, 64, "cpu")
                elif isinstance(b, ObjectBackend):
                    b.export_object(peer, {"x": 1})

        anyio.run(run)

    @pytest.mark.parametrize(
        "info", [b"", b"\xc1garbage", b"\x93\xa1x\x00\x00", bytes(range(64))], ids=str
    )
    def test_bad_references_are_backend_errors(self, backend_class: type[Any], info: bytes) -> None:
        async def run() -> None:
            a = backend_class(self._ctx("a"))
            b = backend_class(self._ctx("b"))
            await a.start()
            await b.start()
            try:
                peer_a = PeerInfo(
                    "a", a.ctx.instance, os.getpid(), "h", "t", Locality.SAME_HOST, a.hello()
                )
                await b.connect(peer_a)
                with pytest.raises(BackendError):
                    imp = await b.import_(peer_a, info, 64)
                    await imp.fetch(0, 64)
            finally:
                await a.aclose()
                await b.aclose()

        anyio.run(run)

    def test_declares_valid_capabilities(self, backend_class: type[Any]) -> None:
        caps = backend_class.capabilities
        assert caps.devices and caps.localities
        assert isinstance(backend_class.availability().available, bool)
        assert backend_class.name == self.backend
