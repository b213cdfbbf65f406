"""The one way frames leave an endpoint.

Every frame to a peer goes through :meth:`Outbox.post` (fire and forget) or
:meth:`Outbox.send` (wait until ZeroMQ took it, bounded). Frames to one peer
leave in the order they were posted: the first goes straight to the socket when
ZeroMQ can take it without waiting; otherwise it, and everything posted after
it, waits in the peer's queue, which one drain task empties. How long the head
of a queue has waited tells the peer table whether the peer still takes frames.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import anyio

from .. import wire
from ..control import ControlPlane
from ..errors import EndpointClosedError, OmniwireError, PeerUnresponsiveError

if TYPE_CHECKING:
    from ._records import Peer
    from ._supervisor import Supervisor

__all__ = ["Outbox"]


class _Waiter:
    __slots__ = ("error", "event")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.error: BaseException | None = None


class Outbox:
    """Per-peer ordered queues in front of the control plane's PUSH sockets."""

    def __init__(self, control: ControlPlane, supervisor: Supervisor) -> None:
        self._control = control
        self._supervisor = supervisor
        self._queues: dict[str, deque[tuple[bytes, _Waiter | None]]] = {}
        self._waiting_since: dict[str, float] = {}
        self._emptied = anyio.Event()  # set when the last queue drained

    @staticmethod
    def encode(peer: Peer, msg: wire.Message) -> bytes:
        """A frame for ``peer`` at the version both speak (Hellos at ours)."""
        if isinstance(msg, wire.HelloMessage | wire.RefusalMessage):
            return wire.encode(msg)
        return wire.encode(msg, version=peer.session.version)

    def post(self, peer: Peer, msg: wire.Message) -> None:
        """Queue ``msg`` to ``peer``; it leaves after everything posted before it."""
        self._post(peer.name, self.encode(peer, msg), None)

    async def send(self, peer: Peer, msg: wire.Message, timeout: float) -> None:
        """Post ``msg`` and wait until ZeroMQ took it.

        Raises:
            PeerUnresponsiveError: the peer took no frame for ``timeout`` seconds.
            PeerLostError, EndpointClosedError: the peer or this endpoint went away.
        """
        waiter = _Waiter()
        self._post(peer.name, self.encode(peer, msg), waiter)
        if not waiter.event.is_set():
            with anyio.move_on_after(timeout):
                await waiter.event.wait()
            if not waiter.event.is_set():
                raise PeerUnresponsiveError(
                    f"peer {peer.name!r} took no frame for {timeout:g} s (stopped, hung or "
                    "overloaded)"
                )
        if waiter.error is not None:
            raise waiter.error

    def refuse(self, address: str, msg: wire.RefusalMessage) -> bool:
        """Best effort: a Refusal to an address that is no peer of ours (rate-limited)."""
        return self._control.send_once(address, wire.encode(msg))

    def waiting_for(self, peer: str, now: float) -> float:
        """Seconds the oldest queued frame to ``peer`` has waited for ZeroMQ (0: none)."""
        since = self._waiting_since.get(peer)
        return 0.0 if since is None else now - since

    def drop(self, peer: str, error: OmniwireError) -> None:
        """Discard what is queued to a peer that is gone; waiters get ``error``."""
        queue = self._queues.pop(peer, None)
        self._waiting_since.pop(peer, None)
        if not self._queues:
            self._emptied.set()
        for _, waiter in queue or ():
            if waiter is not None:
                waiter.error = error
                waiter.event.set()

    async def flush(self, timeout: float) -> None:
        """Wait until every queue is empty, at most ``timeout`` seconds."""
        with anyio.move_on_after(timeout):
            while self._queues:
                self._emptied = anyio.Event()
                await self._emptied.wait()

    def _post(self, peer: str, frame: bytes, waiter: _Waiter | None) -> None:
        queue = self._queues.get(peer)
        if queue is None:
            if self._control.send_nowait(peer, frame):
                if waiter is not None:
                    waiter.event.set()
                return
            queue = self._queues[peer] = deque()
            self._waiting_since[peer] = time.monotonic()
            self._supervisor.spawn(self._drain, peer, queue)
        queue.append((frame, waiter))

    async def _drain(self, peer: str, queue: deque[tuple[bytes, _Waiter | None]]) -> None:
        try:
            while queue and self._queues.get(peer) is queue:
                frame, waiter = queue[0]
                try:
                    await self._control.send(peer, frame)
                except (KeyError, OmniwireError) as exc:  # socket gone: peer dropped
                    self.drop(peer, EndpointClosedError(f"no connection to {peer!r}: {exc}"))
                    return
                queue.popleft()
                self._waiting_since[peer] = time.monotonic()
                if waiter is not None:
                    waiter.event.set()
        finally:
            if self._queues.get(peer) is queue and not queue:
                del self._queues[peer]
                self._waiting_since.pop(peer, None)
            if not self._queues:
                self._emptied.set()
