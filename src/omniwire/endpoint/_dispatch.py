"""Frames in: decode, check, and hand each message to the part of the endpoint it is for.

Nothing a peer sends can stop these loops: a frame that does not decode, a
message that is illegal now, or a bug triggered by one is counted, logged at a
bounded rate, and dropped; the loop goes on with the next frame.

Bounded work per turn: the control loop gives the event loop a turn after
``_TURN_MESSAGES`` messages or ``_TURN_SECONDS`` of applying frames, so a backlog
of one peer (100,000 requests in a hundred frames) holds the application, the
other peers' ACKs and liveness for milliseconds, not seconds. The same budget bounds
what the PULL socket's reader callback applies while the control loop waits, the
abort channel's loop, and a same-host ring's reader. A frame over 1 MiB (up to
65,536 tensor table entries per DataRef, each validated in Python) is decoded in a
worker thread, so its decode does not hold the event loop either.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio

from .. import wire
from ..errors import (
    EndpointClosedError,
    ProtocolError,
    RemoteProtocolError,
    RequestAbortedError,
    UnsupportedVersionError,
    WireFormatError,
    reason_text,
)
from ..ring import RingError, RingReader
from ._core import Core, State
from ._peers import PeerTable
from ._receiver import Receiver
from ._records import QUIET, Peer
from ._sender import Sender

__all__ = ["Dispatcher"]

#: The messages that name their sender in ``from_stage``.
_FromPeer = (
    wire.DataReadyMessage
    | wire.DataProgressMessage
    | wire.DataAckMessage
    | wire.AbortMessage
    | wire.GoodbyeMessage
    | wire.WindowMessage
)

log = logging.getLogger("omniwire.endpoint")

#: Messages applied between two turns of the event loop, at most (one frame may hold
#: up to 4,096: a frame is never split).
_TURN_MESSAGES = 512
#: Seconds of applying frames between two turns of the event loop, at most.
_TURN_SECONDS = 0.002
#: Frames larger than this are decoded in a worker thread (see ``_on_large_frame``).
_THREAD_DECODE = 1 << 20
#: Frames taken from the socket at once.
_RECV_FRAMES = 64
#: A peer's numbered frames applied before we ack them in a frame of our own (if no
#: frame of ours carried the ack meanwhile); the housekeeping tick acks the rest.
ACK_FRAMES = 32


class Dispatcher:
    def __init__(self, core: Core, peers: PeerTable, sender: Sender, receiver: Receiver) -> None:
        self.core = core
        self.peers = peers
        self.sender = sender
        self.receiver = receiver
        self.applied = 0  # messages applied since the control loop's last turn
        self._after_quiet = False  # the frame being applied came after a quiet spell
        self._turn_started = time.monotonic()
        self.name = core.name

    async def control_loop(self) -> None:
        """Frames from every peer's PUSH into our PULL, with a turn of the event loop
        after a bounded amount of work (see the module docstring). While it waits,
        frames are applied as they arrive, in the socket's reader callback
        (:meth:`_apply_arrived`): one turn of the event loop per frame, not two."""
        control = self.core.control
        while True:
            try:
                await self._apply_batch(await control.recv_many(_RECV_FRAMES, self._apply_arrived))
            except EndpointClosedError:
                return

    async def _apply_batch(self, frames: list[bytes]) -> None:
        """Apply a batch of frames, letting go of each as soon as it is applied: no
        frame stays referenced here while the loop waits for more (a refused flood of
        15 MiB frames stayed in memory until a later large frame came)."""
        receiver = self.receiver
        frames.reverse()
        while frames:
            frame = frames.pop()
            if len(frame) > _THREAD_DECODE:
                takeable = await self._on_large_frame(frame)
            else:
                takeable = self.on_frame(frame, abort_channel=False)
            del frame
            for peer in takeable:
                if receiver.pump(peer):
                    await receiver.take_head(peer)
            if self._turn_spent():
                await asyncio.sleep(0)
                self._new_turn()

    def _apply_arrived(self, frames: list[bytes]) -> list[bytes]:
        """(the PULL socket's reader callback, while the control loop waits) Apply
        ``frames`` now, within one turn's budget; returns those left to the control
        loop: the rest once the budget is spent, and from the first frame too large
        to decode on the loop on."""
        self._new_turn()
        receiver = self.receiver
        for i, frame in enumerate(frames):
            if len(frame) > _THREAD_DECODE:
                return frames[i:]
            for peer in self.on_frame(frame, abort_channel=False):
                if receiver.pump(peer):
                    receiver.start_worker(peer)  # no await here: its worker takes it
            if self._turn_spent():
                return frames[i + 1 :]
        return []

    def _new_turn(self) -> None:
        self.applied = 0
        self._turn_started = time.monotonic()

    def _turn_spent(self) -> bool:
        return (
            self.applied >= _TURN_MESSAGES or time.monotonic() - self._turn_started > _TURN_SECONDS
        )

    def start_ring(self, peer: Peer, reader: RingReader, generation: int) -> None:
        """Read ``peer``'s frames from its ring from now on (spec §3.6): each wake-up of
        the ring hands over every frame that arrived, which are applied right there."""
        receiver = self.receiver

        def on_frames(frames: list[bytes]) -> list[bytes]:
            """Apply ``frames`` within one turn's budget; the rest come back later."""
            self._new_turn()
            for i, frame in enumerate(frames):
                if len(frame) > _THREAD_DECODE:
                    reader.pause()  # the ring waits while a worker thread decodes it
                    if not self.core.supervisor.spawn(self._ring_frame, peer, reader, frame):
                        reader.resume()  # closing
                    return frames[i + 1 :]
                for p in self.on_frame(frame, abort_channel=False, source=peer.name):
                    if receiver.pump(p):
                        receiver.start_worker(p)  # an object: its worker takes it
                if self._turn_spent():
                    return frames[i + 1 :]
            return []

        def on_closed(error: RingError | None) -> None:
            if peer.generation == generation and self.core.state is State.OPEN:
                why = reason_text(
                    error,
                    "its writer closed it without a Goodbye: the peer died, or gave this "
                    "endpoint up (it took no frame for the peer's peer_timeout: stopped "
                    "or too slow to read)",
                )
                self.peers.lose(peer, f"its control ring ended ({why})")

        reader.start(on_frames, on_closed)

    async def _ring_frame(self, peer: Peer, reader: RingReader, frame: bytes) -> None:
        """:meth:`_on_large_frame` for a ring's frame; the ring resumes after it."""
        try:
            for p in await self._on_large_frame(frame, source=peer.name):
                if self.receiver.pump(p):
                    self.receiver.start_worker(p)
        finally:
            reader.resume()

    async def abort_loop(self) -> None:
        """Frames from the PUB sockets of the peers we subscribed to, within the same
        budget per turn: a frame already queued comes back without suspending, so a
        flood of aborts would otherwise be applied in one turn, however long."""
        while True:
            try:
                frame = await self.core.control.recv_abort()
            except EndpointClosedError:
                return
            self.on_frame(frame, abort_channel=True)
            if self._turn_spent():
                await asyncio.sleep(0)
                self._new_turn()

    def on_frame(
        self, frame: bytes, *, abort_channel: bool, source: str | None = None
    ) -> list[Peer]:
        """Apply one frame; returns the peers whose inbox the caller may take from now.
        ``source`` is the peer a ring frame came from: every message must be its own."""
        self.core.counters["frames_received"] += 1
        msg = self.decode(frame)
        return [] if msg is None else self.apply(msg, abort_channel=abort_channel, source=source)

    async def _on_large_frame(self, frame: bytes, source: str | None = None) -> list[Peer]:
        """:meth:`on_frame` for a frame of more than ``_THREAD_DECODE`` bytes: decoded in
        a worker thread (its validation runs Python per tensor table entry, and yields
        the interpreter to the event loop every few ms), applied here, in order."""
        self.core.counters["frames_received"] += 1
        # in and out in a box that is emptied: a worker thread keeps its last call's
        # arguments and result referenced while it waits for the next (anyio)
        box = [frame]
        msg = (await anyio.to_thread.run_sync(self._decode_boxed, box)).pop()
        return [] if msg is None else self.apply(msg, abort_channel=False, source=source)

    def _decode_boxed(self, box: list[bytes]) -> list[wire.Message | None]:
        return [self.decode(box.pop())]

    def decode(self, frame: bytes) -> wire.Message | None:
        """The frame's message; None (counted, logged at a bounded rate) if it has none."""
        core = self.core
        try:
            return wire.decode(frame)
        except UnsupportedVersionError as exc:
            core.counters["version_refused"] += 1
            core.noisy.warning("version", "%s refused a frame: %s", core.name, exc)
        except WireFormatError as exc:
            core.counters["decode_errors"] += 1
            core.noisy.warning(
                "decode", "%s dropped a malformed frame (%d bytes): %s", core.name, len(frame), exc
            )
        return None

    def apply(
        self, msg: wire.Message, *, abort_channel: bool, source: str | None = None
    ) -> list[Peer]:
        """Apply a decoded frame (see :meth:`on_frame`)."""
        core = self.core
        resumed: Peer | None = None
        if isinstance(msg, wire.BatchMessage):
            if msg.session:  # numbered, or an ack alone (spec §10.7)
                resumed = self._resumed(msg, abort_channel, source)
                if resumed is None:
                    return []
            messages: tuple[wire.Message, ...] = msg.messages
        else:
            messages = (msg,)
        self.applied += len(messages)
        takeable: list[Peer] = []
        for m in messages:
            try:
                if abort_channel and not isinstance(m, wire.AbortMessage):
                    raise RemoteProtocolError(f"{type(m).__name__} on the abort channel")
                if source is not None and _sender_of(m) != source:
                    raise RemoteProtocolError(
                        f"{type(m).__name__} from {_sender_of(m)!r} in the ring of {source!r}"
                    )
                peer = self._apply(m)
            except ProtocolError as exc:
                core.counters["protocol_errors"] += 1
                core.noisy.warning("protocol", "%s: %s", core.name, exc)
            except Exception:  # a bug: count it, keep serving
                core.counters["internal_errors"] += 1
                log.exception("%s: failed to apply %s", core.name, type(m).__name__)
            else:
                if peer is not None and peer not in takeable:
                    takeable.append(peer)
        if resumed is not None:
            resumption = resumed.session.resumption
            if resumption is not None and (self._after_quiet or resumption.ack_due(ACK_FRAMES)):
                core.outbox.ack(resumed)
        return takeable

    def _resumed(
        self, msg: wire.BatchMessage, abort_channel: bool, source: str | None
    ) -> Peer | None:
        """The peer whose numbered frame (or ack) ``msg`` is, if it is to be applied:
        of the session going on, the next number (spec §10.7). Else it is dropped whole
        and counted: a frame of an ended session, one already applied, or one after
        a gap (those frames come again)."""
        core = self.core
        peer = self.peers.get(msg.from_stage)
        resumption = peer.session.resumption if peer is not None else None
        if abort_channel or (source is not None and msg.from_stage != source):
            core.counters["protocol_errors"] += 1
            core.noisy.warning(
                "protocol", "%s: a numbered frame from %r out of place", core.name, msg.from_stage
            )
            return None
        if peer is None or resumption is None or msg.session != resumption.token:
            core.counters["frames_stale"] += 1
            if peer is not None and resumption is None:
                self.peers.remind(peer)  # it numbers frames of a session we ended
            return None
        if not resumption.accept(msg.session, msg.seq):
            core.counters["frames_duplicate"] += 1
            return None
        now = time.monotonic()
        # the first frame after a quiet spell is acked at once: its sender may wait for
        # that ack to complete a landed object's receipt (``QUIET``)
        self._after_quiet = msg.seq != 0 and now - peer.heard_at >= QUIET / 2
        peer.heard_at = now
        if msg.ack:
            try:
                resumption.on_ack(msg.ack)
            except ProtocolError as exc:
                core.counters["protocol_errors"] += 1
                core.noisy.warning("protocol", "%s: %s: %s", core.name, peer.name, exc)
        return peer

    def _apply(self, msg: wire.Message) -> Peer | None:
        if type(msg) is wire.DataReadyMessage:  # the common case first
            peer = self._said_hello(msg)
            if msg.to_stage != self.name and msg.data_ref is not None:
                self._nack_misaddressed(peer, msg)
            return peer if self.receiver.on_data_ready(peer, msg) else None
        if isinstance(msg, wire.HelloMessage):
            self.peers.on_hello(msg)
        elif isinstance(msg, wire.RefusalMessage):
            self.peers.on_refusal(msg)
        elif isinstance(msg, wire.BatchMessage):
            raise RemoteProtocolError("a BatchMessage inside a BatchMessage")
        elif isinstance(msg, wire.DataProgressMessage):
            self.receiver.on_progress(self._said_hello(msg), msg)
        elif isinstance(msg, wire.DataAckMessage):
            self.sender.ledger.on_ack(self._said_hello(msg), msg)
        elif isinstance(msg, wire.WindowMessage):
            self.sender.ledger.on_window(self._said_hello(msg), msg)
        elif isinstance(msg, wire.AbortMessage):
            peer = self._said_hello(msg)
            peer.session.check(msg)
            self.abort(msg.request_id, msg.origin or msg.from_stage, msg.reason, via=peer.name)
        elif isinstance(msg, wire.GoodbyeMessage):
            self.peers.on_goodbye(self._said_hello(msg), msg)
        return None

    def _said_hello(self, msg: _FromPeer) -> Peer:
        """The peer a message comes from, which must have said Hello."""
        peer = self.peers.get(msg.from_stage)
        if peer is None or peer.session.hello is None:
            raise RemoteProtocolError(
                f"{type(msg).__name__} from {msg.from_stage!r}, which has not said Hello"
            )
        return peer

    def _nack_misaddressed(self, peer: Peer, msg: wire.DataReadyMessage) -> None:
        assert msg.data_ref is not None
        self.core.counters["nacks_sent"] += 1
        self.core.outbox.post(
            peer,
            wire.DataAckMessage(
                object_id=msg.data_ref.object_id,
                from_stage=self.core.name,
                to_stage=peer.name,
                success=False,
                error=f"addressed to {msg.to_stage!r}, not {self.core.name!r}",
                reason="misaddressed",
            ),
        )
        raise RemoteProtocolError(
            f"DataReady from {peer.name!r} is addressed to {msg.to_stage!r}, not {self.core.name!r}"
        )

    def abort(self, request_id: str, origin: str, reason: str, *, via: str | None) -> None:
        """Apply an abort (ours when ``via`` is None, else a peer's) and, the first time
        this endpoint hears of the request's abort, pass it on."""
        core = self.core
        first = core.aborts.remember(request_id, origin, reason)
        if first:  # a request once: it may come back broadcast, direct and forwarded
            core.counters["aborts"] += 1
        error = RequestAbortedError(
            f"request {request_id!r} was aborted by {origin!r}" + (f": {reason}" if reason else "")
        )
        core.aborts.cancel_request(request_id, error)
        self.sender.ledger.on_abort(request_id, error)
        self.receiver.on_abort(request_id, origin, reason, notify=first, via=via)
        if not first:
            return
        msg = wire.AbortMessage(
            request_id=request_id,
            from_stage=core.name,
            reason=reason,
            origin="" if origin == core.name else origin,
        )
        if via is None:
            core.supervisor.spawn(core.control.publish, wire.encode(msg))
        for name in core.aborts.peers_of(request_id):
            peer = self.peers.get(name)
            if peer is None or name == via or peer.status.value != "ready":
                continue
            core.outbox.post(peer, msg)
            if via is not None:
                core.counters["aborts_forwarded"] += 1


def _sender_of(msg: wire.Message) -> str:
    if type(msg) is wire.DataReadyMessage:  # the common case, in one test
        return msg.from_stage
    if isinstance(msg, wire.HelloMessage):
        return msg.endpoint
    if isinstance(msg, wire.BatchMessage):
        return ""  # checked message by message
    return msg.from_stage
