"""Tensors born in transport memory (``Endpoint.empty``): no pack copy on the send.

Lifetime rules (README "Tensors born in transport memory"):

- ``buf = await ep.empty(target, shape, dtype)`` gives a tensor (``buf.tensor``) in
  memory the route to ``target`` sends in place: a slot of the route's backend
  when it has ``Capabilities.shared_refs`` (this endpoint's shm arena on one host,
  mooncake's or nixl's registered pool), else ordinary memory that is *lent* to the
  engine (registered once and read in place; ``lend=True`` is implied).
- Send the tensor itself (``send(target, buf.tensor)`` or a one-entry dict of it):
  the DataRef names the slot; nothing is copied on the sender. A payload with other
  tensors too, a view of part of it, or a route through another backend is packed
  as usual (one copy), which is always correct.
- Write to it only while no send of it is in flight: after each receipt completes
  (``await buf.settled()`` waits for all of them). Several sends of one buffer may
  be in flight at once (a fan-out, or the same bytes to two peers): they read it.
- ``buf.release()`` (or the end of ``async with buf as tensor:``, which first waits
  for the sends in flight) gives the memory back once the last send of it is
  acknowledged, NACKed, aborted or its peer lost; the tensor must not be used after.
  A send of a released buffer raises ``BufferReleasedError``.
- A buffer dropped without ``release()`` gives its memory back once its tensor and
  every view of it are gone too (the tensor's storage owns the slot's view); its
  tensor, kept alone, is sent packed, as any tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
import torch

from .. import packing
from ..delivery import SendReceipt
from ..errors import BufferReleasedError, OmniwireError
from ._records import SharedExport

if TYPE_CHECKING:
    from ._sender import Sender

__all__ = ["DropOnce", "TransportBuffer"]


class DropOnce:
    """Drops a buffer's share of its export once: at ``release()``, or when its
    tensor's storage dies (``soon``, from a finalizer: any thread, any moment, so the
    drop runs on the event loop)."""

    __slots__ = ("_loop", "_shared")

    def __init__(self, shared: SharedExport, loop: asyncio.AbstractEventLoop) -> None:
        self._shared: SharedExport | None = shared
        self._loop = loop

    def __call__(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.drop()

    def soon(self) -> None:
        if self._shared is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: all is gone
                self._loop.call_soon_threadsafe(self)


class TransportBuffer:
    """A tensor in memory its route sends without a pack copy (see the module docstring)."""

    def __init__(
        self,
        sender: Sender,
        tensor: torch.Tensor,
        backend: str | None,
        shared: SharedExport | None,
        drop: DropOnce | None = None,
    ) -> None:
        self.tensor = tensor
        #: The backend whose memory holds it (``"shm"``), or None: ordinary memory, lent.
        self.backend = backend
        self._sender = sender
        self._shared = shared
        self._drop = drop
        self._receipts: list[SendReceipt] = []
        self._released = False
        self.key = tensor.data_ptr()

    @property
    def released(self) -> bool:
        return self._released

    def matches(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is this buffer's tensor, whole (not a view of part of it,
        nor a lazily conjugated or negated view: those are packed)."""
        return (
            tensor.data_ptr() == self.key
            and tensor.nbytes == self.tensor.nbytes
            and tensor.is_contiguous()
            and tensor.device == self.tensor.device
            and packing.holds_its_values(tensor)
        )

    def shared_for(self, backend: str) -> SharedExport | None:
        """Its memory, for one send through ``backend`` (None: it is not that backend's;
        the send packs it as usual). Each send's record takes a share of it.

        Raises:
            BufferReleasedError: it was released.
        """
        if self._released:
            raise BufferReleasedError("this transport buffer was released; allocate another")
        if self._shared is None or backend != self.backend:
            return None
        return self._shared

    def sent(self, receipt: SendReceipt) -> None:
        self._receipts = [r for r in self._receipts if not r.done()]
        self._receipts.append(receipt)

    @property
    def in_flight(self) -> int:
        """Sends of it whose receipt has not completed."""
        return sum(1 for r in self._receipts if not r.done())

    async def settled(self, timeout: float | None = None) -> None:
        """Wait until every send of it completed — was acknowledged, or landed in the
        peer's memory — or failed (then it may be written again). Raises
        ``TimeoutError`` after ``timeout`` seconds."""
        with anyio.fail_after(timeout):
            for receipt in list(self._receipts):
                with contextlib.suppress(OmniwireError):  # failed: nobody reads it now
                    await receipt.wait()
        self._receipts.clear()

    def release(self) -> None:
        """Give its memory back once the sends in flight are over. Idempotent."""
        if self._released:
            return
        self._released = True
        sender = self._sender
        if sender.born.get(self.key) is self:
            del sender.born[self.key]
        sender.released[self.key] = self
        while len(sender.released) > 256:
            del sender.released[next(iter(sender.released))]
        if self._drop is not None:
            self._drop()

    async def __aenter__(self) -> torch.Tensor:
        return self.tensor

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.settled(self._sender.core.config.ack_timeout)
        finally:
            self.release()

    def __repr__(self) -> str:
        where = self.backend or "lent memory"
        state = "released" if self._released else f"{self.in_flight} in flight"
        return (
            f"<TransportBuffer {tuple(self.tensor.shape)} {self.tensor.dtype} in {where}, {state}>"
        )
