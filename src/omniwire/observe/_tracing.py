"""OpenTelemetry spans around omniwire's sends and deliveries
(``pip install "omniwire[tracing]"``; it needs only ``opentelemetry-api``).

Spans (attributes ``omniwire.*``: endpoint, request_id, kind, peer(s), backend(s), bytes):

- ``omniwire.send <kind>`` (PRODUCER) — a ``send``/``stream``/``end_stream`` call, in
  the caller's task (a child of the caller's current span), until the data is
  handed off. Its W3C trace context travels in the DataReady (``traceparent``).
- ``omniwire.transfer`` (INTERNAL, a child of the send span) — one target's object,
  from hand-off to the receiver's acknowledgement; an error status if it failed.
- ``omniwire.deliver <kind>`` (CONSUMER) — on the receiver, from the delivery's
  arrival to the application taking it; **linked** to the sender's send span, so a
  trace viewer joins the two processes. ``Delivery.traceparent`` carries the same
  context for the application's own spans.

Spans go to the tracer provider passed in, else the global one
(``opentelemetry.trace.set_tracer_provider``); with the API alone (no SDK) they
are no-ops.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import __version__
from ..delivery import Delivery, SendReceipt
from ._observer import Observer, SendKind

__all__ = ["TracingObserver"]

_propagator = TraceContextTextMapPropagator()


class TracingObserver(Observer):
    """OpenTelemetry spans of every endpoint it watches (see the module docstring).

    ``Endpoint("talker", observer=TracingObserver())`` traces to the global
    tracer provider; pass ``tracer_provider=`` to use another.
    """

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer("omniwire", __version__, tracer_provider=tracer_provider)

    def send_started(
        self, endpoint: str, targets: tuple[str, ...], request_id: str, kind: SendKind
    ) -> Any:
        return self.tracer.start_span(
            f"omniwire.send {kind}",
            kind=SpanKind.PRODUCER,
            attributes={
                "omniwire.endpoint": endpoint,
                "omniwire.request_id": request_id,
                "omniwire.kind": kind,
                "omniwire.peers": list(targets),
            },
        )

    def traceparent(self, token: Any) -> str:
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=trace.set_span_in_context(token))
        return carrier.get("traceparent", "")

    def send_handed_off(self, token: Any, receipts: Sequence[SendReceipt]) -> None:
        span: Span = token
        if receipts:
            span.set_attribute("omniwire.backends", [r.backend for r in receipts])
            span.set_attribute("omniwire.bytes", sum(r.nbytes for r in receipts))
        context = trace.set_span_in_context(span)
        for receipt in receipts:
            if receipt.done():  # inline: nothing to wait for
                continue
            transfer = self.tracer.start_span(
                "omniwire.transfer",
                context=context,
                attributes={
                    "omniwire.request_id": receipt.request_id,
                    "omniwire.peer": receipt.peer,
                    "omniwire.backend": receipt.backend,
                    "omniwire.bytes": receipt.nbytes,
                    "omniwire.object_id": receipt.object_id or 0,
                },
            )
            receipt.add_done_callback(partial(_end_transfer, transfer))
        span.end()

    def send_failed(self, token: Any, error: BaseException) -> None:
        span: Span = token
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()

    def taken(self, endpoint: str, delivery: Delivery) -> None:
        links = []
        if delivery.traceparent:
            context = _propagator.extract({"traceparent": delivery.traceparent})
            sender = trace.get_current_span(context).get_span_context()
            if sender.is_valid:
                links.append(Link(sender))
        waited = time.monotonic() - delivery.received_at
        span = self.tracer.start_span(
            f"omniwire.deliver {delivery.kind}",
            kind=SpanKind.CONSUMER,
            links=links,
            start_time=time.time_ns() - int(waited * 1e9),
            attributes={
                "omniwire.endpoint": endpoint,
                "omniwire.request_id": delivery.request_id,
                "omniwire.kind": delivery.kind,
                "omniwire.peer": delivery.from_stage,
                "omniwire.backend": delivery.backend or "",
                "omniwire.bytes": delivery.nbytes,
            },
        )
        if delivery.kind == "error":
            span.set_status(Status(StatusCode.ERROR, delivery.error or "error"))
        span.end()


def _end_transfer(span: Span, receipt: SendReceipt) -> None:
    if receipt.error is not None:
        span.record_exception(receipt.error)
        span.set_status(
            Status(StatusCode.ERROR, f"{type(receipt.error).__name__}: {receipt.error}")
        )
    span.end()
