"""What a receiver gets (:class:`Delivery`) and what a sender keeps (:class:`SendReceipt`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import anyio

__all__ = ["Delivery", "DeliveryKind", "SendReceipt"]

DeliveryKind = Literal["payload", "stream_chunk", "stream_end", "error", "aborted"]


@dataclass(eq=False)
class Delivery:
    """One thing that arrived for this endpoint.

    ``kind`` is ``payload``, ``stream_chunk``, ``stream_end`` (the sender ended the
    stream), ``error`` (the sender reported an error, its data could not be
    received, or it went away mid-request: ``error`` says which, ``cause`` is
    ``"peer_lost"`` or ``"peer_closed"`` in the last case) or ``aborted`` (a peer
    aborted ``request_id``; ``from_stage`` is where the abort began).

    In zero-copy mode the tensors of ``payload`` are views of the sender's
    memory, valid until :meth:`release` (or the end of ``async with delivery:``),
    which also acknowledges the data. In copy mode (the default) the data is
    already owned and acknowledged and ``release`` does nothing.
    """

    kind: DeliveryKind
    request_id: str
    from_stage: str
    chunk_id: int = 0
    payload: Any = None
    metadata: Any = None
    error: str | None = None
    #: The backend that carried it ("inline", "local", "shm", ...).
    backend: str | None = None
    #: Tensor bytes carried.
    nbytes: int = 0
    #: For ``error`` deliveries of a peer that went away: ``"peer_lost"`` / ``"peer_closed"``.
    cause: str | None = None
    received_at: float = field(default_factory=time.monotonic)
    _on_release: Callable[[], None] | None = field(default=None, repr=False)
    _budget: int | None = field(default=None, repr=False)  # receive credit held

    @property
    def zero_copy(self) -> bool:
        """True while the payload still views the sender's memory."""
        return self._on_release is not None

    def release(self) -> None:
        """Acknowledge a zero-copy delivery; its tensors must not be used after. Idempotent."""
        callback, self._on_release = self._on_release, None
        if callback is not None:
            callback()

    async def __aenter__(self) -> Delivery:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class SendReceipt:
    """The fate of one sent object: ``await receipt.wait()`` returns once the
    receiver acknowledged it, or raises why it did not (``AckTimeoutError``,
    ``PeerLostError``, ``RequestAbortedError``, or ``BackendError`` carrying the
    receiver's error)."""

    def __init__(
        self, peer: str, request_id: str, object_id: int | None, backend: str, nbytes: int
    ) -> None:
        self.peer = peer
        self.request_id = request_id
        self.object_id = object_id
        self.backend = backend
        self.nbytes = nbytes
        self.started = time.monotonic()
        self.finished: float | None = None
        self.error: BaseException | None = None
        self._event = anyio.Event()
        self.observed = False

    @classmethod
    def completed(cls, peer: str, request_id: str, backend: str, nbytes: int) -> SendReceipt:
        """A receipt for data that needs no ACK (inline chunks, stream ends)."""
        receipt = cls(peer, request_id, None, backend, nbytes)
        receipt.resolve()
        return receipt

    def done(self) -> bool:
        return self._event.is_set()

    @property
    def latency(self) -> float | None:
        """Seconds from the send call to the ACK (None until done)."""
        return None if self.finished is None else self.finished - self.started

    def resolve(self, error: BaseException | None = None) -> None:
        if self._event.is_set():
            return
        self.error = error
        self.finished = time.monotonic()
        self._event.set()

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for the ACK. Raises the failure, or TimeoutError after ``timeout``."""
        self.observed = True
        with anyio.fail_after(timeout):
            await self._event.wait()
        if self.error is not None:
            raise self.error
