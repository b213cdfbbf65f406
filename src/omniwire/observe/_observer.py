"""The observer interface: what an endpoint tells whoever watches it.

An endpoint calls its observer at a few points, each behind a single
``if observer is not None``: with no observer (the default) it costs nothing
else. Every method is a no-op here; subclass :class:`Observer` and override
what you need. Calls come from the endpoint's event loop (``send_*`` in the
caller's task), so an observer must not block; it must not raise either (an
exception propagates into the call that triggered it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ..delivery import Delivery, SendReceipt

if TYPE_CHECKING:
    from ..endpoint import Endpoint

__all__ = ["Observer", "Observers", "SendKind", "as_observer", "observed"]

#: What a send call sends: ``send`` → payload, ``stream`` → stream_chunk,
#: ``end_stream`` → stream_end.
SendKind = Literal["payload", "stream_chunk", "stream_end"]

T = TypeVar("T")


class Observer:
    """Watches endpoints: sends, credit and window waits, deliveries. Every method is a no-op.

    One observer may watch several endpoints (each call names the endpoint).
    """

    def attach(self, endpoint: Endpoint) -> None:
        """``endpoint`` started (an observer may read its state from now on)."""

    def detach(self, endpoint: Endpoint) -> None:
        """``endpoint`` closed."""

    def send_started(
        self, endpoint: str, targets: tuple[str, ...], request_id: str, kind: SendKind
    ) -> Any:
        """A ``send``/``stream``/``end_stream`` call began, in the caller's task.

        Returns a token that the endpoint hands back to :meth:`traceparent`,
        :meth:`send_handed_off` or :meth:`send_failed` for this call.
        """
        return None

    def traceparent(self, token: Any) -> str:
        """The W3C trace context the data of this call carries (``""``: none)."""
        return ""

    def send_handed_off(self, token: Any, receipts: Sequence[SendReceipt]) -> None:
        """The call returned: its data is handed off. Each receipt (one per target;
        none for ``end_stream``) settles later — see :meth:`SendReceipt.add_done_callback`."""

    def send_failed(self, token: Any, error: BaseException) -> None:
        """The call raised ``error`` (cancellation included)."""

    def credit_waited(self, endpoint: str, peer: str, seconds: float) -> None:
        """A send waited ``seconds`` for a credit to ``peer`` (``max_inflight``,
        ``max_inflight_bytes``: objects unacknowledged), whether it got one or not."""

    def window_waited(self, endpoint: str, peer: str, seconds: float) -> None:
        """A send waited ``seconds`` for ``peer``'s byte window (its ``receive_window``:
        what its application has not taken yet), whether it opened or not."""

    def delivered(self, endpoint: str, delivery: Delivery) -> None:
        """The receiver queued ``delivery`` for the application."""

    def taken(self, endpoint: str, delivery: Delivery) -> None:
        """The application took ``delivery`` (``receive``, a stream, ``async for``)."""

    def peer_forgotten(self, endpoint: str, peer: str) -> None:
        """``endpoint`` forgot the gone peer ``peer`` (its table keeps the last 256
        gone peers): what is kept per peer can go."""


class Observers(Observer):
    """Several observers as one (``Endpoint(observer=[a, b])``)."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)

    def attach(self, endpoint: Endpoint) -> None:
        for o in self.observers:
            o.attach(endpoint)

    def detach(self, endpoint: Endpoint) -> None:
        for o in self.observers:
            o.detach(endpoint)

    def send_started(
        self, endpoint: str, targets: tuple[str, ...], request_id: str, kind: SendKind
    ) -> Any:
        return [o.send_started(endpoint, targets, request_id, kind) for o in self.observers]

    def traceparent(self, token: Any) -> str:
        for o, t in zip(self.observers, token, strict=True):
            tp = o.traceparent(t)
            if tp:
                return tp
        return ""

    def send_handed_off(self, token: Any, receipts: Sequence[SendReceipt]) -> None:
        for o, t in zip(self.observers, token, strict=True):
            o.send_handed_off(t, receipts)

    def send_failed(self, token: Any, error: BaseException) -> None:
        for o, t in zip(self.observers, token, strict=True):
            o.send_failed(t, error)

    def credit_waited(self, endpoint: str, peer: str, seconds: float) -> None:
        for o in self.observers:
            o.credit_waited(endpoint, peer, seconds)

    def window_waited(self, endpoint: str, peer: str, seconds: float) -> None:
        for o in self.observers:
            o.window_waited(endpoint, peer, seconds)

    def delivered(self, endpoint: str, delivery: Delivery) -> None:
        for o in self.observers:
            o.delivered(endpoint, delivery)

    def taken(self, endpoint: str, delivery: Delivery) -> None:
        for o in self.observers:
            o.taken(endpoint, delivery)

    def peer_forgotten(self, endpoint: str, peer: str) -> None:
        for o in self.observers:
            o.peer_forgotten(endpoint, peer)


def as_observer(value: Observer | Sequence[Observer] | None) -> Observer | None:
    """``Endpoint(observer=...)``: one observer, several, or None.

    Raises:
        TypeError: something that is not an :class:`Observer`.
    """
    if value is None:
        return None
    if isinstance(value, Observer):
        return value
    items = list(value)
    for item in items:
        if not isinstance(item, Observer):
            raise TypeError(f"observer= takes Observer objects, not {type(item).__name__}")
    if not items:
        return None
    return items[0] if len(items) == 1 else Observers(items)


async def observed(
    observer: Observer,
    endpoint: str,
    targets: tuple[str, ...],
    request_id: str,
    kind: SendKind,
    call: Callable[[str], Awaitable[T]],
) -> T:
    """Run ``call(traceparent)`` — one send call — under ``observer``."""
    token = observer.send_started(endpoint, targets, request_id, kind)
    try:
        result = await call(observer.traceparent(token))
    except BaseException as exc:
        observer.send_failed(token, exc)
        raise
    if isinstance(result, SendReceipt):
        observer.send_handed_off(token, (result,))
    elif isinstance(result, list):
        observer.send_handed_off(token, result)
    else:
        observer.send_handed_off(token, ())
    return result
