"""Rate limits for what a hostile or broken peer can make us do: log lines and sends.

``RateLimitedLog`` lets ``burst`` records per key through in each ``interval``, counts
the rest, and says how many it held back on the next record it lets through (or on
``flush()``): 5,000 refused frames make a few lines and a count, not 5,000 lines.
``TokenBucket`` bounds a rate of events (transient refusal sockets, for one).

Keys should name a cause ("bad_frame", "hello_refused"), not a value a peer chooses:
each new key starts with a fresh burst.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

__all__ = ["RateLimitedLog", "TokenBucket"]

Clock = Callable[[], float]


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second; each event takes one.

    Thread-safe.
    """

    def __init__(self, rate: float, burst: int, *, clock: Clock = time.monotonic) -> None:
        """Raises:
        ValueError: ``rate`` is negative or ``burst`` is below 1.
        """
        if rate < 0 or burst < 1:
            raise ValueError(f"TokenBucket needs rate >= 0 and burst >= 1, not {rate}, {burst}")
        self.rate = float(rate)
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def take(self) -> bool:
        """Take one token. Returns True if there was one, False if the event must be
        dropped (nothing is taken then)."""
        with self._lock:
            self._refill()
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False

    def available(self) -> float:
        """Tokens available now (fractional while refilling)."""
        with self._lock:
            self._refill()
            return self._tokens


@dataclass
class _Window:
    start: float
    emitted: int = 0
    suppressed: int = 0
    last: tuple[int, str, tuple[object, ...]] | None = None  # level, msg, args held back


def _escaped(msg: str, args: tuple[object, ...]) -> str:
    return msg if args else msg.replace("%", "%%")  # a suffix with args makes msg a template


def _formatted(msg: str, args: tuple[object, ...]) -> str:
    """``msg % args`` now: a record held back keeps its text, not its arguments (an
    exception's traceback keeps every frame it passed through, and their locals:
    a refused 15 MiB frame stayed in memory as long as its record was held)."""
    try:
        return msg % args if args else msg
    except (TypeError, ValueError):
        return f"{msg} {args!r}"


def _suffix(n: int, seconds: float) -> str:
    return f" ({n} similar message{'s' if n != 1 else ''} suppressed in the last {seconds:.0f} s)"


class RateLimitedLog:
    """At most ``burst`` records per key in each ``interval`` seconds, through ``logger``.

    The first record a key may log after some were held back carries
    "(N similar messages suppressed in the last T s)". ``flush()`` reports keys that
    went quiet. Cheap when nothing is held back: one level check, a lock, a dict
    lookup. Safe from any thread. At most ``max_keys`` keys are tracked (the one whose
    interval began first is forgotten, with its count).
    """

    def __init__(
        self,
        logger: logging.Logger | str,
        *,
        burst: int = 5,
        interval: float = 60.0,
        max_keys: int = 256,
        clock: Clock = time.monotonic,
    ) -> None:
        """Raises:
        ValueError: ``burst`` or ``max_keys`` below 1, or ``interval`` not positive.
        """
        if burst < 1 or interval <= 0 or max_keys < 1:
            raise ValueError(
                f"RateLimitedLog needs burst >= 1, interval > 0, max_keys >= 1, "
                f"not {burst}, {interval}, {max_keys}"
            )
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.burst = burst
        self.interval = interval
        self.max_keys = max_keys
        self._clock = clock
        self._windows: dict[Hashable, _Window] = {}
        self._lock = threading.Lock()
        #: Records held back so far, all keys together.
        self.suppressed_total = 0

    def log(
        self,
        level: int,
        key: Hashable,
        msg: str,
        *args: object,
        exc_info: bool = False,
        stacklevel: int = 1,
    ) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` used up its burst.

        Returns:
            True if a record was emitted, False if it was held back (or the level
            is disabled).
        """
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            held = 0
            since = 0.0
            if window is None or now - window.start >= self.interval:
                if window is not None:
                    held, since = window.suppressed, now - window.start
                    del self._windows[key]  # re-inserted last: oldest window first
                elif len(self._windows) >= self.max_keys:
                    del self._windows[next(iter(self._windows))]
                window = self._windows[key] = _Window(start=now)
            if window.emitted >= self.burst:
                window.suppressed += 1
                window.last = (level, _formatted(msg, args), ())
                self.suppressed_total += 1
                return False
            window.emitted += 1
        if held:
            msg = _escaped(msg, args) + "%s"
            args = (*args, _suffix(held, since))
        self.logger.log(level, msg, *args, exc_info=exc_info, stacklevel=stacklevel + 1)
        return True

    def debug(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.DEBUG, key, msg, *args, stacklevel=2)

    def info(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, key, msg, *args, stacklevel=2)

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args, stacklevel=2)

    def error(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, key, msg, *args, stacklevel=2)

    def flush(self) -> int:
        """Report keys whose interval ended with records held back: the last record
        held back is logged, with the count of the others. Call it now and then (a
        housekeeping loop) so a flood that stopped is still accounted for.

        Returns:
            The number of records emitted.
        """
        now = self._clock()
        due: list[tuple[int, str, tuple[object, ...]]] = []
        with self._lock:
            for key, window in list(self._windows.items()):
                if now - window.start < self.interval:
                    continue
                del self._windows[key]
                if window.last is None:
                    continue
                level, msg, args = window.last
                if window.suppressed > 1:
                    msg = _escaped(msg, args) + "%s"
                    args = (*args, _suffix(window.suppressed - 1, now - window.start))
                due.append((level, msg, args))
        for level, msg, args in due:
            self.logger.log(level, msg, *args)
        return len(due)
