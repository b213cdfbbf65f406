"""The sender's slot memory: the slot pool on this endpoint's GPU (a reserved region
carved by the shared buddy allocator, :mod:`omniwire.backends.pool`, and dedicated
buffers beyond it) and the ring of interprocess events recorded for slots."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...errors import BackendError
from ..pool import SlotPool
from ..support import mib
from ._gpu import CudaApi, Event

__all__ = ["EventRing", "reserve_pool"]


class EventRing:
    """Reusable interprocess events with their IPC handles, created on demand."""

    def __init__(self, factory: Callable[[], tuple[Event, bytes]]) -> None:
        self._factory = factory
        self._events: list[tuple[Event, bytes]] = []
        self._free: list[int] = []

    def take(self) -> tuple[int, Event, bytes]:
        if self._free:
            i = self._free.pop()
        else:
            i = len(self._events)
            self._events.append(self._factory())
        event, handle = self._events[i]
        return i, event, handle

    def give(self, i: int) -> None:
        self._free.append(i)

    def __len__(self) -> int:
        return len(self._events)

    @property
    def in_use(self) -> int:
        return len(self._events) - len(self._free)


def reserve_pool(
    api: CudaApi, index: int, pool_size: int, min_block: int
) -> tuple[torch.Tensor | None, SlotPool[torch.Tensor]]:
    """The slot pool on GPU ``index`` and its region (None when ``pool_size`` is under
    one block: every object then gets a dedicated buffer).

    Raises:
        torch.cuda.OutOfMemoryError: the region does not fit on the GPU.
    """

    def dedicated(nbytes: int) -> torch.Tensor:
        try:
            return api.empty(nbytes, index)
        except torch.cuda.OutOfMemoryError as exc:
            raise BackendError(
                f"cuda_ipc: no GPU memory for a dedicated {mib(nbytes)} buffer on "
                f"cuda:{index} (the slot pool is full)"
            ) from exc

    pool: SlotPool[torch.Tensor] = SlotPool(
        "cuda_ipc slot pool",
        min_block=min_block,
        create=dedicated,
        option="backend_options['cuda_ipc']['pool_size']",
    )
    region: torch.Tensor | None = None
    if pool_size >= min_block:
        region = api.empty(pool_size, index)
        pool.attach(pool_size)
    return region, pool
