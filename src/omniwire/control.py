"""The control plane: ZeroMQ sockets that move frames, and nothing else.

Each endpoint binds one PULL socket (its ``address``) that every peer PUSHes
frames into, and one PUB socket for aborts that every peer's SUB listens to. It
connects one PUSH per peer and its one SUB to every peer's PUB. ``ipc://`` on one
host, ``tcp://`` across hosts. The control plane does not decode frames and knows
nothing of backends; it reports connection events so the endpoint can tell a dead
peer, and how long a peer has taken no frame so it can tell a hung one.

Every address is checked by :func:`parse_address` before ZeroMQ sees it, and no
``ZMQError`` leaves a public method: a bad address is an :class:`AddressError`, a
served one an :class:`AddressInUseError`, a closed plane an
:class:`EndpointClosedError`.

Authentication (optional): with a shared key every socket runs ZMQ CURVE
(encrypted, authenticated); the bound sockets accept only clients that present
the key pair derived from the same key, so a process without the key can
deliver nothing — no DataReady, no ACK, no abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import hashlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

import zmq
import zmq.asyncio
import zmq.auth.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from ._ratelimit import TokenBucket
from .addresses import (
    Address,
    advertised,
    file_id,
    parse_address,
    probe_ipc,
)
from .errors import (
    AddressError,
    AddressInUseError,
    EndpointClosedError,
    EndpointNotStartedError,
    OmniwireError,
    PeerLostError,
    PeerUnresponsiveError,
)
from .wire import MAX_FRAME_SIZE

__all__ = ["ControlPlane", "CurveKey", "PeerEvent"]

log = logging.getLogger("omniwire.control")

#: ZMQ drops a connection that sends a larger message, before it reaches memory.
#: Frames between MAX_FRAME_SIZE and this are received and refused by the decoder.
_ZMQ_MAX_MSG = 2 * MAX_FRAME_SIZE

_LINGER_MS = 500
_SEND_ONCE_LINGER_MS = 200


# -- keys and events -------------------------------------------------------------------


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


class _MonitorClosed(Exception):
    """Set on a pending monitor read when its socket is released."""


# -- the sockets -----------------------------------------------------------------------


class ControlPlane:
    """Sockets of one endpoint. Not thread-safe: use it from the event loop thread.

    Lifecycle: construct (checks the address), ``await start()`` (binds), then
    ``connect``/``send``/``recv``..., then ``close()`` or ``await aclose()``.

    Args:
        address: where to bind the PULL socket (see :func:`parse_address`).
        key: CURVE key pair for every socket, or None.
        heartbeat_interval: ZMTP heartbeat interval (s).
        heartbeat_timeout: ZMTP heartbeat timeout and TTL (s).
        send_once_rate: frames per second :meth:`send_once` may send (token bucket).
        send_once_burst: the bucket's size.
        send_once_max_live: transient sockets that may linger at once.

    Raises:
        AddressError: ``address`` is malformed (at construction, nothing created).
    """

    def __init__(
        self,
        address: str,
        *,
        key: CurveKey | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 3.0,
        send_once_rate: float = 20.0,
        send_once_burst: int = 20,
        send_once_max_live: int = 20,
    ) -> None:
        self._bind_addr = parse_address(address, what="address", bind=True)
        self._abort_addr = self._bind_addr.abort_address()
        #: The bound address (the real port once started), as peers dial it.
        self.address = str(self._bind_addr)
        #: Where the PUB socket for aborts is bound.
        self.abort_address = str(self._abort_addr)
        self.key = key
        self._hb = (int(heartbeat_interval * 1000), int(heartbeat_timeout * 1000))
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self._sockets: set[zmq.Socket[Any]] = set()  # every socket still open
        self._files: list[tuple[str, tuple[int, int] | None]] = []  # ipc files we bound
        self._pull: zmq.asyncio.Socket | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self._monitors: dict[str, zmq.asyncio.Socket] = {}
        self._subscriptions: dict[str, str] = {}  # peer -> abort address
        self._sub_refs: dict[str, int] = {}  # abort address -> peers subscribed
        self._waiting: dict[str, int] = {}  # async sends in progress, per peer
        self._blocked: dict[str, float] = {}  # peer -> since when its sends wait
        self._pending: dict[str, set[asyncio.Future[Any]]] = {}  # peer -> send futures
        self._reads: set[asyncio.Future[Any]] = set()  # pending recv / recv_abort
        self._monitor_reads: dict[str, asyncio.Future[Any]] = {}
        self._once_bucket = TokenBucket(send_once_rate, send_once_burst)
        self._once_max_live = send_once_max_live
        self._once_lingering: deque[float] = deque()  # when each transient socket is gone
        #: What :meth:`send_once` did: ``sent``, ``rate_limited``, ``invalid``, ``failed``.
        self.send_once_counts: dict[str, int] = dict.fromkeys(
            ("sent", "rate_limited", "invalid", "failed"), 0
        )
        self._loop_thread: int | None = None
        self._state: Literal["new", "open", "closed"] = "new"

    # -- helpers

    def _options(self, sock: zmq.Socket[Any], *, server: bool, ipv6: bool) -> None:
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, _ZMQ_MAX_MSG)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._hb[0])
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._hb[1])
        sock.setsockopt(zmq.HEARTBEAT_TTL, self._hb[1])
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        if self.key is not None:
            sock.curve_secretkey = self.key.secret
            sock.curve_publickey = self.key.public
            if server:
                sock.curve_server = True
            else:
                sock.curve_serverkey = self.key.public

    def _socket(self, kind: int, *, server: bool, ipv6: bool = False) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        self._sockets.add(sock)
        try:
            self._options(sock, server=server, ipv6=ipv6)
        except zmq.ZMQError:
            self._close_socket(sock, 0)
            raise
        return sock

    def _close_socket(self, sock: zmq.Socket[Any] | None, linger: int | None = 0) -> None:
        if sock is None:
            return
        self._sockets.discard(sock)
        with contextlib.suppress(zmq.ZMQError):
            sock.close(linger=linger)

    def _check_open(self) -> None:
        if self._state == "new":
            raise EndpointNotStartedError("control plane not started: call start() first")
        if self._state == "closed":
            raise EndpointClosedError("control plane is closed")

    def _on_loop_thread(self) -> bool:
        return self._loop_thread is None or threading.get_ident() == self._loop_thread

    # -- start and stop

    async def start(self) -> None:
        """Bind the PULL and PUB sockets (creating ipc directories as needed).

        An ipc socket file nobody listens on (left by a crashed process) is
        replaced; one a live process serves is not.

        Raises:
            AddressInUseError: a live process serves the ipc path (or its ``.abort``
                sibling), or the tcp port is in use.
            AddressError: the address cannot be bound (no such interface, a path
                that exists and is not a socket, a directory that cannot be made).
            EndpointClosedError: already closed; OmniwireError: already started.

        On any error every socket and context created here is closed and only the
        socket files this call created are removed.
        """
        if self._state == "closed":
            raise EndpointClosedError("control plane is closed")
        if self._state == "open":
            raise OmniwireError("control plane already started")
        try:
            for addr in (self._bind_addr, self._abort_addr):
                if addr.scheme == "ipc":
                    if addr.file is not None:
                        directory = os.path.dirname(addr.path) or "."
                        try:
                            os.makedirs(directory, exist_ok=True)
                        except OSError as exc:
                            raise AddressError(
                                f"address {str(addr)!r}: cannot create {directory!r}: {exc}"
                            ) from exc
                    probe_ipc(addr, "address")
            self._ctx = zmq.asyncio.Context()
            if self.key is not None:
                self._auth = zmq.auth.asyncio.AsyncioAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback("*", _AllowOne(self.key.public))
            ipv6 = self._bind_addr.is_ipv6
            self._pull = self._socket(zmq.PULL, server=True, ipv6=ipv6)
            self._pub = self._socket(zmq.PUB, server=True, ipv6=ipv6)
            self._sub = self._socket(zmq.SUB, server=False)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._bind(self._pull, self._bind_addr)
            self._bind(self._pub, self._abort_addr)
            self.address = advertised(self._pull.getsockopt_string(zmq.LAST_ENDPOINT))
            self.abort_address = advertised(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException as exc:
            self._release(term=True)
            self._state = "closed"
            if isinstance(exc, zmq.ZMQError):  # an option or the authenticator
                raise OmniwireError(
                    f"cannot start the control plane at {self.address!r}: {exc}"
                ) from exc
            raise
        self._loop_thread = threading.get_ident()
        self._state = "open"

    def _bind(self, sock: zmq.Socket[Any], addr: Address) -> None:
        try:
            sock.bind(str(addr))
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUseError(f"address {str(addr)!r} is in use: {exc}") from exc
            raise AddressError(f"cannot bind address {str(addr)!r}: {exc}") from exc
        if addr.file is not None:
            self._files.append((os.path.abspath(addr.path), file_id(addr.path)))

    def close(self) -> None:
        """Close every socket (pending frames get up to 0.5 s to leave), remove the
        ipc socket files, and terminate the context (this waits for that linger).
        Idempotent. Call it from the event loop thread, or from a worker thread once
        nothing awaits the sockets. Never raises a ZMQError."""
        if self._state == "closed" and self._ctx is None:
            return
        self._state = "closed"
        self._release(term=True)

    async def aclose(self) -> None:
        """Like :meth:`close`, without blocking the event loop: sockets are closed and
        socket files removed before the first await, so they are gone even if this is
        cancelled; the context's linger is awaited in a worker thread."""
        if self._state == "closed" and self._ctx is None:
            return
        self._state = "closed"
        ctx = self._release(term=False)
        if ctx is None:
            return
        # A thread of its own, started before the first await: the context is
        # terminated even if this call is cancelled (only the wait for it ends).
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def term() -> None:
            with contextlib.suppress(zmq.ZMQError):
                ctx.term()
            with contextlib.suppress(RuntimeError):  # the loop may be gone by now
                loop.call_soon_threadsafe(_resolve, done)

        threading.Thread(target=term, name="omniwire-zmq-term", daemon=True).start()
        await done

    def _release(self, *, term: bool) -> zmq.asyncio.Context | None:
        """Fail waiters, close every socket, remove our socket files; then terminate
        the context (``term``) or return it for the caller to terminate."""

        def closed() -> EndpointClosedError:
            return EndpointClosedError("control plane is closed")

        if self._on_loop_thread():
            for futures in self._pending.values():
                _fail_all(futures, closed)
            _fail_all(self._reads, closed)
            _fail_all(self._monitor_reads.values(), _MonitorClosed)
        for peer in list(self._push):
            sock = self._push.pop(peer)
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            self._close_socket(sock, None)  # its frames get the linger to leave
        for other in (*self._monitors.values(), self._pull, self._pub, self._sub):
            self._close_socket(other)
        for leftover in list(self._sockets):
            self._close_socket(leftover)
        self._monitors.clear()
        self._pending.clear()
        self._blocked.clear()
        self._waiting.clear()
        self._subscriptions.clear()
        self._sub_refs.clear()
        self._pull = self._pub = self._sub = None
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        for path, ident in self._files:
            if ident is None or file_id(path) == ident:  # still ours, not a newcomer's
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._files.clear()
        ctx, self._ctx = self._ctx, None
        if ctx is not None and term:
            with contextlib.suppress(zmq.ZMQError):
                ctx.term()
            return None
        return ctx

    # -- peers

    def connect(self, peer: str, address: str) -> zmq.asyncio.Socket:
        """Open (once) the PUSH socket to a peer, and its monitor.

        Returns:
            The monitor socket (see :meth:`events`). A peer already connected keeps
            its socket and address: :meth:`disconnect` first to change it.

        Raises:
            AddressError: ``address`` is malformed or ZeroMQ refuses it; nothing is
                left open.
            EndpointNotStartedError / EndpointClosedError: not started, or closed.
        """
        self._check_open()
        if peer in self._push:
            return self._monitors[peer]
        addr = parse_address(address, what=f"peer {peer!r} address")
        sock: zmq.asyncio.Socket | None = None
        monitor: zmq.asyncio.Socket | None = None
        try:
            sock = self._socket(zmq.PUSH, server=False, ipv6=addr.is_ipv6)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
            self._sockets.add(monitor)
            sock.connect(str(addr))
        except zmq.ZMQError as exc:
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
            self._close_socket(monitor)
            self._close_socket(sock)
            raise AddressError(f"cannot connect to peer {peer!r} at {address!r}: {exc}") from exc
        self._push[peer] = sock
        self._monitors[peer] = monitor
        return monitor

    def has_peer(self, peer: str) -> bool:
        return peer in self._push

    def disconnect(self, peer: str) -> None:
        """Release everything of ``peer``: its PUSH socket (queued frames are dropped),
        its monitor (:meth:`events` ends) and its abort subscription. Sends waiting on
        it fail with :class:`PeerLostError`. Idempotent; never raises."""
        if self._on_loop_thread():
            _fail_all(
                self._pending.pop(peer, ()),
                lambda: PeerLostError(f"the connection to peer {peer!r} was released"),
            )
            read = self._monitor_reads.pop(peer, None)
            if read is not None:
                _fail_all((read,), _MonitorClosed)
        self._pending.pop(peer, None)
        self._blocked.pop(peer, None)
        self._waiting.pop(peer, None)
        sock = self._push.pop(peer, None)
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            self._close_socket(sock, 0)
        self._close_socket(self._monitors.pop(peer, None))
        self.unsubscribe(peer)

    def subscribe(self, peer: str, abort_address: str) -> None:
        """Listen to ``peer``'s abort broadcasts at ``abort_address`` ("" : none).

        One SUB connection per address, however many peers name it; a peer that
        names another address than before moves to it.

        Raises:
            AddressError: the address is malformed or ZeroMQ refuses it (nothing
                changes).
            EndpointNotStartedError / EndpointClosedError: not started, or closed.
        """
        self._check_open()
        if not abort_address:
            return
        addr = parse_address(abort_address, what=f"peer {peer!r} abort address")
        canonical = str(addr)
        if self._subscriptions.get(peer) == canonical:
            return
        if not self._sub_refs.get(canonical):
            assert self._sub is not None
            try:
                if addr.is_ipv6:  # options apply to connections made after they are set
                    self._sub.setsockopt(zmq.IPV6, 1)
                try:
                    self._sub.connect(canonical)
                finally:
                    if addr.is_ipv6:
                        self._sub.setsockopt(zmq.IPV6, 0)
            except zmq.ZMQError as exc:
                raise AddressError(
                    f"cannot subscribe to peer {peer!r} aborts at {abort_address!r}: {exc}"
                ) from exc
        self.unsubscribe(peer)
        self._subscriptions[peer] = canonical
        self._sub_refs[canonical] = self._sub_refs.get(canonical, 0) + 1

    def unsubscribe(self, peer: str) -> None:
        """Stop listening to ``peer``'s aborts (the SUB leaves an address no other peer
        names). Idempotent; never raises."""
        address = self._subscriptions.pop(peer, None)
        if address is None:
            return
        left = self._sub_refs.get(address, 0) - 1
        if left > 0:
            self._sub_refs[address] = left
            return
        self._sub_refs.pop(address, None)
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disconnect(address)

    def subscribed(self) -> dict[str, int]:
        """Abort addresses the SUB socket is connected to, with how many peers name each."""
        return dict(self._sub_refs)

    async def events(self, peer: str) -> AsyncIterator[PeerEvent]:
        """Connection events of the PUSH socket to ``peer``, until it is released."""
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

    # -- frames out

    async def send(self, peer: str, frame: bytes, *, timeout: float | None = None) -> None:
        """Queue one frame to ``peer``, waiting while ZeroMQ's queue to it is full.

        Frames to one peer leave in the order of the calls. While a call waits,
        :meth:`blocked_since` says since when. If the wait ends in an error the frame
        was not queued, and frames queued after it may still leave: treat the peer
        as lost.

        Args:
            timeout: give up after this many seconds (None: wait until released).

        Raises:
            PeerUnresponsiveError: ``timeout`` passed and the peer took no frame.
            PeerLostError: the peer was disconnected while the frame waited.
            EndpointClosedError: the control plane is closed (or closed meanwhile).
            KeyError: ``connect`` was never called for ``peer`` (or it was
                disconnected).
        """
        self._check_open()
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
        if self._state == "closed" or exc.errno in (errno.ENOTSOCK, zmq.ETERM):
            return EndpointClosedError("control plane is closed")
        return OmniwireError(f"cannot send to peer {peer!r}: {exc}")

    def send_nowait(self, peer: str, frame: bytes) -> bool:
        """Send one frame now if ZeroMQ can queue it without waiting.

        Returns:
            True if queued; False if it would wait (then :meth:`send` waits), if an
            earlier send to the peer still waits (frames never overtake each other),
            or if the peer is not connected or the plane is closed.
        """
        sock = self._push.get(peer)
        if sock is None or self._state != "open" or self._waiting.get(peer):
            return False
        try:
            zmq.Socket.send(sock, frame, zmq.DONTWAIT)  # the plain socket: no future
        except zmq.ZMQError:  # Again: it would wait; anything else: it is closing
            return False
        return True

    def blocked_since(self, peer: str) -> float | None:
        """When (``time.monotonic()``) a send to ``peer`` began to wait without any
        send to it completing since; None if no send to it waits.

        A peer that takes no frames (stopped, hung) leaves this set: the endpoint
        declares it unresponsive once ``now - blocked_since(peer)`` exceeds its
        timeout. ZMTP heartbeats alone do not catch it: with a large frame half
        written when the peer stops, no heartbeat is ever sent.
        """
        return self._blocked.get(peer)

    def send_once(self, address: str, frame: bytes) -> bool:
        """Best effort: one frame to an address we have no peer for (a RefusalMessage
        to a Hello we refuse), through a transient PUSH socket closed at once; the
        frame gets 200 ms to leave. Never blocks, never raises.

        Rate-limited (``send_once_rate``/``send_once_burst``) and capped at
        ``send_once_max_live`` transient sockets lingering at once, so a flood of
        Hellos costs a bounded number of sockets.

        Returns:
            True if the frame was handed to ZeroMQ; False if dropped, counted in
            :attr:`send_once_counts` under ``rate_limited`` (rate or cap),
            ``invalid`` (a malformed address, or the plane not open) or ``failed``.
        """
        try:
            addr = parse_address(address, what="refusal address")
        except AddressError:
            self.send_once_counts["invalid"] += 1
            return False
        if self._state != "open" or self._ctx is None:
            self.send_once_counts["invalid"] += 1
            return False
        now = time.monotonic()
        lingering = self._once_lingering
        while lingering and lingering[0] <= now:
            lingering.popleft()
        if len(lingering) >= self._once_max_live or not self._once_bucket.take():
            self.send_once_counts["rate_limited"] += 1
            return False
        sock: zmq.Socket[Any] | None = None
        try:
            sock = zmq.Socket(self._ctx, zmq.PUSH)  # a plain socket: no event-loop state
            self._options(sock, server=False, ipv6=addr.is_ipv6)
            sock.setsockopt(zmq.LINGER, _SEND_ONCE_LINGER_MS)
            sock.setsockopt(zmq.SNDHWM, 1)
            sock.connect(str(addr))
            sock.send(frame, zmq.DONTWAIT)
        except zmq.ZMQError as exc:
            self.send_once_counts["failed"] += 1
            log.debug("send_once to %s failed: %s", address, exc)
            return False
        finally:
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.close()  # returns at once; libzmq lingers in the background
        lingering.append(now + _SEND_ONCE_LINGER_MS / 1000)
        self.send_once_counts["sent"] += 1
        return True

    async def publish(self, frame: bytes) -> None:
        """Broadcast one frame on the PUB socket (never waits: slow subscribers drop).

        Raises:
            EndpointNotStartedError / EndpointClosedError: not started, or closed.
        """
        self._check_open()
        assert self._pub is not None
        try:
            zmq.Socket.send(self._pub, frame, zmq.DONTWAIT)
        except zmq.Again:
            pass  # PUB drops rather than wait; nothing to do
        except zmq.ZMQError as exc:
            raise EndpointClosedError(f"control plane is closed: {exc}") from exc

    # -- frames in

    async def recv(self) -> bytes:
        """The next frame any peer pushed to this endpoint.

        Raises:
            EndpointNotStartedError / EndpointClosedError: not started, or closed
                (also while waiting).
        """
        while True:
            frames = await self.recv_many(1)
            if frames:
                return frames[0]

    async def recv_many(self, limit: int = 512) -> list[bytes]:
        """Every frame queued at this endpoint's PULL socket (1 to ``limit``), waiting
        for one if none is. The socket's file descriptor is watched by the event loop
        only while nothing is queued: a busy endpoint pays no wake-up per frame.

        Raises:
            EndpointNotStartedError / EndpointClosedError: not started, or closed
                (also while waiting).
        """
        self._check_open()
        pull = self._pull
        assert pull is not None
        while True:
            frames: list[bytes] = []
            try:
                while len(frames) < limit:
                    frames.append(zmq.Socket.recv(pull, zmq.DONTWAIT))
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                raise EndpointClosedError(f"control plane is closed: {exc}") from exc
            if frames:
                return frames
            await self._readable(pull)

    async def _readable(self, sock: zmq.asyncio.Socket) -> None:
        """Wait until ``sock`` has a frame (its FD signals, ZMQ_EVENTS says POLLIN)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        fd = cast(int, zmq.Socket.getsockopt(sock, zmq.FD))

        def check() -> None:  # the FD only says "look": ZMQ_EVENTS tells (and re-arms it)
            if fut.done():
                return
            try:
                if cast(int, zmq.Socket.getsockopt(sock, zmq.EVENTS)) & zmq.POLLIN:
                    fut.set_result(None)
            except zmq.ZMQError as exc:
                fut.set_exception(EndpointClosedError(f"control plane is closed: {exc}"))

        self._reads.add(fut)
        loop.add_reader(fd, check)
        try:
            check()  # a frame may have arrived between the last recv and add_reader
            await fut
        finally:
            loop.remove_reader(fd)
            self._reads.discard(fut)

    async def recv_abort(self) -> bytes:
        """The next abort frame any peer published.

        Raises:
            EndpointNotStartedError / EndpointClosedError: not started, or closed
                (also while waiting).
        """
        self._check_open()
        assert self._sub is not None
        return await self._read(self._sub)

    async def _read(self, sock: zmq.asyncio.Socket) -> bytes:
        try:
            fut = cast("asyncio.Future[bytes]", sock.recv())
        except zmq.ZMQError as exc:
            raise EndpointClosedError(f"control plane is closed: {exc}") from exc
        self._reads.add(fut)
        try:
            return await fut
        except zmq.ZMQError as exc:
            raise EndpointClosedError(f"control plane is closed: {exc}") from exc
        finally:
            self._reads.discard(fut)

    # -- accounting

    def socket_count(self) -> int:
        """Sockets this control plane holds open (bound, per-peer PUSH and monitor,
        the ZAP handler's). Transient :meth:`send_once` sockets are closed at once and
        not counted."""
        count = sum(1 for s in self._sockets if not s.closed)
        if self._auth is not None and not self._auth.zap_socket.closed:
            count += 1
        return count

    def peers(self) -> list[str]:
        """Peers with a PUSH socket."""
        return list(self._push)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _fail_all(futures: Iterable[asyncio.Future[Any]], error: Callable[[], BaseException]) -> None:
    """Fail the futures not yet done (before their socket closes: pyzmq would cancel
    them, and a cancelled future reads as the waiter's own cancellation)."""
    for fut in list(futures):
        if not fut.done():
            fut.set_exception(error())
