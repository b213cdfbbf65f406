"""The cuda_ipc backend: tensors shared in place on one GPU, a slot pool across GPUs.
See the package docstring for the lifetime rules."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeVar

import anyio
import torch

from ... import packing
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
from ._blobs import TensorsRef
from ._devices import DeviceIds
from ._gpu import INSTALL_HINT, CudaApi, Event, TorchCuda, release_shares
from ._handles import Mapped, SlotExport, SlotImport, TensorExport, TensorsImport, drop_mapped
from ._peers import Peers, PeerState
from ._slots import EventRing, reserve_pool

__all__ = ["CudaIpcBackend"]

log = logging.getLogger("omniwire.cuda_ipc")

_T = TypeVar("_T")


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
        layouts=frozenset({"packed", "per_tensor"}),
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
        self._gpus = DeviceIds()
        self._region: torch.Tensor | None = None
        self._pool: SlotPool[torch.Tensor] | None = None
        self._events: EventRing | None = None
        self._release_event: Event | None = None
        self._release_handle = b""
        self._dedicated_ids = itertools.count(1)
        self._reaper = Releaser("omniwire-cuda-ipc-reaper")
        self._peers = Peers(self.api, self._reaper)
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
        self._gpus.learn(self.api.devices(), device)
        self.device = device

    def _reserve(self) -> None:
        assert self.device is not None
        index, api = self.device, self.api
        self._release_event, self._release_handle = api.new_event(index)
        self._region, self._pool = reserve_pool(api, index, self.pool_size, self.min_block)
        self._events = EventRing(lambda: api.new_event(index))

    def hello(self) -> bytes:
        device = self._gpus.uuid_by_index.get(self.device, "") if self.device is not None else ""
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
        device = self._gpus.index_by_uuid.get(hello.device)
        mine = self.device
        if reachable and device is not None and mine is not None and device != mine:
            ok = await self._gpu("checking peer access", self.api.peer_access, mine, device)
            if not ok:
                raise BackendError(
                    f"cuda:{mine} (here) and cuda:{device} ({peer.name!r}) cannot access "
                    "each other's memory"
                )
        self._peers.add(
            PeerState(
                key=peer.key,
                pid=peer.pid,
                name=peer.name,
                reachable=reachable,
                device=device,
                release_handle=hello.release_event,
            )
        )

    async def disconnect(self, peer: PeerInfo) -> None:
        st = self._peers.pop(peer.key)
        if st is None:
            return
        self._forget_peer(st, dead=not self.api.process_alive(st.pid))

    def _forget_peer(self, st: PeerState, dead: bool) -> None:
        if self._pool is not None:
            self._pool.reclaim()  # its deferred slots: the peer is gone
        self._peers.forget(st, dead)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for st in self._peers:
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
            "mapped_buffers": sum(len(st.pools) for st in self._peers),
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
        st = self._peers.state(peer)
        if not tensors or st.device is None:
            return None
        if any(self.api.gpu_index(t) != st.device for t in tensors):
            return None
        if not all(packing.holds_its_values(t) for t in tensors):
            return None  # the bit would not travel: packed, which resolves it
        api = self.api
        try:
            ref = blobs.plan_shares(
                tensors,
                lambda s: api.share(s, self._gpus.uuid_of),
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
        return TensorExport(self, st, list(tensors), ref)

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        """A slot of the pool (or a dedicated buffer when none is free) on this
        endpoint's GPU, with an interprocess event for ``publish``.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: the peer is unknown, or no GPU memory for a dedicated buffer.
        """
        self._check_open()
        st = self._peers.state(peer)
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
                    st.pool_share = self.api.share(
                        self._region.untyped_storage(), self._gpus.uuid_of
                    )
                share, buffer_id = st.pool_share, 0
                view = self._region[lease.offset : lease.offset + nbytes]
                self._counts["pooled"] += 1
            else:
                share = self.api.share(lease.buffer.untyped_storage(), self._gpus.uuid_of)
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
        return SlotExport(self, st, lease, view, share, buffer_id, event)

    async def _take(self, nbytes: int) -> Lease[torch.Tensor]:
        """A slot; when slots wait for receivers to release them, wait (off the loop,
        bounded) for those receivers first; else a dedicated buffer."""
        pool = self.pool
        lease = pool.take_slot(nbytes)
        if lease is None and pool.pending and pool.fits(nbytes):
            peers = self._peers
            for st in peers:
                release = st.release
                if release is not None and release is not False and not peers.released(st.key):
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
        st = self._peers.state(peer)
        r = blobs.decode_ref(ref, peer, nbytes)
        if isinstance(r, TensorsRef):
            for s in r.shares:
                self._gpus.index_of(s.device, peer)
            return TensorsImport(self, peer, nbytes, r)
        index = self._gpus.index_of(r.buffer.device, peer)
        dedicated: Mapped | None = None
        if r.dedicated:
            storage = await self._gpu(
                "mapping the peer's buffer", self.api.open_share, r.buffer, index
            )
            mapped = dedicated = Mapped(r.buffer, storage, blobs.byte_view(storage), index)
        else:
            pooled = st.pools.get(r.buffer_id)
            if pooled is None:
                storage = await self._gpu(
                    "mapping the peer's pool", self.api.open_share, r.buffer, index
                )
                pooled = st.pools[r.buffer_id] = Mapped(
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
                drop_mapped(self.api, self._reaper, dedicated)
            raise
        view = mapped.base[r.offset : r.offset + r.size]
        return SlotImport(self, peer, nbytes, view, index, cached[1], dedicated)
