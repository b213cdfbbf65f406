"""The one way frames leave an endpoint.

Every message to a peer goes through :meth:`Outbox.post` (fire and forget) or
:meth:`Outbox.send` (returns once the message is on its way, waiting — bounded —
only when the peer has stopped taking frames). Messages queue per peer and are
flushed at the end of the event-loop iteration they were posted in: what one
iteration posted to a peer leaves as one frame (a BatchMessage when there are
several and the peer reads 1.1), so a burst of stream chunks, ACKs and progress
costs one socket send and one decode on the other side. Order per peer is
posting order, always.

A frame ZeroMQ cannot take right away (the peer's queue is full) waits in the
peer's backlog, which one drain task empties in order; how long its head has
waited tells the peer table whether the peer still takes frames. ``send`` waits
while more than 256 messages or 16 MiB wait for a peer, so what a peer that does
not read pins here is bounded: by its window, and for a peer granting none by
those and the few frames ZeroMQ holds for it (``NO_WINDOW_FRAMES``).

Nothing queued is dropped quietly. Batches are cut by the messages' sizes before
they are encoded (a DataReady's charge, spec §7.6, bounds its encoded size), so no
batch exceeds the frame limit; a message too large for any frame was refused by its
own send (:class:`~omniwire.errors.FrameTooLargeError`). If a peer's channel breaks
anyway (its ring), what was queued for it is dropped *and the peer is declared
lost* (``on_broken``), so every send that returned meant: it arrives, or the peer
is gone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeGuard, cast

import anyio
import msgspec

from .. import wire
from ..control import ControlPlane
from ..errors import OmniwireError, PeerUnresponsiveError, WireFormatError
from ..ring import RingError, RingWriter

if TYPE_CHECKING:
    from ._records import Peer
    from ._supervisor import Supervisor

__all__ = ["Outbox"]

#: Messages queued to one peer before ``send`` waits for ZeroMQ to take some.
_SEND_LIMIT = 256
#: Bytes of frames waiting for a peer's channel before ``send`` waits.
_SEND_BYTES = 16 << 20
#: Most messages in one BatchMessage (the wire allows 4096).
_BATCH_MAX = 1024
#: Batches stay well under the 16 MiB frame limit (counted in the messages' sizes).
_BATCH_BYTES = 4 << 20
_BATCHABLE = (
    wire.DataReadyMessage,
    wire.DataProgressMessage,
    wire.DataAckMessage,
    wire.AbortMessage,
    wire.WindowMessage,
)
#: An upper bound of the encoded size of a batchable message that is not a DataReady.
_SMALL = 2 * wire.MAX_TEXT_BYTES + 4 * wire.MAX_NAME_BYTES


class _ToRing:
    """In a queue's messages: everything after this goes through ``writer``."""

    __slots__ = ("writer",)

    def __init__(self, writer: RingWriter) -> None:
        self.writer = writer


class _Queue:
    """What waits to leave for one peer: messages of this iteration, then frames its
    channel could not take yet (each with the channel it must take: ZeroMQ, or the
    peer's ring)."""

    __slots__ = (
        "backlog",
        "backlog_bytes",
        "draining",
        "error",
        "message_bytes",
        "messages",
        "peer",
        "room",
        "since",
        "sizes",
    )

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.messages: list[wire.Message | _ToRing] = []
        self.sizes: list[int] = []  # each message's size bound, if its poster knew it (else 0)
        self.message_bytes = 0  # the sum of ``sizes``
        self.backlog: deque[tuple[bytes, RingWriter | None]] = deque()
        self.backlog_bytes = 0
        self.draining = False
        self.since = 0.0  # when the backlog's head started to wait
        self.room: anyio.Event | None = None  # set when ``send`` may go on
        self.error: OmniwireError | None = None  # why it was dropped

    def __len__(self) -> int:
        return len(self.messages) + len(self.backlog)

    def crowded(self) -> bool:
        """Whether ``send`` waits: too many messages, or too many bytes of frames."""
        return len(self) > _SEND_LIMIT or self.message_bytes + self.backlog_bytes > _SEND_BYTES


