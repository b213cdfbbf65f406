"""mooncake's memory: host memory registered with the engine — the pool's region, the
pool's dedicated buffers — and the lent tensors' registration cache.

Released memory is unregistered first, then its pages are given back but the
mapping is kept for a while (the last :data:`RETIRED_MAX`): a peer's read that the
engine's server accepted just before the memory was unregistered then reads zeros
instead of faulting.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from ...errors import BackendError
from ..pool import SlotPool
from ..support import HostMemory, RegisteredRecvPool, RegistrationCache, Releaser
from ._engine import Engine

__all__ = ["Registered", "new_pool", "recv_pool", "registration_cache"]

log = logging.getLogger("omniwire.mooncake")

RETIRED_MAX = 32
_retired: deque[HostMemory] = deque()
_retired_lock = threading.Lock()


def _retire(memory: HostMemory) -> None:
    memory.discard()
    with _retired_lock:
        _retired.append(memory)
        old = [_retired.popleft() for _ in range(max(0, len(_retired) - RETIRED_MAX))]
    for m in old:
        m.close()


class Registered:
    """Host memory registered with ``engine``, pre-faulted unless ``populate`` is False
    (blocking to make and to release: call both in worker threads, or on the loop where
    registering is cheap).

    Raises:
        BackendError: it cannot be mapped or registered.
    """

    def __init__(self, engine: Engine, size: int, *, populate: bool = True) -> None:
        self.memory = HostMemory(max(size, 1), populate=populate)
        try:
            engine.register(self.memory.addr, self.memory.size)
        except BaseException:
            self.memory.close()
            raise
        self.engine = engine
        self.addr = self.memory.addr
        self.size = size

    @property
    def tensor(self) -> torch.Tensor:
        return self.memory.tensor

    def release(self) -> None:
        """Unregister, give the pages back, keep the mapping a while (see above)."""
        try:
            self.engine.unregister(self.addr)
        except BackendError as exc:
            log.warning("%s", exc)
        _retire(self.memory)

    def fence(self) -> None:
        """Unregister (the engine's server then refuses a peer's write here: checked
        in tests/test_landing.py) and give the pages back; the mapping stays until
        :meth:`unmap` (a write accepted just before lands in it, not elsewhere).

        Raises:
            BackendError: the engine could not unregister it.
        """
        self.engine.unregister(self.addr)
        self.memory.discard()

    def unmap(self) -> None:
        """Drop the mapping of memory :meth:`fence` d."""
        self.memory.close()


def new_pool(engine: Engine, releaser: Releaser) -> SlotPool[Registered]:
    """The backend's slot pool; dedicated buffers are registered for one object."""
    return SlotPool(
        "mooncake pool",
        create=lambda size: Registered(engine, size),
        destroy=Registered.release,
        releaser=releaser,
        option="backend_options['mooncake']['pool_size']",
    )


def registration_cache(
    engine: Engine, releaser: Releaser, inline_bytes: int
) -> RegistrationCache[int]:
    """Registrations of lent tensors' storages (handle: the address); storages of at
    most ``inline_bytes`` are registered on the event loop."""

    def register(addr: int, nbytes: int, device: torch.device) -> int:
        engine.register(addr, nbytes)
        return addr

    return RegistrationCache(register, engine.unregister, releaser, inline_bytes=inline_bytes)


def recv_pool(engine: Engine, releaser: Releaser, max_idle_bytes: int) -> RegisteredRecvPool[int]:
    """Copy-mode receive buffers, each block registered once (handle: the address)."""

    def register(addr: int, nbytes: int) -> int:
        engine.register(addr, nbytes)
        return addr

    return RegisteredRecvPool(register, engine.unregister, releaser, max_idle_bytes=max_idle_bytes)
