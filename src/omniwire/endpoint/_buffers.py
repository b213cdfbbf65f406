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
import math
import weakref
from types import TracebackType

import anyio
import torch

from .. import packing
from ..backends.base import ByteBackend
from ..delivery import SendReceipt
from ..errors import BufferReleasedError, OmniwireError
from ..routing import PayloadInfo
from ._core import Core
from ._peers import PeerTable
from ._records import SharedExport
from ._routebook import RouteBook

__all__ = ["Buffers", "DropOnce", "TransportBuffer"]


class Buffers:
    """An endpoint's transport buffers: ``Endpoint.empty`` makes them, a send finds
    the one a payload is (:meth:`of`)."""

    def __init__(self, core: Core, peers: PeerTable, routes: RouteBook) -> None:
        self.core = core
        self.peers = peers
        self.routes = routes
        #: live transport buffers, by their tensor's data_ptr, and the last released
        #: ones (at most 256: a send of one is a clear error)
        self.born: weakref.WeakValueDictionary[int, TransportBuffer] = (
            weakref.WeakValueDictionary()
        )  # (weak: a buffer the application dropped is no longer ours to keep)
        self.released: dict[int, TransportBuffer] = {}

    def of(self, tensors: list[torch.Tensor]) -> TransportBuffer | None:
        """The transport buffer a payload of one tensor is, if it is one, whole."""
        if len(tensors) != 1 or not (self.born or self.released):
            return None
        key = tensors[0].data_ptr()
        buf = self.born.get(key) or self.released.get(key)
        return buf if buf is not None and buf.matches(tensors[0]) else None

    async def empty(
        self, target: str, shape: tuple[int, ...], dtype: torch.dtype, device: str
    ) -> TransportBuffer:
        """A transport buffer for ``target`` (see the module docstring)."""
        core = self.core
        core.check_open()
        peer = await self.peers.wait_ready(target, core.config.handshake_timeout)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        info = PayloadInfo("payload", nbytes, frozenset({torch.device(device).type}), 1)
        route = self.routes.select(peer, info)
        backend = core.backends.get(route.backend)
        if (
            isinstance(backend, ByteBackend)
            and type(backend).capabilities.shared_refs
            and device == "cpu"
        ):
            pinfo = self.peers.connected_backend(peer, route.backend)
            export = await backend.export(pinfo, nbytes, device)
            assert export.buffer is not None
            shared = SharedExport(export)
            # The tensor's storage owns this array (and nothing else does): once the
            # tensor and every view of it are gone, the slot goes back, even if the
            # buffer was never released (dropped, or kept only as its tensor).
            owner = export.buffer[:nbytes].numpy()
            drop = DropOnce(shared, asyncio.get_running_loop())
            weakref.finalize(owner, drop.soon)
            tensor = torch.from_numpy(owner).view(dtype).view(shape)
            buf = TransportBuffer(self, tensor, route.backend, shared, drop)
        else:
            buf = TransportBuffer(self, torch.empty(shape, dtype=dtype, device=device), None, None)
        self.released.pop(buf.key, None)
        self.born[buf.key] = buf
        return buf

    def gone(self, buf: TransportBuffer) -> None:
        """``buf`` was released: a send of it is refused (see ``released``)."""
        if self.born.get(buf.key) is buf:
            del self.born[buf.key]
        self.released[buf.key] = buf
        while len(self.released) > 256:
            del self.released[next(iter(self.released))]


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
        owner: Buffers,
        tensor: torch.Tensor,
        backend: str | None,
        shared: SharedExport | None,
        drop: DropOnce | None = None,
    ) -> None:
        self.tensor = tensor
        #: The backend whose memory holds it (``"shm"``), or None: ordinary memory, lent.
        self.backend = backend
        self._owner = owner
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
        self._owner.gone(self)
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
            await self.settled(self._owner.core.config.ack_timeout)
        finally:
            self.release()

    def __repr__(self) -> str:
        where = self.backend or "lent memory"
        state = "released" if self._released else f"{self.in_flight} in flight"
        return (
            f"<TransportBuffer {tuple(self.tensor.shape)} {self.tensor.dtype} in {where}, {state}>"
        )