class Outbox:
    """Per-peer ordered queues in front of the control plane's PUSH sockets."""

    def __init__(self, control: ControlPlane, supervisor: Supervisor) -> None:
        self._control = control
        self._supervisor = supervisor
        self._queues: dict[str, _Queue] = {}
        self._dirty: list[_Queue] = []
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._emptied = anyio.Event()  # set when nothing waits any more
        self._closed = False
        self._sent_now: set[str] = set()  # peers sent a frame at once this iteration
        self._reset_scheduled = False
        #: Told when a peer's channel broke and its queue was dropped (the peer table
        #: declares it lost); set by the endpoint.
        self.on_broken: Callable[[str, OmniwireError], None] | None = None

    # -- the API ---------------------------------------------------------------------

    def post(self, peer: Peer, msg: wire.Message, size: int = 0) -> None:
        """Queue ``msg`` to ``peer``; it leaves after everything posted before it.
        ``size``: a DataReady's charge, if the caller has it (it bounds the encoded
        size: see :func:`_frames`).

        The first message to a peer in an event-loop iteration, with nothing queued
        before it, leaves at once (a request/reply pays no extra trip around the
        loop); the ones after it in the same iteration are batched at its end (a
        burst costs one frame, one wake-up and one decode on the other side).
        """
        name = peer.name
        if name not in self._queues and name not in self._sent_now and not self._closed:
            self._sent_now.add(name)
            if not self._reset_scheduled:
                self._reset_scheduled = True
                (self._loop or self._get_loop()).call_soon(self._new_iteration)
            ring = peer.ring_writer
            numbered = False
            try:
                if _numbers(msg, peer):
                    numbered = True
                    frame = _numbered(peer, (msg,))
                else:
                    frame = _frame(msg, peer.session.version)
                if ring is not None:
                    if _ring_send(ring, frame):
                        return
                elif self._control.send_nowait(name, frame):
                    return
                if numbered:  # numbered and retained: it waits as this frame, not anew
                    queue = self._queues[name] = _Queue(peer)
                    self._send(queue, frame)
                    return
            except OmniwireError as exc:  # the ring broke, or a frame cannot be made
                self._broken(name, exc)
                return
        self._enqueue(peer, msg, size)

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    def _new_iteration(self) -> None:
        self._reset_scheduled = False
        self._sent_now.clear()

    def _enqueue(self, peer: Peer, msg: wire.Message | _ToRing, size: int = 0) -> None:
        if self._closed:
            return
        queue = self._queues.get(peer.name)
        if queue is None:
            queue = self._queues[peer.name] = _Queue(peer)
        if not queue.messages:
            self._dirty.append(queue)
        queue.messages.append(msg)
        queue.sizes.append(size)
        queue.message_bytes += size
        if not self._scheduled:
            self._scheduled = True
            loop = self._loop or asyncio.get_running_loop()
            self._loop = loop
            loop.call_soon(self._flush)

    def has_room(self, peer: Peer) -> bool:
        """Whether :meth:`send` to ``peer`` would return without waiting now."""
        queue = self._queues.get(peer.name)
        return queue is None or not queue.crowded()

    async def send(self, peer: Peer, msg: wire.Message, timeout: float, size: int = 0) -> None:
        """Post ``msg``; wait only while too much is queued to ``peer`` (it takes no frames).

        Raises:
            PeerUnresponsiveError: the peer took no frame for ``timeout`` seconds.
        """
        self.post(peer, msg, size)
        queue = self._queues.get(peer.name)
        if queue is None or not queue.crowded():
            return  # gone straight out (a ring), or room to spare
        deadline = time.monotonic() + timeout
        while queue.crowded() and self._queues.get(peer.name) is queue:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerUnresponsiveError(
                    f"peer {peer.name!r} took no frame for {timeout:g} s (stopped, hung or "
                    "overloaded)"
                )
            if queue.room is None or queue.room.is_set():  # one event for every waiter
                queue.room = anyio.Event()
            room = queue.room
            with anyio.move_on_after(left):
                await room.wait()
        if queue.error is not None:
            raise queue.error

    def switch_to_ring(self, peer: Peer, writer: RingWriter) -> None:
        """Frames posted to ``peer`` from now on go through its ring, after every frame
        posted before (those still go by ZeroMQ: the last of them is the peer's cue)."""
        self._enqueue(peer, _ToRing(writer))

    def resend(self, peer: Peer, *, rekey: bool = False) -> int:
        """Send every frame of the session the peer has not acknowledged again, in order,
        ahead of anything not sent yet (spec §10.7): our link to it came back (frames
        the dropped connection held are lost), or (``rekey``) its session token changed
        and it dropped what carried the old one. Returns how many frames."""
        resumption = peer.session.resumption
        if resumption is None or self._closed or not resumption.retained:
            return 0
        # numbered frames still in the backlog are retained ones: they go in this order
        numbered = {id(frame) for _, frame in resumption.retained}
        if rekey:
            resumption.retained = deque(
                (seq, _readdressed(frame, resumption.peer_token))
                for seq, frame in resumption.retained
            )
        queue = self._queues.get(peer.name)
        if queue is None:
            queue = self._queues[peer.name] = _Queue(peer)
        else:
            queue.backlog = deque(item for item in queue.backlog if id(item[0]) not in numbered)
            queue.backlog_bytes = sum(len(frame) for frame, _ in queue.backlog)
        try:
            for _, frame in resumption.retained:
                self._send(queue, frame)
        except OmniwireError as exc:  # its ring broke
            self._broken(peer.name, exc)
            return 0
        if not queue.backlog and not queue.messages:
            self._done(queue)
        return len(resumption.retained)

    def numbered_through(self, peer: Peer) -> int:
        """Number (and send) what is queued to ``peer`` now; the number of the last frame
        of the session so far, so of the frame that holds what was posted last (spec
        §10.7). 0 when the session numbers nothing."""
        resumption = peer.session.resumption
        if resumption is None:
            return 0
        queue = self._queues.get(peer.name)
        if queue is not None and queue.messages and not self._flush_queue(queue):
            return 0
        return resumption.next_seq - 1

    def ack(self, peer: Peer) -> None:
        """Tell ``peer`` how far its numbered frames were applied here (spec §10.7), in a
        frame of its own unless messages to it are queued (their frames carry it)."""
        resumption = peer.session.resumption
        queue = self._queues.get(peer.name)
        if resumption is None or self._closed or (queue is not None and queue.messages):
            return
        resumption.ack_sent = resumption.received
        frame = wire.encode(
            wire.BatchMessage(
                messages=(),
                from_stage=peer.session.local_name,
                session=resumption.peer_token,
                ack=resumption.received,
            ),
            version=peer.session.version,
        )
        if queue is None:
            queue = self._queues[peer.name] = _Queue(peer)
        try:
            self._send(queue, frame)
        except OmniwireError as exc:
            self._broken(peer.name, exc)
            return
        if not queue.backlog and not queue.messages:
            self._done(queue)

    def close(self) -> None:
        """The endpoint closes: what was not sent by now is dropped; nothing new is queued."""
        self._closed = True
        for queue in self._queues.values():
            _close_rings(queue.messages)
        self._queues.clear()
        self._dirty.clear()
        self._emptied.set()

    def refuse(self, address: str, msg: wire.RefusalMessage) -> bool:
        """Best effort: a Refusal to an address that is no peer of ours (rate-limited)."""
        return self._control.send_once(address, wire.encode(msg))

    def waiting_for(self, peer: str, now: float) -> float:
        """Seconds the oldest frame to ``peer`` has waited for ZeroMQ (0: none)."""
        queue = self._queues.get(peer)
        return now - queue.since if queue is not None and queue.backlog else 0.0

    def _broken(self, peer: str, error: OmniwireError) -> None:
        """The channel to ``peer`` broke: drop its queue and have it declared lost."""
        self.drop(peer, error)
        if self.on_broken is not None:
            self.on_broken(peer, error)

    def drop(self, peer: str, error: OmniwireError) -> None:
        """Discard what is queued to a peer that is gone (its waiters move on)."""
        queue = self._queues.pop(peer, None)
        if queue is not None:
            queue.error = error
            _close_rings(queue.messages)
            queue.messages.clear()
            queue.sizes.clear()
            queue.message_bytes = 0
            queue.backlog.clear()
            queue.backlog_bytes = 0
            if queue.room is not None:
                queue.room.set()
        if not self._queues:
            self._emptied.set()

    async def flush(self, timeout: float) -> None:
        """Send what is queued and wait until every backlog is empty, at most ``timeout`` s."""
        self._flush()
        with anyio.move_on_after(timeout):
            while self._queues:
                self._emptied = anyio.Event()
                await self._emptied.wait()

    # -- frames out ------------------------------------------------------------------

    def _flush(self) -> None:
        """Turn each peer's messages of this iteration into frames and send them."""
        self._scheduled = False
        dirty, self._dirty = self._dirty, []
        for queue in dirty:
            if self._queues.get(queue.peer.name) is queue and queue.messages:
                self._flush_queue(queue)

    def _flush_queue(self, queue: _Queue) -> bool:
        """Send the messages queued to one peer as frames; False if its channel broke
        (it is declared lost)."""
        messages, queue.messages = queue.messages, []
        sizes, queue.sizes = queue.sizes, []
        queue.message_bytes = 0
        try:
            self._send_all(queue, messages, sizes)
        except OmniwireError as exc:  # its ring broke, or a frame cannot be made
            self._broken(queue.peer.name, exc)
            return False
        if not queue.backlog:
            self._done(queue)
        return True

    def _send_all(
        self, queue: _Queue, messages: list[wire.Message | _ToRing], sizes: list[int]
    ) -> None:
        if 0 not in sizes:  # only charged DataReadys (a switch to the ring has size 0)
            for frame in _frames(queue.peer, cast("list[wire.Message]", messages), sizes):
                self._send(queue, frame)
            return
        run: list[wire.Message] = []
        run_sizes: list[int] = []
        for item, size in zip(messages, sizes, strict=True):
            if isinstance(item, _ToRing):
                for frame in _frames(queue.peer, run, run_sizes):
                    self._send(queue, frame)
                run, run_sizes = [], []
                queue.peer.ring_writer = item.writer
            else:
                run.append(item)
                run_sizes.append(size)
        for frame in _frames(queue.peer, run, run_sizes):
            self._send(queue, frame)

    def _send(self, queue: _Queue, frame: bytes) -> None:
        ring = queue.peer.ring_writer
        if not queue.backlog:
            if ring is None:
                if self._control.send_nowait(queue.peer.name, frame):
                    return
            elif _ring_send(ring, frame):
                return
            queue.since = time.monotonic()
        queue.backlog.append((frame, ring))
        queue.backlog_bytes += len(frame)
        if not queue.draining:
            queue.draining = True
            self._supervisor.spawn(self._drain, queue)

    async def _drain(self, queue: _Queue) -> None:
        name = queue.peer.name
        try:
            while queue.backlog and self._queues.get(name) is queue:
                frame, ring = queue.backlog[0]
                try:
                    if ring is None:
                        await self._control.send(name, frame)
                    else:
                        while not _ring_send(ring, frame):
                            await ring.wait_writable()
                except (KeyError, OmniwireError):  # channel gone: the peer is being dropped
                    return
                queue.backlog.popleft()
                queue.backlog_bytes -= len(frame)
                queue.since = time.monotonic()
                if queue.room is not None and not queue.crowded():
                    queue.room.set()
        finally:
            queue.draining = False
            if not queue.backlog and not queue.messages:
                self._done(queue)

    def _done(self, queue: _Queue) -> None:
        """Nothing left for this peer: forget its queue (a new one comes with the next post)."""
        if queue.room is not None:
            queue.room.set()
        if self._queues.get(queue.peer.name) is queue and not queue.draining:
            del self._queues[queue.peer.name]
        if not self._queues:
            self._emptied.set()


