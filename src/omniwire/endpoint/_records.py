"""The records of an endpoint: one per peer, one per object in flight per side.

An :class:`OutRecord` (sender) and an :class:`InRecord` (receiver) are the
protocol session's own entries (they subclass the sans-I/O
:class:`~omniwire.wire.OutboundObject` / :class:`~omniwire.wire.InboundObject`),
so the protocol state and the handles that hold memory live in one typed
object. Each has one release path, idempotent, whatever ended the object:
ACK, NACK, abort, peer loss, timeout, close, cancellation.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import torch

from .. import wire
from ..backends.base import Export, Import, Layout, PeerInfo
from ..delivery import Outcome, SendReceipt
from ..errors import PeerRefusedError
from ..flow import Credits, ReceiveWindow, Window
from ..ring import RingReader, RingWriter
from ..routing import Candidate, Edge, RouteCache
from ._inbox import Inbox
from ._stats import RouteStats

__all__ = [
    "READY",
    "ExportShare",
    "ForwardedExport",
    "InRecord",
    "OutRecord",
    "Peer",
    "PeerStatus",
    "SharedExport",
]


class PeerStatus(enum.Enum):
    CONNECTING = "connecting"  # no accepted Hello yet (or not reachable yet)
    READY = "ready"  # Hello accepted, backends connected, our PUSH is up
    LOST = "lost"  # died, hung, or disconnected too long
    CLOSED = "closed"  # said Goodbye


#: ``PeerStatus.READY``, for the per-message paths: reading a member through its
#: enum class costs 70 ns in Python 3.11, a module global 5.
READY = PeerStatus.READY


#: Seconds without a numbered frame from a resuming peer after which it may have ended
#: its side of the session unseen (a loss it noticed and we did not): a landed object's
#: receipt then completes only once the peer acknowledged its announce, and the peer,
#: hearing from us after as long, acknowledges at once (spec §10.7).
QUIET = 1.0


@dataclass(eq=False, kw_only=True)
class OutRecord(wire.OutboundObject):
    """One object this endpoint announced (or is about to announce) to a peer.

    Owns a credit of ``length`` bytes while ``credits`` is set and the export
    while ``export`` is set; :meth:`release` gives both back and settles the
    receipt, exactly once.
    """

    peer: Peer
    generation: int
    receipt: SendReceipt
    stats: RouteStats
    credits: Credits | None = None
    export: Export | ExportShare | None = None
    deadline: float = float("inf")
    released: bool = False

    def fail(self, error: BaseException) -> None:
        """Settle the receipt with ``error`` but keep the buffer: the peer may still
        read it until its ACK (ACK timeout, abort)."""
        self.receipt.resolve(error)

    def release(self, error: BaseException | None, outcome: Outcome = "unknown") -> None:
        """The object is over: free the export, return the credit, settle the receipt
        (``outcome`` when ``error`` is set: ``"refused"`` for a NACK, ``"not sent"``
        before it was announced; ``"unknown"`` otherwise)."""
        if self.released:
            return
        self.released = True
        session = self.peer.session
        if session.outbound.get(self.object_id) is self:
            del session.outbound[self.object_id]
        if self.export is not None:
            export, self.export = self.export, None
            export.release()
        if self.credits is not None:
            credits, self.credits = self.credits, None
            credits.release(self.length)
        if error is None and not self.receipt.done():
            self.receipt.resolve()
            if self.receipt.latency is not None:
                self.stats.latencies.append(self.receipt.latency)
        else:
            self.receipt.resolve(error)
        self.receipt.settle("delivered" if error is None else outcome)


class SharedExport:
    """One export that several objects of a fan-out announce (a backend with
    ``Capabilities.shared_refs``): each object holds an :class:`ExportShare`, and
    the export is released when the last share is, and the fan-out let go.

    The fan-out holds a share of its own while it announces, so an early ACK
    cannot free the buffer before every target was told of it.
    """

    __slots__ = ("export", "published", "users")

    def __init__(self, export: Export) -> None:
        self.export = export
        self.users = 1  # the fan-out's own hold
        self.published = 0

    def share(self) -> ExportShare:
        self.users += 1
        return ExportShare(self)

    def drop(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.export.release()


class ForwardedExport(SharedExport):
    """A :class:`SharedExport` of bytes this endpoint received zero-copy and forwards
    by reference (``Import.forward``): when it is released — the last downstream
    ACK, NACK, abort or loss — ``let_go`` ends its hold on the upstream object, whose
    ACK waits for it."""

    __slots__ = ("_let_go",)

    def __init__(self, export: Export, let_go: Callable[[], None]) -> None:
        super().__init__(export)
        self._let_go: Callable[[], None] | None = let_go

    def drop(self) -> None:
        super().drop()
        if self.users == 0 and self._let_go is not None:
            let_go, self._let_go = self._let_go, None
            let_go()


class ExportShare:
    """One object's hold on a :class:`SharedExport` (what ``OutRecord.export`` holds)."""

    __slots__ = ("_released", "shared")

    def __init__(self, shared: SharedExport) -> None:
        self.shared = shared
        self._released = False

    @property
    def layout(self) -> Layout:
        return self.shared.export.layout

    @property
    def ref(self) -> bytes:
        return self.shared.export.ref

    @property
    def buffer(self) -> torch.Tensor | None:
        return None if self._released else self.shared.export.buffer

    async def publish(self, lo: int, hi: int) -> None:
        """Publish once for every share (the bytes are the same)."""
        if hi > self.shared.published:
            await self.shared.export.publish(self.shared.published, hi)
            self.shared.published = hi

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.shared.drop()


