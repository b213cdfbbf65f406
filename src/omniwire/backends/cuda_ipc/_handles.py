"""cuda_ipc's export and import handles (tensors shared in place; a slot of the pool
or a dedicated buffer) and the mapping work they do in worker threads and in the
clean-up thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...errors import BackendError
from ..base import Export, Import, PeerInfo
from ..pool import Lease
from ..support import Releaser
from . import _blobs as blobs
from ._blobs import Share, SlotRef, TensorsRef
from ._gpu import CudaApi, Event, release_shares

if TYPE_CHECKING:
    from ._backend import CudaIpcBackend
    from ._peers import PeerState

__all__ = [
    "Mapped",
    "Mapping",
    "SlotExport",
    "SlotImport",
    "TensorExport",
    "TensorsImport",
    "copy_out",
    "drop_mapped",
    "map_tensors",
]

log = logging.getLogger("omniwire.cuda_ipc")


@dataclass(eq=False)
class Mapped:
    share: Share
    storage: torch.UntypedStorage
    base: torch.Tensor
    index: int


@dataclass(eq=False)
class Mapping:
    """What a mapping thread did: the storages mapped so far, and whether it ended."""

    storages: list[torch.UntypedStorage] = field(default_factory=list)
    settled: bool = False


def map_tensors(
    api: CudaApi, ref: TensorsRef, index_of: dict[str, int], m: Mapping
) -> list[torch.Tensor]:
    """Map every share (recording each in ``m`` as it goes), wait for the sender's
    events, and build the views. Runs in a worker thread."""
    try:
        for share in ref.shares:
            m.storages.append(api.open_share(share, index_of[share.device]))
        # _new_shared_cuda made this thread's current stream wait for the sender's
        # event; wait here so that the views are ready for any stream.
        api.sync_streams(index_of.values())
        return blobs.build_views(ref, m.storages)
    finally:
        m.settled = True


def copy_out(api: CudaApi, dest: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """``dest[lo:hi] = src[lo:hi]`` and wait for it. Runs in a worker thread."""
    dest[lo:hi].copy_(src[lo:hi])
    api.sync_streams(t.device.index or 0 for t in (src, dest) if t.is_cuda)


def drop_mapped(api: CudaApi, reaper: Releaser, mapped: Mapped) -> None:
    """Drop a mapping in the reaper, once the local work queued on it is done."""
    box = [mapped]
    events = api.local_events({mapped.index})

    def clean_up() -> None:
        for event in events:
            event.synchronize()
        box.clear()

    reaper.submit(clean_up)


class TensorExport(Export):
    """Same GPU: the caller's tensors, shared in place until the ACK."""

    def __init__(
        self, backend: CudaIpcBackend, st: PeerState, tensors: list[torch.Tensor], ref: TensorsRef
    ) -> None:
        super().__init__(backend, blobs.packed_length(tensors), None, layout="per_tensor")
        self.st = st
        self.tensors: list[torch.Tensor] = tensors
        self.shares = ref.shares
        self._ref = blobs.encode(ref)

    @property
    def ref(self) -> bytes:
        return self._ref

    def _release(self) -> None:
        self.st.recent_shares.extend(self.shares)
        self.tensors = []  # torch keeps the blocks (limbo) while the receiver maps them


class SlotExport(Export):
    """A slot of the pool, or a dedicated buffer, with an interprocess event."""

    def __init__(
        self,
        backend: CudaIpcBackend,
        st: PeerState,
        lease: Lease[torch.Tensor],
        view: torch.Tensor,
        share: Share,
        buffer_id: int,
        event: tuple[int, Event, bytes],
    ) -> None:
        super().__init__(backend, lease.nbytes, view)
        self.ipc = backend
        self.st = st
        self.lease = lease
        self.share = share
        self.buffer_id = buffer_id
        self.event_id, self.event, self.event_handle = event

    @property
    def ref(self) -> bytes:
        return blobs.encode(
            SlotRef(
                buffer=self.share,
                buffer_id=self.buffer_id,
                dedicated=self.lease.dedicated,
                offset=max(self.lease.offset, 0),
                size=self.nbytes,
                event=self.event_handle,
                event_id=self.event_id,
            )
        )

    async def publish(self, lo: int, hi: int) -> None:
        """Record the slot's interprocess event after the packing copies."""
        if self.ipc.device is not None:
            self.ipc.api.record_after(self.event, self.ipc.device)

    def _release(self) -> None:
        ipc = self.ipc
        if ipc._events is not None:
            ipc._events.give(self.event_id)
        lease, st = self.lease, self.st
        if lease.dedicated or ipc._peers.released(st.key):
            lease.release()  # a dedicated buffer stays protected by torch's counter
            ipc.pool.reclaim()  # the receiver's earlier slots are done with too
        else:  # zero-copy views of it may still be in use on the receiver's GPU
            lease.release_when(lambda: ipc._peers.released(st.key))


