"""Aborts: which requests are aborted, the sends they must stop, where to forward them.

Every send runs inside a :class:`SendGuard`, a cancel scope registered under its
request id and its peer. Aborting the request, losing the peer or closing the
endpoint cancels the scopes of that key *with the error the send must raise*,
wherever the send is waiting (the handshake, a credit, the pack, the announce).

An abort reaches every stage that saw the request: each endpoint remembers which
peers it sent data of a request to, and forwards the first abort of a request it
hears to each of them once (the remembered ids make it stop at a cycle).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import anyio

from ..errors import RequestAbortedError

__all__ = ["ABORT_MEMORY", "Aborts", "SendGuard"]

#: How many aborted request ids (and request → peers entries) an endpoint remembers.
ABORT_MEMORY = 65536


class SendGuard:
    """The cancel scope of one send, and the error it raises when cancelled."""

    __slots__ = ("error", "scope")

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.error: BaseException | None = None

    def cancel(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.scope.cancel()


class Aborts:
    """Aborted request ids, live send guards, and the peers that saw each request."""

    def __init__(self, memory: int = ABORT_MEMORY) -> None:
        self.memory = memory
        self._aborted: OrderedDict[str, str] = OrderedDict()  # request id -> why (origin: reason)
        self._peers_of: OrderedDict[str, set[str]] = OrderedDict()
        self._guards: dict[str, set[SendGuard]] = {}

    # -- guards ------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self, request_id: str, peer: str) -> Iterator[SendGuard]:
        """Run a send under a guard; if an abort, a loss or the close cancels it, the
        error they gave is raised here instead of the cancellation."""
        guard = SendGuard()
        keys = ("r:" + request_id, "p:" + peer, "*")
        for key in keys:
            self._guards.setdefault(key, set()).add(guard)
        try:
            with guard.scope:
                yield guard
        finally:
            for key in keys:
                guards = self._guards.get(key)
                if guards is not None:
                    guards.discard(guard)
                    if not guards:
                        del self._guards[key]
        if guard.scope.cancelled_caught and guard.error is not None:
            raise guard.error

    def cancel_request(self, request_id: str, error: BaseException) -> None:
        self._cancel("r:" + request_id, error)

    def cancel_peer(self, peer: str, error: BaseException) -> None:
        self._cancel("p:" + peer, error)

    def cancel_all(self, error: BaseException) -> None:
        self._cancel("*", error)

    def _cancel(self, key: str, error: BaseException) -> None:
        for guard in list(self._guards.get(key, ())):
            guard.cancel(error)

    # -- memory ------------------------------------------------------------------

    def is_aborted(self, request_id: str) -> bool:
        return request_id in self._aborted

    def remember(self, request_id: str, origin: str, reason: str = "") -> bool:
        """Record an abort; True the first time this request id is aborted."""
        first = request_id not in self._aborted
        if first:
            self._aborted[request_id] = f"by {origin!r}" + (f": {reason}" if reason else "")
        self._aborted.move_to_end(request_id)
        while len(self._aborted) > self.memory:
            self._aborted.popitem(last=False)
        return first

    def error(self, request_id: str) -> RequestAbortedError:
        """The error a send of an aborted request raises, naming who aborted it and why."""
        why = self._aborted.get(request_id, "")
        return RequestAbortedError(f"request {request_id!r} was aborted {why}".rstrip())

    def note_peer(self, request_id: str, peer: str) -> None:
        """``peer`` has seen ``request_id``: we sent it data of it, or it sent us some.
        An abort of the request must reach it (spec §7.5)."""
        peers = self._peers_of.get(request_id)
        if peers is None:
            peers = self._peers_of[request_id] = set()
            while len(self._peers_of) > self.memory:
                self._peers_of.popitem(last=False)
        peers.add(peer)

    def seen(self, request_id: str) -> bool:
        """Whether data of ``request_id`` went through this endpoint (to or from a peer)."""
        return request_id in self._peers_of

    def peers_of(self, request_id: str) -> set[str]:
        """The peers that have seen ``request_id`` through this endpoint (forgotten after)."""
        return self._peers_of.pop(request_id, set())
