"""The control plane: ZeroMQ sockets that move frames, and nothing else.

Each endpoint binds one PULL socket (its ``address``) that every peer PUSHes
frames into, and one PUB socket for aborts that every peer's SUB listens to. It
connects one PUSH and one SUB per peer. ``ipc://`` on one host, ``tcp://``
across hosts. The control plane does not decode frames and knows nothing of
backends; it reports connection events so the endpoint can tell a dead peer.

Authentication (optional): with a shared key every socket runs ZMQ CURVE
(encrypted, authenticated); the bound sockets accept only clients that present
the key pair derived from the same key, so a process without the key can
deliver nothing — no DataReady, no ACK, no abort.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from .errors import AddressError, EndpointClosedError, OmniwireError
from .wire import MAX_FRAME_SIZE

__all__ = ["Address", "ControlPlane", "CurveKey", "PeerEvent", "parse_address"]

log = logging.getLogger("omniwire.control")

#: ZMQ drops a connection that sends a larger message, before it reaches memory.
#: Frames between MAX_FRAME_SIZE and this are received and refused by the decoder.
_ZMQ_MAX_MSG = 2 * MAX_FRAME_SIZE


class PeerEvent(enum.Enum):
    UP = "up"  # handshake with the peer's PULL socket completed
    DOWN = "down"  # the connection closed (zmq will retry)
    AUTH_FAILED = "auth_failed"  # the peer refused our credentials


@dataclass(frozen=True)
class CurveKey:
    """A CURVE key pair derived from a shared secret (any string or bytes)."""

    public: bytes
    secret: bytes

    @classmethod
    def from_shared_secret(cls, secret: str | bytes) -> CurveKey:
        raw = secret.encode() if isinstance(secret, str) else secret
        if not raw:
            raise ValueError("the shared authentication key is empty")
        secret_z85 = z85.encode(hashlib.sha256(b"omniwire-curve-v1\0" + raw).digest())
        return cls(public=zmq.curve_public(secret_z85), secret=secret_z85)


class _AllowOne:
    """ZAP credentials provider: accept exactly one client public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


@dataclass(frozen=True)
class Address:
    """TEMPORARY stand-in (the leaf module replaces it)."""

    scheme: str
    path: str | None = None
    host: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.path}"
        return f"tcp://{self.host}:{self.port if self.port else '*'}"


def parse_address(text: str, *, what: str = "address", bind: bool = False) -> Address:
    """TEMPORARY stand-in."""
    if not isinstance(text, str) or not text:
        raise AddressError(f"{what} {text!r} is not a ZeroMQ address")
    if text.startswith("ipc://"):
        path = text[6:]
        if not path or len(path.encode()) > 100:
            raise AddressError(f"{what} {text!r}: bad ipc path")
        return Address("ipc", path=path)
    if text.startswith("tcp://"):
        host, _, port = text[6:].rpartition(":")
        if not host or not (port.isdigit() or (bind and port == "*")):
            raise AddressError(f"{what} {text!r}: bad tcp address")
        return Address("tcp", host=host, port=int(port) if port.isdigit() else 0)
    raise AddressError(f"{what} {text!r} is not an ipc:// or tcp:// address")


def ipc_path(address: str) -> str | None:
    return address[len("ipc://") :] if address.startswith("ipc://") else None


def derive_abort_address(address: str) -> str:
    """Where the PUB socket binds: beside the ipc path, or a free tcp port."""
    path = ipc_path(address)
    if path is not None:
        return f"ipc://{path}.abort"
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        return f"tcp://{host}:*"
    raise OmniwireError(f"unsupported control address {address!r}: use ipc:// or tcp://")


def primary_ip() -> str:
    """This host's address as others see it (the route to a public address), or loopback."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def advertised(address: str) -> str:
    """A bound address as peers should dial it: a wildcard host becomes this host's IP."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if host in ("0.0.0.0", "*", "[::]", "::"):
            return f"tcp://{primary_ip()}:{port}"
    return address


