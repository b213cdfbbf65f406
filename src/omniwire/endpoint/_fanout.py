"""Fan-out: one payload to several targets, encoded once, packed once where it can be.

``send([a, b, c], payload)`` encodes the payload and plans its layout once, then
routes each target on its own: each gets its own route, credit, object id and
receipt. Targets whose route is a backend with ``Capabilities.shared_refs`` (shm,
mooncake, nixl) share one export — packed once, announced to each, released when the last of
them acknowledges (:class:`~._records.SharedExport`). Every other target gets an
export of its own from the same encoding (``local`` hands each target its own
containers, as for single sends). Shared objects are never announced in pieces.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio

from .. import codec, packing
from ..backends.base import ByteBackend
from ..delivery import SendReceipt
from ..routing import Route
from ._exporting import export_bytes
from ._records import Peer, SharedExport
from ._sender import Kind, Sender, payload_info

__all__ = ["FanOut", "check_targets"]


def check_targets(targets: Sequence[str]) -> list[str]:
    """The target names of a fan-out, checked.

    Raises:
        ValueError: no target, or one named twice. TypeError: a name is not a str.
    """
    names = list(targets)
    if not names:
        raise ValueError("send to several targets needs at least one target")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"target names must be str, not {type(name).__name__} ({name!r})")
    twice = sorted(n for n, k in Counter(names).items() if k > 1)
    if twice:
        raise ValueError(f"targets named more than once: {', '.join(map(repr, twice))}")
    return names


class FanOut:
    def __init__(self, sender: Sender) -> None:
        self.sender = sender

    async def send(
        self,
        targets: Sequence[str],
        payload: Any,
        request_id: str,
        kind: Kind,
        metadata: Any,
        lend: bool,
        traceparent: str,
    ) -> list[SendReceipt]:
        """Send ``payload`` to every target; the receipts, in target order.

        Raises: as ``Endpoint.send``, on the first target that fails (targets
        announced before it keep their data until their ACK).
        """
        sender, core = self.sender, self.sender.core
        names = check_targets(targets)
        core.check_open()
        if core.aborts.is_aborted(request_id):
            raise core.aborts.error(request_id)
        enc = codec.dumps(payload, allow_pickle=core.config.allow_pickle)
        meta = sender.metadata(metadata)
        layout = packing.plan(enc.tensors, enc.paths)
        info = payload_info(kind, enc.tensors, layout)
        with contextlib.ExitStack() as guards:
            for name in names:
                guards.enter_context(core.aborts.guard(request_id, name))
            deadline = time.monotonic() + core.config.handshake_timeout
            peers = [
                await sender.peers.wait_ready(name, max(0.0, deadline - time.monotonic()))
                for name in names
            ]
            routes = [sender.routes.select(peer, info) for peer in peers]
            sharing = self._shared_backends(routes)
            exports: dict[str, list[SharedExport]] = {}
            forwards: list[SharedExport] = []
            receipts: list[SendReceipt] = []
            try:
                for peer, route in zip(peers, routes, strict=True):
                    shared: SharedExport | None = None
                    if lend and sender.holds is not None:  # a delivery sent on: by reference
                        shared = await sender.holds.forwarded(peer, route, enc.tensors)
                        if shared is not None:
                            forwards.append(shared)
                    if shared is None and route.backend in sharing:
                        shared = self._shareable(peer, route, exports.get(route.backend, []))
                        if shared is None:
                            shared = await self._export(peer, route, enc, layout, lend)
                            exports.setdefault(route.backend, []).append(shared)
                    receipts.append(
                        await sender.send_routed(
                            peer,
                            route,
                            enc,
                            layout,
                            payload,
                            request_id,
                            kind,
                            meta,
                            lend,
                            traceparent,
                            shared,
                        )
                    )
            finally:
                for shared in (*(s for made in exports.values() for s in made), *forwards):
                    shared.drop()  # the fan-out's own hold: the last ACK releases the buffer
        return receipts

    async def end_stream(
        self,
        targets: Sequence[str],
        request_id: str,
        error: str | None,
        metadata: Any,
        traceparent: str,
    ) -> None:
        """End the stream on every target, concurrently (one that fails or waits for
        its handshake does not keep the others' streams open); then raise the first
        target's error, in target order."""
        names = check_targets(targets)
        failures: dict[str, Exception] = {}

        async def end(name: str) -> None:
            try:
                await self.sender.end_stream(name, request_id, error, metadata, traceparent)
            except Exception as exc:
                failures[name] = exc

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(end, name)
        for name in names:
            if name in failures:
                raise failures[name]

    def _shared_backends(self, routes: list[Route]) -> set[str]:
        """Backends that carry several of the targets and can share one export."""
        backends = self.sender.core.backends
        shared = set()
        for name, count in Counter(r.backend for r in routes).items():
            backend = backends.get(name)
            if (
                count > 1
                and isinstance(backend, ByteBackend)
                and type(backend).capabilities.shared_refs
            ):
                shared.add(name)
        return shared

    def _shareable(self, peer: Peer, route: Route, made: list[SharedExport]) -> SharedExport | None:
        """An export made for an earlier target that this one may be sent too (shm:
        a sealed segment only to a peer that reads them, spec §9.2), or None."""
        backend = self.sender.core.backends[route.backend]
        info = self.sender.peers.connected_backend(peer, route.backend)
        return next((s for s in made if backend.shares(s.export, info)), None)

    async def _export(
        self,
        peer: Peer,
        route: Route,
        enc: codec.Encoded,
        layout: packing.PackPlan,
        lend: bool,
    ) -> SharedExport:
        """One export for every target on ``route``, packed (once) in full."""
        backend = self.sender.core.backends[route.backend]
        assert isinstance(backend, ByteBackend)
        info = self.sender.peers.connected_backend(peer, route.backend)
        export, _ = await export_bytes(backend, info, enc.tensors, layout, lend=lend)
        if export.buffer is not None:
            self.sender.core.counters["bytes_packed"] += layout.nbytes
        return SharedExport(export)
