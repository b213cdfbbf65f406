"""The receiving side: one take path per object, one release path (spec §4.2, §7).

A DataReady becomes an :class:`~._records.InRecord` in its peer's inbox (data-less
messages — inline chunks, stream ends, errors — queue as they are, so order
holds). Items are taken in order by :meth:`Receiver.take`: read the object
(:mod:`._reading`: import, fetch as announced, rebuild), hand a :class:`~omniwire.delivery.Delivery` to the application, ACK. The
receive loop takes an item itself when nothing of it can wait (a small object
in mapped memory); otherwise a worker task drains the peer's inbox.
:meth:`Receiver.finish` is the one way an inbound object ends: import closed,
session entry removed, ACK or NACK (with its reason) posted once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import anyio

from .. import codec, packing, wire
from ..backends.base import ObjectBackend
from ..delivery import Delivery, DeliveryKind
from ..errors import (
    PeerLostError,
    WireFormatError,
)
from ._core import Core
from ._deliveries import Deliveries
from ._peers import PeerTable
from ._reading import ObjectReader, nack_of
from ._records import InRecord, Peer, PeerStatus

__all__ = ["Receiver"]

log = logging.getLogger("omniwire.endpoint")

_OPEN_STREAMS = 65536  # open streams remembered per peer


class Receiver:
    def __init__(self, core: Core, peers: PeerTable) -> None:
        self.core = core
        self.peers = peers
        cfg = core.config
        self.deliveries = Deliveries(core)
        self.budget = self.deliveries.budget
        self.reader = ObjectReader(core)
        self._inbox_limit = 4 * cfg.max_inflight + cfg.receive_buffer

    # -- frames in ---------------------------------------------------------------------

    def on_data_ready(self, peer: Peer, msg: wire.DataReadyMessage) -> bool:
        """Queue a DataReady; True if its peer's inbox can be taken from right now."""
        core = self.core
        ref = msg.data_ref
        record = None
        if ref is not None:
            ready = ref.ref.length if ref.ready is None else ref.ready
            record = InRecord(
                ref.object_id,
                msg.request_id,
                ref.ref.length,
                ready,
                msg=msg,
                ref=ref,
                generation=peer.generation,
            )
        peer.session.on_data_ready(msg, record)  # RemoteProtocolError: nothing changed
        core.aborts.note_peer(msg.request_id, peer.name)  # an abort of it must reach peer
        if core.aborts.is_aborted(msg.request_id):
            if record is not None:
                self.refuse(peer, record, "aborted", "request aborted")
            return False
        if record is not None and len(peer.inbox) >= self._inbox_limit:
            core.counters["inbox_full"] += 1
            self.refuse(peer, record, "queue_full", "receiver queue full")
            return False
        peer.inbox.append(record if record is not None else msg)
        return True

    def on_progress(self, peer: Peer, msg: wire.DataProgressMessage) -> None:
        record = peer.session.on_progress(msg)
        record.progressed.set()

    def on_ready(self, peer: Peer) -> None:
        """The peer became READY: what it sent before can be taken now."""
        if self.pump(peer):
            self.start_worker(peer)

    def pump(self, peer: Peer) -> bool:
        """Take, now, the data-less and inline messages at the head of ``peer``'s inbox
        (nothing of them waits). Returns True if the object then at the head can be taken
        without waiting too — the caller may ``await take_head(peer)`` — else a worker
        task takes the rest."""
        if peer.busy or peer.worker or peer.status is not PeerStatus.READY:
            return False
        inbox = peer.inbox
        while inbox and isinstance(head := inbox[0], wire.DataReadyMessage):
            inbox.popleft()
            msg = head
            peer.busy = True
            try:
                self.take_message(peer, msg)
            except Exception:  # a bug must not stop the peer's inbox
                self.core.counters["internal_errors"] += 1
                log.exception("%s: failed to take a message from %s", self.core.name, peer.name)
            finally:
                peer.busy = False
        if not inbox:
            return False
        head = inbox[0]
        if len(inbox) == 1 and (
            not isinstance(head, InRecord)
            or self.reader.fits_now(
                head, self.budget.would_admit(0 if self.core.config.zero_copy else head.length)
            )
        ):
            return True
        self.start_worker(peer)
        return False

    def start_worker(self, peer: Peer) -> None:
        if not peer.worker and not peer.busy and peer.inbox:
            peer.worker = True
            self.core.supervisor.spawn(self._drain, peer, peer.generation)

    async def take_head(self, peer: Peer) -> None:
        """Take the head of ``peer``'s inbox in the calling task (the receive loop)."""
        if peer.busy or peer.worker or not peer.inbox:
            return
        await self._take_next(peer)

    async def _drain(self, peer: Peer, generation: int) -> None:
        try:
            while peer.inbox and peer.generation == generation and peer.status is PeerStatus.READY:
                await self._take_next(peer)
        finally:
            peer.worker = False

    async def _take_next(self, peer: Peer) -> None:
        item = peer.inbox.popleft()
        peer.busy = True
        try:
            await self.take(peer, item)
        except Exception as exc:  # a bug must not stop the peer's inbox
            self.core.counters["internal_errors"] += 1
            log.exception("%s: failed to take data from %s", self.core.name, peer.name)
            if isinstance(item, InRecord):
                self.finish(peer, item, "internal", f"receiver error: {type(exc).__name__}")
        finally:
            peer.busy = False

    # -- the take path -----------------------------------------------------------------

    async def take(self, peer: Peer, item: InRecord | wire.DataReadyMessage) -> None:
        """Take one inbox item: a message at once, an object through its backend."""
        if isinstance(item, wire.DataReadyMessage):
            self.take_message(peer, item)
            return
        msg = item.msg
        if item.refusal is not None:
            await self.reader.consume(peer, item)
            self.finish(peer, item, *item.refusal)
            return
        if self.core.aborts.is_aborted(msg.request_id):
            self.finish(peer, item, "aborted", "request aborted")
            return
        ok, metadata = self._metadata(peer, msg, item)
        if not ok:
            return
        await self._take_object(peer, item, metadata)
        self._ended(peer, msg, metadata)

    def take_message(self, peer: Peer, msg: wire.DataReadyMessage) -> None:
        """Take a data-less or inline DataReady (nothing of it waits)."""
        if self.core.aborts.is_aborted(msg.request_id):
            return
        ok, metadata = self._metadata(peer, msg, None)
        if not ok:
            return
        if msg.error is not None:
            peer.open_streams.pop(msg.request_id, None)
            self._deliver(_error(peer, msg, msg.error, metadata))
        elif msg.inline is not None:
            self._take_inline(peer, msg, msg.inline, metadata)
        self._ended(peer, msg, metadata)

    def _metadata(
        self, peer: Peer, msg: wire.DataReadyMessage, record: InRecord | None
    ) -> tuple[bool, Any]:
        """The message's metadata; on a bad one the object is NACKed, an error
        delivered, and ``(False, None)`` returned."""
        if not msg.metadata:
            return True, None
        try:
            return True, codec.loads(msg.metadata, [])
        except WireFormatError as exc:
            if record is not None:
                self.finish(peer, record, "malformed", f"bad metadata: {exc}")
            self._deliver(_error(peer, msg, str(exc)))
            return False, None

    def _ended(self, peer: Peer, msg: wire.DataReadyMessage, metadata: Any) -> None:
        if msg.is_done:
            peer.open_streams.pop(msg.request_id, None)
            self._deliver(
                Delivery(
                    "stream_end",
                    msg.request_id,
                    peer.name,
                    msg.chunk_id,
                    metadata=metadata,
                    traceparent=msg.traceparent,
                )
            )

    def _take_inline(
        self,
        peer: Peer,
        msg: wire.DataReadyMessage,
        inline: wire.InlineStreamChunkRef,
        metadata: Any,
    ) -> None:
        try:
            tensors = packing.unpack_inline(inline)
            value = codec.loads(inline.header, tensors, allow_pickle=self.core.config.allow_pickle)
        except WireFormatError as exc:
            self.core.counters["decode_errors"] += 1
            self._deliver(_error(peer, msg, str(exc)))
            return
        nbytes = sum(t.nbytes for t in inline.tensors)
        self._deliver(_data(peer, msg, inline.kind, value, metadata, "inline", nbytes))

    async def _take_object(self, peer: Peer, record: InRecord, metadata: Any) -> None:
        msg, ref = record.msg, record.ref
        backend = self.core.backends.get(ref.backend)
        info = peer.info.get(ref.backend)
        if backend is None or info is None or ref.layout not in type(backend).capabilities.layouts:
            why = (
                f"backend {ref.backend!r} is not running on {self.core.name!r} for {peer.name!r}"
                if backend is None or info is None
                else f"backend {ref.backend!r} does not use layout {ref.layout!r} (§9)"
            )
            self.finish(peer, record, "unsupported", why)
            self._deliver(_error(peer, msg, why))
            return
        zero_copy = self.core.config.zero_copy
        budget = 0 if zero_copy else ref.ref.length
        value: Any = None
        taken = False  # fetched: the budget share is held
        failure: tuple[wire.NackReason, str] | None = None
        with anyio.CancelScope() as scope:
            peer.current_take = (msg.request_id, scope)
            try:
                await self.budget.acquire(budget)
                try:
                    value = await self.reader.read(peer, backend, info, record)
                    taken = True
                except BaseException:
                    self.budget.release(budget)
                    raise
            except Exception as exc:
                failure = nack_of(exc)
                if failure is None:
                    raise
            finally:
                peer.current_take = None
        aborted = self.core.aborts.is_aborted(msg.request_id)
        if scope.cancel_called or aborted:  # aborted, the peer is gone, or we are closing
            if taken:
                self.budget.release(budget)  # taken, but it will not be delivered
            reason: wire.NackReason = "aborted" if aborted else "receiver_closed"
            self.finish(peer, record, reason, reason.replace("_", " "))
            return
        if failure is not None:
            self.core.counters["receive_errors"] += 1
            self.core.noisy.warning(
                "take",
                "%s: cannot take object %d from %s: %s",
                self.core.name,
                ref.object_id,
                peer.name,
                failure[1],
            )
            self.finish(peer, record, *failure)
            self._deliver(_error(peer, msg, failure[1], metadata, ref.backend))
            return
        delivery = _data(peer, msg, ref.kind, value, metadata, ref.backend, ref.ref.length)
        delivery._budget = budget
        if zero_copy and not isinstance(backend, ObjectBackend):
            record.lent = True
            delivery._on_release = lambda: self._released(peer, record)
            self._deliver(delivery)
        else:
            self._deliver(delivery)
            self.finish(peer, record)

    # -- the release path --------------------------------------------------------------

    def refuse(self, peer: Peer, record: InRecord, reason: wire.NackReason, text: str) -> None:
        """Refuse an announced object. A two-sided engine's object still goes through
        the take path (in order); any other is NACKed now."""
        backend = self.core.backends.get(record.ref.backend)
        if backend is not None and type(backend).capabilities.two_sided and not record.finished:
            record.refusal = (reason, text)
            if record not in peer.inbox:
                peer.inbox.append(record)
            if peer.status is PeerStatus.READY:
                self.start_worker(peer)
            return
        if record in peer.inbox:
            peer.inbox.remove(record)
        self.finish(peer, record, reason, text)

    def finish(
        self, peer: Peer, record: InRecord, reason: wire.NackReason | None = None, text: str = ""
    ) -> None:
        """End an inbound object: close its import, forget it, ACK or NACK it. Once."""
        if record.finished:
            return
        record.finished = True
        if peer.session.inbound.get(record.object_id) is record:
            del peer.session.inbound[record.object_id]
        if record.imp is not None:
            record.imp.close()
        if record.orphaned or peer.generation != record.generation:
            return  # the peer is gone: nobody to acknowledge to
        core = self.core
        msg = wire.DataAckMessage(
            object_id=record.object_id,
            from_stage=core.name,
            to_stage=peer.name,
            success=reason is None,
            error=text[: wire.MAX_TEXT_BYTES // 4] if reason is not None else None,
            reason=reason,
        )
        core.counters["acks_sent" if reason is None else "nacks_sent"] += 1
        core.outbox.post(peer, msg)

    def _released(self, peer: Peer, record: InRecord) -> None:
        """A zero-copy delivery was released (from any thread)."""
        if threading.get_ident() != self.core.loop_thread:
            loop = self.core.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._released, peer, record)
            return
        aborted = self.core.aborts.is_aborted(record.request_id)
        self.finish(
            peer, record, "aborted" if aborted else None, "request aborted" if aborted else ""
        )

    # -- deliveries ----------------------------------------------------------------------

    def _deliver(self, delivery: Delivery) -> None:
        observer = self.core.observer
        if observer is not None:
            observer.delivered(self.core.name, delivery)
        self.deliveries.put(delivery)

    # -- aborts, loss, close -------------------------------------------------------------

    def on_abort(
        self, request_id: str, origin: str, reason: str, *, notify: bool, via: str = ""
    ) -> None:
        for peer in self.peers.all():
            for item in [i for i in peer.inbox if _rid(i) == request_id]:
                if isinstance(item, InRecord):
                    self.refuse(peer, item, "aborted", "request aborted")
                else:
                    peer.inbox.remove(item)
            if peer.current_take is not None and peer.current_take[0] == request_id:
                peer.current_take[1].cancel()
            peer.open_streams.pop(request_id, None)
        self.deliveries.drop(request_id)  # a zero-copy one NACKs "aborted" (the id is remembered)
        if notify:
            self._deliver(Delivery("aborted", request_id, origin, error=reason or None, via=via))

    def on_peer_gone(
        self, peer: Peer, records: list[InRecord], cause: str, error: PeerLostError
    ) -> None:
        """The peer died or closed: drop what it sent, and tell the application which of
        its requests were cut short."""
        cut: dict[str, None] = dict.fromkeys(peer.open_streams)
        for item in peer.inbox:
            cut.setdefault(_rid(item), None)
        for record in records:
            record.orphaned = True
            if not record.lent:
                cut.setdefault(record.request_id, None)
                self.finish(peer, record)
        peer.inbox.clear()
        peer.open_streams.clear()
        if peer.current_take is not None:
            peer.current_take[1].cancel()
        for rid in cut:
            if not self.core.aborts.is_aborted(rid):
                self._deliver(Delivery("error", rid, peer.name, error=str(error), cause=cause))

    def close(self) -> None:
        for peer in self.peers.all():
            for record in list(peer.session.inbound.values()):
                if record.lent:
                    record.orphaned = True  # released after our Goodbye: no ACK then
                else:
                    if record in peer.inbox:
                        peer.inbox.remove(record)
                    self.finish(peer, record, "receiver_closed", "receiver closed")
            peer.inbox.clear()
            if peer.current_take is not None:
                peer.current_take[1].cancel()
        self.deliveries.close()
        self.reader.close()

    def in_flight(self) -> dict[str, int]:
        return {p.name: len(p.session.inbound) for p in self.peers.all()}


