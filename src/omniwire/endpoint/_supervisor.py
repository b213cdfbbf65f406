"""The endpoint's background tasks: owned by the endpoint, not by its caller's scopes.

Tasks are plain asyncio tasks that the supervisor tracks, for two reasons:

- they must be startable from event-loop callbacks (a ring's wake-up, the outbox's
  end-of-iteration flush), where no task is current — anyio cannot start a task
  there under ``asyncio.run``;
- their lifetime must not be tied to the caller's cancel scopes: a task group
  entered in ``start()`` and exited in ``aclose()`` would break when the caller
  wraps ``aclose`` in ``fail_after`` (anyio refuses to exit a scope that is not the
  innermost one).

``aclose`` cancels every task and waits for them, bounded and shielded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ._stats import Counters

__all__ = ["Supervisor"]

log = logging.getLogger("omniwire.endpoint")


class Supervisor:
    """Runs background tasks; a crash is logged and counted, never fatal."""

    def __init__(self, owner: str, counters: Counters) -> None:
        self.owner = owner
        self.counters = counters
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._running = True

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Run ``fn(*args)`` in the background until it returns or the endpoint closes.
        Callable from a task or from a loop callback; nothing starts once closing
        (returns False then)."""
        if not self._running or self._loop is None:
            return False

        async def guarded() -> None:
            try:
                await fn(*args)
            except asyncio.CancelledError:
                pass
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("%s: background task %s failed", self.owner, fn.__name__)

        task = self._loop.create_task(guarded(), name=f"omniwire:{self.owner}:{fn.__name__}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def aclose(self, timeout: float) -> None:
        """Cancel every task and wait for them, at most ``timeout`` seconds (shielded)."""
        self._running = False
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        with anyio.CancelScope(shield=True):
            _, pending = await asyncio.wait(tasks, timeout=timeout)
        if pending:
            log.warning(
                "%s: %d background task(s) did not stop within %g s: %s",
                self.owner,
                len(pending),
                timeout,
                ", ".join(sorted(t.get_name() for t in pending)),
            )