def _close_rings(messages: list[wire.Message | _ToRing]) -> None:
    """Close the rings of switches that will never happen (their queue is dropped):
    nobody else holds those writers."""
    for item in messages:
        if isinstance(item, _ToRing):
            item.writer.close()


def _ring_send(ring: RingWriter, frame: bytes) -> bool:
    """``ring.send_nowait``; a closed or broken ring raises (the peer is gone)."""
    if ring.closed:
        raise RingError("the ring to this peer is closed")
    return ring.send_nowait(frame)


def _frames(peer: Peer, messages: list[wire.Message], sizes: list[int]) -> list[bytes]:
    """The frames for ``messages`` to ``peer``: runs of batchable messages become
    BatchMessages (1.1 peers) of at most ``_BATCH_MAX`` messages and ``_BATCH_BYTES``
    (by the messages' sizes before encoding: a DataReady's charge, given by its poster
    in ``sizes`` or computed here, bounds it), everything else a frame of its own."""
    version = peer.session.version
    numbered = peer.session.resumption is not None
    if (len(messages) == 1 and not numbered) or version < (1, 1):
        return [_frame(m, version) for m in messages]
    if 0 not in sizes and len(messages) <= _BATCH_MAX and sum(sizes) <= _BATCH_BYTES:
        # every one a DataReady its poster charged (the common burst): one batch
        return _batch(peer, cast("list[wire.BatchedMessage]", messages), version)
    frames: list[bytes] = []
    run: list[wire.BatchedMessage] = []
    size = 0
    for msg, known in zip(messages, sizes, strict=True):
        if not isinstance(msg, _BATCHABLE):
            frames += _batch(peer, run, version)
            run, size = [], 0
            frames.append(_frame(msg, version))
            continue
        cost = known or (wire.charge(msg) if type(msg) is wire.DataReadyMessage else _SMALL)
        if run and (len(run) >= _BATCH_MAX or size + cost > _BATCH_BYTES):
            frames += _batch(peer, run, version)
            run, size = [], 0
        run.append(msg)
        size += cost
    frames += _batch(peer, run, version)
    return frames


