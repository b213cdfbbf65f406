"""Per-peer protocol state (spec §7.3, §10.2), sans-I/O.

Theory of operation
-------------------
An endpoint keeps one :class:`Session` per peer. A session starts in
``AWAITING_HELLO``; the peer's HelloMessage moves it to ``ACTIVE``. Until then the
only legal messages from the peer are a Hello and a Refusal, and this side may
not announce data to it. A Hello carrying a different ``instance`` means the peer
restarted: every object in flight with the old instance is returned to the
caller to release, and the session continues with the new instance. A Goodbye
from the current instance moves the session to ``CLOSED`` and returns every
object in flight the same way; from there only a Hello (of any instance) is legal.

Objects are tracked in both directions, keyed by ``object_id`` (unique per
sending endpoint instance)::

    outbound (we sent a DataRef)          inbound (the peer sent us a DataRef)
    announce ──► ANNOUNCED                 DataReady ──► OPEN(ready)
    advance  ──► ANNOUNCED (ready grows)   DataProgress ──► OPEN (ready grows, ≤ length)
    DataAck  ──► removed                   we ACK ──► removed

The session stores the endpoint's own records (subclasses of
:class:`OutboundObject` / :class:`InboundObject`), so one typed record per object
carries both the protocol state and the endpoint's handles.

Everything else is a protocol error that names the offender: a
:class:`RemoteProtocolError` when the peer sent it (an ACK for an object it was
never sent, a duplicate ACK, progress backwards or past the end), a
:class:`LocalProtocolError` when this side tried it. Errors never change state,
so one bad message cannot corrupt the session.
"""

from __future__ import annotations

import enum
import secrets
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..errors import LocalProtocolError, RemoteProtocolError
from ._constants import SUPPORTED_MAJORS, WIRE_VERSION
from ._messages import (
    AbortMessage,
    DataAckMessage,
    DataProgressMessage,
    DataReadyMessage,
    GoodbyeMessage,
    HelloMessage,
    Message,
    RefusalMessage,
    WindowMessage,
)

__all__ = [
    "RESUME_FEATURE",
    "HelloOutcome",
    "InboundObject",
    "OutboundObject",
    "PeerState",
    "Resumption",
    "Session",
    "negotiate",
]


class PeerState(enum.Enum):
    AWAITING_HELLO = "awaiting_hello"
    ACTIVE = "active"
    CLOSED = "closed"

    # Members are singletons compared by identity: hash them the same way, in C
    # (Enum's own __hash__ is Python code, run for every message a peer sends).
    __hash__ = object.__hash__


_ACTIVE = PeerState.ACTIVE  # (a module global: reading it through the enum costs 70 ns)


class HelloOutcome(enum.Enum):
    NEW = "new"  # first Hello from this peer (or first after it closed)
    DUPLICATE = "duplicate"  # same instance again (e.g. a reconnect)
    RESTART = "restart"  # a new instance of the peer, or its higher epoch: old objects are gone


@dataclass(eq=False)
class OutboundObject:
    """An object this side announced and the peer has not acknowledged yet."""

    object_id: int
    request_id: str
    length: int
    ready: int


@dataclass(eq=False)
class InboundObject:
    """An object the peer announced and this side has not acknowledged yet."""

    object_id: int
    request_id: str
    length: int
    ready: int


#: The Hello feature that numbers a session's frames so that it outlives its
#: connection (spec §10.7).
RESUME_FEATURE = "resume"


def new_token() -> int:
    """A session token (spec §10.7): random, never 0."""
    return secrets.randbits(63) + 1


