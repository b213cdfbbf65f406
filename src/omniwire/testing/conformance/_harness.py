"""The endpoint under test and its peer: a :class:`Harness` living in a blocking
portal's event loop, built by the fixtures of :class:`Configured`."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any, ClassVar

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ...backends.base import BackendStats
from ...endpoint import Endpoint
from ...peer import backend_stats
from ._support import PeerProcess, ipc_address, require_backend

__all__ = ["Configured", "Harness"]


class Harness:
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


class Configured:
    """What a subclass sets, and the fixtures every group of checks uses."""

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
    def harness(cls, backend_class: type[Any]) -> Iterator[Harness]:
        yield from cls._make_harness(mode="echo")

    @classmethod
    def _make_harness(cls, mode: str, **ep_kw: Any) -> Iterator[Harness]:
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
                    yield Harness(portal, ep, other, peer_ep)
            finally:
                if peer_ctx is not None:
                    peer_ctx.__exit__(None, None, None)
                if peer_proc is not None:
                    code = peer_proc.stop()
                    assert code == 0, f"peer process exited with {code}"

    @staticmethod
    async def _in_process_peer(ep: Endpoint, mode: str) -> None:
        from ...peer import _answer

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