def _batch(peer: Peer, run: list[wire.BatchedMessage], version: tuple[int, int]) -> list[bytes]:
    if not run:
        return []
    numbered = peer.session.resumption is not None
    if len(run) == 1 and not numbered:
        return [_frame(run[0], version)]
    try:
        if numbered:
            return [_numbered(peer, tuple(run))]
        return [wire.encode(wire.BatchMessage(messages=tuple(run)), version=version)]
    except WireFormatError:  # sizes underestimated (long paths, ids): split until it fits
        if len(run) == 1:
            raise
        half = len(run) // 2
        return _batch(peer, run[:half], version) + _batch(peer, run[half:], version)


def _numbers(msg: wire.Message, peer: Peer) -> TypeGuard[wire.BatchedMessage]:
    """Whether ``msg`` to ``peer`` goes in a numbered frame (spec §10.7)."""
    return peer.session.resumption is not None and isinstance(msg, _BATCHABLE)


def _numbered(peer: Peer, run: tuple[wire.BatchedMessage, ...]) -> bytes:
    """The next numbered frame of the session with ``peer``, retained until it acks.

    Raises:
        WireFormatError: the frame would exceed the frame limit (nothing is numbered).
    """
    resumption = peer.session.resumption
    assert resumption is not None
    msg = wire.BatchMessage(
        messages=run,
        from_stage=run[0].from_stage,
        session=resumption.peer_token,
        seq=resumption.next_seq,
        ack=resumption.received,
    )
    frame = wire.encode(msg, version=peer.session.version)
    resumption.sent(frame)
    return frame


def _readdressed(frame: bytes, token: int) -> bytes:
    """A numbered frame of ours, addressed to the peer's new session ``token``."""
    msg = wire.decode(frame)
    assert isinstance(msg, wire.BatchMessage)
    return wire.encode(
        msgspec.structs.replace(msg, session=token), version=wire.peek_version(frame)
    )


def _frame(msg: wire.Message, version: tuple[int, int]) -> bytes:
    """One frame; Hellos and Refusals at our own version (the peer's is not known yet)."""
    if isinstance(msg, wire.HelloMessage | wire.RefusalMessage):
        return wire.encode(msg)
    return wire.encode(msg, version=version)