class Resumption:
    """The numbered frames of one session, both ways (spec §10.7).

    Theory of operation
    -------------------
    Every frame this side sends the peer in the session (but Hellos, Goodbyes and
    acks alone) is a BatchMessage numbered 1, 2, 3, …, carrying the peer's session
    token and ``ack``: the highest number of the peer's frames applied here, in
    order. Its bytes are **retained** until the peer acknowledges that number. When
    our link to the peer comes up again, every retained frame is sent again, in
    order; so is every one when the peer's token changes while the session goes on
    (it ended its side of the session and numbers from 1 again: those frames are
    re-addressed to the new token). The receiver applies a frame only if it carries
    its own current token and the next number it expects; anything else — a frame
    it already has, or one after a gap (frames a dropped connection lost, which come
    again) — is dropped whole. So no frame is applied twice or out of order, and
    none is lost while the session lasts.

    Bounds: what is retained is what the peer has not acknowledged; the peer acks
    at least every ``ACK_FRAMES`` frames it applies and at every housekeeping tick,
    and the peer's window (§7.6) bounds what may be outstanding.
    """

    __slots__ = (
        "ack_sent",
        "acked",
        "next_seq",
        "peer_token",
        "received",
        "retained",
        "retained_bytes",
        "token",
        "waiters",
    )

    def __init__(self, token: int, peer_token: int) -> None:
        self.token = token  # ours: the peer's numbered frames must carry it
        self.peer_token = peer_token  # the peer's: our numbered frames carry it
        self.next_seq = 1  # the number of the next frame we send
        self.acked = 0  # the highest of our numbers the peer acknowledged
        self.retained: deque[tuple[int, bytes]] = deque()  # (number, frame), after ``acked``
        self.retained_bytes = 0
        self.received = 0  # the highest number of the peer's frames applied, in order
        self.ack_sent = 0  # the last ``received`` we told the peer
        #: (number, callback): called once the peer acknowledged that frame; at most
        #: one per object in flight (the sender's credits bound them)
        self.waiters: deque[tuple[int, Callable[[], None]]] = deque()

    def sent(self, frame: bytes) -> int:
        """``frame`` (numbered ``next_seq``, carrying ``received`` as its ack) is sent:
        retain it until acknowledged; returns its number. (One call, after the frame
        was made: one that could not be made takes no number.)"""
        seq = self.next_seq
        self.next_seq = seq + 1
        self.ack_sent = self.received
        self.retained.append((seq, frame))
        self.retained_bytes += len(frame)
        return seq

    def on_ack(self, ack: int) -> None:
        """The peer applied our frames up to ``ack``: forget them.

        Raises:
            RemoteProtocolError: ``ack`` names a frame we never sent.
        """
        if ack >= self.next_seq:
            raise RemoteProtocolError(
                f"ack of frame {ack}, but only {self.next_seq - 1} were sent in this session"
            )
        if ack <= self.acked:
            return
        self.acked = ack
        retained = self.retained
        while retained and retained[0][0] <= ack:
            self.retained_bytes -= len(retained.popleft()[1])
        waiters = self.waiters
        while waiters and waiters[0][0] <= ack:
            waiters.popleft()[1]()

    def when_acked(self, seq: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the peer acknowledged frame ``seq`` (at once if it has);
        never if the session ends first."""
        if seq <= self.acked:
            callback()
        else:
            self.waiters.append((seq, callback))

    def accept(self, token: int, seq: int) -> bool:
        """Whether to apply a frame of the peer's numbered ``seq`` for session ``token``
        (else it is dropped whole: stale, a duplicate, or after a gap)."""
        if token != self.token:
            return False
        if seq == 0:
            return True  # an ack alone
        if seq != self.received + 1:
            return False
        self.received = seq
        return True

    def ack_due(self, frames: int) -> bool:
        """Whether the peer should be told ``received`` now: ``frames`` or more of its
        frames applied since we last told it."""
        return self.received - self.ack_sent >= frames


O = TypeVar("O", bound=OutboundObject)  # noqa: E741 - the outbound record type
I = TypeVar("I", bound=InboundObject)  # noqa: E741 - the inbound record type

#: Which message types are legal from the peer in each state.
#: The messages addressed to one stage (their ``to_stage`` must name this side).
_ADDRESSED = (DataReadyMessage, DataProgressMessage, DataAckMessage, WindowMessage)

_LEGAL: dict[PeerState, frozenset[type]] = {
    PeerState.AWAITING_HELLO: frozenset({HelloMessage, RefusalMessage}),
    PeerState.ACTIVE: frozenset(
        {
            HelloMessage,
            DataReadyMessage,
            DataProgressMessage,
            DataAckMessage,
            AbortMessage,
            GoodbyeMessage,
            RefusalMessage,
            WindowMessage,
        }
    ),
    PeerState.CLOSED: frozenset({HelloMessage, RefusalMessage}),
}


def negotiate(hello: HelloMessage) -> tuple[int, int] | None:
    """The wire version to use with a peer: the highest version in both ranges
    (spec §8.2), or None when the ranges share no major version."""
    ours_min, ours_max = (WIRE_VERSION[0], 0), WIRE_VERSION
    low = max(ours_min, hello.wire_min)
    high = min(ours_max, hello.wire_max)
    if low > high or high[0] not in SUPPORTED_MAJORS:
        return None
    return high


@dataclass(eq=False)
class Session(Generic[O, I]):
    """What this endpoint knows about one peer. Feed it every message from the peer."""

    local_name: str
    peer_name: str
    state: PeerState = PeerState.AWAITING_HELLO
    hello: HelloMessage | None = None
    #: The version both sides speak (set by the Hello): what this side may send.
    version: tuple[int, int] = (1, 0)
    outbound: dict[int, O] = field(default_factory=dict)
    inbound: dict[int, I] = field(default_factory=dict)
    #: Our token for the session (spec §10.7): a new one whenever it ends.
    token: int = field(default_factory=new_token)
    #: Whether this side numbers its sessions (offers ``"resume"`` in its Hellos).
    resumes: bool = False
    #: The numbered frames of the session, when both sides offered ``"resume"``.
    resumption: Resumption | None = None

    # -- messages from the peer -------------------------------------------------

    def check(self, msg: Message) -> None:
        """Raise RemoteProtocolError if ``msg`` is illegal from this peer now."""
        if type(msg) not in _LEGAL[self.state]:
            when = "after its Goodbye" if self.state is PeerState.CLOSED else "before its Hello"
            raise RemoteProtocolError(f"{type(msg).__name__} from {self.peer_name!r} {when}")
        if isinstance(msg, _ADDRESSED) and msg.to_stage != self.local_name:
            raise RemoteProtocolError(
                f"{type(msg).__name__} from {self.peer_name!r} is addressed to "
                f"{msg.to_stage!r}, not {self.local_name!r}"
            )
        if isinstance(msg, DataReadyMessage):  # the common case ends here
            if msg.data_ref is not None and msg.data_ref.object_id in self.inbound:
                raise RemoteProtocolError(
                    f"{self.peer_name!r} announced object {msg.data_ref.object_id} twice"
                )
        elif isinstance(msg, DataProgressMessage):
            obj = self.inbound.get(msg.object_id)
            if obj is None:
                raise RemoteProtocolError(
                    f"DataProgress from {self.peer_name!r} for unknown object {msg.object_id}"
                )
            if not obj.ready <= msg.ready <= obj.length:
                raise RemoteProtocolError(
                    f"DataProgress from {self.peer_name!r} for object {msg.object_id} moves "
                    f"ready from {obj.ready} to {msg.ready} (length {obj.length})"
                )
        elif isinstance(msg, DataAckMessage) and msg.object_id not in self.outbound:
            raise RemoteProtocolError(
                f"DataAck from {self.peer_name!r} for object {msg.object_id}, which is not "
                f"in flight to it (stale, duplicate, or another peer's)"
            )
        elif (
            isinstance(msg, GoodbyeMessage)
            and self.hello is not None
            and msg.instance != self.hello.instance
        ):
            raise RemoteProtocolError(
                f"Goodbye from {self.peer_name!r} names instance {msg.instance}, not the "
                f"current {self.hello.instance}"
            )

    def on_hello(self, msg: HelloMessage) -> tuple[HelloOutcome, list[O], list[I]]:
        """Apply a Hello. On a restart, returns the objects of the old instance.

        Raises:
            RemoteProtocolError: the Hello names another endpoint, or no wire version
                in its range is one this side speaks.
        """
        if msg.endpoint != self.peer_name:
            raise RemoteProtocolError(
                f"HelloMessage from {msg.endpoint!r} arrived on the session of {self.peer_name!r}"
            )
        version = negotiate(msg)
        if version is None:
            raise RemoteProtocolError(
                f"{msg.endpoint!r} speaks wire {msg.wire_min[0]}.{msg.wire_min[1]}–"
                f"{msg.wire_max[0]}.{msg.wire_max[1]}; this endpoint speaks "
                f"{WIRE_VERSION[0]}.0–{WIRE_VERSION[0]}.{WIRE_VERSION[1]}"
            )
        previous, restarts = self.hello, self.restarts(msg)
        was_closed = self.state is PeerState.CLOSED
        self.hello = msg
        self.version = version
        self.state = PeerState.ACTIVE
        if previous is None or was_closed:
            self._begin(msg)
            return HelloOutcome.NEW, [], []
        if not restarts:
            if self.resumption is not None and msg.session:
                self.resumption.peer_token = msg.session  # see :meth:`rekeyed`
            return HelloOutcome.DUPLICATE, [], []
        # a new instance, or the same one that gave our session up (it declared us
        # lost while we did not notice, §10.6): either way its old objects are gone
        lost_out, lost_in = self._take_all()
        self.token = new_token()
        self._begin(msg)
        return HelloOutcome.RESTART, lost_out, lost_in

    def _begin(self, msg: HelloMessage) -> None:
        """A session starts with ``msg``: number its frames if both sides resume."""
        resumes = self.resumes and RESUME_FEATURE in msg.features and msg.session != 0
        self.resumption = Resumption(self.token, msg.session) if resumes else None

    def restarts(self, msg: HelloMessage) -> bool:
        """Whether :meth:`on_hello` of ``msg`` would end an active session: another
        instance, or the same one with a higher ``epoch`` (§10.6)."""
        previous = self.hello
        if previous is None or self.state is PeerState.CLOSED:
            return False
        same = previous.instance == msg.instance and previous.process_token == msg.process_token
        return not (same and msg.epoch <= previous.epoch)

    def on_goodbye(self, msg: GoodbyeMessage) -> tuple[list[O], list[I]]:
        """Apply a Goodbye: the peer closed; returns every object in flight with it."""
        self.check(msg)
        self.state = PeerState.CLOSED
        self._end()
        return self._take_all()

    def reset(self) -> tuple[list[O], list[I]]:
        """The peer was lost: back to ``AWAITING_HELLO``; returns every object in flight."""
        self.state = PeerState.AWAITING_HELLO
        self.hello = None
        self._end()
        return self._take_all()

    def _end(self) -> None:
        """The session ended: its numbered frames are void, and a new token tells the
        peer's frames of it from those of the next session."""
        self.resumption = None
        self.token = new_token()

    def _take_all(self) -> tuple[list[O], list[I]]:
        lost_out = list(self.outbound.values())
        lost_in = list(self.inbound.values())
        self.outbound.clear()
        self.inbound.clear()
        return lost_out, lost_in

    def on_data_ready(self, msg: DataReadyMessage, record: I | None) -> None:
        """Check a DataReady and open the inbound object it announces (``record``,
        built by the caller from ``msg.data_ref``; None when it carries no DataRef)."""
        if msg.data_ref is None and self.state is _ACTIVE and msg.to_stage == self.local_name:
            return  # :meth:`check` of an inline message or a stream end, in one test
        self.check(msg)
        if record is not None:
            self.inbound[record.object_id] = record

    def on_progress(self, msg: DataProgressMessage) -> I:
        self.check(msg)
        obj = self.inbound[msg.object_id]
        obj.ready = msg.ready
        return obj

    def on_ack(self, msg: DataAckMessage) -> O:
        self.check(msg)
        return self.outbound.pop(msg.object_id)

    def close_inbound(self, object_id: int) -> I | None:
        """This side acknowledged (or dropped) an inbound object."""
        return self.inbound.pop(object_id, None)

    # -- what this side sends -----------------------------------------------------

    def announce(self, obj: O) -> None:
        """Record an object this side is about to announce with a DataReady.

        Raises:
            LocalProtocolError: no Hello from the peer yet, or the id is in flight.
        """
        if self.state is not PeerState.ACTIVE:
            raise LocalProtocolError(f"cannot send to {self.peer_name!r} before its HelloMessage")
        if obj.object_id in self.outbound:
            raise LocalProtocolError(f"object {obj.object_id} is already in flight")
        self.outbound[obj.object_id] = obj

    def advance(self, object_id: int, ready: int) -> None:
        """Record a DataProgress this side is about to send."""
        obj = self.outbound.get(object_id)
        if obj is None or not obj.ready <= ready <= obj.length:
            raise LocalProtocolError(f"illegal progress {ready} for object {object_id}")
        obj.ready = ready

    def forget_outbound(self, object_id: int) -> O | None:
        """Drop an outbound object without an ACK (its send failed before the DataReady left)."""
        return self.outbound.pop(object_id, None)

    def outbound_of(self, request_id: str) -> Iterator[O]:
        return (o for o in list(self.outbound.values()) if o.request_id == request_id)

    def inbound_of(self, request_id: str) -> Iterator[I]:
        return (o for o in list(self.inbound.values()) if o.request_id == request_id)
