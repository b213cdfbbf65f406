"""What an endpoint counts: route statistics and event counters."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from ..routing import Route

__all__ = ["Counters", "RouteStats"]


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


#: Named event counts (``ep.counters["peers_lost"]``); a missing name reads 0.
Counters = Counter[str]
