"""Aborts: the PUB socket this endpoint broadcasts them on, and the SUB socket
connected to every peer's PUB, one connection per abort address however many
peers name it."""

from __future__ import annotations

import contextlib

import zmq
import zmq.asyncio

from ..addresses import parse_address
from ..errors import AddressError, EndpointClosedError
from ._sockets import Sockets


class Aborts:
    """The PUB and SUB sockets (see :class:`ControlPlane`'s ``subscribe`` and
    ``publish``); the plane reads the SUB. The caller checks that the plane is open."""

    def __init__(self, sockets: Sockets) -> None:
        self._sockets = sockets
        self.pub: zmq.asyncio.Socket | None = None
        self.sub: zmq.asyncio.Socket | None = None
        self._subscriptions: dict[str, str] = {}  # peer -> abort address
        self._sub_refs: dict[str, int] = {}  # abort address -> peers subscribed

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

    def close(self) -> None:
        for sock in (self.pub, self.sub):
            self._sockets.close(sock)
        self.pub = self.sub = None
        self._subscriptions.clear()
        self._sub_refs.clear()
