"""``omniwire.observe``: metrics and tracing for endpoints, off by default.

Pass an observer to an endpoint — ``Endpoint(..., observer=obs)``, or a list of
them. With none (the default) the endpoint makes no observer call at all.

=======================  =================================================  =====================
name                     what it does                                       needs
=======================  =================================================  =====================
:class:`Observer`        the interface: subclass it to watch sends,         nothing
                         credit and window waits, deliveries
:class:`PrometheusObserver`  Prometheus metrics on a registry you pass       ``omniwire[metrics]``
:func:`serve_metrics`    serves a registry over HTTP (``/metrics``)         ``omniwire[metrics]``
:class:`TracingObserver` OpenTelemetry spans around send, transfer and      ``omniwire[tracing]``
                         delivery, linked across processes
=======================  =================================================  =====================

``import omniwire.observe`` imports neither ``prometheus_client`` nor
``opentelemetry``: each is imported when its observer is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._observer import Observer, Observers, SendKind, as_observer

if TYPE_CHECKING:
    from ._prometheus import PrometheusObserver, serve_metrics
    from ._tracing import TracingObserver

__all__ = [
    "Observer",
    "Observers",
    "PrometheusObserver",
    "SendKind",
    "TracingObserver",
    "as_observer",
    "serve_metrics",
]

_LAZY = {
    "PrometheusObserver": "_prometheus",
    "serve_metrics": "_prometheus",
    "TracingObserver": "_tracing",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omniwire.observe' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)
