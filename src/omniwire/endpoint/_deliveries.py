"""What arrived and waits for the application: the delivery queue and its budget.

The receiver hands every :class:`~omniwire.delivery.Delivery` here;
:meth:`Deliveries.receive` hands them out in arrival order. Undelivered data is
bounded (``receive_buffer`` deliveries, ``receive_buffer_bytes`` bytes): the
receiver takes a share of the budget before it copies an object and the share
comes back when the application takes the delivery, so a slow consumer makes
the receiver stop taking — and so stop acknowledging — instead of growing memory.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio

from ..delivery import Delivery
from ..flow import Credits

__all__ = ["Deliveries"]


class Deliveries:
    def __init__(self, max_count: int, max_bytes: int, check_open: Callable[[], None]) -> None:
        self.queue: deque[Delivery] = deque()
        self.budget = Credits(max_count, max_bytes)
        self._check_open = check_open
        self._arrived = anyio.Event()

    def __len__(self) -> int:
        return len(self.queue)

    def put(self, delivery: Delivery) -> None:
        self.queue.append(delivery)
        self._arrived.set()

    async def receive(self, timeout: float | None) -> Delivery:
        """The next delivery.

        Raises:
            TimeoutError: none within ``timeout`` seconds.
            EndpointNotStartedError, EndpointClosedError: nothing left and not open.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.queue:
                delivery = self.queue.popleft()
                self._give_back(delivery)
                return delivery
            self._check_open()
            self._arrived = anyio.Event()
            if deadline is None:
                await self._arrived.wait()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no delivery within {timeout:g} s")
            with anyio.move_on_after(left):
                await self._arrived.wait()

    def drop(self, request_id: str) -> None:
        """Drop the undelivered deliveries of an aborted request (zero-copy ones NACK)."""
        kept: deque[Delivery] = deque()
        for d in self.queue:
            if d.request_id == request_id and d.kind != "aborted":
                d.release()
                self._give_back(d)
            else:
                kept.append(d)
        self.queue = kept

    def close(self) -> None:
        for d in self.queue:
            d.release()
            self._give_back(d)
        self.queue.clear()
        self._arrived.set()

    def _give_back(self, delivery: Delivery) -> None:
        if delivery._budget is not None:
            self.budget.release(delivery._budget)
            delivery._budget = None
