"""What the parts of a control plane share: the ZeroMQ context and its CURVE
authenticator, the options every socket gets, every socket still open, the ipc
socket files bound, and the plane's state."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal

import zmq
import zmq.asyncio
import zmq.auth.asyncio

from ..addresses import Address, file_id
from ..errors import (
    AddressError,
    AddressInUseError,
    EndpointClosedError,
    EndpointNotStartedError,
)
from ..wire import MAX_FRAME_SIZE
from ._curve import AllowOne, CurveKey

#: ZMQ drops a connection that sends a larger message, before it reaches memory.
#: Frames between MAX_FRAME_SIZE and this are received and refused by the decoder.
_ZMQ_MAX_MSG = 2 * MAX_FRAME_SIZE

_LINGER_MS = 500
#: A connection to a peer that is not listening yet (or any more) is tried again
#: after 100 ms, doubling up to this: a peer that comes up is found within 200 ms of
#: binding its address. ZeroMQ's backoff up to 1 s (the value before) cost a pipeline
#: whose stages come up seconds apart up to a second per hop after the last one
#: started (scripts/startup_time.py: 0.25-0.71 s, now 0.01-0.02 s); a failed connect
#: to a missing ipc file or a closed port costs microseconds, five times a second.
_RECONNECT_MS = (100, 200)


def closed_error() -> EndpointClosedError:
    return EndpointClosedError("control plane is closed")


def fail_all(futures: Iterable[asyncio.Future[Any]], error: Callable[[], BaseException]) -> None:
    """Fail the futures not yet done (before their socket closes: pyzmq would cancel
    them, and a cancelled future reads as the waiter's own cancellation)."""
    for fut in list(futures):
        if not fut.done():
            fut.set_exception(error())


def remove_reader(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    """Unregister ``fd`` from ``loop``, from its thread or from another one."""
    if loop.is_closed():
        return
    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    if on_loop:
        loop.remove_reader(fd)
    else:  # closed from another thread: the loop's own thread unregisters it
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.remove_reader, fd)


class Sockets:
    """The context of one control plane and every socket made in it.

    Args:
        key: CURVE key pair for every socket, or None.
        heartbeat_interval: ZMTP heartbeat interval (s).
        heartbeat_timeout: ZMTP heartbeat timeout and TTL (s).
    """

    def __init__(
        self, *, key: CurveKey | None, heartbeat_interval: float, heartbeat_timeout: float
    ) -> None:
        self.key = key
        self._hb = (int(heartbeat_interval * 1000), int(heartbeat_timeout * 1000))
        self.ctx: zmq.asyncio.Context | None = None
        self._auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self._open: set[zmq.Socket[Any]] = set()  # every socket still open
        self._files: list[tuple[str, tuple[int, int] | None]] = []  # ipc files we bound
        self.loop_thread: int | None = None
        self.state: Literal["new", "open", "closed"] = "new"

    def check_open(self) -> None:
        if self.state == "new":
            raise EndpointNotStartedError("control plane not started: call start() first")
        if self.state == "closed":
            raise closed_error()

    def on_loop_thread(self) -> bool:
        return self.loop_thread is None or threading.get_ident() == self.loop_thread

    def start(self) -> None:
        """Create the context, and the authenticator when there is a key."""
        self.ctx = zmq.asyncio.Context()
        if self.key is not None:
            self._auth = zmq.auth.asyncio.AsyncioAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", AllowOne(self.key.public))

    def options(self, sock: zmq.Socket[Any], *, server: bool, ipv6: bool) -> None:
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, _ZMQ_MAX_MSG)
        # libzmq (4.3.5, and its master in 2026) aborts the process (Assertion
        # !_io_error, stream_engine_base.cpp; libzmq#3937, #4767) when a connection
        # whose receive queue is full sees its peer go and then writes: a heartbeat
        # PING from its timer, or a PONG to a PING the peer queued behind the frames.
        # Any peer could do that to us, so no socket lets a peer fill its queue:
        if sock.type == zmq.PUSH:
            # We never read a PUSH socket: whatever a peer sends into it stays queued
            # (RCVHWM bounds it) and no PONG is made; no heartbeat timer runs. The
            # peer's PULL heartbeats us with a TTL, which libzmq honours; TCP ends a
            # dead link without them, in the kernel, so bytes of a connection that
            # ZeroMQ gave up cannot arrive later on the peer's still-open side.
            interval_s = max(1, round(self._hb[0] / 1000))  # keepalive counts seconds
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, interval_s)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, interval_s)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, max(1, -(-self._hb[1] // self._hb[0])))
            sock.setsockopt(zmq.TCP_MAXRT, self._hb[1])  # TCP_USER_TIMEOUT on Linux
        else:
            # PULL and SUB we read, PUB reads subscriptions (Aborts): their queues
            # never stop input (libzmq reads on); what may queue is bounded by the
            # windows a legitimate peer keeps to and by how fast our loop drains it.
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.HEARTBEAT_IVL, self._hb[0])
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._hb[1])
            sock.setsockopt(zmq.HEARTBEAT_TTL, self._hb[1])
        sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS[0])
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MS[1])
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        if self.key is not None:
            sock.curve_secretkey = self.key.secret
            sock.curve_publickey = self.key.public
            if server:
                sock.curve_server = True
            else:
                sock.curve_serverkey = self.key.public

    def socket(self, kind: int, *, server: bool, ipv6: bool = False) -> zmq.asyncio.Socket:
        assert self.ctx is not None
        sock = self.ctx.socket(kind)
        self._open.add(sock)
        try:
            self.options(sock, server=server, ipv6=ipv6)
        except zmq.ZMQError:
            self.close(sock, 0)
            raise
        return sock

    def track(self, sock: zmq.Socket[Any]) -> None:
        """Count a socket made elsewhere (a monitor) among those to close."""
        self._open.add(sock)

    def close(self, sock: zmq.Socket[Any] | None, linger: int | None = 0) -> None:
        if sock is None:
            return
        self._open.discard(sock)
        with contextlib.suppress(zmq.ZMQError):
            sock.close(linger=linger)

    def bind(self, sock: zmq.Socket[Any], addr: Address) -> None:
        try:
            try:
                sock.bind(str(addr))
            except zmq.ZMQError as exc:
                if exc.errno != errno.ENOENT or addr.file is None:
                    raise
                # another endpoint's close removed the emptied directory (release())
                os.makedirs(os.path.dirname(addr.path) or ".", exist_ok=True)
                sock.bind(str(addr))
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUseError(f"address {str(addr)!r} is in use: {exc}") from exc
            raise AddressError(f"cannot bind address {str(addr)!r}: {exc}") from exc
        if addr.file is not None:  # (bound again: the new file replaces the old entry)
            path = os.path.abspath(addr.path)
            self._files = [f for f in self._files if f[0] != path]
            self._files.append((path, file_id(addr.path)))

    def count(self) -> int:
        """Sockets still open, the ZAP handler's included."""
        count = sum(1 for s in self._open if not s.closed)
        if self._auth is not None and not self._auth.zap_socket.closed:
            count += 1
        return count

    def release(self, *, term: bool) -> zmq.asyncio.Context | None:
        """Close the sockets left open, stop the authenticator, remove our socket
        files (and their directory, once empty, if it is named ``omniwire-*``); then terminate the context (``term``) or return it for the caller to
        terminate."""
        for leftover in list(self._open):
            self.close(leftover)
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        for path, ident in self._files:
            if ident is None or file_id(path) == ident:  # still ours, not a newcomer's
                with contextlib.suppress(OSError):
                    os.unlink(path)
            directory = os.path.dirname(path)
            if os.path.basename(directory).startswith("omniwire-"):
                # a directory made for omniwire's sockets (the default address, the demo,
                # the example) goes with its last socket; rmdir refuses a non-empty one
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
        self._files.clear()
        ctx, self.ctx = self.ctx, None
        if ctx is not None and term:
            with contextlib.suppress(zmq.ZMQError):
                ctx.term()
            return None
        return ctx
