"""Reading an announced object: import its reference, fetch the bytes as the sender
announces them, rebuild the payload (spec §7.2–§7.4). The receiver decides when; this
module only knows how.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch

from .. import codec, hops, packing, wire
from ..backends.base import THREAD_COPY_THRESHOLD, BackendBase, ByteBackend, ObjectBackend
from ..digest import digest_of_async
from ..errors import (
    BackendError,
    BadReferenceError,
    DigestMismatchError,
    OmniwireError,
    WireFormatError,
    described,
    reason_text,
)
from ..flow import FairBudget
from ..recvpool import RecvPool
from ._core import Core
from ._records import InRecord, Peer

__all__ = ["ObjectReader", "Share", "Stalled", "nack_of"]


class Stalled(OmniwireError):
    """The sender of a progressive object announced no more of it in time."""


def nack_of(exc: Exception) -> tuple[wire.NackReason, str] | None:
    """The NACK reason and text for an object whose read raised ``exc`` (spec §7.4);
    None when ``exc`` is not a failure of the read (a bug: let it propagate)."""
    if isinstance(exc, (WireFormatError, BadReferenceError)):  # the peer's fault
        return "malformed", reason_text(exc, "malformed")
    if isinstance(exc, Stalled):
        return "timeout", reason_text(exc, "stalled")
    if isinstance(exc, DigestMismatchError):
        return "digest_mismatch", reason_text(exc, "digest mismatch")
    if isinstance(exc, (OmniwireError, TypeError, ValueError, RuntimeError, OSError)):
        return "backend_error", described(exc)
    return None


class Share:
    """One object's share of the receive budget (:class:`~omniwire.flow.FairBudget`),
    taken as its bytes are announced: a progressive object holds what is ready, not its
    whole declared length. Uncounted (zero-copy: the bytes stay the sender's), it holds
    one object of no bytes."""

    __slots__ = ("budget", "bytes", "counted", "key", "taken")

    def __init__(self, budget: FairBudget, key: str, *, counted: bool) -> None:
        self.budget = budget
        self.key = key
        self.counted = counted
        self.bytes = 0
        self.taken = False

    async def reserve(self, upto: int) -> None:
        """Hold at least ``upto`` bytes (waiting for the budget)."""
        want = upto if self.counted else 0
        if not self.taken:
            await self.budget.acquire(self.key, want)
            self.taken, self.bytes = True, want
        elif want > self.bytes:
            await self.budget.acquire(self.key, want - self.bytes, count=0)
            self.bytes = want

    def release(self) -> None:
        if self.taken:
            self.taken = False
            self.budget.release(self.key, self.bytes)


async def _check_digest(ref: wire.DataRef, tensors: Sequence[torch.Tensor]) -> None:
    """Raise DigestMismatchError unless ``tensors`` hash to ``ref.digest`` (spec §7.7)."""
    got = await digest_of_async(tensors)
    if got is not None and got != ref.digest:
        raise DigestMismatchError(
            f"object {ref.object_id} ({ref.ref.length} bytes via {ref.backend}) was corrupted "
            f"on the way: its tensor bytes hash to {got:#018x}, the sender's to {ref.digest:#018x}"
        )


class ObjectReader:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.pool = RecvPool()  # warm host buffers for copy-mode deliveries

    def fits_now(self, record: InRecord, admits: bool) -> bool:
        """Whether reading ``record`` cannot wait on I/O: a small, fully announced
        object in mapped memory (or an in-process object). ``admits``: the receive
        budget has room for it."""
        backend = self.core.backends.get(record.ref.backend)
        if backend is None:
            return False
        caps = type(backend).capabilities
        return (
            (isinstance(backend, ObjectBackend) or caps.mapped)
            and record.ready == record.length
            and record.ref.layout != "per_tensor"
            and record.length < THREAD_COPY_THRESHOLD
            and admits
        )

    async def read(
        self,
        peer: Peer,
        backend: BackendBase,
        info: Any,
        record: InRecord,
        reserve: Callable[[int], Awaitable[None]],
    ) -> Any:
        """Import and read the object; returns the payload (views in zero-copy mode).

        Raises: ``Stalled``; ``WireFormatError`` / ``BadReferenceError`` for the peer's
        bad reference; the backend's errors.
        """
        ref = record.ref
        length = ref.ref.length
        zero_copy = self.core.config.zero_copy
        record.imp = imp = await backend.import_(info, ref.ref.info, length)
        backend.note_received(length)
        if isinstance(backend, ObjectBackend):
            return imp.value
        if ref.layout == "per_tensor":
            await reserve(length)
            await imp.fetch(0, length)
            tensors = list(imp.tensors or [])
            if not zero_copy:
                tensors = [t.clone() for t in tensors]
        else:
            dest = None if zero_copy else await self._landing(backend, imp.buffer, length)
            hops.mark("recv: imported, landing ready")
            if dest is not None:
                self.core.counters["bytes_copied"] += length
            done = 0
            while done < length:
                ready = await self._announced_past(peer, record, done)
                await reserve(ready)  # the receive budget, as the bytes are announced
                await imp.fetch(done, ready, dest)
                done = ready
            source = dest if dest is not None else imp.buffer
            if source is None:
                if length:
                    raise BackendError(
                        f"backend {ref.backend} imported no buffer for object {ref.object_id}"
                    )
                source = torch.empty(0, dtype=torch.uint8)  # a payload with no tensor bytes
            tensors = packing.unpack(source, ref.tensors, copy=False)
        if ref.digest is not None:
            await _check_digest(ref, tensors)
        return codec.loads(ref.header, tensors, allow_pickle=self.core.config.allow_pickle)

    async def consume(self, peer: Peer, record: InRecord) -> None:
        """Import a refused object of a two-sided engine (its receive pairs with the
        sender's send, in order); nothing else needs it."""
        backend = self.core.backends.get(record.ref.backend)
        info = peer.info.get(record.ref.backend)
        if backend is None or info is None or not type(backend).capabilities.two_sided:
            return
        with contextlib.suppress(OmniwireError):
            record.imp = await backend.import_(info, record.ref.ref.info, record.ref.ref.length)

    async def _announced_past(self, peer: Peer, record: InRecord, done: int) -> int:
        """Wait until the sender announced bytes past ``done``; return the new ``ready``."""
        timeout = self.core.config.ack_timeout
        while record.ready <= done:
            record.progressed = anyio.Event()
            with anyio.move_on_after(timeout):
                await record.progressed.wait()
            if record.ready <= done and not record.progressed.is_set():
                raise Stalled(
                    f"{peer.name!r} made no progress on object {record.object_id} for {timeout:g} s"
                )
        return record.ready

    async def _landing(
        self, backend: BackendBase, source: torch.Tensor | None, length: int
    ) -> torch.Tensor:
        """Where a copy-mode delivery lands: the receiving GPU when the backend
        delivers to one, else a warm host buffer: the backend's registered one
        (:meth:`~omniwire.backends.base.ByteBackend.receive_buffer`), or ours."""
        if source is not None and source.device.type != "cpu":
            return torch.empty(length, dtype=torch.uint8, device=source.device)
        if isinstance(backend, ByteBackend):
            registered = await backend.delivery_buffer(length)
            if registered is not None:
                return registered
        return self.pool.take(length)

    def close(self) -> None:
        self.pool.clear()
