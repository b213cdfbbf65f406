"""The endpoint's background tasks: a task group that lives in a task of its own.

A task group entered in ``start()`` and exited in ``aclose()`` would tie the
endpoint's cancel scope to the caller's (anyio refuses to exit a scope that is
not the innermost, so ``fail_after`` around ``aclose`` would break it). Running
the group in its own task keeps the caller's scopes and the endpoint's apart:
``aclose`` just asks that task to stop and waits for it, bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ._stats import Counters

__all__ = ["Supervisor"]

log = logging.getLogger("omniwire.endpoint")


class Supervisor:
    """Runs background tasks; a crash is logged and counted, never fatal."""

    def __init__(self, owner: str, counters: Counters) -> None:
        self.owner = owner
        self.counters = counters
        self._tg: TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = anyio.Event()

    async def start(self) -> None:
        started = anyio.Event()

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                started.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()

        self._task = asyncio.get_running_loop().create_task(main(), name=f"omniwire:{self.owner}")
        await started.wait()

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background until it returns or the endpoint closes."""
        if self._tg is None or self._stop.is_set():
            return

        async def guarded() -> None:
            try:
                await fn(*args)
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("%s: background task %s failed", self.owner, fn.__name__)

        self._tg.start_soon(guarded, name=getattr(fn, "__name__", "task"))

    async def aclose(self, timeout: float) -> None:
        """Cancel every task and wait for them, at most ``timeout`` seconds (shielded)."""
        self._stop.set()
        task = self._task
        if task is None:
            return
        with anyio.CancelScope(shield=True):
            await asyncio.wait({task}, timeout=timeout)
        if not task.done():
            task.cancel()
            log.warning("%s: background tasks did not stop within %g s", self.owner, timeout)
