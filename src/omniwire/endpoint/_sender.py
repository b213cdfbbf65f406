"""The sending side: encode → route → credit → export/pack → announce (spec §4.2, §7).

Each object gets one :class:`~._records.OutRecord` the moment it takes a credit.
Until its DataReady is posted the send owns it (a failure releases it at once);
after that only the peer's ACK/NACK, the peer's loss or the endpoint's close
release it — the peer may be reading the buffer. An ACK timeout or an abort
settles the receipt early but leaves the buffer reserved until then.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import anyio
import msgspec
import torch

from .. import codec, hops, packing, wire
from ..backends.base import ByteBackend, Export, ObjectBackend
from ..delivery import SendReceipt
from ..digest import digest_of_async
from ..errors import (
    AckTimeoutError,
    EndpointClosedError,
    FrameTooLargeError,
)
from ..flow import Credits, Window
from ..routing import INLINE, Route
from ._buffers import Buffers
from ._core import Core
from ._exporting import export_bytes, publish_rest
from ._holds import Holds
from ._inline import Kind, carried_inline, fit, inline_message, payload_info, unaccount
from ._ledger import Ledger
from ._peers import PeerTable
from ._records import QUIET, READY, OutRecord, Peer, PeerStatus, SharedExport
from ._routebook import RouteBook
from ._stats import RouteStats

__all__ = ["Kind", "Sender", "payload_info"]

log = logging.getLogger("omniwire.endpoint")
route_log = logging.getLogger("omniwire.route")


class Sender:
    def __init__(self, core: Core, peers: PeerTable, trace: bool = False) -> None:
        self.core = core
        self.peers = peers
        self.routes = RouteBook(core, trace)
        #: per (peer, kind, backend): what went that way (the book's, kept in place)
        self.route_stats = self.routes.stats
        self._ids = itertools.count(1)
        #: tensors born in transport memory (``Endpoint.empty``)
        self.buffers = Buffers(core, peers, self.routes)
        #: the receiver's zero-copy deliveries, for forwards by reference (set by the
        #: endpoint; None: nothing is forwarded)
        self.holds: Holds | None = None
        #: what is in flight: ACKs, NACKs, deadlines, aborts, loss, drain
        self.ledger = Ledger(core, peers)

    # -- the API ---------------------------------------------------------------------

    async def send(
        self,
        target: str,
        payload: Any,
        request_id: str,
        kind: Kind,
        metadata: Any,
        lend: bool,
        traceparent: str = "",
    ) -> SendReceipt:
        core = self.core
        core.check_open()
        if core.aborts.is_aborted(request_id):
            raise core.aborts.error(request_id)
        enc = codec.dumps(payload, allow_pickle=core.config.allow_pickle)
        meta = self.metadata(metadata)
        peer = self.peers.get(target)
        ready: tuple[Peer, packing.PackPlan, Route] | None = None
        if peer is not None and peer.status is READY:
            # The fast path: a small payload to a ready peer with room in its queue waits
            # for nothing, so it needs no guard and no trip around the event loop.
            layout = packing.plan(enc.tensors, enc.paths)
            route = self.routes.route_of(peer, kind, enc.tensors, layout)
            ready = (peer, layout, route)
            if route.backend == INLINE.name and core.outbox.has_room(peer):
                stats, msg, charge = self._inline(
                    peer, route, enc, layout, request_id, kind, meta, traceparent
                )
                if peer.window.try_acquire(charge):
                    core.outbox.post(peer, msg, charge)  # room in its queue: no wait
                    return carried_inline(peer, request_id, layout, stats)
                with core.aborts.guard(request_id, target):
                    msg = await self._inline_window(peer, msg, kind, charge)
                    await core.outbox.send(peer, msg, core.config.ack_timeout, charge)
                return carried_inline(peer, request_id, layout, stats)
        with core.aborts.guard(request_id, target):
            peer = await self.peers.wait_ready(target, core.config.handshake_timeout)
            if ready is not None and ready[0] is peer:  # still the session it was routed for
                layout, route = ready[1], ready[2]
            else:
                layout = packing.plan(enc.tensors, enc.paths)
                route = self.routes.route_of(peer, kind, enc.tensors, layout)
            born = self.buffers.of(enc.tensors)
            shared = forward = None
            if born is not None:
                lend = lend or born.backend is None  # ordinary memory: lent to the engine
                shared = born.shared_for(route.backend)  # BufferReleasedError; None: packed
                if shared is not None and not core.backends[route.backend].shares(
                    shared.export, self.peers.connected_backend(peer, route.backend)
                ):
                    shared = None  # a form this peer cannot read (shm §9.2): packed
            elif lend and self.holds is not None:
                shared = forward = await self.holds.forwarded(peer, route, enc.tensors)
            try:
                receipt = await self.send_routed(
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
            finally:
                if forward is not None:
                    forward.drop()  # ours: the send's share holds it until its ACK
            if born is not None:
                born.sent(receipt)
            return receipt

    async def send_routed(
        self,
        peer: Peer,
        route: Route,
        enc: codec.Encoded,
        layout: packing.PackPlan,
        payload: Any,
        request_id: str,
        kind: Kind,
        meta: bytes,
        lend: bool,
        traceparent: str,
        shared: SharedExport | None = None,
    ) -> SendReceipt:
        """Send an encoded payload to a ready peer on its route (also one target of a
        fan-out, which passes the ``shared`` export it packed once)."""
        if route.backend == INLINE.name:  # may wait for its window and room in the queue
            stats, msg, charge = self._inline(
                peer, route, enc, layout, request_id, kind, meta, traceparent
            )
            msg = await self._inline_window(peer, msg, kind, charge)
            await self.core.outbox.send(peer, msg, self.core.config.ack_timeout, charge)
            return carried_inline(peer, request_id, layout, stats)
        stats, chunk_id = self._account(peer, route, request_id, kind)
        return await self._send_object(
            peer,
            route,
            enc,
            layout,
            payload,
            request_id,
            kind,
            chunk_id,
            meta,
            stats,
            lend,
            traceparent,
            shared,
        )

    async def end_stream(
        self, target: str, request_id: str, error: str | None, metadata: Any, traceparent: str = ""
    ) -> None:
        core = self.core
        core.check_open()
        meta = self.metadata(metadata)
        with core.aborts.guard(request_id, target):
            peer = await self.peers.wait_ready(target, core.config.handshake_timeout)
            core.aborts.note_peer(request_id, target)
            msg = wire.DataReadyMessage(
                request_id=request_id,
                from_stage=core.name,
                to_stage=target,
                chunk_id=peer.chunk_ids.get(request_id, 0),
                is_done=True,
                error=error,
                metadata=meta,
                traceparent=traceparent,
            )
            charge = fit(msg)
            await self._window(peer, charge)
            # its chunk id as it leaves: a chunk another task sent while it waited is
            # still before it (and one that never leaves ends nothing)
            chunk_id = peer.chunk_ids.pop(request_id, 0)
            if chunk_id != msg.chunk_id:
                msg = msgspec.structs.replace(msg, chunk_id=chunk_id)
            await core.outbox.send(peer, msg, core.config.ack_timeout, charge)

    def metadata(self, metadata: Any) -> bytes:
        if metadata is None:
            return b""
        if type(metadata) is dict and (header := codec.scalars_header(metadata)) is not None:
            return header  # the usual metadata: str keys, plain scalars
        enc = codec.dumps(metadata, allow_pickle=self.core.config.allow_pickle, root="metadata")
        if enc.tensors:
            raise TypeError(f"metadata cannot hold tensors (found {enc.paths[0]})")
        return enc.header

    def route(self, target: str, payload: Any, kind: Kind) -> Route:
        peer = self.peers.get(target)
        if peer is None or peer.edge is None or peer.status is not PeerStatus.READY:
            from ..errors import HandshakeError

            raise HandshakeError(f"no completed handshake with {target!r}")
        enc = codec.dumps(payload, allow_pickle=self.core.config.allow_pickle)
        return self.routes.select(peer, payload_info(kind, enc.tensors, packing.plan(enc.tensors)))

    def _account(
        self, peer: Peer, route: Route, request_id: str, kind: Kind
    ) -> tuple[RouteStats, int]:
        """Note that ``peer`` gets data of the request (an abort must reach it); the
        route's statistics and the chunk's position in its stream."""
        self.core.aborts.note_peer(request_id, peer.name)
        chunk_id = 0
        if kind == "stream_chunk":
            chunk_id = peer.chunk_ids.get(request_id, 0)
            peer.chunk_ids[request_id] = chunk_id + 1
        return self.routes.stats_of(peer.name, kind, route), chunk_id

    # -- inline ------------------------------------------------------------------------

    def _inline(
        self,
        peer: Peer,
        route: Route,
        enc: codec.Encoded,
        layout: packing.PackPlan,
        request_id: str,
        kind: Kind,
        meta: bytes,
        traceparent: str,
    ) -> tuple[RouteStats, wire.DataReadyMessage, int]:
        """The inline DataReady of a payload, accounted to its route and stream, and its
        charge (spec §7.6).

        Raises:
            FrameTooLargeError: it would not fit in a frame (nothing was accounted).
        """
        stats, chunk_id = self._account(peer, route, request_id, kind)
        try:
            msg, charge = inline_message(
                self.core.name, peer, enc, layout, request_id, kind, chunk_id, meta, traceparent
            )
        except FrameTooLargeError:
            if kind == "stream_chunk":
                unaccount(peer, request_id, chunk_id)
            raise
        return stats, msg, charge

    async def _inline_window(
        self, peer: Peer, msg: wire.DataReadyMessage, kind: Kind, charge: int
    ) -> wire.DataReadyMessage:
        """:meth:`_window` for an inline message just accounted to its stream; returns
        the message to post at once. A stream chunk gives its chunk id back while it
        waits and takes the stream's next one when the window lets it go: whichever
        task's chunk the window lets go first, a stream's chunks leave in id order, and
        one that never goes (timeout, abort, cancellation) leaves no gap."""
        if kind != "stream_chunk":
            await self._window(peer, charge)
            return msg
        rid = msg.request_id
        unaccount(peer, rid, msg.chunk_id)
        await self._window(peer, charge)
        chunk_id = peer.chunk_ids.get(rid, 0)
        peer.chunk_ids[rid] = chunk_id + 1
        return msg if chunk_id == msg.chunk_id else msgspec.structs.replace(msg, chunk_id=chunk_id)

    async def _window(self, peer: Peer, charge: int) -> None:
        """Take ``charge`` of the peer's window (spec §7.6), waiting while its
        application has not taken what we sent before (:meth:`_wait`)."""
        if not peer.window.try_acquire(charge):
            await self._wait(peer, peer.window, charge)

    async def _wait(self, peer: Peer, budget: Window | Credits, nbytes: int) -> None:
        """Wait for ``nbytes`` of the peer's window or credits, counted (``window_waits``,
        ``credit_waits``), for as long as the peer gives something back at least every
        ``ack_timeout`` seconds (a consumer that is slow but takes is not a dead one).

        Raises:
            AckTimeoutError: nothing came back for ``ack_timeout`` seconds (it says
                what came back before, and when).
        """
        core = self.core
        window = isinstance(budget, Window)
        core.counters["window_waits" if window else "credit_waits"] += 1
        timeout = core.config.ack_timeout
        started = time.monotonic()
        acquired = await budget.acquire(nbytes, patience=timeout)
        if core.observer is not None:
            told = core.observer.window_waited if window else core.observer.credit_waited
            told(core.name, peer.name, time.monotonic() - started)
        if not acquired:
            if window:
                self.ledger.missed(peer, "window")  # PeerUnresponsiveError
            raise AckTimeoutError(f"{peer.name!r} {budget.stalled(timeout)}")

    # -- objects -----------------------------------------------------------------------

    async def _send_object(
        self,
        peer: Peer,
        route: Route,
        enc: codec.Encoded,
        layout: packing.PackPlan,
        payload: Any,
        request_id: str,
        kind: Kind,
        chunk_id: int,
        meta: bytes,
        stats: RouteStats,
        lend: bool,
        traceparent: str,
        shared: SharedExport | None,
    ) -> SendReceipt:
        hops.mark("send: object path")
        core = self.core
        backend = core.backends[route.backend]
        info = self.peers.connected_backend(peer, route.backend)
        nbytes = layout.nbytes
        record = OutRecord(
            next(self._ids),
            request_id,
            nbytes,
            nbytes,
            peer=peer,
            generation=peer.generation,
            receipt=SendReceipt(peer.name, request_id, None, route.backend, nbytes),
            stats=stats,
        )
        record.receipt.object_id = record.object_id
        posted = landed = False
        try:
            await self._credit(peer, record)  # AckTimeoutError, cancellation: not sent
            if isinstance(backend, ObjectBackend):
                record.export = backend.export_object(info, payload)
                points = [nbytes]
            elif shared is None:
                assert isinstance(backend, ByteBackend)
                record.export, points = await export_bytes(
                    backend,
                    info,
                    enc.tensors,
                    layout,
                    lend=lend,
                    piece=self._piece(peer, backend, info, nbytes),
                )
                if record.export.buffer is not None:
                    core.counters["bytes_packed"] += nbytes  # packed by now, or piece by piece
            else:  # a fan-out packed it once, or a transport buffer: one buffer for all
                record.export = shared.share()
                points = [nbytes]
            assert record.export is not None
            if (
                points[0] == nbytes
                and record.export.layout == "packed"
                and isinstance(backend, ByteBackend)
            ):  # written into the peer's landing: its receipt completes when announced
                source = shared.export if shared is not None else record.export
                assert isinstance(source, Export)
                moved = await backend.land(info, source)
                if moved is not None:
                    replaced, record.export, landed = record.export, moved, True
                    replaced.release()  # (a share: the others still read the buffer)
            hops.mark("send: export ready (packed or registered)")
            digest = None
            hello = peer.hello
            if core.config.digest and record.export.layout != "object" and hello is not None:
                digest = await digest_of_async(enc.tensors) if "digest" in hello.features else None
            ref = wire.DataRef(
                object_id=record.object_id,
                kind=kind,
                backend=backend.name,
                layout=record.export.layout,
                ref=wire.BackendRef(backend=backend.name, info=record.export.ref, length=nbytes),
                header=enc.header if record.export.layout != "object" else b"",
                tensors=layout.metas if record.export.layout != "object" else (),
                ready=points[0] if points[0] < nbytes else None,
                digest=digest,
            )
            msg = wire.DataReadyMessage(
                request_id=request_id,
                from_stage=core.name,
                to_stage=peer.name,
                chunk_id=chunk_id,
                data_ref=ref,
                metadata=meta,
                traceparent=traceparent,
            )
            charge = fit(msg)
            # publish and announce under the peer's lock: a two-sided engine pairs sends
            # and receives in announce order.
            async with _locked(peer.send_lock):
                await self._window(peer, charge)
                window = peer.window
                try:
                    self._check_peer(peer, record)
                    record.ready = points[0]
                    peer.session.announce(record)
                    try:
                        if record.export.layout == "packed":
                            await record.export.publish(0, points[0])
                        record.deadline = time.monotonic() + core.config.ack_timeout
                        core.outbox.post(peer, msg, charge)
                        posted = True
                        hops.mark("send: announced")
                    finally:
                        if not posted:
                            peer.session.forget_outbound(record.object_id)
                finally:
                    if not posted:
                        window.reopen(charge)  # never sent: the charge is ours again
        except BaseException as exc:
            if not posted:
                record.release(_as_error(exc, peer), "not sent")
                if kind == "stream_chunk":
                    unaccount(peer, request_id, chunk_id)
            raise
        stats.count += 1
        backend.note_sent(nbytes)
        stats.nbytes += nbytes
        if landed:
            self._land(peer, record, stats)
        if len(points) > 1:
            await self._publish_rest(peer, record, enc.tensors, layout, points)
        return record.receipt

    def _land(self, peer: Peer, record: OutRecord, stats: RouteStats) -> None:
        """An object written into the peer's landing and announced: its receipt completes
        now (its bytes are in the peer's memory, its announce goes until the peer has
        it) — unless the peer has been quiet for ``QUIET``: it may have ended the session
        unseen, and would drop the announce; then once it acknowledged the announce's
        frame (spec §10.7). A session that ends first fails the object as lost."""
        resumption = peer.session.resumption
        receipt = record.receipt
        if resumption is not None and time.monotonic() - peer.heard_at >= QUIET:
            seq = self.core.outbox.numbered_through(peer)
            self.core.counters["landings_confirmed"] += 1

            def confirmed() -> None:
                if not receipt.done():
                    receipt.land()

            resumption.when_acked(seq, confirmed)
            return
        receipt.land()
        if receipt.latency is not None:
            stats.latencies.append(receipt.latency)

    async def _publish_rest(
        self,
        peer: Peer,
        record: OutRecord,
        tensors: list[torch.Tensor],
        layout: packing.PackPlan,
        points: list[int],
    ) -> None:
        """:func:`publish_rest` of an announced object, in a task of its own: it is
        finished whatever its caller does (a bounded copy, piece by piece, that stops
        at a NACK or a lost peer). Left half-published by a cancelled caller — an
        anyio scope or a plain ``Task.cancel()`` — it held its receiver's take, and
        every later object of the peer, until ``ack_timeout``, and counted as a
        missed ACK against a healthy peer."""
        failure: list[Exception] = []
        done = anyio.Event()

        async def publish() -> None:
            try:
                await publish_rest(self.core, peer, record, tensors, layout, points)
            except Exception as exc:
                failure.append(exc)
            finally:
                done.set()

        if not self.core.supervisor.spawn(publish):  # closing: no background task
            await publish_rest(self.core, peer, record, tensors, layout, points)
            return
        await done.wait()
        if failure:
            raise failure[0]

    async def _credit(self, peer: Peer, record: OutRecord) -> None:
        if not peer.credits.try_acquire(record.length):
            await self._wait(peer, peer.credits, record.length)
        record.credits = peer.credits

    def _piece(self, peer: Peer, backend: ByteBackend, info: Any, nbytes: int) -> int:
        """The progressive piece size of an object of ``nbytes`` for ``peer`` on
        ``backend`` (0: in one piece)."""
        hello = peer.hello
        chunk = self.core.config.progressive_chunk
        if (
            not chunk
            or nbytes <= chunk
            or not type(backend).capabilities.progressive
            or "zero_copy" in (hello.features if hello else ())
        ):  # a zero-copy receiver copies nothing: announcing in pieces buys nothing
            return 0
        if backend.can_land(info, nbytes):
            # packed whole and written into the peer's landing: between two namespace
            # hosts a 64 MiB object went 2.4x faster with nixl (its WRITE beats its
            # READ) and no slower with mooncake than read in pieces
            return 0
        return chunk

    def _check_peer(self, peer: Peer, record: OutRecord) -> None:
        if peer.status is not PeerStatus.READY or peer.generation != record.generation:
            raise self.peers.gone_error(peer)

    def forget(self, name: str) -> None:
        """The peer table forgot the gone peer ``name``: so do its route statistics
        (a stage whose peers come and go under new names keeps those of the peers it
        remembers, not of every peer it ever served)."""
        self.routes.forget(name)


def _as_error(exc: BaseException, peer: Peer) -> BaseException | None:
    """The error a receipt reports for a send that failed before its announce."""
    return (
        exc
        if isinstance(exc, Exception)
        else EndpointClosedError(f"send to {peer.name!r} cancelled")
    )


class _locked:
    """``async with lock`` without anyio's scheduling checkpoint when it is free: an
    uncontended send must not cost a trip around the event loop."""

    __slots__ = ("lock",)

    def __init__(self, lock: anyio.Lock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        try:
            self.lock.acquire_nowait()
        except anyio.WouldBlock:
            await self.lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()
