"""The links to peers: one PUSH socket per peer, the sends waiting on it, and the
socket monitor whose events tell the endpoint a peer is up, down or refused us."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..addresses import parse_address
from ..errors import AddressError, OmniwireError, PeerLostError, PeerUnresponsiveError
from ._sockets import Sockets, closed_error, fail_all


class PeerEvent(enum.Enum):
    UP = "up"  # handshake with the peer's PULL socket completed
    DOWN = "down"  # the connection closed (zmq will retry)
    # ZMTP handshake failures, told apart (only the first two are about keys):
    AUTH_FAILED = "auth_failed"  # its ZAP handler refused our CURVE key
    MECHANISM_MISMATCH = "mechanism_mismatch"  # one side runs CURVE, the other not
    HANDSHAKE_FAILED = "handshake_failed"  # cut short: it closed, or (CURVE) a wrong key


#: ZeroMQ's default high-water mark, in frames.
_ZMQ_DEFAULT_HWM = 1000


class _MonitorClosed(Exception):
    """Set on a pending monitor read when its socket is released."""


class Links:
    """The PUSH socket to each peer and its monitor (see :class:`ControlPlane`'s
    ``connect``, ``send`` and ``events``). The caller checks that the plane is open."""

    def __init__(self, sockets: Sockets) -> None:
        self._sockets = sockets
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self._monitors: dict[str, zmq.asyncio.Socket] = {}
        self._waiting: dict[str, int] = {}  # async sends in progress, per peer
        self._blocked: dict[str, float] = {}  # peer -> since when its sends wait
        self._pending: dict[str, set[asyncio.Future[Any]]] = {}  # peer -> send futures
        self._monitor_reads: dict[str, asyncio.Future[Any]] = {}

    # -- peers

    def connect(self, peer: str, address: str) -> zmq.asyncio.Socket:
        if peer in self._push:
            return self._monitors[peer]
        addr = parse_address(address, what=f"peer {peer!r} address")
        sock: zmq.asyncio.Socket | None = None
        monitor: zmq.asyncio.Socket | None = None
        try:
            sock = self._sockets.socket(zmq.PUSH, server=False, ipv6=addr.is_ipv6)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
            self._sockets.track(monitor)
            sock.connect(str(addr))
        except zmq.ZMQError as exc:
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
            self._sockets.close(monitor)
            self._sockets.close(sock)
            raise AddressError(f"cannot connect to peer {peer!r} at {address!r}: {exc}") from exc
        self._push[peer] = sock
        self._monitors[peer] = monitor
        return monitor

    def has_peer(self, peer: str) -> bool:
        return peer in self._push

    def limit_frames(self, peer: str, frames: int) -> None:
        sock = self._push.get(peer)
        if sock is not None:  # libzmq >= 4.3 applies it to the existing pipe too
            sock.setsockopt(zmq.SNDHWM, frames or _ZMQ_DEFAULT_HWM)

    def peers(self) -> list[str]:
        return list(self._push)

    def disconnect(self, peer: str) -> None:
        """Close ``peer``'s PUSH socket and monitor; fail the sends waiting on it."""
        if self._sockets.on_loop_thread():
            fail_all(
                self._pending.pop(peer, ()),
                lambda: PeerLostError(f"the connection to peer {peer!r} was released"),
            )
            read = self._monitor_reads.pop(peer, None)
            if read is not None:
                fail_all((read,), _MonitorClosed)
        self._pending.pop(peer, None)
        self._blocked.pop(peer, None)
        self._waiting.pop(peer, None)
        sock = self._push.pop(peer, None)
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            self._sockets.close(sock, 0)
        self._sockets.close(self._monitors.pop(peer, None))

    async def events(self, peer: str) -> AsyncIterator[PeerEvent]:
        monitor = self._monitors.get(peer)
        if monitor is None:
            return
        while not monitor.closed:
            try:
                read = cast("asyncio.Future[list[bytes]]", monitor.recv_multipart())
            except zmq.ZMQError:
                return
            self._monitor_reads[peer] = read
            try:
                raw = await read
            except (zmq.ZMQError, _MonitorClosed):
                return
            finally:
                if self._monitor_reads.get(peer) is read:
                    del self._monitor_reads[peer]
            parsed = parse_monitor_message(raw)
            event = parsed["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                yield PeerEvent.UP
            elif event == zmq.EVENT_DISCONNECTED:
                yield PeerEvent.DOWN
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                yield PeerEvent.AUTH_FAILED
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and (
                parsed["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            ):
                yield PeerEvent.MECHANISM_MISMATCH
            elif event in (
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                yield PeerEvent.HANDSHAKE_FAILED
            elif event == zmq.EVENT_MONITOR_STOPPED:
                return

    # -- frames out

    async def send(self, peer: str, frame: bytes, *, timeout: float | None) -> None:
        if self.send_nowait(peer, frame):
            return
        sock = self._push[peer]
        self._waiting[peer] = self._waiting.get(peer, 0) + 1
        self._blocked.setdefault(peer, time.monotonic())
        pending = self._pending.setdefault(peer, set())
        done = False
        try:
            while True:
                try:
                    fut = cast("asyncio.Future[Any]", sock.send(frame, copy=len(frame) < 65536))
                except zmq.ZMQError as exc:
                    raise self._send_error(peer, exc) from exc
                pending.add(fut)
                try:
                    await (fut if timeout is None else asyncio.wait_for(fut, timeout))
                except zmq.Again:  # pyzmq raced another writer: queue it again
                    continue
                except asyncio.TimeoutError:
                    raise PeerUnresponsiveError(
                        f"peer {peer!r} took no frame for {timeout:g} s "
                        "(its queue stayed full: stopped, hung or flooded)"
                    ) from None
                except zmq.ZMQError as exc:
                    raise self._send_error(peer, exc) from exc
                finally:
                    pending.discard(fut)
                done = True
                return
        finally:
            left = self._waiting.get(peer, 1) - 1
            if self._push.get(peer) is not sock:
                pass  # released meanwhile (perhaps connected anew): not ours to count
            elif left > 0:
                self._waiting[peer] = left
                if done and peer in self._blocked:
                    self._blocked[peer] = time.monotonic()  # it moved: wait from now
            else:
                self._waiting.pop(peer, None)
                self._blocked.pop(peer, None)

    def _send_error(self, peer: str, exc: zmq.ZMQError) -> OmniwireError:
        if self._sockets.state == "closed" or exc.errno in (errno.ENOTSOCK, zmq.ETERM):
            return closed_error()
        return OmniwireError(f"cannot send to peer {peer!r}: {exc}")

    def send_nowait(self, peer: str, frame: bytes) -> bool:
        sock = self._push.get(peer)
        if sock is None or self._sockets.state != "open" or self._waiting.get(peer):
            return False
        try:
            zmq.Socket.send(sock, frame, zmq.DONTWAIT)  # the plain socket: no future
        except zmq.ZMQError:  # Again: it would wait; anything else: it is closing
            return False
        return True

    def blocked_since(self, peer: str) -> float | None:
        return self._blocked.get(peer)

    # -- release

    def fail_sends(self) -> None:
        for futures in self._pending.values():
            fail_all(futures, closed_error)

    def fail_monitor_reads(self) -> None:
        fail_all(self._monitor_reads.values(), _MonitorClosed)

    def close(self) -> None:
        """Close every PUSH socket and its monitor."""
        for peer in list(self._push):
            sock = self._push.pop(peer)
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            self._sockets.close(sock, None)  # its frames get the linger to leave
        for monitor in self._monitors.values():
            self._sockets.close(monitor)
        self._monitors.clear()
        self._pending.clear()
        self._blocked.clear()
        self._waiting.clear()
