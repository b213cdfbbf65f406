"""What an endpoint counts: route statistics and event counters.

:data:`COUNTERS` is the one registry of the names ``ep.counters`` holds, each with
what it counts. Every name starts at 0 and is always there (``dict(ep.counters)``
lists them all); reading or incrementing a name that is not registered raises
:class:`~omniwire.errors.UnknownNameError` instead of reading 0, so a misspelled
name cannot hide. ``tests/test_counters.py`` scans the source so that no code uses
a name outside the registry, and keeps the README's list equal to it. Adding a
counter means adding one line here. (Plain assignment of a new name,
``counters["x"] = 1``, is left to the scan: checking ``__setitem__`` at run time
would cost every increment on the per-frame path about 0.1 µs.)
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..errors import UnknownNameError
from ..routing import Route

__all__ = ["COUNTERS", "Counters", "RouteStats", "counters_list"]


@dataclass
class RouteStats:
    """What one (peer, kind, backend) route carried, for ``omniwire demo`` and tests."""

    peer: str
    kind: str
    backend: str
    reason: str
    count: int = 0
    nbytes: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    #: The latest decision on this route, with every candidate's rejection.
    route: Route | None = None

    def latency_ms(self, q: float = 0.5) -> float | None:
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


#: Every name ``ep.counters`` holds, and what it counts (the README's list is this).
COUNTERS: Mapping[str, str] = MappingProxyType(
    {
        # -- frames
        "frames_received": "control frames received (a batch is one)",
        "frames_resent": "frames sent again after a connection broke (session resumption)",
        "frames_duplicate": "numbered frames already applied, or past a gap (they come again), dropped",
        "frames_stale": "numbered frames of a session that is not the peer's current one, dropped",
        "sessions_resumed": "peers whose connection broke and came back within `resume_window`",
        "peers_reminded": "Hellos sent to a peer still numbering frames of a session we ended",
        "landings_confirmed": "landed objects to a peer quiet for a second: receipt at its ack",
        "decode_errors": "frames (or headers) that could not be decoded",
        "protocol_errors": "messages that break the protocol (logged; the frame is dropped)",
        "version_refused": "Hellos refused: no wire version in common",
        "internal_errors": "bugs caught in a background task or a handler (logged)",
        # -- objects
        "acks_sent": "objects received and acknowledged",
        "nacks_sent": "objects received and refused (each NACK is logged with its reason)",
        "nacks_received": "objects a peer refused",
        "inbox_full": "objects refused `queue_full`: too many waiting from one peer",
        "receive_errors": "objects that could not be taken (read, rebuilt or checked)",
        "bytes_packed": "bytes packed (copied) into a backend's buffer to send",
        "bytes_copied": "bytes copied out of a backend's memory on receipt (copy mode)",
        "objects_forwarded": "received objects sent on by reference, not packed again",
        "bytes_forwarded": "bytes of the objects sent on by reference",
        # -- flow control
        "credit_waits": "sends that waited for a credit (`max_inflight`, `max_inflight_bytes`)",
        "window_waits": "sends that waited for the peer's byte window (`receive_window`)",
        "window_exceeded": "peers that overran this endpoint's window (their session ends)",
        # -- streams, deliveries and requests
        "streams_refused": "streams refused over `max_open_streams` (aborted back)",
        "streams_idle": "streams ended after `stream_idle_timeout` without a chunk",
        "deliveries_unclaimed": "deliveries of a request nobody held, dropped (`unclaimed`)",
        "deliveries_scanned": "queue entries looked at to find a consumer's next delivery",
        "notices_dropped": "notices (aborted, error) of requests nobody held, dropped",
        "aborts": "requests aborted here (by this endpoint or a peer), each counted once",
        "aborts_forwarded": "aborts passed on to a peer that had seen the request",
        # -- peers
        "peers_lost": "peers declared lost (died, hung, disconnected)",
        "peers_closed": "peers that said Goodbye",
        "peers_unresponsive": "peers declared lost for missing `max_ack_timeouts` deadlines",
        "peers_dropped": "peers that said Hello but could never be reached",
        "restarts_held": "Hellos of a restarted peer held back (restarting too fast)",
        "hellos_refused": "Hellos refused (each is logged with its code)",
        "refusals_sent": "Refusals sent to a refused peer",
        "refusals_received": "Refusals received from a peer that refused this endpoint",
        "backend_refused": "backends that could not serve a peer (routed around)",
        "auth_failed": "connections refused by CURVE: a wrong or missing key",
        "handshakes_failed": "ZeroMQ handshakes cut short (e.g. by a peer closing)",
    }
)


class Counters(Counter[str]):
    """Named event counts (``ep.counters["peers_lost"]``): every name of
    :data:`COUNTERS`, from 0. Another name raises ``UnknownNameError`` (a KeyError)."""

    def __init__(self, counts: Mapping[str, int] | None = None) -> None:
        super().__init__()
        dict.update(self, dict.fromkeys(COUNTERS, 0))
        if counts:
            self.update(counts)

    def __missing__(self, name: str) -> int:
        raise UnknownNameError(f"{name!r} is not a counter (omniwire.endpoint.COUNTERS)")

    def get(self, name: str, default: Any = None) -> Any:
        """``self[name]`` (every counter is there; another name raises)."""
        return self[name]

    def update(self, counts: Any = None, /, **kwargs: int) -> None:
        if counts is not None and not isinstance(counts, Mapping):
            counts = list(counts)
        for name in (*(counts or ()), *kwargs):
            self[name]  # an unknown name raises
        super().update(counts, **kwargs)


def counters_list() -> str:
    """The README's list of counters (between ``<!-- counters:begin/end -->``)."""
    return "\n".join(f"- `{name}`: {meaning}" for name, meaning in COUNTERS.items())
