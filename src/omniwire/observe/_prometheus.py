"""Prometheus metrics of omniwire endpoints (``pip install "omniwire[metrics]"``).

Metrics (labels in braces; an *edge* is ``endpoint`` → ``peer``)::

    omniwire_sent_objects_total{endpoint,peer,kind,backend}       objects handed off
    omniwire_sent_bytes_total{endpoint,peer,kind,backend}         their tensor bytes
    omniwire_send_latency_seconds{endpoint,peer,kind,backend}     send call → ACK (histogram)
    omniwire_received_objects_total{endpoint,peer,kind,backend}   deliveries queued
    omniwire_received_bytes_total{endpoint,peer,kind,backend}     their tensor bytes
    omniwire_delivery_wait_seconds{endpoint,peer,kind}            queued → taken by the
                                                                  application (histogram)
    omniwire_credit_wait_seconds{endpoint,peer}                   sends that waited for a
                                                                  credit (histogram)
    omniwire_window_wait_seconds{endpoint,peer}                   sends that waited for the
                                                                  peer's byte window (histogram)
    omniwire_errors_total{endpoint,side,cause}                    failed sends (side "send")
                                                                  and error or aborted
                                                                  deliveries ("receive")
    omniwire_in_flight_objects{endpoint,peer,direction}           sent / received, not ACKed
    omniwire_peers{endpoint}                                      peers ready now
    omniwire_deliveries_queued{endpoint}                          waiting for the application
    omniwire_events_total{endpoint,event}                         ``Endpoint.counters``

``peer`` is the peer at the other end of the connection, also for an aborted
delivery whose abort began further away (``Delivery.via``). A peer's series are
removed when its endpoint forgets it (the last 256 gone peers are remembered). ``cause`` is one
vocabulary for both sides (:func:`cause_of`): ``aborted``, ``peer_lost``,
``peer_closed``, ``refused``, ``timeout``, ``no_route``, ``handshake``, ``closed``,
``backend_error``, ``unclaimed`` (a delivery no consumer came for) and ``error``
(anything else: an error the sender reported, data that could not be read, a bug).

``kind`` is ``payload``, ``stream_chunk`` or ``stream_end`` (backend ``control``:
the end rides on the control plane). Stream chunks carried inline have backend
``inline``; their latency is send → hand-off (they need no ACK). The last four
are read from the endpoints when the registry is collected, so they cost the
endpoints nothing between scrapes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..delivery import Delivery, SendReceipt
from ..errors import (
    AckTimeoutError,
    BackendError,
    EndpointClosedError,
    HandshakeError,
    NoRouteError,
    PeerClosedError,
    PeerLostError,
    PeerRefusedError,
    RequestAbortedError,
)
from ._observer import Observer, SendKind

if TYPE_CHECKING:
    from ..endpoint import Endpoint

__all__ = ["LATENCY_BUCKETS", "PrometheusObserver", "cause_of", "serve_metrics"]

#: Histogram buckets (seconds): 50 µs … 30 s.
LATENCY_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

_EDGE = ("endpoint", "peer", "kind", "backend")

#: Error classes → causes, most specific first (a subclass before its base).
_CAUSES: tuple[tuple[type[BaseException], str], ...] = (
    (RequestAbortedError, "aborted"),
    (PeerClosedError, "peer_closed"),
    (PeerRefusedError, "refused"),
    (PeerLostError, "peer_lost"),
    (AckTimeoutError, "timeout"),
    (NoRouteError, "no_route"),
    (HandshakeError, "handshake"),
    (EndpointClosedError, "closed"),
    (BackendError, "backend_error"),
)


def cause_of(error: BaseException | Delivery) -> str:
    """The ``cause`` label of a failed send (its error) or of an ``error`` /
    ``aborted`` delivery: one vocabulary for both sides of the same event."""
    if isinstance(error, Delivery):
        if error.kind == "aborted":
            return "aborted"
        return error.cause or "error"
    for cls, cause in _CAUSES:
        if isinstance(error, cls):
            return cause
    return "error"


class PrometheusObserver(Observer):
    """Prometheus metrics of every endpoint it watches, registered on ``registry``.

    One observer per registry; it may watch several endpoints (their name is a
    label)::

        from prometheus_client import CollectorRegistry
        from omniwire.observe import PrometheusObserver, serve_metrics

        registry = CollectorRegistry()
        metrics = PrometheusObserver(registry)
        server, port = serve_metrics(registry, 9464)        # GET http://host:9464/metrics
        async with Endpoint("thinker", observer=metrics) as ep: ...

    Raises:
        ValueError: ``registry`` already holds omniwire metrics.
    """

    def __init__(
        self, registry: CollectorRegistry, *, buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> None:
        r = registry
        self.sent_objects = Counter(
            "omniwire_sent_objects", "Objects handed off, per edge, kind and backend", _EDGE,
            registry=r,
        )  # fmt: skip
        self.sent_bytes = Counter(
            "omniwire_sent_bytes", "Tensor bytes handed off", _EDGE, registry=r
        )
        self.send_latency = Histogram(
            "omniwire_send_latency_seconds",
            "From the send call to the receiver's acknowledgement",
            _EDGE,
            buckets=buckets,
            registry=r,
        )
        self.received_objects = Counter(
            "omniwire_received_objects", "Deliveries queued for the application", _EDGE,
            registry=r,
        )  # fmt: skip
        self.received_bytes = Counter(
            "omniwire_received_bytes", "Tensor bytes received", _EDGE, registry=r
        )
        self.delivery_wait = Histogram(
            "omniwire_delivery_wait_seconds",
            "From a delivery's arrival to the application taking it",
            ("endpoint", "peer", "kind"),
            buckets=buckets,
            registry=r,
        )
        self.credit_wait = Histogram(
            "omniwire_credit_wait_seconds",
            "Sends that waited for a credit (too much unacknowledged), and how long",
            ("endpoint", "peer"),
            buckets=buckets,
            registry=r,
        )
        self.window_wait = Histogram(
            "omniwire_window_wait_seconds",
            "Sends that waited for the peer's byte window (too much not taken), and how long",
            ("endpoint", "peer"),
            buckets=buckets,
            registry=r,
        )
        self.errors = Counter(
            "omniwire_errors", "Failed sends and error deliveries, by cause",
            ("endpoint", "side", "cause"), registry=r,
        )  # fmt: skip
        self._endpoints: dict[int, Endpoint] = {}
        self._lock = threading.Lock()  # scrapes read _endpoints from their own thread
        registry.register(_StateCollector(self))

    # -- the endpoints watched -------------------------------------------------------

    def attach(self, endpoint: Endpoint) -> None:
        with self._lock:
            self._endpoints[id(endpoint)] = endpoint

    def detach(self, endpoint: Endpoint) -> None:
        with self._lock:
            self._endpoints.pop(id(endpoint), None)

    def endpoints(self) -> list[Endpoint]:
        with self._lock:
            return list(self._endpoints.values())

    # -- events ----------------------------------------------------------------------

    def send_started(
        self, endpoint: str, targets: tuple[str, ...], request_id: str, kind: SendKind
    ) -> Any:
        return (endpoint, targets, kind, time.monotonic())

    def send_handed_off(self, token: Any, receipts: Sequence[SendReceipt]) -> None:
        endpoint, targets, kind, started = token
        if kind == "stream_end":
            for target in targets:
                self.sent_objects.labels(endpoint, target, kind, "control").inc()
            return
        for receipt in receipts:
            labels = (endpoint, receipt.peer, kind, receipt.backend)
            self.sent_objects.labels(*labels).inc()
            self.sent_bytes.labels(*labels).inc(receipt.nbytes)
            receipt.add_done_callback(partial(self._settled, labels, started))

    def _settled(self, labels: tuple[str, ...], started: float, receipt: SendReceipt) -> None:
        if receipt.error is None:
            assert receipt.finished is not None
            self.send_latency.labels(*labels).observe(receipt.finished - started)
        else:
            self.errors.labels(labels[0], "send", cause_of(receipt.error)).inc()

    def send_failed(self, token: Any, error: BaseException) -> None:
        if isinstance(error, Exception):  # not a cancellation
            self.errors.labels(token[0], "send", cause_of(error)).inc()

    def credit_waited(self, endpoint: str, peer: str, seconds: float) -> None:
        self.credit_wait.labels(endpoint, peer).observe(seconds)

    def window_waited(self, endpoint: str, peer: str, seconds: float) -> None:
        self.window_wait.labels(endpoint, peer).observe(seconds)

    def delivered(self, endpoint: str, delivery: Delivery) -> None:
        kind = delivery.kind
        if kind in ("payload", "stream_chunk"):
            labels = (endpoint, delivery.from_stage, kind, delivery.backend or "unknown")
            self.received_objects.labels(*labels).inc()
            self.received_bytes.labels(*labels).inc(delivery.nbytes)
        elif kind == "stream_end":
            self.received_objects.labels(endpoint, delivery.from_stage, kind, "control").inc()
        else:
            self.errors.labels(endpoint, "receive", cause_of(delivery)).inc()

    def taken(self, endpoint: str, delivery: Delivery) -> None:
        wait = time.monotonic() - delivery.received_at
        peer = delivery.via or delivery.from_stage
        self.delivery_wait.labels(endpoint, peer, delivery.kind).observe(wait)

    def peer_forgotten(self, endpoint: str, peer: str) -> None:
        """Its series go (a stage whose peers come and go under new names keeps those
        of the peers its table remembers)."""
        edge = {"endpoint": endpoint, "peer": peer}
        for metric in (
            self.sent_objects,
            self.sent_bytes,
            self.send_latency,
            self.received_objects,
            self.received_bytes,
            self.delivery_wait,
            self.credit_wait,
            self.window_wait,
        ):
            metric.remove_by_labels(edge)


class _StateCollector(Collector):
    """Gauges read from the endpoints at collection time (from the scrape's thread)."""

    def __init__(self, owner: PrometheusObserver) -> None:
        self.owner = owner

    def collect(self) -> Iterable[Metric]:
        peers = GaugeMetricFamily("omniwire_peers", "Peers ready now", labels=["endpoint"])
        in_flight = GaugeMetricFamily(
            "omniwire_in_flight_objects",
            "Objects sent and not yet acknowledged (direction out), or received and "
            "not yet acknowledged (direction in)",
            labels=["endpoint", "peer", "direction"],
        )
        queued = GaugeMetricFamily(
            "omniwire_deliveries_queued",
            "Deliveries waiting for the application",
            labels=["endpoint"],
        )
        events = CounterMetricFamily(
            "omniwire_events", "Endpoint.counters: named event counts", labels=["endpoint", "event"]
        )
        for ep in self.owner.endpoints():
            state = _read(ep)
            if state is None:
                continue
            ready, flight, waiting, counters = state
            peers.add_metric([ep.name], ready)
            for peer, (out, inn) in sorted(flight.items()):
                in_flight.add_metric([ep.name, peer, "out"], out)
                in_flight.add_metric([ep.name, peer, "in"], inn)
            queued.add_metric([ep.name], waiting)
            for event, count in sorted(counters.items()):
                events.add_metric([ep.name, event], count)
        return [peers, in_flight, queued, events]


def _read(
    ep: Endpoint,
) -> tuple[int, dict[str, tuple[int, int]], int, dict[str, int]] | None:
    """A snapshot of what the gauges show. The endpoint's loop may change its tables
    while this thread reads them: a read that collides is tried again."""
    for _ in range(5):
        try:
            return len(ep.peer_names()), ep.in_flight(), ep.queued(), dict(ep.counters)
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return None


def serve_metrics(
    registry: CollectorRegistry, port: int = 0, *, addr: str = "127.0.0.1"
) -> tuple[WSGIServer, int]:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread.

    ``port=0`` picks a free port. Returns the server (stop it with
    ``server.shutdown(); server.server_close()``) and the port it listens on.
    Equivalent to ``prometheus_client.start_http_server(port, addr, registry)``.

    Raises:
        OSError: the address cannot be bound.
    """
    server, _ = start_http_server(port, addr, registry)
    return server, int(server.server_port)
