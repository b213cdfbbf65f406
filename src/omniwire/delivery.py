"""What a receiver gets (:class:`Delivery`) and what a sender keeps (:class:`SendReceipt`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol

import anyio

from .errors import OmniwireError

__all__ = ["Delivery", "DeliveryKind", "Outcome", "SendReceipt"]

DeliveryKind = Literal["payload", "stream_chunk", "stream_end", "error", "aborted"]
#: What a sender knows of an object's fate (see :class:`SendReceipt`).
Outcome = Literal["pending", "landed", "delivered", "sent", "refused", "not sent", "unknown"]


class _Replier(Protocol):
    """What a delivery answers through: the endpoint that received it."""

    async def send(
        self,
        target: str,
        payload: Any,
        *,
        request_id: str,
        metadata: Any = None,
        lend: bool = False,
    ) -> SendReceipt: ...

    async def stream(
        self, target: str, chunk: Any, *, request_id: str, metadata: Any = None
    ) -> SendReceipt: ...

    async def end_stream(
        self, target: str, *, request_id: str, error: str | None = None, metadata: Any = None
    ) -> None: ...


@dataclass(eq=False, slots=True)
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

    :meth:`reply`, :meth:`stream_reply` and :meth:`end_reply` answer the stage it
    came from, under the same request id.
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
    #: Tensor bytes carried (the same for every backend, ``local`` included).
    nbytes: int = 0
    #: For ``error`` deliveries: ``"peer_lost"`` / ``"peer_closed"`` (the sender went
    #: away), ``"unclaimed"`` (dropped while no consumer came for it), ``"stream_idle"``
    #: (its stream had no chunk for ``stream_idle_timeout``), else None.
    cause: str | None = None
    #: The peer it arrived from: ``from_stage``, except for an ``aborted`` delivery
    #: forwarded by another stage (``from_stage`` is then where the abort began).
    via: str = ""
    #: ``time.monotonic()`` when it was queued for the application.
    received_at: float = field(default_factory=time.monotonic)
    #: The W3C trace context of the sender's span (``""`` if it traces nothing).
    traceparent: str = ""
    _on_release: Callable[[], None] | None = field(default=None, repr=False)
    _budget: int | None = field(default=None, repr=False)  # receive budget held (from_stage's)
    #: The peer session's ReceiveWindow that ``_charge`` bytes of charge it holds go
    #: back to when it leaves the queue (spec §7.6).
    _window: Any = field(default=None, repr=False, compare=False)
    _charge: int = field(default=0, repr=False, compare=False)
    _lent: bool = field(default=False, repr=False)  # released views of the sender's memory
    _replier: _Replier | None = field(default=None, repr=False, compare=False)

    @property
    def zero_copy(self) -> bool:
        """True if the payload views the sender's memory (stays True after
        :meth:`release`; see :attr:`released`)."""
        return self._lent or self._on_release is not None

    @property
    def released(self) -> bool:
        """True once a zero-copy delivery was released (its views must not be used)."""
        return self._lent and self._on_release is None

    def release(self) -> None:
        """Acknowledge a zero-copy delivery; its tensors must not be used after. Idempotent."""
        callback, self._on_release = self._on_release, None
        if callback is not None:
            self._lent = True
            callback()

    # -- replies ------------------------------------------------------------------------

    def _endpoint(self) -> _Replier:
        if self._replier is None:
            raise OmniwireError(
                f"this {self.kind} delivery of request {self.request_id!r} was not received "
                "by an endpoint: there is nobody to reply through"
            )
        return self._replier

    async def reply(self, payload: Any, *, metadata: Any = None, lend: bool = False) -> SendReceipt:
        """Send ``payload`` back to :attr:`from_stage` under the same request id.

        The sender said Hello when it connected, so the endpoint already reaches it
        at the address that Hello carried: no ``peers=`` entry is needed. Same as
        ``endpoint.send(d.from_stage, payload, request_id=d.request_id, ...)``.

        Returns:
            The receipt of the reply (see :meth:`Endpoint.send`).

        Raises:
            As :meth:`Endpoint.send`; ``PeerLostError`` if the sender is gone,
            ``HandshakeError`` for an ``aborted`` delivery whose origin is no peer.
        """
        return await self._endpoint().send(
            self.from_stage, payload, request_id=self.request_id, metadata=metadata, lend=lend
        )

    async def stream_reply(self, chunk: Any, *, metadata: Any = None) -> SendReceipt:
        """Send the next chunk of a streamed reply to :attr:`from_stage` (in order).

        Raises: as :meth:`Endpoint.stream`.
        """
        return await self._endpoint().stream(
            self.from_stage, chunk, request_id=self.request_id, metadata=metadata
        )

    async def end_reply(self, *, error: str | None = None, metadata: Any = None) -> None:
        """End the streamed reply (optionally with an error).

        Raises: as :meth:`Endpoint.end_stream`.
        """
        await self._endpoint().end_stream(
            self.from_stage, request_id=self.request_id, error=error, metadata=metadata
        )

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
    receiver acknowledged it — or, for an object that *landed* (written by the engine
    into memory the receiver lent for that, before it was announced: mooncake between
    hosts), once it is in the receiver's memory and announced — or raises why it did
    not (``AckTimeoutError``, ``PeerLostError``, ``RequestAbortedError``, or
    ``BackendError`` carrying the receiver's error).

    A failure does not always mean the object was not delivered: after an ACK
    timeout, an abort or the loss of the peer the receiver may have taken it all
    the same. :attr:`outcome` says what is known, and :meth:`settled` waits until
    this side knows all it will: ``"pending"`` (not done), ``"landed"`` (in the
    receiver's memory and announced, its ACK not back yet: it will be delivered unless
    the receiver refuses it or is lost meanwhile), ``"delivered"`` (the
    receiver acknowledged it, also after the receipt failed), ``"sent"`` (data that
    needs no ACK, handed to the control plane), ``"refused"`` (the receiver NACKed
    it: not delivered), ``"not sent"`` (it never left this endpoint), ``"unknown"``
    (it may or may not have been delivered: the peer went before its ACK or NACK
    came, or it has not come yet).

    Attributes: ``peer``, ``request_id``, ``object_id`` (None for data that needs
    no ACK: inline chunks), ``backend``, ``nbytes`` (tensor bytes), ``started`` /
    ``finished`` (``time.monotonic()``), ``error`` (once done), :attr:`latency`,
    :attr:`outcome`.
    """

    __slots__ = (
        "_callbacks",
        "_done",
        "_event",
        "_final",
        "_settled",
        "backend",
        "error",
        "finished",
        "nbytes",
        "object_id",
        "outcome",
        "peer",
        "request_id",
        "started",
    )

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
        self._done = False
        self._event: anyio.Event | None = None  # made by the first wait on a pending receipt
        self._callbacks: list[Callable[[SendReceipt], None]] | None = None
        self.outcome: Outcome = "pending"
        self._final = False  # the outcome will not change
        self._settled: anyio.Event | None = None  # made by the first settled() that waits

    def __repr__(self) -> str:
        obj = "" if self.object_id is None else f" object={self.object_id}"
        head = (
            f"<SendReceipt to {self.peer!r} request={self.request_id!r}{obj} "
            f"via {self.backend} {_size(self.nbytes)}"
        )
        if not self.done():
            return f"{head} pending>"
        assert self.finished is not None
        took = f"{1000 * (self.finished - self.started):.2f} ms"
        if self.error is None and self.object_id is None:
            return f"{head} handed off (no ACK needed)>"
        if self.error is None and self.outcome == "landed":
            return f"{head} landed in {took}, not acknowledged yet>"
        if self.error is None:
            return f"{head} acknowledged in {took}>"
        return f"{head} failed after {took}: {type(self.error).__name__}: {self.error}>"

    def add_done_callback(self, fn: Callable[[SendReceipt], None]) -> None:
        """Call ``fn(receipt)`` once it is done (at once if it is already), on the
        endpoint's event loop. For observers; ``fn`` must not raise or block."""
        if self._done:
            fn(self)
        elif self._callbacks is None:
            self._callbacks = [fn]
        else:
            self._callbacks.append(fn)

    @classmethod
    def completed(cls, peer: str, request_id: str, backend: str, nbytes: int) -> SendReceipt:
        """A receipt for data that needs no ACK (inline chunks, stream ends)."""
        # __init__, resolve() and settle("sent") of a receipt nobody waits on yet, in
        # place (one runs per inline chunk)
        receipt = cls.__new__(cls)
        receipt.peer = peer
        receipt.request_id = request_id
        receipt.object_id = None
        receipt.backend = backend
        receipt.nbytes = nbytes
        receipt.started = receipt.finished = time.monotonic()
        receipt.error = receipt._event = receipt._callbacks = receipt._settled = None
        receipt._done = receipt._final = True
        receipt.outcome = "sent"
        return receipt

    def done(self) -> bool:
        return self._done

    @property
    def latency(self) -> float | None:
        """Seconds from the send call to the ACK (None until done)."""
        return None if self.finished is None else self.finished - self.started

    def resolve(self, error: BaseException | None = None, *, landed: bool = False) -> None:
        if self._done:
            return
        self._done = True
        self.error = error
        self.finished = time.monotonic()
        if not self._final:
            self.outcome = "landed" if landed else "delivered" if error is None else "unknown"
        if self._event is not None:
            self._event.set()
        callbacks, self._callbacks = self._callbacks, None
        if callbacks is not None:
            for fn in callbacks:
                fn(self)

    def land(self) -> None:
        """The object landed in the receiver's memory and was announced: :meth:`wait`
        returns; the outcome is ``"landed"`` until the ACK or NACK settles it."""
        self.resolve(landed=True)

    def settle(self, outcome: Outcome) -> None:
        """The object is over on this side (its buffer released): ``outcome`` is final.
        Resolves the receipt too, if nothing did yet (with no error only when
        ``outcome`` is ``"delivered"`` or ``"sent"``)."""
        if self._final:
            return
        if not self._done and outcome not in ("delivered", "sent"):
            raise ValueError(f"settle({outcome!r}) of a receipt that was not resolved")
        self.resolve()
        self._final = True
        self.outcome = outcome
        if self._settled is not None:
            self._settled.set()

    async def settled(self, timeout: float | None = None) -> Outcome:
        """Wait until the outcome is final (the ACK or NACK came, or the peer is gone)
        and return it. Raises TimeoutError after ``timeout``."""
        if not self._final:
            if self._settled is None:
                self._settled = anyio.Event()
            with anyio.fail_after(timeout):
                await self._settled.wait()
        return self.outcome

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for the ACK. Raises the failure, or TimeoutError after ``timeout``."""
        if not self._done:
            if self._event is None:
                self._event = anyio.Event()
            with anyio.fail_after(timeout):
                await self._event.wait()
        if self.error is not None:
            raise self.error


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
