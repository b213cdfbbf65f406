"""The receiving half of :class:`~omniwire.Endpoint`'s API (a base class of it).

``receive``, ``deliveries``, ``requests`` and ``async for`` all read the one
delivery queue, :class:`~._deliveries.Deliveries` (its docstring tells how
scoped and unscoped consumers share it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ..delivery import Delivery
from ..errors import EndpointClosedError, EndpointNotStartedError
from ._core import Core, State
from ._deliveries import DeliveryStream
from ._receiver import Receiver

__all__ = ["Receiving"]


class Receiving:
    """What an endpoint's application reads: deliveries, by request or not."""

    _core: Core
    _receiver: Receiver

    async def receive(
        self,
        timeout: float | None = None,
        *,
        request_id: str | None = None,
        from_stage: str | None = None,
    ) -> Delivery:
        """The next delivery: payloads, stream chunks, stream ends, errors (kind
        ``error``; ``cause`` says ``peer_lost``/``peer_closed`` when a peer went away
        mid-request), aborts.

        With ``request_id``: the next delivery of that request (waiting for it, and
        holding the request meanwhile — see :meth:`deliveries`); without: the
        oldest delivery of a request nobody holds. ``from_stage`` keeps only what
        that stage sent (an ``aborted`` delivery of the request always matches).

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds.
            EndpointNotStartedError, EndpointClosedError.
        """
        if request_id is not None:
            self._ended_already(request_id)
        return await self._receiver.deliveries.receive(timeout, request_id, from_stage)

    def deliveries(
        self, *, request_id: str | None = None, from_stage: str | None = None
    ) -> DeliveryStream:
        """A stream of deliveries: ``async for d in ep.deliveries(request_id=r): ...``.

        With ``request_id`` the stream holds that request from now on: its
        deliveries (from ``from_stage``, if given) go to this stream, in arrival
        order, and to no unscoped consumer; it ends after the request's
        ``stream_end``, ``error`` or ``aborted`` delivery, when closed, or when the
        endpoint closes. An abort ends it wherever it was made, here too: a stream
        (or ``receive``) of a request already aborted gets its ``aborted`` delivery.
        Any number of streams may be read at once, each in its own task: nothing is
        lost or reordered, and what arrives for a request before its stream exists
        waits for it. Without ``request_id`` it yields
        every delivery of a request nobody holds, until the endpoint closes.

        What arrives for a request nobody holds and nobody takes keeps its share of
        the receive budget; when the budget is full while other consumers wait,
        such a delivery is dropped after ``unclaimed_timeout`` seconds and its
        request gets an ``error`` delivery with ``cause="unclaimed"`` instead.

        Raises:
            EndpointNotStartedError, EndpointClosedError.
        """
        self._core.check_open()
        stream = self._receiver.deliveries.stream(request_id, from_stage)
        if request_id is not None:
            self._ended_already(request_id)
        return stream

    def _ended_already(self, request_id: str) -> None:
        """A consumer comes for an aborted request whose end is not queued (taken by an
        earlier consumer, or the abort came before anyone held it): it gets an
        ``aborted`` delivery of its own, so that it ends too."""
        why = self._core.aborts.why(request_id)
        if (
            why is not None
            and self._core.state is State.OPEN
            and not self._receiver.deliveries.ends_queued(request_id)
        ):
            self._receiver.notice_abort(request_id, *why, late=True)

    async def requests(self, *, from_stage: str | None = None) -> AsyncIterator[DeliveryStream]:
        """One held :class:`DeliveryStream` per request, as its first delivery arrives::

            async for request in ep.requests():
                tg.start_soon(serve, request)   # async with request: async for d in request

        Each request nobody holds yet is yielded once (``from_stage``: only what
        that stage sends, or a request whose first delivery is ``aborted``, whatever
        stage began the abort); the stream starts at the request's first delivery.
        A request is yielded again only for data that comes after its stream ended
        (an abort of a request being served reaches its stream; one that comes after
        its stream ended makes no delivery). Ends when the endpoint closes.

        Raises:
            EndpointNotStartedError: the endpoint was not started.
        """
        queue = self._receiver.deliveries
        while True:
            try:
                stream = await queue.next_request(from_stage)
            except EndpointNotStartedError:
                raise
            except EndpointClosedError:
                return
            yield stream
            del stream  # not kept while waiting: one the application drops is let go

    def __aiter__(self) -> AsyncIterator[Delivery]:
        """Every delivery of a request nobody holds, until the endpoint closes."""
        return self._receiver.deliveries.stream(None, None)

    def queued(self) -> int:
        """Deliveries that arrived and wait for :meth:`receive`."""
        return len(self._receiver.deliveries)
