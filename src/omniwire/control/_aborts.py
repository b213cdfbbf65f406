"""Aborts: the PUB socket this endpoint broadcasts them on, and the SUB socket
connected to every peer's PUB, one connection per abort address however many
peers name it.

libzmq applies a subscriber's subscriptions when the application calls into the
PUB socket; until then they wait in its queue, which has no limit (spec §3.4). So
the PUB's descriptor is watched, and each signal has libzmq apply what waits."""

from __future__ import annotations

import asyncio
import contextlib
from typing import cast

import zmq
import zmq.asyncio

from ..addresses import parse_address
from ..errors import AddressError, EndpointClosedError
from ._sockets import Sockets, remove_reader


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

    def open_pub(self, *, ipv6: bool) -> zmq.asyncio.Socket:
        """Make the PUB socket, and have libzmq apply its subscriptions as they come,
        on the running event loop."""
        self.pub = pub = self._sockets.socket(zmq.PUB, server=True, ipv6=ipv6)
        loop = asyncio.get_running_loop()
        fd = cast(int, pub.getsockopt(zmq.FD))
        loop.add_reader(fd, self._apply_subscriptions)
        self._watch = (loop, fd)
        return pub

    def _apply_subscriptions(self) -> None:
        pub = self.pub
        if pub is not None and not pub.closed:
            with contextlib.suppress(zmq.ZMQError):
                zmq.Socket.getsockopt(pub, zmq.EVENTS)  # processes its commands: re-arms the FD

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
        assert self.pub is not None
        try:
            zmq.Socket.send(self.pub, frame, zmq.DONTWAIT)
        except zmq.Again:
            pass  # PUB drops rather than wait; nothing to do
        except zmq.ZMQError as exc:
            raise EndpointClosedError(f"control plane is closed: {exc}") from exc
        self._apply_subscriptions()  # the send may have taken the FD's signal

    def close(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            remove_reader(*watch)  # before the socket (and its FD) goes
        for sock in (self.pub, self.sub):
            self._sockets.close(sock)
        self.pub = self.sub = None
        self._subscriptions.clear()
        self._sub_refs.clear()