class ControlPlane:
    """Sockets of one endpoint. Not thread-safe: use it from the event loop."""

    def __init__(
        self,
        address: str,
        *,
        key: CurveKey | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 3.0,
    ) -> None:
        self.address = address
        self.abort_address = derive_abort_address(address)
        self.key = key
        self._hb = (int(heartbeat_interval * 1000), int(heartbeat_timeout * 1000))
        self._ctx = zmq.asyncio.Context()
        self._auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self._monitors: dict[str, zmq.asyncio.Socket] = {}
        self._subscribed: set[str] = set()
        self._waiting: dict[str, int] = {}  # async sends in progress, per peer
        self._closed = False

    def _options(self, sock: zmq.Socket[Any], *, server: bool) -> None:
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.MAXMSGSIZE, _ZMQ_MAX_MSG)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._hb[0])
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._hb[1])
        sock.setsockopt(zmq.HEARTBEAT_TTL, self._hb[1])
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.key is not None:
            sock.curve_secretkey = self.key.secret
            sock.curve_publickey = self.key.public
            if server:
                sock.curve_server = True
            else:
                sock.curve_serverkey = self.key.public

    async def start(self) -> None:
        """Bind the PULL and PUB sockets (creating ipc directories as needed).

        Raises:
            OmniwireError: the address cannot be bound (in use, bad path, too long).
        """
        if self.key is not None:
            self._auth = zmq.auth.asyncio.AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowOne(self.key.public))
        for address in (self.address, self.abort_address):
            path = ipc_path(address)
            if path is not None:
                if len(path.encode()) > 100:
                    raise OmniwireError(
                        f"ipc path {path!r} is too long for a unix socket (> 100 B)"
                    )
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._pull = self._ctx.socket(zmq.PULL)
        self._options(self._pull, server=True)
        self._pub = self._ctx.socket(zmq.PUB)
        self._options(self._pub, server=True)
        self._sub = self._ctx.socket(zmq.SUB)
        self._options(self._sub, server=False)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            self._pull.bind(self.address)
            self._pub.bind(self.abort_address)
        except zmq.ZMQError as exc:
            self.close()
            raise OmniwireError(f"cannot bind control address {self.address!r}: {exc}") from exc
        self.address = advertised(self._pull.getsockopt_string(zmq.LAST_ENDPOINT))
        self.abort_address = advertised(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    def connect(self, peer: str, address: str) -> zmq.asyncio.Socket:
        """Open (once) the PUSH socket to a peer, and its monitor. Returns the monitor."""
        if peer in self._push:
            return self._monitors[peer]
        sock = self._ctx.socket(zmq.PUSH)
        self._options(sock, server=False)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        sock.connect(address)
        self._push[peer] = sock
        self._monitors[peer] = monitor
        return monitor

    def send_once(self, address: str, frame: bytes) -> bool:
        """TEMPORARY stand-in."""
        try:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 200)
            sock.connect(address)
            try:
                zmq.Socket.send(sock, frame, zmq.DONTWAIT)
            except zmq.Again:
                return False
            finally:
                sock.close()
        except zmq.ZMQError:
            return False
        return True

    def unsubscribe(self, peer: str) -> None:
        """TEMPORARY stand-in."""

    def has_peer(self, peer: str) -> bool:
        return peer in self._push

    def subscribe(self, peer: str, abort_address: str) -> None:
        """Listen to a peer's abort broadcasts (once per address)."""
        if self._sub is None or not abort_address or abort_address in self._subscribed:
            return
        self._subscribed.add(abort_address)
        self._sub.connect(abort_address)

    async def events(self, peer: str) -> AsyncIterator[PeerEvent]:
        """Connection events of the PUSH socket to ``peer``, until it is closed."""
        monitor = self._monitors.get(peer)
        if monitor is None:
            return
        while True:
            try:
                raw = await monitor.recv_multipart()
            except (zmq.ZMQError, zmq.error.ContextTerminated, EndpointClosedError):
                return
            event = parse_monitor_message(raw)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                yield PeerEvent.UP
            elif event == zmq.EVENT_DISCONNECTED:
                yield PeerEvent.DOWN
            elif event in (
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                yield PeerEvent.AUTH_FAILED
            elif event == zmq.EVENT_MONITOR_STOPPED:
                return

    async def send(self, peer: str, frame: bytes) -> None:
        """Queue one frame to ``peer`` (never blocks on a slow or absent peer).

        Raises:
            EndpointClosedError: the control plane is closed.
            KeyError: ``connect`` was never called for ``peer``.
        """
        if self._closed:
            raise EndpointClosedError("control plane is closed")
        if self.send_nowait(peer, frame):
            return
        sock = self._push[peer]
        self._waiting[peer] = self._waiting.get(peer, 0) + 1
        try:
            await sock.send(frame, copy=len(frame) < 65536)
        finally:
            self._waiting[peer] -= 1

    def send_nowait(self, peer: str, frame: bytes) -> bool:
        """Send one frame now if ZeroMQ can queue it without waiting; False if not
        (then :meth:`send` waits). Skipped while an earlier send to the peer waits,
        so frames to a peer never overtake each other."""
        sock = self._push.get(peer)
        if sock is None or self._closed or self._waiting.get(peer):
            return False
        try:
            zmq.Socket.send(sock, frame, zmq.DONTWAIT)  # the plain socket: no future
        except zmq.Again:
            return False
        return True

    async def publish(self, frame: bytes) -> None:
        if self._pub is None or self._closed:
            raise EndpointClosedError("control plane is closed")
        await self._pub.send(frame)

    async def recv(self) -> bytes:
        """The next frame any peer pushed to this endpoint."""
        if self._pull is None or self._closed:
            raise EndpointClosedError("control plane is closed")
        try:  # frames already queued are taken without a future; this is the only reader
            return zmq.Socket.recv(self._pull, zmq.DONTWAIT)
        except zmq.Again:
            return await self._pull.recv()

    async def recv_abort(self) -> bytes:
        """The next abort frame any peer published."""
        if self._sub is None or self._closed:
            raise EndpointClosedError("control plane is closed")
        return await self._sub.recv()

    def disconnect(self, peer: str) -> None:
        sock = self._push.pop(peer, None)
        monitor = self._monitors.pop(peer, None)
        if sock is not None:
            sock.disable_monitor()
            sock.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)

    def close(self) -> None:
        """Close every socket (pending frames get up to 0.5 s to leave) and the context."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._push):
            sock = self._push.pop(peer)
            sock.disable_monitor()
            sock.close()
        for monitor in self._monitors.values():
            monitor.close(linger=0)
        self._monitors.clear()
        for bound in (self._pull, self._pub, self._sub):
            if bound is not None:
                bound.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        for address in (self.address, self.abort_address):
            path = ipc_path(address)
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