def _rid(item: InRecord | wire.DataReadyMessage) -> str:
    return item.request_id


def _data(
    peer: Peer,
    msg: wire.DataReadyMessage,
    kind: str,
    value: Any,
    metadata: Any,
    backend: str,
    nbytes: int,
) -> Delivery:
    """A payload or stream chunk for the application (a chunk opens its stream)."""
    delivered: DeliveryKind = "payload" if kind == "payload" else "stream_chunk"
    if delivered == "stream_chunk":
        streams = peer.open_streams
        streams[msg.request_id] = None
        if len(streams) > _OPEN_STREAMS:
            streams.popitem(last=False)
    return Delivery(
        delivered,
        msg.request_id,
        peer.name,
        msg.chunk_id,
        value,
        metadata,
        backend=backend,
        nbytes=nbytes,
        traceparent=msg.traceparent,
    )


def _error(
    peer: Peer,
    msg: wire.DataReadyMessage,
    error: str,
    metadata: Any = None,
    backend: str | None = None,
) -> Delivery:
    """An ``error`` delivery: a message of ``peer`` could not be taken."""
    return Delivery(
        "error",
        msg.request_id,
        peer.name,
        msg.chunk_id,
        metadata=metadata,
        error=error,
        backend=backend,
        traceparent=msg.traceparent,
    )
