"""nixl's memory: registrations of its own memory — the pools' regions (host memory,
plus an optional GPU pool), the pools' dedicated buffers, and the lent tensors'
registration cache.

A dedicated buffer carries the partial metadata of its one registration, which a
reference to it carries to the peer.
"""

from __future__ import annotations

import torch

from ..pool import SlotPool
from ..support import HostMemory, RegisteredRecvPool, RegistrationCache, Releaser
from ._blobs import Mem, Region
from ._engine import Agent, Registration

__all__ = ["LentRegistration", "Memory", "new_pool", "recv_pool", "registration_cache"]

PAGE = 4096


class Memory:
    """``size`` bytes (rounded up to pages) of host memory (pre-faulted unless
    ``populate`` is False) or of GPU ``dev``, registered with ``agent``. Blocking to
    make and to release.

    Raises:
        BackendError: it cannot be allocated or registered.
    """

    def __init__(
        self, agent: Agent, size: int, mem: Mem, dev: int, *, partial: bool, populate: bool = True
    ) -> None:
        size = max(PAGE, -(-size // PAGE) * PAGE)
        self.host: HostMemory | None = None
        if mem == "VRAM":
            self.tensor = torch.empty(size, dtype=torch.uint8, device=f"cuda:{dev}")
        else:
            self.host = HostMemory(size, populate=populate)
            self.tensor = self.host.tensor
        self.region = Region(self.tensor.data_ptr(), size, dev, mem)
        self.metadata = b""  # of this registration alone: for dedicated buffers
        try:
            self.registration: Registration | None = agent.register(self.region)
            if partial:
                self.metadata = agent.partial_metadata(self.registration)
        except BaseException:
            self._drop()
            raise
        self.agent = agent

    def release(self) -> None:
        """Deregister and unmap."""
        if self.registration is not None:
            self.agent.deregister(self.registration)
            self.registration = None
        self._drop()

    def fence(self) -> None:
        """Deregister and give the pages back, the mapping kept until :meth:`unmap`:
        UCX's tcp and shared-memory transports write an address they are given,
        registered or not (checked in tests/test_landing.py), so a late write lands
        in this mapping — lent to nobody — rather than in memory mapped anew.

        Raises:
            BackendError: NIXL could not deregister it.
        """
        if self.registration is not None:
            registration, self.registration = self.registration, None
            self.agent.deregister(registration)
        if self.host is not None:
            self.host.discard()

    def unmap(self) -> None:
        """Drop the mapping of memory :meth:`fence` d."""
        self._drop()

    def _drop(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self.host is not None:
            self.host.close()
            self.host = None


def new_pool(agent: Agent, index: int, mem: Mem, dev: int, releaser: Releaser) -> SlotPool[Memory]:
    """A pool (``index`` in the Hello) whose dedicated buffers are registrations of
    their own on the same memory kind."""
    return SlotPool(
        f"nixl {mem} pool",
        min_block=PAGE,
        create=lambda size: Memory(agent, size, mem, dev, partial=True),
        destroy=Memory.release,
        releaser=releaser,
        option="backend_options['nixl']['pool_size']",
    )


class LentRegistration:
    """A lent tensor's storage, registered, with the metadata peers load for it."""

    __slots__ = ("metadata", "region", "registration")

    def __init__(self, region: Region, registration: Registration, metadata: bytes) -> None:
        self.region = region
        self.registration = registration
        self.metadata = metadata


def registration_cache(
    agent: Agent, releaser: Releaser, inline_bytes: int
) -> RegistrationCache[LentRegistration]:
    """Registrations of lent tensors' storages, with their partial metadata; host
    storages of at most ``inline_bytes`` are registered on the event loop."""

    def register(addr: int, nbytes: int, device: torch.device) -> LentRegistration:
        mem: Mem = "VRAM" if device.type == "cuda" else "DRAM"
        region = Region(addr, nbytes, device.index or 0, mem)
        registration = agent.register(region)
        try:
            return LentRegistration(region, registration, agent.partial_metadata(registration))
        except BaseException:
            agent.deregister(registration)
            raise

    def unregister(lent: LentRegistration) -> None:
        agent.deregister(lent.registration)

    return RegistrationCache(register, unregister, releaser, inline_bytes=inline_bytes)


def recv_pool(
    agent: Agent, releaser: Releaser, max_idle_bytes: int
) -> RegisteredRecvPool[Registration]:
    """Copy-mode receive buffers in host memory, each block registered once."""

    def register(addr: int, nbytes: int) -> Registration:
        return agent.register(Region(addr, nbytes, 0, "DRAM"))

    return RegisteredRecvPool(register, agent.deregister, releaser, max_idle_bytes=max_idle_bytes)
