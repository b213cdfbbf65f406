"""The nixl backend: exports in a registered pool (or the caller's lent tensors),
written into the peer's landing or read by it with one-sided READs. See the package
docstring."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Iterator
from typing import ClassVar, Literal

import anyio
import torch

from ... import hops
from ...errors import BackendClosedError, BackendError
from .. import landing
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
from ..landing import (
    LANDING_PEERS,
    LANDING_QUARANTINE,
    LANDING_SIZE,
    LandedImport,
    Lands,
    Lender,
    LentLanding,
    land_into,
)
from ..pool import Lease, SlotPool
from ..support import (
    Completions,
    LentExport,
    RegisteredRecvPool,
    RegistrationCache,
    Releaser,
    lend,
)
from ..threads import make_in_thread, run_to_end
from . import _blobs as blobs
from ._blobs import Lent, Mem
from ._engine import (
    Agent,
    AgentFactory,
    NixlAgent,
    Registration,
    agent_name,
    check_agent,
    load_api,
    load_checked,
    read,
    read_async,
)
from ._memory import LentRegistration, Memory, new_pool, recv_pool, registration_cache
from ._reading import Loaded, Remote, SpanImport

__all__ = ["NixlBackend"]

log = logging.getLogger("omniwire.nixl")

INSTALL_HINT = 'pip install "omniwire[nixl]"'
#: Stale dedicated regions of a peer kept loaded before its metadata is reloaded.
MAX_STALE = 64


class _Pool:
    """One registered pool: its index in the Hello, its region, its slots."""

    def __init__(self, index: int, memory: Memory, slots: SlotPool[Memory]) -> None:
        self.index = index
        self.memory = memory
        self.slots = slots


class _Export(Export):
    """A slot of a pool, or a dedicated registration, until the ACK."""

    def __init__(self, backend: NixlBackend, pool: _Pool, lease: Lease[Memory]) -> None:
        if lease.buffer is not None:
            view = lease.buffer.tensor[: lease.nbytes]
        else:
            view = pool.memory.tensor[lease.offset : lease.offset + lease.nbytes]
        super().__init__(backend, lease.nbytes, view)
        self.pool = pool
        self.lease = lease

    @property
    def ref(self) -> bytes:
        memory = self.lease.buffer
        if memory is None:
            return blobs.encode(blobs.Ref(self.pool.index, self.lease.offset, self.nbytes))
        return blobs.encode(
            blobs.Ref(blobs.DEDICATED, 0, self.nbytes, memory.region, memory.metadata)
        )

    async def publish(self, lo: int, hi: int) -> None:
        buffer = self.buffer
        if buffer is not None and buffer.is_cuda:  # packing may still be queued
            await anyio.to_thread.run_sync(torch.cuda.synchronize, buffer.device)

    def _release(self) -> None:
        self.lease.release()


class NixlBackend(ByteBackend):
    """NIXL over UCX. Options: see the package docstring."""

    name: ClassVar[str] = "nixl"
    summary: ClassVar[str] = (
        "NVIDIA NIXL agent over UCX: one-sided READs from a registered pool, or WRITEs "
        "into the receiver's landing"
    )
    install_hint: ClassVar[str] = INSTALL_HINT
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "tcp"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu"}),
        localities=frozenset({Locality.SAME_HOST, Locality.CROSS_HOST}),
        progressive=True,
        zero_copy=True,
        # a reference names a pool and an offset (or a dedicated region with its
        # metadata): any peer may read it, so a fan-out reads one packed buffer and
        # Endpoint.empty() hands out pool slots
        shared_refs=True,
        preference=50,
    )

    def __init__(self, ctx: BackendContext, *, agent_factory: AgentFactory | None = None) -> None:
        super().__init__(ctx)
        opts = ctx.options
        try:
            self.pool_size = int(opts.get("pool_size", 128 << 20))
            self.vram_pool_size = int(opts.get("vram_pool_size", 0))
            cuda_device = opts.get("cuda_device")
            self.cuda_device = int(cuda_device) if cuda_device is not None else None
            self.register_dest_min = int(opts.get("register_dest_min", 256 << 10))
            self.recv_pool_idle = int(opts.get("recv_pool_idle", 256 << 20))
            # UCX (tcp) registers 1 MiB of host memory and makes its metadata in ~50 µs
            self.register_inline = int(opts.get("register_inline", 4 << 20))
            timeout = opts.get("timeout")
            self._timeout = float(timeout) if timeout is not None else None
            self.landing_size = int(opts.get("landing_size", LANDING_SIZE))
            self.landing_peers = int(opts.get("landing_peers", LANDING_PEERS))
            self.landing_quarantine = float(opts.get("landing_quarantine", LANDING_QUARANTINE))
        except (TypeError, ValueError) as exc:
            raise BackendError(f"nixl: bad options {dict(opts)!r}: {exc}") from None
        if self.landing_size < 0 or self.landing_peers < 0 or not self.landing_quarantine >= 0:
            raise BackendError(
                f"nixl: bad options {dict(opts)!r} (landing_size, landing_peers and "
                "landing_quarantine >= 0)"
            )
        self._factory: AgentFactory = agent_factory or opts.get("agent_factory") or NixlAgent
        self.agent_name = agent_name(ctx.endpoint)
        self._agent: Agent | None = None
        self._pools: list[_Pool] = []
        self._info = b""
        self._hello = blobs.PiecesHello("", b"", [])  # what _info encodes, once started
        self._releaser = Releaser("omniwire-nixl")
        self._registrations: RegistrationCache[LentRegistration] | None = None
        #: Copy-mode receive buffers, registered once per block (delivery_buffer).
        self._recv_pool: RegisteredRecvPool[Registration] | None = None
        #: Waits for READs started on the event loop (see _reading.SpanImport.fetch).
        self._completions = Completions("omniwire-nixl-completions")
        self._remotes: dict[tuple[str, int], Remote] = {}
        #: Landings peers lent us, by their names (sender side).
        self._lands: dict[str, Lands] = {}
        self._quarantined: list[object] = []  # what a READ that could not be cancelled may hit
        self._active = 0
        self._idle: anyio.Event | None = None
        self._closed = False
        self.counters = {
            "reads": 0,
            "reloads": 0,
            "dest_registrations": 0,
            "lent": 0,
            "recv_pool_refused": 0,
            **landing.counters(),
        }
        #: Landings we lend, by the name of the peer they are lent to (receiver side).
        self._landings: Lender[Memory] = Lender(
            "nixl",
            size=self.landing_size,
            peers=self.landing_peers,
            quarantine=self.landing_quarantine,
            make=self._new_landing,
            fence=Memory.fence,
            unmap=Memory.unmap,
            counters=self.counters,
        )

    @classmethod
    def availability(cls) -> Availability:
        try:
            load_api()
        except ImportError as exc:
            return Availability.missing(str(exc), INSTALL_HINT)
        return Availability.ok()

    def timeout_for(self, nbytes: int) -> float:
        """Seconds a READ of ``nbytes`` may take."""
        if self._timeout is not None:
            return self._timeout
        return 30.0 + nbytes / 50e6

    @property
    def registrations(self) -> RegistrationCache[LentRegistration]:
        if self._registrations is None:
            raise BackendError("nixl backend is not started")
        return self._registrations

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the agent and register the pools.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: NIXL cannot start, or a pool cannot be registered.
        """
        if self._closed:
            raise BackendClosedError("nixl backend is closed")
        if self._agent is not None:
            return
        if self.vram_pool_size > 0 and not torch.cuda.is_available():
            raise BackendError("nixl: vram_pool_size is set but CUDA is not available here")
        agent, pools, metadata = await make_in_thread(self._start_blocking, _close_started)
        if self._closed_now():  # closed while it was made
            _close_started((agent, pools, metadata))
            raise BackendClosedError("nixl backend is closed")
        self._pools = pools
        self._hello = blobs.PiecesHello(
            self.agent_name, metadata, [p.memory.region for p in pools], pieces=True
        )
        self._info = blobs.encode(self._hello)
        self._registrations = registration_cache(agent, self._releaser, self.register_inline)
        if self.recv_pool_idle > 0:
            self._recv_pool = recv_pool(agent, self._releaser, self.recv_pool_idle)
        self._agent = agent

    def _start_blocking(self) -> tuple[Agent, list[_Pool], bytes]:
        """The agent, its registered pools and its metadata (in a worker thread)."""
        agent = self._factory(self.agent_name)
        pools: list[_Pool] = []
        try:
            kinds: list[tuple[int, Mem, int]] = []
            if self.pool_size > 0:
                kinds.append((self.pool_size, "DRAM", 0))
            if self.vram_pool_size > 0:
                dev = self.cuda_device
                kinds.append(
                    (
                        self.vram_pool_size,
                        "VRAM",
                        torch.cuda.current_device() if dev is None else dev,
                    )
                )
            for size, mem, dev in kinds:
                memory = Memory(agent, size, mem, dev, partial=False)
                slots = new_pool(agent, len(pools), mem, dev, self._releaser)
                slots.attach(memory.region.length)
                pools.append(_Pool(len(pools), memory, slots))
            metadata = agent.metadata()
        except BaseException:
            _close_started((agent, pools, b""))
            raise
        return agent, pools, metadata

    def _closed_now(self) -> bool:
        """Whether :meth:`aclose` ran (read after an await, where it may have)."""
        return self._closed

    def hello(self) -> bytes:
        return self._info

    def hello_to(self, peer: str) -> bytes:
        """:meth:`hello` with the landing lent to ``peer`` (made on its first Hello;
        none past ``landing_peers`` peers, or with ``landing_size`` 0)."""
        landing = self._landing_for(peer)
        if landing is None:
            return self._info
        hello = self._hello
        return blobs.encode(
            blobs.LandingHello(
                hello.agent,
                hello.metadata,
                hello.pools,
                pieces=True,
                landing=blobs.Landing(
                    landing.memory.region, landing.memory.metadata, landing.token
                ),
            )
        )

    def _landing_for(self, peer: str) -> LentLanding[Memory] | None:
        if self._agent is None or self._closed:
            return None
        return self._landings.lend(peer)

    def _new_landing(self, size: int) -> tuple[Memory, int, int]:
        """A landing's memory: registered, not pre-faulted (on the loop: UCX registers
        unfaulted host memory in tens of microseconds)."""
        memory = Memory(self._live_agent(), size, "DRAM", 0, partial=True, populate=False)
        return memory, memory.region.addr, memory.region.length

    def peer_gone(self, peer: str) -> None:
        """``peer``'s session ended: the landing lent to it comes back (fenced, see
        :class:`~omniwire.backends.landing.Lender`: for NIXL the quarantine is the
        fence, UCX writes memory that is no longer registered)."""
        self._landings.gone(peer)

    def _live_agent(self) -> Agent:
        if self._closed:
            raise BackendClosedError("nixl backend is closed")
        if self._agent is None:
            raise BackendError("nixl backend is not started")
        return self._agent

    async def connect(self, peer: PeerInfo) -> None:
        agent = self._live_agent()
        hello = blobs.decode_hello(peer)
        if hello.agent == agent.name:
            raise BackendError(f"nixl peer {peer.name!r} claims this endpoint's own agent name")
        for other in self._remotes.values():
            if other.agent == hello.agent and other.key != peer.key:
                raise BackendError(
                    f"nixl peer {peer.name!r} claims agent {hello.agent!r}, "
                    f"which belongs to {other.peer!r}"
                )
        check_agent(hello.metadata, hello.agent, peer.name)
        old = self._remotes.get(peer.key)
        if old is not None:
            if old.agent == hello.agent and old.metadata == hello.metadata:
                return
            await self.disconnect(peer)
        remote = Remote(peer, hello)

        def load() -> None:
            agent.unload(hello.agent)  # a stale copy (the same agent seen before)
            load_checked(agent, hello.metadata, hello.agent, peer.name)
            agent.connect(hello.agent)

        await anyio.to_thread.run_sync(load)
        self._remotes[peer.key] = remote
        await self._lent_by(peer, remote, hello)

    async def _lent_by(self, peer: PeerInfo, remote: Remote, hello: blobs.LandingHello) -> None:
        """Keep the landing ``peer`` lent us (if any), its registration made known to
        our agent (loaded for good: a reload of the peer keeps it)."""
        lands = self._lands.get(peer.name)
        landing = hello.landing
        if landing is None:
            if lands is not None and not lands.ranges.allocations:
                del self._lands[peer.name]
            return
        region = landing.region
        try:
            await self._load(remote, Lent(region, landing.metadata))
        except BackendError as exc:
            log.warning("nixl: the landing %r lent cannot be used: %s", peer.name, exc)
            return
        if lands is None or not lands.same(landing.token, hello.agent):
            lands = self._lands[peer.name] = Lands(
                region.addr, region.length, landing.token, hello.agent, peer.key
            )
        lands.key = peer.key

    async def disconnect(self, peer: PeerInfo) -> None:
        lands = self._lands.get(peer.name)
        if lands is not None and lands.key == peer.key and not lands.ranges.allocations:
            del self._lands[peer.name]
        remote = self._remotes.pop(peer.key, None)
        if remote is None:
            return
        remote.alive = False  # reads in flight from it stop waiting
        with anyio.move_on_after(10):
            await self._wait_idle(remote)
        if self._agent is not None and not self._closed:
            await anyio.to_thread.run_sync(self._agent.unload, remote.agent)
        remote.loaded.clear()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for remote in self._remotes.values():
            remote.alive = False
        with anyio.move_on_after(10):
            while self._active:
                self._idle = anyio.Event()
                await self._idle.wait()
        agent, self._agent = self._agent, None
        remotes = list(self._remotes.values())
        self._remotes.clear()
        pools, self._pools = self._pools, []
        for pool in pools:
            await pool.slots.aclose()
        cached = self._registrations.clear() if self._registrations is not None else []
        recv, self._recv_pool = self._recv_pool, None
        received = recv.close_registered() if recv is not None else []
        landings, quarantined = self._landings.close()
        self._lands.clear()

        def teardown() -> None:
            self._completions.stop()
            self._releaser.stop()
            if agent is None:
                return
            for remote in remotes:
                agent.unload(remote.agent)
            for lent, _ in cached:
                agent.deregister(lent.registration)
            cached.clear()  # deregistered: the lent tensors' memory may go now
            for registration in received:
                agent.deregister(registration)
            if recv is not None:
                recv.clear()
            for pool in pools:
                pool.memory.release()
            for memory in landings:
                memory.release()
            for memory in quarantined:  # (deregistered already)
                memory.unmap()
            agent.close()

        await anyio.to_thread.run_sync(teardown)
        self._quarantined.clear()

    def detail(self) -> dict[str, int]:
        out = {
            "remotes": len(self._remotes),
            "reads_in_flight": self._active,
            "quarantined": len(self._quarantined),
            "registrations": len(self._registrations) if self._registrations else 0,
            "recv_pool_registrations": self._recv_pool.registrations if self._recv_pool else 0,
            "recv_pool_bytes": self._recv_pool.registered_bytes if self._recv_pool else 0,
            "reads_on_loop": self._completions.waited,
            **self._landings.detail(),
            **self.counters,
        }
        for pool in self._pools:
            for k, v in pool.slots.detail().items():
                out[k] = out.get(k, 0) + v
        return out

    # -- helpers ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def transferring(self, remote: Remote) -> Iterator[None]:
        """One READ or WRITE in flight from or to ``remote``: a reload of the peer and
        :meth:`aclose` wait until none is."""
        self._active += 1
        remote.active += 1
        try:
            yield
        finally:
            self._active -= 1
            remote.active -= 1
            if remote.active == 0 and remote.idle is not None:
                remote.idle.set()
            if self._active == 0 and self._idle is not None:
                self._idle.set()

    async def _wait_idle(self, remote: Remote) -> None:
        while remote.active:
            if remote.idle is None or remote.idle.is_set():
                remote.idle = anyio.Event()
            await remote.idle.wait()

    def holds(self, dest: torch.Tensor) -> bool:
        """Whether ``dest`` is a block of the registered receive pool (host memory)."""
        pool = self._recv_pool
        return pool is not None and dest.device.type == "cpu" and pool.holds(dest)

    async def delivery_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of the registered receive pool: READs land in it with no
        registration of their own."""
        self._live_agent()
        pool = self._recv_pool
        if pool is None or nbytes < self.register_dest_min:
            return None
        return await pool.delivery_buffer(nbytes, self.counters, "nixl")

    def _pool_for(self, device: str) -> _Pool | None:
        if device.startswith("cuda"):
            dev = torch.device(device).index
            for pool in self._pools:
                r = pool.memory.region
                if r.mem == "VRAM" and (dev is None or r.dev == dev):
                    return pool
        return next((p for p in self._pools if p.memory.region.mem == "DRAM"), None)

    def landing_pool(self) -> _Pool:
        """Where the receiver lands bytes it does not read into ``dest``.

        Raises:
            BackendError: the backend has no host-memory pool (``pool_size=0``).
        """
        pool = self._pool_for("cpu")
        if pool is None:
            raise BackendError("nixl: no host-memory pool (pool_size=0) to read into")
        return pool

    async def _load(self, remote: Remote, lent: Lent) -> Loaded:
        """Make a registration of the peer known to our agent; count one user."""
        agent = self._live_agent()
        region, metadata = lent.region, lent.metadata
        async with remote.lock:
            entry = remote.loaded.get(region.key)
            if entry is not None and entry.metadata == metadata:
                entry.users += 1  # the same registration again: nothing to load
                return entry
            if any(e.users and e.region.overlaps(region) for e in remote.loaded.values()):
                raise BackendError(
                    f"nixl reference from {remote.peer!r} names a region that overlaps one "
                    "still in use"
                )
            stale = [e for e in remote.loaded.values() if e.region.overlaps(region)]
            if stale or len(remote.loaded) > MAX_STALE:
                await self._reload(remote)
            check_agent(metadata, remote.agent, remote.peer)
            try:
                await anyio.to_thread.run_sync(agent.load, metadata)
            except BackendError:
                await self._reload(remote)  # NIXL refused it against a stale entry
                await anyio.to_thread.run_sync(agent.load, metadata)
            entry = remote.loaded[region.key] = Loaded(region, metadata)
            entry.users += 1
            return entry

    async def _reload(self, remote: Remote) -> None:
        """Forget everything the agent knows of the peer and load its metadata again
        (with the registrations still in use), once no read from it is in flight. The
        caller holds ``remote.lock``.

        A registration of a peer stays known to the agent after the peer released it
        (NIXL cannot forget one region of a peer). When a new one overlaps such a
        stale one — the peer reuses addresses — or too many pile up, this reload
        keeps a read from resolving to a stale registration.
        """
        agent = self._live_agent()
        event = remote.refreshing = anyio.Event()
        try:
            with anyio.fail_after(self.timeout_for(0)):
                await self._wait_idle(remote)
            keep = {k: e for k, e in remote.loaded.items() if e.users}

            def reload() -> None:
                agent.unload(remote.agent)
                load_checked(agent, remote.metadata, remote.agent, remote.peer)
                for e in keep.values():
                    agent.load(e.metadata)

            await anyio.to_thread.run_sync(reload)
            remote.loaded = keep
            self.counters["reloads"] += 1
        except TimeoutError:
            raise BackendError(
                f"nixl: reads from {remote.peer!r} did not drain; cannot reload its metadata"
            ) from None
        finally:
            remote.refreshing = None
            event.set()

    async def _recover(self, remote: Remote) -> None:
        """After a failed read: NIXL forgets a peer's metadata after a connection error;
        load it again, so that later objects can be read."""
        agent = self._agent
        if agent is None or not remote.alive or self._closed:
            return
        async with remote.lock:
            if not await anyio.to_thread.run_sync(agent.known, remote.agent):
                with contextlib.suppress(BackendError):
                    await self._reload(remote)

    # -- sender ----------------------------------------------------------------------------

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        self._live_agent()
        pool = self._pool_for(device)
        if pool is None:
            raise BackendError("nixl: no pool to send from (pool_size=0)")
        lease = await pool.slots.take(nbytes, purpose=f"to {peer.name!r}")
        return _Export(self, pool, lease)

    async def export_tensors(
        self, peer: PeerInfo, tensors: list[torch.Tensor], *, lent: bool
    ) -> Export | None:
        """Lent CPU tensors are registered (cached) and read by the peer in place; else
        None (the endpoint packs into :meth:`export`)."""
        self._live_agent()
        remote = self._remotes.get(peer.key)
        if not lent or remote is None or not remote.pieces:
            return None
        image = await lend(self.registrations, tensors, frozenset({"cpu"}), self._own)
        if image is None:
            return None
        pieces, nbytes, acquired = image
        regions: dict[Hashable, int] = {}
        lents: list[blobs.Lent] = []
        out: list[blobs.Piece] = []
        for p, (key, reg) in zip(pieces, acquired, strict=True):
            named = key if key is not None else ("own", reg.region.addr)
            if named not in regions:
                regions[named] = len(lents)
                lents.append(blobs.Lent(reg.region, reg.metadata))
            out.append(blobs.Piece(p.at, p.addr, p.nbytes, regions[named]))
        ref = blobs.encode(blobs.PiecesRef(blobs.PIECES, 0, nbytes, lent=lents, pieces=out))
        self.counters["lent"] += 1
        keys = [key for key, _ in acquired]
        tensors = [p.tensor for p in pieces]
        spans = [(p.at, p.addr, p.nbytes) for p in pieces]
        return LentExport(self, nbytes, ref, self.registrations, keys, tensors, spans)

    def _own(self, addr: int, nbytes: int) -> LentRegistration | None:
        """The registration of a landing this backend lent that holds ``[addr, addr +
        nbytes)``, or None: what it forwards from there is read (or written) in place
        with that registration's metadata, not registered again."""
        for lent in self._landings.registered():
            memory = lent.memory
            region = memory.region
            if (
                memory.registration is not None
                and region.addr <= addr
                and addr + nbytes <= region.addr + region.length
            ):
                return LentRegistration(region, memory.registration, memory.metadata)
        return None

    def _lands_for(self, peer: PeerInfo, nbytes: int) -> Lands | None:
        """The landing ``peer``'s session lent us, if an object of ``nbytes`` may be
        written there (not whether a range is free)."""
        lands = self._lands.get(peer.name)
        remote = self._remotes.get(peer.key)
        if lands is None or remote is None or lands.key != peer.key or not remote.alive:
            return None
        if not nbytes or not hasattr(self._agent, "start_write"):
            return None
        return lands

    def can_land(self, peer: PeerInfo, nbytes: int) -> bool:
        lands = self._lands_for(peer, nbytes)
        return lands is not None and lands.ranges.fits(nbytes)

    async def land(self, peer: PeerInfo, export: Export) -> Export | None:
        """WRITE the export's bytes into the landing ``peer`` lent us, in one transfer
        from where they are (a pool slot, a dedicated buffer, the lent tensors); None
        when it lent none, none of its ranges is free, or the WRITE failed."""
        agent = self._live_agent()
        nbytes = export.nbytes
        lands = self._lands_for(peer, nbytes)
        remote = self._remotes.get(peer.key)
        if lands is None or remote is None or export.released:
            return None
        local = self._local_spans(export)
        if local is None:
            return None

        def ref(offset: int) -> bytes:
            landed = blobs.LandedRef(blobs.LANDED, offset, nbytes, landing=lands.token)
            return blobs.encode(landed)

        async def write(writes: list[tuple[int, int, int]]) -> None:
            await self._write(agent, remote, writes, nbytes)

        # Whether a failed WRITE can still land is not known here (NIXL cancels what
        # it releases, but a WRITE cut off by a lost peer, say, may have been on the
        # wire): every failed one keeps its range out of use.
        return await land_into(
            self, lands, export, local, write, ref, self.counters, abandoned=lambda exc: True
        )

    def _local_spans(self, export: Export) -> list[tuple[int, int, int]] | None:
        """Where an export's bytes are in our registered host memory: ``(at, address,
        length)`` per span; None for another kind (a VRAM slot, another backend's)."""
        if isinstance(export, _Export):
            memory = export.lease.buffer or export.pool.memory
            if memory.region.mem != "DRAM":
                return None
            offset = 0 if export.lease.buffer is not None else export.lease.offset
            return [(0, memory.region.addr + offset, export.nbytes)]
        if isinstance(export, LentExport) and export.backend is self and export.spans:
            return export.spans
        return None

    async def _write(
        self, agent: Agent, remote: Remote, writes: list[tuple[int, int, int]], nbytes: int
    ) -> None:
        """One WRITE of ``(local, remote, length)`` spans to the peer, waited for as a
        READ is (on the loop once its connection is up, else in a worker thread); it
        counts as a transfer in flight from the peer (a reload waits for it)."""
        while remote.refreshing is not None:
            await remote.refreshing.wait()
        timeout = self.timeout_for(nbytes)
        what = f"{nbytes} bytes to {remote.peer!r}"
        dram = (0, "DRAM")

        def cancelled() -> bool:
            return not remote.alive or self._closed

        def run() -> None:
            read(agent, writes, dram, remote.agent, dram, timeout, what, cancelled, write=True)

        error: BackendError | None = None
        with self.transferring(remote):
            try:
                if remote.opened and len(writes) <= 16:
                    hops.mark("engine: submit WRITE (event loop)")
                    await read_async(
                        agent,
                        self._completions,
                        writes,
                        dram,
                        remote.agent,
                        dram,
                        timeout,
                        what,
                        cancelled,
                        write=True,
                    )
                else:
                    hops.mark("engine: submit and wait WRITE (worker thread)")
                    await run_to_end(run)
                    remote.opened = True
                hops.mark("engine: back on the loop")
            except BackendError as exc:
                error = exc
        if error is not None:  # (a reload waits for transfers in flight: this one ended)
            remote.opened = False
            await self._recover(remote)
            raise error

    # -- receiver --------------------------------------------------------------------------

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        self._live_agent()
        remote = self._remotes.get(peer.key)
        if remote is None or not remote.alive:
            raise BackendError(f"{peer.name!r} did not announce nixl in its Hello")
        landing = self._landings.get(peer.name)
        token, size = (landing.token, landing.size) if landing else (0, 0)
        landed = blobs.landed_range(ref, token, size, nbytes, peer.name)
        if landed is not None:
            assert landing is not None
            offset, _ = landed
            self.counters["landed_in"] += 1
            view = landing.memory.tensor[offset : offset + nbytes]
            return LandedImport(self, peer, nbytes, self._landings, landing, view)
        spans, lents = blobs.resolve(ref, remote.pools, nbytes, peer.name)
        loaded: list[Loaded] = []
        try:
            for lent in lents:
                loaded.append(await self._load(remote, lent))
        except BaseException:
            for entry in loaded:
                entry.users -= 1
            raise
        return SpanImport(self, peer, nbytes, remote, spans, loaded)


def _close_started(started: tuple[Agent, list[_Pool], bytes]) -> None:
    """Undo :meth:`NixlBackend._start_blocking` (for a start that failed or was given up)."""
    agent, pools, _metadata = started
    for pool in pools:
        pool.memory.release()
    agent.close()
