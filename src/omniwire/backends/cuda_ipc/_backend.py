"""The cuda_ipc backend: tensors shared in place on one GPU, a slot pool across GPUs.
See the package docstring for the lifetime rules."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

import anyio
import torch

from ...errors import BackendClosedError, BackendError
from ..base import (
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    Export,
    Import,
    Locality,
    PeerInfo,
)
from ..pool import Lease, SlotPool
from ..support import Releaser, mib
from . import _blobs as blobs
from ._blobs import Share, SlotRef, TensorsRef
from ._gpu import INSTALL_HINT, CudaApi, Event, TorchCuda, release_shares

__all__ = ["CudaIpcBackend", "EventRing"]

log = logging.getLogger("omniwire.cuda_ipc")

#: freed shares remembered per peer, to release their counters if the peer dies.
_RECENT_SHARES = 4096

_T = TypeVar("_T")


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


@dataclass(eq=False)
class _Mapped:
    share: Share
    storage: torch.UntypedStorage
    base: torch.Tensor
    index: int


@dataclass(eq=False)
class _Mapping:
    """What a mapping thread did: the storages mapped so far, and whether it ended."""

    storages: list[torch.UntypedStorage] = field(default_factory=list)
    settled: bool = False


@dataclass(eq=False)
class _PeerState:
    key: tuple[str, int]
    pid: int
    name: str
    reachable: bool
    #: the peer's receiving GPU, as a local index (None: not visible here)
    device: int | None
    release_handle: bytes
    #: sender side: the peer's release event, opened here (None: not yet; False: cannot)
    release: Event | Literal[False] | None = None
    pool_share: Share | None = None
    recent_shares: collections.deque[Share] = field(
        default_factory=lambda: collections.deque(maxlen=_RECENT_SHARES)
    )
    #: receiver side: the peer's buffers mapped here, its events opened here
    pools: dict[int, _Mapped] = field(default_factory=dict)
    events: dict[int, tuple[bytes, Event]] = field(default_factory=dict)


class _TensorExport(Export):
    """Same GPU: the caller's tensors, shared in place until the ACK."""

    def __init__(
        self, backend: CudaIpcBackend, st: _PeerState, tensors: list[torch.Tensor], ref: TensorsRef
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


class _SlotExport(Export):
    """A slot of the pool, or a dedicated buffer, with an interprocess event."""

    def __init__(
        self,
        backend: CudaIpcBackend,
        st: _PeerState,
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
        if lease.dedicated or ipc._released(st.key):
            lease.release()  # a dedicated buffer stays protected by torch's counter
            ipc.pool.reclaim()  # the receiver's earlier slots are done with too
        else:  # zero-copy views of it may still be in use on the receiver's GPU
            lease.release_when(lambda: ipc._released(st.key))


class _TensorsImport(Import):
    """Tensors shared in place: mapped by :meth:`fetch`."""

    def __init__(self, backend: CudaIpcBackend, peer: PeerInfo, nbytes: int, ref: TensorsRef):
        super().__init__(backend, peer, nbytes)
        self.ipc = backend
        self.ref = ref
        self.mapping: _Mapping | None = None

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        """Map the tensors (``tensors``) once the sender's work is done.

        Raises:
            BackendError: the mapping failed or timed out.
        """
        ipc = self.ipc
        if self.mapping is None:
            index_of = {s.device: ipc._index_of(s.device, self.peer) for s in self.ref.shares}
            self.mapping = _Mapping()
            self.tensors = await ipc._gpu(
                "mapping the peer's tensors", ipc._map_tensors, self.ref, index_of, self.mapping
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


class _SlotImport(Import):
    """A view of the peer's slot (its pool mapped once, or a dedicated buffer)."""

    def __init__(
        self,
        backend: CudaIpcBackend,
        peer: PeerInfo,
        nbytes: int,
        view: torch.Tensor,
        index: int,
        event: Event,
        dedicated: _Mapped | None,
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
                "copying out of the peer's slot", ipc._copy_out, dest, self.buffer, lo, hi
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
            ipc._drop_mapped(dedicated)


class CudaIpcBackend(ByteBackend):
    """CUDA tensors between GPU stages of one host. See the package docstring."""

    name: ClassVar[str] = "cuda_ipc"
    summary: ClassVar[str] = "CUDA IPC: same GPU mapped in place, other GPUs via a slot pool"
    install_hint: ClassVar[str] = INSTALL_HINT
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cuda"}),
        localities=frozenset({Locality.SAME_HOST}),
        streaming=True,
        payloads=True,
        host_staging=False,
        zero_copy=True,
        two_sided=True,
        needs_gpu_peer_access=True,
        preference=85,
    )
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "always"
    needs_gpu: ClassVar[bool] = True

    def __init__(self, ctx: BackendContext, *, api: CudaApi | None = None) -> None:
        super().__init__(ctx)
        opts = ctx.options
        try:
            self.pool_size = int(opts.get("pool_size", 256 << 20))
            self.min_block = int(opts.get("min_block", 64 << 10))
            self.timeout = float(opts.get("timeout", 60.0))
        except (TypeError, ValueError) as exc:
            raise BackendError(f"cuda_ipc: bad options {dict(opts)!r}: {exc}") from None
        self._wanted_device = opts.get("device")
        if self.pool_size < 0 or self.min_block <= 0 or self.min_block & (self.min_block - 1):
            raise BackendError(
                "cuda_ipc options: pool_size must be >= 0 and min_block a power of two"
            )
        self.api: CudaApi = api or opts.get("api") or TorchCuda()
        self.device: int | None = None
        self._uuid_by_index: dict[int, str] = {}
        self._index_by_uuid: dict[str, int] = {}
        self._region: torch.Tensor | None = None
        self._pool: SlotPool[torch.Tensor] | None = None
        self._events: EventRing | None = None
        self._release_event: Event | None = None
        self._release_handle = b""
        self._peers: dict[tuple[str, int], _PeerState] = {}
        self._dedicated_ids = itertools.count(1)
        self._reaper = Releaser("omniwire-cuda-ipc-reaper")
        self._started = False
        self._closed = False
        self._warned: set[str] = set()
        #: objects sent per path, since start
        self._counts = {"in_place": 0, "pooled": 0, "dedicated": 0}

    @classmethod
    def availability(cls) -> Availability:
        return TorchCuda().availability()

    @property
    def pool(self) -> SlotPool[torch.Tensor]:
        if self._pool is None:
            raise BackendError("cuda_ipc backend is not started")
        return self._pool

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Pick this endpoint's GPU, reserve the slot pool, create the release event.

        Raises:
            BackendError: no CUDA device, or the pool does not fit on the GPU.
        """
        if self._started:
            return
        av = self.api.availability()
        if not av.available:
            raise BackendError(f"cuda_ipc cannot start: {av.reason}")
        self._started = True
        # The current device is per thread: read it here, on the endpoint's thread.
        wanted = self._wanted_device
        current = self.api.current_device() if wanted is None else int(wanted)
        # The rest (CUDA initialisation, the pool's cudaMalloc) can take a while.
        await anyio.to_thread.run_sync(self._pick_device, current)
        device = self.device
        assert device is not None
        try:
            await anyio.to_thread.run_sync(self._reserve)
        except torch.cuda.OutOfMemoryError as exc:
            free, total = await anyio.to_thread.run_sync(self.api.mem_get_info, device)
            raise BackendError(
                f"cannot reserve the cuda_ipc slot pool of {mib(self.pool_size)} on cuda:{device} "
                f"({mib(free)} of {mib(total)} free): lower "
                "backend_options['cuda_ipc']['pool_size']"
            ) from exc
        except RuntimeError as exc:
            raise BackendError(f"cuda_ipc cannot start on cuda:{device}: {exc}") from exc

    def _pick_device(self, device: int) -> None:
        self.api.init()
        for d in self.api.devices():
            if d.kind == "cuda":
                # Without a UUID (old drivers) fall back to the index, as
                # torch.multiprocessing does: both ends must then number GPUs alike.
                self._uuid_by_index[d.index] = d.uuid or f"cuda-index-{d.index}"
        self._index_by_uuid = {u: i for i, u in self._uuid_by_index.items()}
        if device not in self._uuid_by_index:
            raise BackendError(
                f"cuda_ipc: device {device} is not one of this process's GPUs "
                f"({sorted(self._uuid_by_index)})"
            )
        self.device = device

    def _reserve(self) -> None:
        assert self.device is not None
        index, api = self.device, self.api
        self._release_event, self._release_handle = api.new_event(index)

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
            min_block=self.min_block,
            create=dedicated,
            option="backend_options['cuda_ipc']['pool_size']",
        )
        if self.pool_size >= self.min_block:
            self._region = api.empty(self.pool_size, index)
            pool.attach(self.pool_size)
        self._pool = pool
        self._events = EventRing(lambda: api.new_event(index))

    def hello(self) -> bytes:
        device = self._uuid_by_index.get(self.device, "") if self.device is not None else ""
        return blobs.encode(
            blobs.HelloInfo(pid=os.getpid(), device=device, release_event=self._release_handle)
        )

    async def connect(self, peer: PeerInfo) -> None:
        """Learn the peer's GPU and release event.

        Raises:
            BackendError: malformed Hello info, or the two GPUs cannot access each
                other (the endpoint then routes this peer elsewhere).
        """
        hello = blobs.decode_hello(peer)
        reachable = peer.locality is Locality.SAME_HOST
        device = self._index_by_uuid.get(hello.device)
        mine = self.device
        if reachable and device is not None and mine is not None and device != mine:
            ok = await self._gpu("checking peer access", self.api.peer_access, mine, device)
            if not ok:
                raise BackendError(
                    f"cuda:{mine} (here) and cuda:{device} ({peer.name!r}) cannot access "
                    "each other's memory"
                )
        self._peers[peer.key] = _PeerState(
            key=peer.key,
            pid=peer.pid,
            name=peer.name,
            reachable=reachable,
            device=device,
            release_handle=hello.release_event,
        )

    async def disconnect(self, peer: PeerInfo) -> None:
        st = self._peers.pop(peer.key, None)
        if st is None:
            return
        self._forget_peer(st, dead=not self.api.process_alive(st.pid))

    def _forget_peer(self, st: _PeerState, dead: bool) -> None:
        if self._pool is not None:
            self._pool.reclaim()  # its deferred slots: the peer is gone
        mapped = list(st.pools.values())
        st.pools.clear()
        st.events.clear()
        # The peer cannot give back torch's counters of what we shared with it any more:
        # do it for it (an extra release of a dead consumer's share frees nothing early).
        orphaned = list(st.recent_shares) if dead else []
        if dead and st.pool_share is not None:
            orphaned.append(st.pool_share)
        st.recent_shares.clear()
        st.release = None
        api = self.api

        def clean_up() -> None:
            release_shares(api, orphaned)
            mapped.clear()  # the storages die here, in the reaper

        if mapped or orphaned:
            self._reaper.submit(clean_up)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for st in list(self._peers.values()):
            self._forget_peer(st, dead=False)
        self._peers.clear()
        if self._pool is not None:
            await self._pool.aclose()
        self._region = None
        self._events = None
        self._release_event = None
        await anyio.to_thread.run_sync(self._reaper.stop, 10.0)
        if self._started:
            await anyio.to_thread.run_sync(self.api.ipc_collect)

    def detail(self) -> dict[str, int]:
        pool = self._pool
        return {
            **(pool.detail() if pool is not None else {}),
            "events": len(self._events) if self._events else 0,
            "mapped_buffers": sum(len(st.pools) for st in self._peers.values()),
            "sent_in_place": self._counts["in_place"],
            "sent_pooled": self._counts["pooled"],
            "sent_dedicated": self._counts["dedicated"],
        }

    def wait_for_clean_ups(self, timeout: float = 10.0) -> bool:
        """Block until the clean-ups queued so far ran (tests; blocking)."""
        return self._reaper.wait_idle(timeout)

    # -- helpers ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError("cuda_ipc backend is closed")
        if not self._started:
            raise BackendError("cuda_ipc backend is not started")

    def _state(self, peer: PeerInfo) -> _PeerState:
        st = self._peers.get(peer.key)
        if st is None:
            raise BackendError(f"{peer.name!r} did not announce cuda_ipc in its Hello")
        if not st.reachable:
            raise BackendError(
                f"cuda_ipc reaches processes on this host only; {peer.name!r} is "
                f"{peer.locality.value.replace('_', ' ')}"
            )
        return st

    def _uuid_of(self, index: int) -> str:
        try:
            return self._uuid_by_index[index]
        except KeyError:
            raise BackendError(f"cuda:{index} is not a GPU this process knows") from None

    def _index_of(self, uuid: str, peer: PeerInfo) -> int:
        index = self._index_by_uuid.get(uuid)
        if index is None:
            raise BackendError(
                f"GPU {uuid[:64]!r} of {peer.name!r} is not visible in this process "
                "(check CUDA_VISIBLE_DEVICES on both ends)"
            )
        return index

    async def _gpu(self, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking CUDA call in a worker thread, bounded by ``timeout``; its
        errors are BackendErrors (the one mapping of this backend's engine errors)."""
        try:
            with anyio.fail_after(self.timeout):
                return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except TimeoutError:
            raise BackendError(
                f"cuda_ipc: {what} did not finish within {self.timeout:g} s"
            ) from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise BackendError(f"cuda_ipc: {what} failed: {exc}") from exc

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _released(self, holder: tuple[str, int]) -> bool:
        """Whether the receiver ``holder`` is done with every slot it was given."""
        st = self._peers.get(holder)
        release = st.release if st is not None else None
        if release is None or release is False:
            return True
        try:
            return bool(release.query())
        except Exception:
            return True

    def _map_tensors(
        self, ref: TensorsRef, index_of: dict[str, int], m: _Mapping
    ) -> list[torch.Tensor]:
        """Map every share (recording each in ``m`` as it goes), wait for the sender's
        events, and build the views. Runs in a worker thread."""
        try:
            for share in ref.shares:
                m.storages.append(self.api.open_share(share, index_of[share.device]))
            # _new_shared_cuda made this thread's current stream wait for the sender's
            # event; wait here so that the views are ready for any stream.
            self.api.sync_streams(index_of.values())
            return blobs.build_views(ref, m.storages)
        finally:
            m.settled = True

    def _copy_out(self, dest: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
        """``dest[lo:hi] = src[lo:hi]`` and wait for it. Runs in a worker thread."""
        dest[lo:hi].copy_(src[lo:hi])
        self.api.sync_streams(t.device.index or 0 for t in (src, dest) if t.is_cuda)

    def _drop_mapped(self, mapped: _Mapped) -> None:
        """Drop a mapping in the reaper, once the local work queued on it is done."""
        box = [mapped]
        events = self.api.local_events({mapped.index})

        def clean_up() -> None:
            for event in events:
                event.synchronize()
            box.clear()

        self._reaper.submit(clean_up)

    # -- sender ------------------------------------------------------------------------

    async def export_tensors(
        self, peer: PeerInfo, tensors: list[torch.Tensor], *, lent: bool
    ) -> Export | None:
        """Same GPU: share the tensors in place (layout ``per_tensor``), lent or not —
        torch keeps a shared block from reuse until the receiver is done, as
        ``torch.multiprocessing`` does; a sent tensor must not be modified in place.
        Returns None — so the endpoint packs into a slot — when the peer receives on
        another GPU, a tensor is not on CUDA, or torch cannot share a storage.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: the peer is unknown or not on this host.
        """
        self._check_open()
        st = self._state(peer)
        if not tensors or st.device is None:
            return None
        if any(self.api.gpu_index(t) != st.device for t in tensors):
            return None
        api = self.api
        try:
            ref = blobs.plan_shares(
                tensors,
                lambda s: api.share(s, self._uuid_of),
                lambda s: self._reaper.submit(release_shares, api, [s]),
            )
        except (RuntimeError, BackendError) as exc:
            self._warn_once(
                "export",
                "cuda_ipc: cannot share a tensor in place (%s); copying through the slot pool",
                exc,
            )
            return None
        self._counts["in_place"] += 1
        return _TensorExport(self, st, list(tensors), ref)

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        """A slot of the pool (or a dedicated buffer when none is free) on this
        endpoint's GPU, with an interprocess event for ``publish``.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: the peer is unknown, or no GPU memory for a dedicated buffer.
        """
        self._check_open()
        st = self._state(peer)
        assert self.device is not None and self._events is not None
        if st.release is None and st.release_handle and st.device is not None:
            try:
                st.release = await self._gpu(
                    "opening the peer's release event",
                    self.api.open_event,
                    st.device,
                    st.release_handle,
                )
            except BackendError as exc:
                st.release = False
                self._warn_once(
                    "release",
                    "cuda_ipc: cannot open the release event of %s (%s): freed slots are "
                    "reused at once",
                    peer.name,
                    exc,
                )
        lease = await self._take(nbytes)
        event = self._events.take()
        try:
            if lease.buffer is None:
                assert self._region is not None
                if st.pool_share is None:
                    st.pool_share = self.api.share(self._region.untyped_storage(), self._uuid_of)
                share, buffer_id = st.pool_share, 0
                view = self._region[lease.offset : lease.offset + nbytes]
                self._counts["pooled"] += 1
            else:
                share = self.api.share(lease.buffer.untyped_storage(), self._uuid_of)
                st.recent_shares.append(share)
                buffer_id = next(self._dedicated_ids)
                view = lease.buffer[:nbytes]
                self._counts["dedicated"] += 1
        except BaseException as exc:
            self._events.give(event[0])
            lease.release()
            if isinstance(exc, RuntimeError):
                raise BackendError(
                    f"cuda_ipc: cannot share a buffer with {peer.name!r}: {exc}"
                ) from exc
            raise
        return _SlotExport(self, st, lease, view, share, buffer_id, event)

    async def _take(self, nbytes: int) -> Lease[torch.Tensor]:
        """A slot; when slots wait for receivers to release them, wait (off the loop,
        bounded) for those receivers first; else a dedicated buffer."""
        pool = self.pool
        lease = pool.take_slot(nbytes)
        if lease is None and pool.pending and pool.fits(nbytes):
            for st in list(self._peers.values()):
                release = st.release
                if release is not None and release is not False and not self._released(st.key):
                    with contextlib.suppress(BackendError):
                        await self._gpu(
                            "waiting for a receiver to release its slots", release.synchronize
                        )
            lease = pool.take_slot(nbytes)
        if lease is None:
            lease = await pool.take(nbytes, purpose="a CUDA object")
        return lease

    # -- receiver ------------------------------------------------------------------------

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        """Validate a reference; for a slot, map the peer's buffer (once per pool) and
        open its event. Tensors shared in place are mapped by ``fetch``; an import
        closed unfetched gives torch's counters of its shares back.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: malformed or foreign reference, or the mapping failed.
        """
        self._check_open()
        st = self._state(peer)
        r = blobs.decode_ref(ref, peer, nbytes)
        if isinstance(r, TensorsRef):
            for s in r.shares:
                self._index_of(s.device, peer)
            return _TensorsImport(self, peer, nbytes, r)
        index = self._index_of(r.buffer.device, peer)
        dedicated: _Mapped | None = None
        if r.dedicated:
            storage = await self._gpu(
                "mapping the peer's buffer", self.api.open_share, r.buffer, index
            )
            mapped = dedicated = _Mapped(r.buffer, storage, blobs.byte_view(storage), index)
        else:
            pooled = st.pools.get(r.buffer_id)
            if pooled is None:
                storage = await self._gpu(
                    "mapping the peer's pool", self.api.open_share, r.buffer, index
                )
                pooled = st.pools[r.buffer_id] = _Mapped(
                    r.buffer, storage, blobs.byte_view(storage), index
                )
            elif pooled.share != r.buffer:
                raise BackendError(f"{peer.name!r} changed its cuda_ipc pool {r.buffer_id}")
            mapped = pooled
        try:
            cached = st.events.get(r.event_id)
            if cached is None or cached[0] != r.event:
                event = await self._gpu(
                    "opening the peer's event", self.api.open_event, index, r.event
                )
                cached = st.events[r.event_id] = (r.event, event)
        except BaseException:
            if dedicated is not None:
                self._drop_mapped(dedicated)
            raise
        view = mapped.base[r.offset : r.offset + r.size]
        return _SlotImport(self, peer, nbytes, view, index, cached[1], dedicated)
