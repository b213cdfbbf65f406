"""The control plane's facade: :class:`ControlPlane` starts and stops the sockets
and hands each call to its part (links to peers, aborts, the inbox, send_once)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from ..addresses import advertised, parse_address, probe_ipc
from ..errors import AddressError, EndpointClosedError, OmniwireError
from ._aborts import Aborts
from ._curve import CurveKey
from ._links import Links, PeerEvent
from ._once import SendOnce
from ._receive import Inbox
from ._sockets import Sockets

__all__ = ["ControlPlane"]


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
        self._sockets = Sockets(
            key=key, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout
        )
        self._links = Links(self._sockets)
        self._aborts = Aborts(self._sockets)
        self._inbox = Inbox(self._sockets)
        self._once = SendOnce(
            self._sockets, rate=send_once_rate, burst=send_once_burst, max_live=send_once_max_live
        )
        #: What :meth:`send_once` did: ``sent``, ``rate_limited``, ``invalid``, ``failed``.
        self.send_once_counts: dict[str, int] = self._once.counts

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
        sockets = self._sockets
        if sockets.state == "closed":
            raise EndpointClosedError("control plane is closed")
        if sockets.state == "open":
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
            sockets.start()
            ipv6 = self._bind_addr.is_ipv6
            self._inbox.pull = pull = sockets.socket(zmq.PULL, server=True, ipv6=ipv6)
            pub = self._aborts.open_pub(ipv6=ipv6)
            self._aborts.sub = sub = sockets.socket(zmq.SUB, server=False)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sockets.bind(pull, self._bind_addr)
            sockets.bind(pub, self._abort_addr)
            self.address = advertised(pull.getsockopt_string(zmq.LAST_ENDPOINT))
            self.abort_address = advertised(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException as exc:
            self._release(term=True)
            sockets.state = "closed"
            if isinstance(exc, zmq.ZMQError):  # an option or the authenticator
                raise OmniwireError(
                    f"cannot start the control plane at {self.address!r}: {exc}"
                ) from exc
            raise
        sockets.loop_thread = threading.get_ident()
        sockets.state = "open"

    def close(self) -> None:
        """Close every socket (pending frames get up to 0.5 s to leave), remove the
        ipc socket files, and terminate the context (this waits for that linger).
        Idempotent. Call it from the event loop thread, or from a worker thread once
        nothing awaits the sockets. Never raises a ZMQError."""
        if self._sockets.state == "closed" and self._sockets.ctx is None:
            return
        self._sockets.state = "closed"
        self._release(term=True)

    async def aclose(self) -> None:
        """Like :meth:`close`, without blocking the event loop: sockets are closed and
        socket files removed before the first await, so they are gone even if this is
        cancelled; the context's linger is awaited in a worker thread."""
        if self._sockets.state == "closed" and self._sockets.ctx is None:
            return
        self._sockets.state = "closed"
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
        if self._sockets.on_loop_thread():
            self._links.fail_sends()
            self._inbox.fail_reads()
            self._links.fail_monitor_reads()
        self._links.close()
        self._inbox.close()
        self._aborts.close()
        return self._sockets.release(term=term)

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
        self._sockets.check_open()
        return self._links.connect(peer, address)

    def has_peer(self, peer: str) -> bool:
        return self._links.has_peer(peer)

    def limit_frames(self, peer: str, frames: int) -> None:
        """At most ``frames`` frames queued in ZeroMQ for ``peer`` (its PUSH socket's
        high-water mark, applied to its current connection too; 0: ZeroMQ's default).
        A send that finds them queued waits (:meth:`send`) or is refused
        (:meth:`send_nowait`)."""
        self._links.limit_frames(peer, frames)

    def disconnect(self, peer: str) -> None:
        """Release everything of ``peer``: its PUSH socket (queued frames are dropped),
        its monitor (:meth:`events` ends) and its abort subscription. Sends waiting on
        it fail with :class:`PeerLostError`. Idempotent; never raises."""
        self._links.disconnect(peer)
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
        self._sockets.check_open()
        self._aborts.subscribe(peer, abort_address)

    def unsubscribe(self, peer: str) -> None:
        """Stop listening to ``peer``'s aborts (the SUB leaves an address no other peer
        names). Idempotent; never raises."""
        self._aborts.unsubscribe(peer)

    def subscribed(self) -> dict[str, int]:
        """Abort addresses the SUB socket is connected to, with how many peers name each."""
        return self._aborts.subscribed()

    @property
    def abort_renewals(self) -> int:
        """Times the abort socket was closed and bound anew because its subscribers
        named too many topics (see ``_aborts``)."""
        return self._aborts.renewals

    def events(self, peer: str) -> AsyncIterator[PeerEvent]:
        """Connection events of the PUSH socket to ``peer``, until it is released."""
        return self._links.events(peer)

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
        self._sockets.check_open()
        await self._links.send(peer, frame, timeout=timeout)

    def send_nowait(self, peer: str, frame: bytes) -> bool:
        """Send one frame now if ZeroMQ can queue it without waiting.

        Returns:
            True if queued; False if it would wait (then :meth:`send` waits), if an
            earlier send to the peer still waits (frames never overtake each other),
            or if the peer is not connected or the plane is closed.
        """
        return self._links.send_nowait(peer, frame)

    def blocked_since(self, peer: str) -> float | None:
        """When (``time.monotonic()``) a send to ``peer`` began to wait without any
        send to it completing since; None if no send to it waits.

        A peer that takes no frames (stopped, hung) leaves this set: the endpoint
        declares it unresponsive once ``now - blocked_since(peer)`` exceeds its
        timeout. ZMTP heartbeats alone do not catch it: with a large frame half
        written when the peer stops, no heartbeat is ever sent.
        """
        return self._links.blocked_since(peer)

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
        return self._once.send(address, frame)

    async def publish(self, frame: bytes) -> None:
        """Broadcast one frame on the PUB socket (never waits: slow subscribers drop).

        Raises:
            EndpointNotStartedError / EndpointClosedError: not started, or closed.
        """
        self._sockets.check_open()
        self._aborts.publish(frame)

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

    async def recv_many(
        self, limit: int = 512, apply: Callable[[list[bytes]], list[bytes]] | None = None
    ) -> list[bytes]:
        """Every frame queued at this endpoint's PULL socket (1 to ``limit``), waiting
        for one if none is. The socket's file descriptor is watched by the event loop
        only while nothing is queued: a busy endpoint pays no wake-up per frame.

        ``apply``: while this call waits, frames that arrive are passed to
        ``apply(frames)`` in the socket's reader callback (at most ``limit`` at a
        time, in order), which returns those it did not take; this call returns
        those. When ``apply`` took all, this call goes on waiting; after a full
        ``limit`` more may be queued, and the waiting task takes them a turn of the
        event loop later (one callback's work stays bounded). ``apply`` must not
        block.

        Raises:
            EndpointNotStartedError / EndpointClosedError: not started, or closed
                (also while waiting).
        """
        self._sockets.check_open()
        return await self._inbox.recv_many(limit, apply)

    async def recv_abort(self) -> bytes:
        """The next abort frame any peer published.

        Raises:
            EndpointNotStartedError / EndpointClosedError: not started, or closed
                (also while waiting).
        """
        self._sockets.check_open()
        assert self._aborts.sub is not None
        return await self._inbox.read(self._aborts.sub)

    # -- accounting

    def socket_count(self) -> int:
        """Sockets this control plane holds open (bound, per-peer PUSH and monitor,
        the ZAP handler's). Transient :meth:`send_once` sockets are closed at once and
        not counted."""
        return self._sockets.count()

    def peers(self) -> list[str]:
        """Peers with a PUSH socket."""
        return self._links.peers()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
