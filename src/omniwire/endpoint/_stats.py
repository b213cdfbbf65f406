"""What an endpoint counts: route statistics, event counters, and bounded logging of
whatever a peer can trigger (so a hostile peer cannot flood the log)."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from ..routing import Route

__all__ = ["Counters", "NoisyLog", "RouteStats"]


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


class NoisyLog:
    """Log records a peer can cause, at most ``burst`` per ``interval`` per key; the
    next record after a quiet spell says how many were suppressed."""

    def __init__(self, logger: logging.Logger, burst: int = 5, interval: float = 10.0) -> None:
        self.logger = logger
        self.burst = burst
        self.interval = interval
        self._windows: dict[str, tuple[float, int, int]] = {}  # key -> (start, sent, dropped)

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        start, sent, dropped = self._windows.get(key, (now, 0, 0))
        if now - start >= self.interval:
            if dropped:
                msg += f" ({dropped} similar message(s) suppressed in the last {now - start:.0f} s)"
            start, sent, dropped = now, 0, 0
        if sent >= self.burst:
            self._windows[key] = (start, sent, dropped + 1)
            return
        if len(self._windows) > 1024:  # keys come from peers: keep the table bounded
            self._windows.clear()
        self._windows[key] = (start, sent + 1, dropped)
        self.logger.log(level, msg, *args)

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def info(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.INFO, key, msg, *args)
