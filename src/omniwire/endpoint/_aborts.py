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
from collections.abc import Iterator, Set

import anyio

from ..errors import RequestAbortedError

__all__ = ["ABORT_MEMORY", "ABORT_MEMORY_BYTES", "Aborts", "SendGuard"]

#: How many aborted request ids (and request → peers entries) an endpoint remembers.
ABORT_MEMORY = 65536
#: ... and how many bytes of ids and reasons, at most, in each (request ids may be
#: 1 KiB: 65,536 of them, with their reasons in full, were 343 MiB).
ABORT_MEMORY_BYTES = 8 << 20
#: The reason of an abort is remembered (for the error of a later send) up to this.
_WHY_CHARS = 256


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
        self._aborted: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (origin, reason)
        self._aborted_bytes = 0
        #: request id -> the peers that saw it, the least recently active first
        self._peers_of: OrderedDict[str, set[str]] = OrderedDict()
        self._peers_of_bytes = 0
        self._newest: str | None = None  # the last key of _peers_of, when known
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
        aborted = self._aborted
        first = request_id not in aborted
        if first:
            why = (_clip(origin, 64), _clip(reason, _WHY_CHARS))
            aborted[request_id] = why
            self._aborted_bytes += len(request_id) + len(why[0]) + len(why[1])
        aborted.move_to_end(request_id)
        while len(aborted) > self.memory or self._aborted_bytes > ABORT_MEMORY_BYTES:
            rid, (old_origin, old_reason) = aborted.popitem(last=False)
            self._aborted_bytes -= len(rid) + len(old_origin) + len(old_reason)
        return first

    def why(self, request_id: str) -> tuple[str, str] | None:
        """``(origin, reason)`` of the request's abort (both clipped), or None if it is
        not aborted (or forgotten)."""
        return self._aborted.get(request_id)

    def error(self, request_id: str) -> RequestAbortedError:
        """The error a send of an aborted request raises, naming who aborted it and why."""
        why = self._aborted.get(request_id)
        text = f"request {request_id!r} was aborted"
        if why is not None:
            text += f" by {why[0]!r}" + (f": {why[1]}" if why[1] else "")
        return RequestAbortedError(text)

    def note_peer(self, request_id: str, peer: str) -> None:
        """``peer`` has seen ``request_id``: we sent it data of it, or it sent us some.
        An abort of the request must reach it (spec §7.5)."""
        peers_of = self._peers_of
        peers = peers_of.get(request_id)
        if peers is None:
            peers = peers_of[request_id] = set()
            self._peers_of_bytes += len(request_id)
            while len(peers_of) > self.memory or self._peers_of_bytes > ABORT_MEMORY_BYTES:
                rid, _ = peers_of.popitem(last=False)
                self._peers_of_bytes -= len(rid)
            self._newest = request_id if peers_of else None
        elif request_id != self._newest:  # (a stream's chunks after its first: no move)
            peers_of.move_to_end(request_id)  # still active: forgotten last
            self._newest = request_id
        peers.add(peer)

    def seen(self, request_id: str) -> bool:
        """Whether data of ``request_id`` went through this endpoint (to or from a peer)."""
        return request_id in self._peers_of

    def involved(self, request_id: str) -> Set[str]:
        """The peers that have seen ``request_id`` through this endpoint (kept)."""
        return self._peers_of.get(request_id, _NONE)

    def peers_of(self, request_id: str) -> set[str]:
        """The peers that have seen ``request_id`` through this endpoint (forgotten after)."""
        peers = self._peers_of.pop(request_id, None)
        if peers is None:
            return set()
        self._peers_of_bytes -= len(request_id)
        if request_id == self._newest:
            self._newest = None
        return peers


_NONE: frozenset[str] = frozenset()


def _clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"