@dataclass(eq=False, kw_only=True)
class InRecord(wire.InboundObject):
    """One object a peer announced to this endpoint, until it is ACKed or NACKed
    (:meth:`~omniwire.endpoint._receiver.Receiver.finish` is its one release path)."""

    msg: wire.DataReadyMessage
    ref: wire.DataRef
    generation: int
    progressed: anyio.Event = field(default_factory=anyio.Event)
    imp: Import | None = None
    #: Refused while queued: (NACK reason, text); taken out in order all the same.
    refusal: tuple[wire.NackReason, str] | None = None
    #: Handed to the application as a zero-copy delivery (the ACK waits for release).
    lent: bool = False
    #: Forwards of it by reference in flight (spec §9.2 "Forwarding"): the ACK waits
    #: for the application's release *and* for each of them to end.
    holds: int = 0
    #: The application released the zero-copy delivery.
    app_released: bool = False
    #: The peer is gone: no ACK will be sent for it.
    orphaned: bool = False
    #: What its DataReady counts against the peer's window (spec §7.6).
    charge: int = 0
    finished: bool = False


@dataclass(eq=False)
class Peer:
    """Everything this endpoint knows about one peer, for the life of its name."""

    name: str
    session: wire.Session[OutRecord, InRecord]
    credits: Credits
    #: The address given in ``peers=``/``add_peer`` (we keep connecting to it), if any.
    configured: str | None = None
    #: Where frames to it go (the configured address, else its Hello's).
    address: str | None = None
    status: PeerStatus = PeerStatus.CONNECTING
    #: Set (and replaced) on every change a waiter may care about.
    changed: anyio.Event = field(default_factory=anyio.Event)
    #: Bumped at every new session, so records of an old one are told apart.
    generation: int = 0
    #: How many times this endpoint declared the peer lost: sent in our Hellos, so a
    #: peer that did not notice the loss ends its side of the session (spec §10.6).
    epoch: int = 0
    push_open: bool = False  # our PUSH socket (and its monitor) exist
    connected: bool = False  # our PUSH completed a ZMTP handshake since it was opened
    hello_done: bool = False  # the current Hello was accepted and backends connected
    accepted_at: float = field(default_factory=time.monotonic)
    #: A Hello that would restart the session too soon after the last one, held back
    #: until ``RESTART_INTERVAL`` has passed (the latest wins).
    held_hello: wire.HelloMessage | None = None
    down_since: float | None = None
    #: when our ZeroMQ connection to it dropped while its session was ready (frames
    #: its socket buffers held are gone: the session ends, see ``Peers.tick``)
    dropped_at: float | None = None
    reason: str = ""  # why it was lost or closed
    refusal: PeerRefusedError | None = None
    auth_failure: str = ""
    failed_handshakes: int = 0  # ZMTP handshakes cut short since the last one that succeeded
    reminded_at: float = 0.0  # when we last told it its session had ended (spec §10.7)
    relinked: bool = False  # our link to it broke and came back since its session began
    heard_at: float = 0.0  # when its last numbered frame (or ack) was applied here
    # routing
    info: dict[str, PeerInfo] = field(default_factory=dict)
    edge: Edge | None = None
    candidates: tuple[Candidate, ...] = ()
    routes: RouteCache = field(default_factory=RouteCache)
    # the same-host control ring, each direction (spec §3.6)
    ring_reader: RingReader | None = None  # created by us for its frames
    ring_writer: RingWriter | None = None  # its reader, attached: our frames go there
    ring_attached: str = ""  # the name of the peer's ring we attached to
    ring_attaching: str = ""  # the name of the peer's ring we are attaching to
    ring_reading: bool = False  # our ring's reader loop runs
    # flow control of DataReady charge (spec §7.6), both directions, per session
    window: Window = field(default_factory=lambda: Window(0))  # what the peer grants us
    rwindow: ReceiveWindow = field(default_factory=lambda: ReceiveWindow(4 << 20))  # ours
    ack_timeouts: int = 0  # consecutive ACK deadlines it missed
    # sending
    chunk_ids: dict[str, int] = field(default_factory=dict)
    send_lock: anyio.Lock = field(default_factory=anyio.Lock)
    # receiving: announced objects and data-less messages, in arrival order
    inbox: Inbox[InRecord | wire.DataReadyMessage] = field(default_factory=Inbox)
    busy: bool = False  # an item of the inbox is being taken
    worker: bool = False  # a task is draining the inbox
    current_take: tuple[str, anyio.CancelScope] | None = None
    #: Streams (request ids) with chunks taken and no end yet -> when the last came
    #: (at most ``max_open_streams``; the oldest first, for the idle check).
    open_streams: OrderedDict[str, float] = field(default_factory=OrderedDict)

    @property
    def hello(self) -> wire.HelloMessage | None:
        return self.session.hello

    def close_rings(self) -> None:
        for ring in (self.ring_reader, self.ring_writer):
            if ring is not None:
                ring.close()
        self.ring_reader = self.ring_writer = None
        self.ring_attached = ""

    def notify(self) -> None:
        """Wake every task waiting on this peer's state."""
        self.changed.set()
        self.changed = anyio.Event()
