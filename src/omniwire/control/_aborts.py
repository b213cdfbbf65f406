"""Aborts: the PUB socket this endpoint broadcasts them on, and the SUB socket
connected to every peer's PUB, one connection per abort address however many
peers name it.

libzmq applies a subscriber's subscriptions when the application calls into the
PUB socket; until then they wait in its queue, which has no limit (spec §3.4). So
the PUB's descriptor is watched, and each signal has libzmq apply what waits.

libzmq also keeps every distinct topic a subscriber names for as long as it stays
connected, and no socket option bounds them or drops one subscriber. Subscribers
need only the empty topic (spec §3.4), so the PUB is an XPUB, which reports each
topic when its first subscriber adds it and when its last one goes: past
``MAX_TOPICS`` the socket is closed and bound anew at the same address. Every
subscriber's connection ends with it; ours reconnect by themselves and subscribe
again, and the broadcast is best effort (aborts also go directly, §7.5)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import cast

import zmq
import zmq.asyncio

from .._ratelimit import RateLimitedLog
from ..addresses import Address, parse_address
from ..errors import AddressError, AddressInUseError, EndpointClosedError
from ._sockets import Sockets, remove_reader

log = logging.getLogger("omniwire.control")
_noisy = RateLimitedLog(log, interval=10.0)  # a subscriber may make us renew over and over

#: Distinct topics the abort socket's subscribers may hold together before it is
#: made anew (they need one: the empty topic).
MAX_TOPICS = 64
#: The largest subscription message taken (a larger one ends its connection).
_MAX_SUBSCRIPTION = 1024
#: Subscription notices read per event-loop turn.
_NOTICES_PER_TURN = 256
#: A new socket's bind is retried while the old one's listener closes (libzmq closes
#: it in its I/O thread): every 10 ms, this many times.
_BIND_TRIES = 200


class Aborts:
    """The PUB and SUB sockets (see :class:`ControlPlane`'s ``subscribe`` and
    ``publish``); the plane reads the SUB. The caller checks that the plane is open."""

    def __init__(self, sockets: Sockets) -> None:
        self._sockets = sockets
        self.pub: zmq.asyncio.Socket | None = None
        self.sub: zmq.asyncio.Socket | None = None
        self._subscriptions: dict[str, str] = {}  # peer -> abort address
        self._sub_refs: dict[str, int] = {}  # abort address -> peers subscribed
        self._watch: tuple[asyncio.AbstractEventLoop, int] | None = None  # the PUB's FD
        self._ipv6 = False
        self._topics: set[bytes] = set()  # held by the PUB's subscribers
        self._rebind: asyncio.TimerHandle | None = None  # a bind of a new PUB, retried
        #: Times the PUB was made anew (its subscribers named too many topics).
        self.renewals = 0

    def open_pub(self, *, ipv6: bool) -> zmq.asyncio.Socket:
        """Make the PUB socket (the caller binds it), and have libzmq apply its
        subscriptions as they come, on the running event loop."""
        self._ipv6 = ipv6
        self.pub = pub = self._sockets.socket(zmq.XPUB, server=True, ipv6=ipv6)
        pub.setsockopt(zmq.MAXMSGSIZE, _MAX_SUBSCRIPTION)
        loop = asyncio.get_running_loop()
        fd = cast(int, pub.getsockopt(zmq.FD))
        loop.add_reader(fd, self._apply_subscriptions)
        self._watch = (loop, fd)
        return pub

    def _apply_subscriptions(self) -> None:
        """Have libzmq apply what subscribers sent, and count the topics they hold
        (reading until libzmq has nothing more re-arms the descriptor)."""
        pub = self.pub
        if pub is None or pub.closed:
            return
        topics = self._topics
        try:
            for _ in range(_NOTICES_PER_TURN):
                notice = zmq.Socket.recv(pub, zmq.NOBLOCK)
                if notice[:1] == b"\x01":
                    topics.add(notice[1:])
                else:
                    topics.discard(notice[1:])
            else:  # more may wait: the next turn reads on
                asyncio.get_running_loop().call_soon(self._apply_subscriptions)
        except zmq.Again:
            pass
        except zmq.ZMQError:
            return
        if len(topics) > MAX_TOPICS:
            self._renew(pub)

    def _renew(self, old: zmq.asyncio.Socket) -> None:
        """Close the PUB, whose subscribers hold too many topics, and bind a new one
        at its address."""
        where = old.getsockopt_string(zmq.LAST_ENDPOINT)
        try:
            addr = parse_address(where, what="abort address")
        except AddressError as exc:  # (what libzmq says it bound: not expected)
            log.error("abort socket %s: cannot be made anew (%s)", where, exc)
            return
        self.renewals += 1
        _noisy.log(
            logging.WARNING,
            "abort_topics",
            "abort socket %s: its subscribers named %d topics (at most %d are kept; the "
            "empty one is all a peer needs): made anew, which drops every subscriber",
            where,
            len(self._topics),
            MAX_TOPICS,
        )
        self._close_pub()
        try:
            self.open_pub(ipv6=self._ipv6)
        except zmq.ZMQError as exc:  # out of sockets or descriptors: none until close
            log.error("abort socket: cannot make a new one (%s); aborts go only directly", exc)
            return
        self._bind_again(addr, _BIND_TRIES)

    def _bind_again(self, addr: Address, tries: int) -> None:
        self._rebind = None
        pub = self.pub
        if pub is None:
            return
        try:
            self._sockets.bind(pub, addr)
        except AddressInUseError:  # the old socket's listener is still closing
            if tries > 1:
                loop = asyncio.get_running_loop()
                self._rebind = loop.call_later(0.01, self._bind_again, addr, tries - 1)
                return
            log.error("abort socket: cannot bind %s again; aborts go only directly", addr)
        except AddressError as exc:
            log.error("abort socket: cannot bind %s again (%s); aborts go only directly", addr, exc)

    def _close_pub(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            remove_reader(*watch)  # before the socket (and its FD) goes
        if self._rebind is not None:
            self._rebind.cancel()
            self._rebind = None
        self._sockets.close(self.pub)
        self.pub = None
        self._topics.clear()

    def subscribe(self, peer: str, abort_address: str) -> None:
        if not abort_address:
            return
        addr = parse_address(abort_address, what=f"peer {peer!r} abort address")
        canonical = str(addr)
        if self._subscriptions.get(peer) == canonical:
            return
        if not self._sub_refs.get(canonical):
            assert self.sub is not None
            try:
                if addr.is_ipv6:  # options apply to connections made after they are set
                    self.sub.setsockopt(zmq.IPV6, 1)
                try:
                    self.sub.connect(canonical)
                finally:
                    if addr.is_ipv6:
                        self.sub.setsockopt(zmq.IPV6, 0)
            except zmq.ZMQError as exc:
                raise AddressError(
                    f"cannot subscribe to peer {peer!r} aborts at {abort_address!r}: {exc}"
                ) from exc
        self.unsubscribe(peer)
        self._subscriptions[peer] = canonical
        self._sub_refs[canonical] = self._sub_refs.get(canonical, 0) + 1

    def unsubscribe(self, peer: str) -> None:
        address = self._subscriptions.pop(peer, None)
        if address is None:
            return
        left = self._sub_refs.get(address, 0) - 1
        if left > 0:
            self._sub_refs[address] = left
            return
        self._sub_refs.pop(address, None)
        if self.sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sub.disconnect(address)

    def subscribed(self) -> dict[str, int]:
        return dict(self._sub_refs)

    def publish(self, frame: bytes) -> None:
        if self.pub is None:  # made anew and not bound again: no subscriber to drop it for
            return
        try:
            zmq.Socket.send(self.pub, frame, zmq.DONTWAIT)
        except zmq.Again:
            pass  # PUB drops rather than wait; nothing to do
        except zmq.ZMQError as exc:
            raise EndpointClosedError(f"control plane is closed: {exc}") from exc
        self._apply_subscriptions()  # the send may have taken the FD's signal

    def close(self) -> None:
        self._close_pub()
        self._sockets.close(self.sub)
        self.sub = None
        self._subscriptions.clear()
        self._sub_refs.clear()
