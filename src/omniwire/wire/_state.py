"""Per-peer protocol state (spec §7), sans-I/O.

Theory of operation
-------------------
An endpoint keeps one :class:`Session` per peer. A session starts in
``AWAITING_HELLO``; the peer's HelloMessage moves it to ``ACTIVE``. Until then the
only legal message from the peer is a Hello, and this side may not announce data
to it. A Hello carrying a different ``instance`` means the peer restarted: every
object in flight with the old instance is returned to the caller to release, and
the session continues with the new instance.

Objects are tracked in both directions, keyed by ``object_id`` (unique per
sending endpoint instance):

    outbound (we sent a DataRef)          inbound (the peer sent us a DataRef)
    announce ──► ANNOUNCED                 DataReady ──► OPEN(ready)
    progress ──► ANNOUNCED (ready grows)   DataProgress ──► OPEN (ready grows, ≤ length)
    DataAck  ──► removed                   we ACK ──► removed

Everything else is a protocol error that names the offender: a
:class:`RemoteProtocolError` when the peer sent it (an ACK for an object it was
never sent, a duplicate ACK, progress backwards or past the end), a
:class:`LocalProtocolError` when this side tried it. Errors never change state,
so one bad message cannot corrupt the session.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import LocalProtocolError, RemoteProtocolError
from ._constants import SUPPORTED_MAJORS, WIRE_VERSION
from ._messages import (
    AbortMessage,
    DataAckMessage,
    DataProgressMessage,
    DataReadyMessage,
    HelloMessage,
    Message,
)

__all__ = ["HelloOutcome", "InboundObject", "OutboundObject", "PeerState", "Session"]


class PeerState(enum.Enum):
    AWAITING_HELLO = "awaiting_hello"
    ACTIVE = "active"


class HelloOutcome(enum.Enum):
    NEW = "new"  # first Hello from this peer
    DUPLICATE = "duplicate"  # same instance again (e.g. a reconnect)
    RESTART = "restart"  # a new instance of the peer: old objects are gone


@dataclass
class OutboundObject:
    """An object this side announced and the peer has not acknowledged yet."""

    object_id: int
    request_id: str
    length: int
    ready: int
    data: Any = None  # the endpoint's own bookkeeping (lease, receipt, ...)


@dataclass
class InboundObject:
    """An object the peer announced and this side has not acknowledged yet."""

    object_id: int
    request_id: str
    length: int
    ready: int
    data: Any = None


#: Which message types are legal from the peer in each state.
_LEGAL: dict[PeerState, frozenset[type]] = {
    PeerState.AWAITING_HELLO: frozenset({HelloMessage}),
    PeerState.ACTIVE: frozenset(
        {HelloMessage, DataReadyMessage, DataProgressMessage, DataAckMessage, AbortMessage}
    ),
}


@dataclass
class Session:
    """What this endpoint knows about one peer. Feed it every message from the peer."""

    local_name: str
    peer_name: str
    state: PeerState = PeerState.AWAITING_HELLO
    hello: HelloMessage | None = None
    outbound: dict[int, OutboundObject] = field(default_factory=dict)
    inbound: dict[int, InboundObject] = field(default_factory=dict)

    # -- messages from the peer -------------------------------------------------

    def check(self, msg: Message) -> None:
        """Raise RemoteProtocolError if ``msg`` is illegal from this peer now."""
        if type(msg) not in _LEGAL[self.state]:
            raise RemoteProtocolError(
                f"{type(msg).__name__} from {self.peer_name!r} before its HelloMessage"
            )
        if (
            isinstance(msg, DataReadyMessage | DataProgressMessage | DataAckMessage)
            and msg.to_stage != self.local_name
        ):
            raise RemoteProtocolError(
                f"{type(msg).__name__} from {self.peer_name!r} is addressed to "
                f"{msg.to_stage!r}, not {self.local_name!r}"
            )
        if isinstance(msg, DataReadyMessage) and msg.data_ref is not None:
            if msg.data_ref.object_id in self.inbound:
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

    def on_hello(
        self, msg: HelloMessage
    ) -> tuple[HelloOutcome, list[OutboundObject], list[InboundObject]]:
        """Apply a Hello. On a restart, returns the objects of the old instance.

        Raises:
            RemoteProtocolError: the Hello names another endpoint, or no wire version
                in its range is one this side speaks.
        """
        if msg.endpoint != self.peer_name:
            raise RemoteProtocolError(
                f"HelloMessage from {msg.endpoint!r} arrived on the session of {self.peer_name!r}"
            )
        majors = set(range(msg.wire_min[0], msg.wire_max[0] + 1))
        if not majors & SUPPORTED_MAJORS:
            raise RemoteProtocolError(
                f"{msg.endpoint!r} speaks wire {msg.wire_min[0]}.{msg.wire_min[1]}–"
                f"{msg.wire_max[0]}.{msg.wire_max[1]}; this endpoint speaks "
                f"{WIRE_VERSION[0]}.{WIRE_VERSION[1]}"
            )
        previous = self.hello
        self.hello = msg
        self.state = PeerState.ACTIVE
        if previous is None:
            return HelloOutcome.NEW, [], []
        if previous.instance == msg.instance and previous.process_token == msg.process_token:
            return HelloOutcome.DUPLICATE, [], []
        lost_out = list(self.outbound.values())
        lost_in = list(self.inbound.values())
        self.outbound.clear()
        self.inbound.clear()
        return HelloOutcome.RESTART, lost_out, lost_in

    def on_data_ready(self, msg: DataReadyMessage, data: Any = None) -> InboundObject | None:
        """Open the inbound object a DataReady announces (None if it carries no DataRef)."""
        self.check(msg)
        ref = msg.data_ref
        if ref is None:
            return None
        ready = ref.ref.length if ref.ready is None else ref.ready
        obj = InboundObject(ref.object_id, msg.request_id, ref.ref.length, ready, data)
        self.inbound[ref.object_id] = obj
        return obj

    def on_progress(self, msg: DataProgressMessage) -> InboundObject:
        self.check(msg)
        obj = self.inbound[msg.object_id]
        obj.ready = msg.ready
        return obj

    def on_ack(self, msg: DataAckMessage) -> OutboundObject:
        self.check(msg)
        return self.outbound.pop(msg.object_id)

    def close_inbound(self, object_id: int) -> InboundObject | None:
        """This side acknowledged (or dropped) an inbound object."""
        return self.inbound.pop(object_id, None)

    # -- what this side sends -----------------------------------------------------

    def announce(self, obj: OutboundObject) -> None:
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

    def forget_outbound(self, object_id: int) -> OutboundObject | None:
        """Drop an outbound object without an ACK (timeout, peer lost)."""
        return self.outbound.pop(object_id, None)

    def outbound_of(self, request_id: str) -> Iterator[OutboundObject]:
        return (o for o in list(self.outbound.values()) if o.request_id == request_id)

    def inbound_of(self, request_id: str) -> Iterator[InboundObject]:
        return (o for o in list(self.inbound.values()) if o.request_id == request_id)
