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

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from .. import codec, hops, packing, wire
from ..backends.base import ObjectBackend
from ..delivery import Delivery, DeliveryKind
from ..errors import (
    PeerLostError,
    WireFormatError,
    described,
)
from ..flow import ReceiveWindow
from ._core import Core
from ._deliveries import Deliveries
from ._holds import Holds
from ._peers import PeerTable
from ._reading import ObjectReader, Share, nack_of
from ._records import READY, InRecord, Peer, PeerStatus

__all__ = ["Receiver"]

log = logging.getLogger("omniwire.endpoint")


class Receiver:
    def __init__(self, core: Core, peers: PeerTable) -> None:
        self.core = core
        self.peers = peers
        cfg = core.config
        self.deliveries = Deliveries(core)
        self.budget = self.deliveries.budget
        self.reader = ObjectReader(core)
        #: zero-copy deliveries lent to the application, and the forwards of them
        self.holds = Holds(core, peers, self.finish)
        self._inbox_limit = 4 * cfg.max_inflight + cfg.receive_buffer
        self._made = 0  # deliveries made so far, and the last one (see _charged)
        self._last: Delivery | None = None

    # -- frames in ---------------------------------------------------------------------

    def on_data_ready(self, peer: Peer, msg: wire.DataReadyMessage) -> bool:
        """Queue a DataReady; True if its peer's inbox can be taken from right now.

        Its charge (spec §7.6) is held against the peer's window until what it
        carried leaves this endpoint; a peer that overruns its window is lost."""
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
        charge = wire.charge(msg)
        if not peer.rwindow.charge(charge):
            core.counters["window_exceeded"] += 1
            self.peers.lose(
                peer,
                f"it overran its flow-control window ({peer.rwindow.held} bytes of charge "
                f"outstanding; {peer.rwindow.size} granted)",
            )
            return False
        if record is not None:
            record.charge = charge
        core.aborts.note_peer(msg.request_id, peer.name)  # an abort of it must reach peer
        if core.aborts.is_aborted(msg.request_id):
            if record is not None:
                self.refuse(peer, record, "aborted", "request aborted")
            else:
                self.credit(peer, peer.generation, charge)
            return False
        inbox = peer.inbox
        if record is None:
            if not inbox and not peer.busy and not peer.worker and peer.status is READY:
                self.take_message(peer, msg, charge)  # the common case: nothing queued before it
                return False
            inbox.append(msg)
            return True
        if len(inbox) >= self._inbox_limit:
            core.counters["inbox_full"] += 1
            self.refuse(peer, record, "queue_full", "receiver queue full")
            return False
        inbox.append(record)
        return True

    # -- the window (spec §7.6) ---------------------------------------------------------

    def credit(self, peer: Peer, generation: int, charge: int) -> None:
        """What a message of ``peer`` carried left this endpoint: give its charge back,
        and tell the peer when enough came back (a WindowMessage, batched with
        whatever else goes to it in this turn)."""
        if peer.generation == generation and charge and (increment := peer.rwindow.credit(charge)):
            self._reopen(peer, increment)  # (a past session's charge: its window is gone)

    def flush_windows(self) -> None:
        """Tell each peer what came back since its last WindowMessage (a few times a
        second: see ReceiveWindow)."""
        for peer in self.peers.all():
            self._reopen(peer, peer.rwindow.flush())

    def _reopen(self, peer: Peer, increment: int) -> None:
        hello = peer.hello
        if increment and hello is not None and hello.window and peer.status is READY:
            self.core.outbox.post(
                peer,
                wire.WindowMessage(
                    from_stage=self.core.name, to_stage=peer.name, increment=increment
                ),
            )

    def _charged(self, peer: Peer, charge: int, mark: int) -> None:
        """The message just taken holds ``charge``: on the last delivery it made (given
        back when that one is taken or dropped: ``ReceiveWindow.give``), or, if it made
        none, given back now. The receiver forgets that delivery here: kept, it would
        keep its payload (a copy-mode receive buffer: its pool block) alive after the
        application let go."""
        last, self._last = self._last, None
        if self._made != mark and last is not None:
            window = peer.rwindow
            if window.on_reopen is None:
                window.on_reopen = functools.partial(
                    self._reopen_session, peer, window, peer.generation
                )
            last._window = window
            last._charge = charge
        else:
            self.credit(peer, peer.generation, charge)

    def _reopen_session(
        self, peer: Peer, window: ReceiveWindow, generation: int, increment: int
    ) -> None:
        """A delivery gave ``increment`` back to ``window``: tell the peer, if that is
        still its session's window (a past session's window is gone)."""
        if peer.rwindow is window and peer.generation == generation:
            self._reopen(peer, increment)

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
        if peer.busy or peer.worker or peer.status is not READY:
            return False
        inbox = peer.inbox
        while inbox and isinstance(head := inbox.head(), wire.DataReadyMessage):
            inbox.popleft()
            self.take_message(peer, head, wire.charge(head))
        if not inbox:
            return False
        head = inbox.head()
        if len(inbox) == 1 and (
            not isinstance(head, InRecord)
            or self.reader.fits_now(
                head,
                self.budget.would_admit(
                    peer.name, 0 if self.core.config.zero_copy else head.length
                ),
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
            while peer.inbox and peer.generation == generation and peer.status is READY:
                await self._take_next(peer)
        finally:
            peer.worker = False

    async def _take_next(self, peer: Peer) -> None:
        item = peer.inbox.popleft()
        peer.busy = True
        made = self._made
        try:
            await self.take(peer, item)
        except Exception as exc:  # a bug must not stop the peer's inbox, nor lose the item
            self.core.counters["internal_errors"] += 1
            log.exception("%s: failed to take data from %s", self.core.name, peer.name)
            why = f"receiver error: {described(exc)}"
            record = item if isinstance(item, InRecord) else None
            if self._made == made:  # nothing of it reached the application: say so
                if record is not None:
                    self.finish(peer, record, "internal", why)
                msg = record.msg if record is not None else item
                assert isinstance(msg, wire.DataReadyMessage)
                self._deliver(_error(peer, msg, why), notice=True)
            elif record is not None and not record.lent:
                self.finish(peer, record)  # delivered: acknowledged
        finally:
            peer.busy = False

    # -- the take path -----------------------------------------------------------------

    async def take(self, peer: Peer, item: InRecord | wire.DataReadyMessage) -> None:
        """Take one inbox item: a message at once, an object through its backend."""
        if isinstance(item, wire.DataReadyMessage):
            self.take_message(peer, item, wire.charge(item))
            return
        mark = self._made
        try:
            await self._take_record(peer, item)
        finally:
            self._charged(peer, item.charge, mark)

    async def _take_record(self, peer: Peer, item: InRecord) -> None:
        msg = item.msg
        if item.refusal is not None:
            await self.reader.consume(peer, item)
            self.finish(peer, item, *item.refusal)
            return
        if self.core.aborts.is_aborted(msg.request_id):
            self.finish(peer, item, "aborted", "request aborted")
            return
        if item.ref.kind == "stream_chunk" and not self._stream_admitted(peer, msg):
            self.finish(peer, item, "aborted", "too_many_streams")
            return
        ok, metadata = self._metadata(peer, msg, item)
        if not ok:
            return
        await self._take_object(peer, item, metadata)
        self._ended(peer, msg, metadata)

    # -- open streams: a cap per peer, an idle timeout ----------------------------------

    def _stream_admitted(self, peer: Peer, msg: wire.DataReadyMessage) -> bool:
        """Whether a chunk of ``msg.request_id`` may be taken: its stream is open, or
        one more fits under ``max_open_streams``. A stream beyond the cap is refused
        by aborting its request back to the peer (reason ``too_many_streams``)."""
        rid = msg.request_id
        streams = peer.open_streams
        if rid in streams or len(streams) < self.core.config.max_open_streams:
            return True
        self.core.counters["streams_refused"] += 1
        self._refuse_stream(
            peer,
            rid,
            f"too_many_streams: {peer.name!r} has {len(streams)} streams open at "
            f"{self.core.name!r} (max_open_streams)",
        )
        return False

    def _refuse_stream(self, peer: Peer, request_id: str, reason: str) -> None:
        """Abort ``request_id`` here and back to ``peer`` alone (spec §7.6)."""
        core = self.core
        core.aborts.remember(request_id, core.name, reason)
        self.core.outbox.post(
            peer, wire.AbortMessage(request_id=request_id, from_stage=core.name, reason=reason)
        )

    def check_idle(self, now: float) -> None:
        """End the streams that had no chunk for ``stream_idle_timeout`` seconds: an
        ``error`` delivery (``cause="stream_idle"``), and an abort back to the sender."""
        limit = self.core.config.stream_idle_timeout
        for peer in self.peers.all():
            streams = peer.open_streams
            while streams:
                rid, last = next(iter(streams.items()))
                if now - last <= limit:
                    break  # the rest had a chunk later
                del streams[rid]
                self.core.counters["streams_idle"] += 1
                why = f"stream_idle: no chunk of request {rid!r} from {peer.name!r} for {limit:g} s"
                self._refuse_stream(peer, rid, why)
                stale = Delivery("error", rid, peer.name, error=why, cause="stream_idle")
                self._deliver(stale, notice=True)

    def take_message(self, peer: Peer, msg: wire.DataReadyMessage, charge: int) -> None:
        """Take a data-less or inline DataReady now (nothing of it waits). Its
        ``charge`` is what it holds of the peer's window (see :meth:`_charged`). (One
        function, but for its rare branches: it runs for every small message.)"""
        mark = self._made
        peer.busy = True
        try:
            # (not aborted: on_data_ready refused it then, and an abort drops it from the inbox)
            ok, metadata = self._metadata(peer, msg, None) if msg.metadata else (True, None)
            if ok:
                inline = msg.inline
                if msg.error is not None:
                    peer.open_streams.pop(msg.request_id, None)
                    self._deliver(_error(peer, msg, msg.error, metadata))
                elif inline is not None:
                    if (
                        inline.kind == "stream_chunk"
                        and msg.request_id not in peer.open_streams
                        and not self._stream_admitted(peer, msg)
                    ):
                        return  # refused (the finally clause gives its charge back)
                    self._take_inline(peer, msg, inline, metadata)
                if msg.is_done:
                    self._ended(peer, msg, metadata)
        except Exception:  # a bug must not stop the peer's inbox
            self.core.counters["internal_errors"] += 1
            log.exception("%s: failed to take a message from %s", self.core.name, peer.name)
        finally:
            peer.busy = False
            self._charged(peer, charge, mark)

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
        metas = inline.tensors
        nbytes = metas[0].nbytes if len(metas) == 1 else sum(t.nbytes for t in metas)
        self._deliver(_data(peer, msg, inline.kind, value, metadata, "inline", nbytes))

    async def _take_object(self, peer: Peer, record: InRecord, metadata: Any) -> None:
        hops.mark("recv: take begins")
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
        share = Share(self.budget, peer.name, counted=not zero_copy)
        value: Any = None
        taken = False  # fetched: the budget share is held
        failure: tuple[wire.NackReason, str] | None = None
        with anyio.CancelScope() as scope:
            peer.current_take = (msg.request_id, scope)
            try:
                try:
                    await share.reserve(min(record.ready, record.length))
                    value = await self.reader.read(peer, backend, info, record, share.reserve)
                    taken = True
                except BaseException:
                    share.release()
                    raise
            except Exception as exc:
                failure = nack_of(exc)
                if failure is None:  # not a failure a read may have: a bug, still reported
                    self.core.counters["internal_errors"] += 1
                    log.exception("%s: reading object from %s failed", self.core.name, peer.name)
                    failure = "internal", f"receiver error: {described(exc)}"
            finally:
                peer.current_take = None
        aborted = self.core.aborts.is_aborted(msg.request_id)
        if scope.cancel_called or aborted:  # aborted, the peer is gone, or we are closing
            if taken:
                share.release()  # taken, but it will not be delivered
            if aborted and record.imp is None:
                # aborted before its read began (waiting for room): a two-sided engine's
                # send still needs its receive, in order, or it never completes
                await self.reader.consume(peer, record)
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
        hops.mark("recv: read and unpacked")
        lent = zero_copy and not isinstance(backend, ObjectBackend)
        delivery = _data(
            peer,
            msg,
            ref.kind,
            value,
            metadata,
            ref.backend,
            ref.ref.length,
            budget=share.bytes,
            on_release=self.holds.lend(peer, record) if lent else None,
        )
        self._deliver(delivery)
        if not lent:
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
        charge, record.charge = record.charge, 0
        self.credit(peer, record.generation, charge)

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
        hops.mark("recv: ACK posted")

    # -- deliveries ----------------------------------------------------------------------

    def _deliver(self, delivery: Delivery, *, notice: bool = False, late: bool = False) -> None:
        """Queue ``delivery`` (``notice``: made here, it holds no budget and no window;
        one of a request that is over for the application is not queued, unless
        ``late``: for a consumer that came for it again)."""
        if notice and not late and self.deliveries.over(delivery.request_id):
            return
        observer = self.core.observer
        if observer is not None:
            observer.delivered(self.core.name, delivery)
        self._made += 1
        self._last = delivery
        self.deliveries.put(delivery, notice=notice)

    # -- aborts, loss, close -------------------------------------------------------------

    def on_abort(
        self, request_id: str, origin: str, reason: str, *, notify: bool, via: str | None = ""
    ) -> None:
        """Drop everything of the request. The ``aborted`` delivery (when ``notify``) is
        made only where a consumer holds or waits for the request, or, for a peer's
        abort (``via``: the peer it came from; None: our own), where the request was
        seen — data of it sent or received here: an abort of a request never seen here
        costs nothing but its remembered id (so its late data is still refused). A
        consumer that comes for the request later gets its own (``Receiving``)."""
        seen = self.core.aborts.seen(request_id)
        for name in self.core.aborts.involved(request_id):  # only they sent us any of it
            peer = self.peers.get(name)
            if peer is None:
                continue
            for item in peer.inbox.of_request(request_id):
                if isinstance(item, InRecord):
                    self.refuse(peer, item, "aborted", "request aborted")
                else:
                    peer.inbox.remove(item)
                    self.credit(peer, peer.generation, wire.charge(item))
            if peer.current_take is not None and peer.current_take[0] == request_id:
                peer.current_take[1].cancel()
            peer.open_streams.pop(request_id, None)
        self.deliveries.drop(request_id)  # zero-copy ones NACK "aborted"
        if notify and (self.deliveries.wanted(request_id) or (seen and via is not None)):
            self.notice_abort(request_id, origin, reason, via or "")

    def notice_abort(
        self, request_id: str, origin: str, reason: str, via: str = "", *, late: bool = False
    ) -> None:
        """Queue the ``aborted`` delivery of ``request_id`` (a notice: it holds nothing;
        ``late``: for a consumer that comes for an aborted request)."""
        aborted = Delivery("aborted", request_id, origin, error=reason or None, via=via)
        self._deliver(aborted, notice=True, late=late)

    def on_peer_gone(
        self, peer: Peer, records: list[InRecord], cause: str, error: PeerLostError
    ) -> None:
        """The peer died or closed: drop what it sent, and tell the application which of
        its requests were cut short."""
        cut: dict[str, None] = dict.fromkeys(peer.open_streams)
        for item in peer.inbox:
            cut.setdefault(item.request_id, None)
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
                cut_short = Delivery("error", rid, peer.name, error=str(error), cause=cause)
                self._deliver(cut_short, notice=True)

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


def _data(
    peer: Peer,
    msg: wire.DataReadyMessage,
    kind: str,
    value: Any,
    metadata: Any,
    backend: str,
    nbytes: int,
    *,
    budget: int | None = None,
    on_release: Callable[[], None] | None = None,
) -> Delivery:
    """A payload or stream chunk for the application (a chunk opens its stream),
    holding ``budget`` bytes of the receive budget; ``on_release``: it views memory
    lent to it, its ``release()`` calls that."""
    delivered: DeliveryKind = "payload" if kind == "payload" else "stream_chunk"
    if delivered == "stream_chunk":  # (re)opens its stream, the newest for the idle check
        streams = peer.open_streams
        streams[msg.request_id] = time.monotonic()
        streams.move_to_end(msg.request_id)
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
        _on_release=on_release,
        _budget=budget,
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