class TensorsImport(Import):
    """Tensors shared in place: mapped by :meth:`fetch`."""

    def __init__(self, backend: CudaIpcBackend, peer: PeerInfo, nbytes: int, ref: TensorsRef):
        super().__init__(backend, peer, nbytes)
        self.ipc = backend
        self.ref = ref
        self.mapping: Mapping | None = None

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        """Map the tensors (``tensors``) once the sender's work is done.

        Raises:
            BackendError: the mapping failed or timed out.
        """
        ipc = self.ipc
        if self.mapping is None:
            index_of = {s.device: ipc._gpus.index_of(s.device, self.peer) for s in self.ref.shares}
            self.mapping = Mapping()
            self.tensors = await ipc._gpu(
                "mapping the peer's tensors", map_tensors, ipc.api, self.ref, index_of, self.mapping
            )
        elif self.tensors is None:
            raise BackendError("cuda_ipc: mapping the peer's tensors failed before")

    def _close(self) -> None:
        ipc = self.ipc
        views = self.tensors
        m = self.mapping
        # Shares never mapped give their counter back. While an abandoned (timed-out)
        # mapping thread may still run, nothing is released: a leak beats a double free.
        if m is None:
            unmapped = list(self.ref.shares)
        elif m.settled:
            unmapped = list(self.ref.shares[len(m.storages) :])
        else:
            unmapped = []
        storages = list(m.storages) if m is not None else []
        events = ipc.api.local_events({s.device.index or 0 for s in storages}) if storages else []
        keep: list[Any] = [views, storages]

        def clean_up() -> None:
            for event in events:
                event.synchronize()
            keep.clear()
            release_shares(ipc.api, unmapped)

        ipc._reaper.submit(clean_up)


class SlotImport(Import):
    """A view of the peer's slot (its pool mapped once, or a dedicated buffer)."""

    def __init__(
        self,
        backend: CudaIpcBackend,
        peer: PeerInfo,
        nbytes: int,
        view: torch.Tensor,
        index: int,
        event: Event,
        dedicated: Mapped | None,
    ) -> None:
        super().__init__(backend, peer, nbytes, buffer=view)
        self.ipc = backend
        self.index = index
        self.event = event
        self.dedicated = dedicated
        self.ready = False
        self.viewed = False

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        """Wait for the sender's event, then copy ``[lo, hi)`` into ``dest`` (and
        synchronize) or leave the bytes to be viewed in ``buffer``.

        Raises:
            BackendError: the wait or the copy failed or timed out.
        """
        ipc = self.ipc
        if not self.ready:
            await ipc._gpu("waiting for the sender's copy", self.event.synchronize)
            self.ready = True
        if dest is None:
            self.viewed = True
            return
        if hi > lo:
            assert self.buffer is not None
            await ipc._gpu(
                "copying out of the peer's slot", copy_out, ipc.api, dest, self.buffer, lo, hi
            )

    def _close(self) -> None:
        ipc = self.ipc
        if self.viewed and ipc._release_event is not None and ipc.device is not None:
            # zero-copy views of the slot were handed out: tell the sender when the work
            # queued on them (on this GPU or the slot's) is done
            try:
                with ipc.api.on_device(ipc.device):
                    ipc.api.record_after(ipc._release_event, ipc.device, (self.index,))
            except Exception:
                log.exception("cuda_ipc: cannot record the release event")
        dedicated, self.dedicated = self.dedicated, None
        if dedicated is not None:
            drop_mapped(ipc.api, ipc._reaper, dedicated)
