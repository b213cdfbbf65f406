"""The mooncake backend: exports in the registered pool (or the caller's lent
tensors), written into the peer's landing or read by it with the engine. See the
package docstring."""

from __future__ import annotations

import logging
import time
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
    TransferAbandonedError,
    TransferTimeoutError,
    lend,
    mib,
)
from ..threads import Threads, make_in_thread
from . import _blobs as blobs
from ._engine import Engine, Reads, import_error, shared_engine, submit
from ._memory import Registered, new_pool, recv_pool, registration_cache
from ._reading import SpanImport

__all__ = ["MooncakeBackend"]

log = logging.getLogger("omniwire.mooncake")

#: A session written to successfully this recently takes its next write's submit on
#: the event loop (see MooncakeBackend._write).
WARM_S = 1.0
#: A landing write not done ``LAND_STALL_S`` plus its bytes at ``LAND_STALL_RATE``
#: after it started (10.5 s for 24 MiB) is given up by its sender, which has the object
#: read instead; its range stays out of use until the engine says the write ended.
#: Longer than the default ``peer_timeout`` (5 s): a write cut by a partition from a
#: peer without resumption is still abandoned at the loss ("not sent", never
#: announced); past it, a resuming peer reads the object once the link is back.
#: With 0.3.13's tcp transport on 2 overloaded cores, up to one 24 MiB write in two
#: had every byte acknowledged by TCP and was never reported complete (the engine's io
#: thread idle): the object waited the whole ``timeout`` (60 s). On a link slower than
#: the rate the object is read while the write still runs (its bytes go twice).
LAND_STALL_S = 10.0
LAND_STALL_RATE = 50e6

INSTALL_HINT = 'pip install "omniwire[mooncake]"'
APT_HINT = "apt-get install libibverbs1 libnl-3-200 libnl-route-3-200"


class _Export(Export):
    """A slot of the pool, or a dedicated registered buffer, until the ACK."""

    def __init__(self, backend: MooncakeBackend, lease: Lease[Registered], view: torch.Tensor):
        super().__init__(backend, lease.nbytes, view)
        self.lease = lease
        self.session = backend.engine.session
        self.addr = lease.buffer.addr if lease.buffer is not None else 0

    @property
    def ref(self) -> bytes:
        if self.lease.buffer is None:
            return blobs.encode(blobs.Ref(self.session, self.lease.offset, self.nbytes))
        return blobs.encode(blobs.Ref(self.session, 0, self.nbytes, dedicated=self.addr))

    def _release(self) -> None:
        self.lease.release()


class MooncakeBackend(ByteBackend):
    """Options: ``protocol`` ("tcp" | "rdma"), ``device_name``, ``host``, ``pool_size``
    (bytes, default 64 MiB), ``register_dest`` (bool), ``recv_pool_idle`` (bytes of idle
    registered receive buffers kept, default 256 MiB; 0: none), ``timeout`` (s), ``engine`` (an
    :class:`~omniwire.backends.mooncake.Engine` to use instead of the process's
    Mooncake engine). See the package docstring."""

    name: ClassVar[str] = "mooncake"
    summary: ClassVar[str] = (
        "Mooncake Transfer Engine (P2P handshake): the receiver reads from the sender's "
        "registered pool, or the sender writes into the receiver's landing"
    )
    install_hint: ClassVar[str] = INSTALL_HINT
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "tcp"
    needs_gpu: ClassVar[bool] = False
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu"}),
        localities=frozenset({Locality.SAME_HOST, Locality.CROSS_HOST}),
        progressive=True,
        zero_copy=True,
        # an export's reference is (session, offset, length): any peer may read it, so a
        # fan-out reads one packed buffer and Endpoint.empty() hands out pool slots
        shared_refs=True,
        preference=60,
    )

    def __init__(self, ctx: BackendContext, *, engine: Engine | None = None) -> None:
        super().__init__(ctx)
        opts = ctx.options
        try:
            self.protocol = str(opts.get("protocol", "tcp"))
            self.device_name = str(opts.get("device_name", ""))
            self.host = str(opts.get("host", ctx.host))
            self.pool_size = int(opts.get("pool_size", 64 << 20))
            self.register_dest = bool(opts.get("register_dest", self.protocol == "tcp"))
            self.timeout = float(opts.get("timeout", 60.0))
            self.recv_pool_idle = int(opts.get("recv_pool_idle", 256 << 20))
            # tcp registers 1–64 MiB in 4–76 µs (no pinning): cheaper than a thread hop
            inline = (64 << 20) if self.protocol == "tcp" else 0
            self.register_inline = int(opts.get("register_inline", inline))
            # tcp registers without pinning: a landing's pages are touched as objects land
            lent = LANDING_SIZE if self.protocol == "tcp" else 0
            self.landing_size = int(opts.get("landing_size", lent))
            self.landing_peers = int(opts.get("landing_peers", LANDING_PEERS))
            self.landing_quarantine = float(opts.get("landing_quarantine", LANDING_QUARANTINE))
        except (TypeError, ValueError) as exc:
            raise BackendError(f"mooncake: bad options {dict(opts)!r}: {exc}") from None
        if (
            not self.protocol
            or not self.host
            or self.pool_size < 0
            or self.timeout <= 0
            or self.recv_pool_idle < 0
            or self.register_inline < 0
            or self.landing_size < 0
            or self.landing_peers < 0
            or not self.landing_quarantine >= 0
        ):
            raise BackendError(
                f"mooncake: bad options {dict(opts)!r} (protocol and host must be non-empty, "
                "pool_size >= 0, recv_pool_idle >= 0, register_inline >= 0, landing_size >= 0, "
                "landing_peers >= 0, landing_quarantine >= 0, timeout > 0)"
            )
        self._given_engine = engine if engine is not None else opts.get("engine")
        self._engine: Engine | None = None
        self._region: Registered | None = None
        self._pool_addr = 0
        self._hello = b""
        self._releaser = Releaser("omniwire-mooncake")
        #: where reads are submitted (blocking calls), and where they are waited for
        self._threads = Threads("omniwire-mooncake-submit")
        self._completions = Completions("omniwire-mooncake-completions")
        self._pool: SlotPool[Registered] | None = None
        self._registrations: RegistrationCache[int] | None = None
        #: Copy-mode receive buffers, registered once per block (delivery_buffer).
        self._recv_pool: RegisteredRecvPool[int] | None = None
        self._peers: dict[tuple[str, int], blobs.LandingHello] = {}
        #: Landings peers lent us, by their names (sender side).
        self._lands: dict[str, Lands] = {}
        #: When a write to each session last ended well (see _write).
        self._warm: dict[str, float] = {}
        self._busy = 0
        #: Callers' memory that abandoned reads (timeout, peer lost) may still write:
        #: (the tensor, kept so it is not reused; its address if registered for that
        #: read) until aclose.
        self._abandoned: list[tuple[torch.Tensor, int | None]] = []
        self._idle = anyio.Event()
        self._idle.set()
        self._closed = False
        self.counters = {
            "reads": 0,
            "bytes_read": 0,
            "lent": 0,
            "recv_pool_refused": 0,
            **landing.counters(),
        }
        #: Landings we lend, by the name of the peer they are lent to (receiver side).
        self._landings: Lender[Registered] = Lender(
            "mooncake",
            size=self.landing_size,
            peers=self.landing_peers,
            quarantine=self.landing_quarantine,
            make=self._new_landing,
            fence=Registered.fence,
            unmap=Registered.unmap,
            counters=self.counters,
        )

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        error = import_error()
        if error is None:
            return Availability.ok()
        hint = INSTALL_HINT
        if any(lib in error for lib in ("libibverbs", "libnl", "librdmacm")):
            hint = f"{APT_HINT} (the engine links against them), then {INSTALL_HINT}"
        return Availability.missing(error, hint)

    @property
    def engine(self) -> Engine:
        return self._check_open()

    @property
    def pool(self) -> SlotPool[Registered]:
        if self._pool is None:
            raise BackendError("mooncake backend was not started")
        return self._pool

    @property
    def registrations(self) -> RegistrationCache[int]:
        if self._registrations is None:
            raise BackendError("mooncake backend was not started")
        return self._registrations

    async def start(self) -> None:
        """Start (or join) the engine and register the pool.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: the engine cannot start or the pool cannot be registered.
        """
        if self._engine is not None:
            return
        if self._closed:
            raise BackendClosedError("mooncake backend is closed")
        given = self._given_engine
        engine: Engine = (
            given
            if given is not None
            else await anyio.to_thread.run_sync(
                shared_engine, self.host, self.protocol, self.device_name
            )
        )
        pool = new_pool(engine, self._releaser)
        if self.pool_size > 0:
            size = self.pool_size
            region = await make_in_thread(lambda: Registered(engine, size), Registered.release)
            if self._closed_now():  # closed while it was registered
                region.release()
                raise BackendClosedError("mooncake backend is closed")
            pool.attach(self.pool_size)
            self._region, self._pool_addr = region, region.addr
        self._engine, self._pool = engine, pool
        self._registrations = registration_cache(engine, self._releaser, self.register_inline)
        if self.recv_pool_idle > 0:
            self._recv_pool = recv_pool(engine, self._releaser, self.recv_pool_idle)
        self._hello = blobs.encode(
            blobs.PiecesHello(
                engine.session, self.protocol, self._pool_addr, pool.capacity, pieces=True
            )
        )
        log.debug(
            "mooncake engine %s (%s, pool %s)", engine.session, self.protocol, mib(pool.capacity)
        )

    def _closed_now(self) -> bool:
        """Whether :meth:`aclose` ran (read after an await, where it may have)."""
        return self._closed

    def hello(self) -> bytes:
        return self._hello

    def hello_to(self, peer: str) -> bytes:
        """:meth:`hello` with the landing lent to ``peer`` (made on its first Hello;
        none past ``landing_peers`` peers, or with ``landing_size`` 0)."""
        landing = self._landing_for(peer)
        if landing is None:
            return self._hello
        engine, pool = self.engine, self.pool
        return blobs.encode(
            blobs.LandingHello(
                engine.session,
                self.protocol,
                self._pool_addr,
                pool.capacity,
                pieces=True,
                landing=blobs.Landing(landing.addr, landing.size, landing.token),
            )
        )

    def _landing_for(self, peer: str) -> LentLanding[Registered] | None:
        if self._engine is None or self._closed:
            return None
        return self._landings.lend(peer)

    def _new_landing(self, size: int) -> tuple[Registered, int, int]:
        """A landing's memory: registered, not pre-faulted (on the loop: tcp registers
        unpinned memory in microseconds)."""
        memory = Registered(self.engine, size, populate=False)
        return memory, memory.addr, size

    def peer_gone(self, peer: str) -> None:
        """``peer``'s session ended: the landing lent to it comes back (fenced, see
        :class:`~omniwire.backends.landing.Lender`)."""
        self._landings.gone(peer)

    async def connect(self, peer: PeerInfo) -> None:
        hello = self._peers[peer.key] = blobs.decode_hello(peer, self.protocol)
        lands = self._lands.get(peer.name)
        if hello.landing is None:
            if lands is not None and not lands.ranges.allocations:
                del self._lands[peer.name]
            return
        landing = hello.landing
        if lands is None or not lands.same(landing.token, hello.session):
            self._lands[peer.name] = Lands(
                landing.addr, landing.length, landing.token, hello.session, peer.key
            )
        else:
            lands.key = peer.key

    async def disconnect(self, peer: PeerInfo) -> None:
        """Forget the peer: its references no longer import, reads from it fail.

        Handles still alive for it are released by their owners (the endpoint always
        does): releasing them here could hand a slot to another object while a pack
        still writes into it or a zero-copy view still reads it. What it lent us is
        kept while a range of it is held (see :class:`Lands`).
        """
        hello = self._peers.pop(peer.key, None)
        if hello is not None:
            self._warm.pop(hello.session, None)  # (one entry per live session, no more)
        lands = self._lands.get(peer.name)
        if lands is not None and lands.key == peer.key and not lands.ranges.allocations:
            del self._lands[peer.name]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # reads in flight write into our memory: let them finish (they are bounded by
        # the read timeout) before anything is unregistered
        while self._busy:
            await self._idle.wait()
        self._peers.clear()
        engine, self._engine = self._engine, None
        if self._pool is not None:
            await self._pool.aclose()
        retired = self._registrations.clear() if self._registrations is not None else []
        cached = [addr for addr, _ in retired]
        cached += [addr for _, addr in self._abandoned if addr is not None]
        recv, self._recv_pool = self._recv_pool, None
        if recv is not None:
            cached += recv.close_registered()
        region, self._region = self._region, None
        landings, quarantined = self._landings.close()
        self._lands.clear()

        def teardown() -> None:
            self._completions.stop()
            self._threads.stop()
            self._releaser.stop()
            if engine is not None:
                for addr in cached:
                    try:
                        engine.unregister(addr)
                    except BackendError as exc:
                        log.warning("%s", exc)
            # The engine stays (shared, see the package docstring): a peer may still be
            # reading this memory through it, so it is emptied and kept, not unmapped.
            if region is not None:
                region.release()
            for memory in landings:  # a late write lands in a mapping kept a while
                memory.release()
            for memory in quarantined:  # (fenced already)
                memory.unmap()
            if recv is not None:
                recv.clear()
            retired.clear()  # unregistered: the lent tensors' memory may go now

        await anyio.to_thread.run_sync(teardown)
        self._abandoned.clear()

    def detail(self) -> dict[str, int]:
        pool = self._pool.detail() if self._pool is not None else {}
        regs = self._registrations
        return {
            **pool,
            "reads_in_flight": self._busy,
            "registrations": len(regs) if regs is not None else 0,
            "recv_pool_registrations": self._recv_pool.registrations if self._recv_pool else 0,
            "recv_pool_bytes": self._recv_pool.registered_bytes if self._recv_pool else 0,
            **self._landings.detail(),
            **self.counters,
        }

    # -- helpers -------------------------------------------------------------------------

    def _check_open(self) -> Engine:
        if self._closed:
            raise BackendClosedError("mooncake backend is closed")
        if self._engine is None:
            raise BackendError("mooncake backend was not started")
        return self._engine

    def _view(self, lease: Lease[Registered]) -> torch.Tensor:
        if lease.buffer is not None:
            return lease.buffer.tensor[: lease.nbytes]
        assert self._region is not None
        return self._region.tensor[lease.offset : lease.offset + lease.nbytes]

    def _enter(self) -> None:
        if self._busy == 0:
            self._idle = anyio.Event()
        self._busy += 1

    def _leave(self) -> None:
        self._busy -= 1
        if self._busy == 0:
            self._idle.set()

    # -- sender ------------------------------------------------------------------------

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        self._check_open()
        lease = await self.pool.take(nbytes, purpose=f"to {peer.name!r}")
        return _Export(self, lease, self._view(lease))

    async def export_tensors(
        self, peer: PeerInfo, tensors: list[torch.Tensor], *, lent: bool
    ) -> Export | None:
        """Lent CPU tensors are registered (cached) and read by the peer in place; else
        None (the endpoint packs into :meth:`export`)."""
        self._check_open()
        hello = self._peers.get(peer.key)
        if not lent or hello is None or not hello.pieces:
            return None
        lent_image = await lend(self.registrations, tensors, frozenset({"cpu"}), self._own)
        if lent_image is None:
            return None
        pieces, nbytes, acquired = lent_image
        ref = blobs.PiecesRef(
            self.engine.session,
            0,
            nbytes,
            pieces=[blobs.Piece(p.at, p.addr, p.nbytes) for p in pieces],
        )
        self.counters["lent"] += 1
        return LentExport(
            self,
            nbytes,
            blobs.encode(ref),
            self.registrations,
            [key for key, _ in acquired],
            [p.tensor for p in pieces],
            [(p.at, p.addr, p.nbytes) for p in pieces],
        )

    def _own(self, addr: int, nbytes: int) -> int | None:
        """The address of memory this backend registered itself — a landing it lent,
        its pool, a receive block — that holds ``[addr, addr + nbytes)``, or None:
        what it forwards from there is read (or written) in place, not registered
        again (the engine refuses an overlapping registration)."""
        owned = [landing.memory for landing in self._landings.registered()]
        if self._region is not None:
            owned.append(self._region)
        for memory in owned:
            if memory.addr <= addr and addr + nbytes <= memory.addr + memory.size:
                return memory.addr
        recv = self._recv_pool
        return recv.handle_of(addr, nbytes) if recv is not None else None

    def _lands_for(self, peer: PeerInfo, nbytes: int) -> Lands | None:
        """The landing ``peer``'s session lent us, if an object of ``nbytes`` may be
        written there (not whether a range is free)."""
        lands = self._lands.get(peer.name)
        if lands is None or lands.key != peer.key or not nbytes:
            return None
        if not hasattr(self._engine, "submit_write"):
            return None  # none yet, or an engine of the caller's that only reads
        return lands

    def can_land(self, peer: PeerInfo, nbytes: int) -> bool:
        lands = self._lands_for(peer, nbytes)
        return lands is not None and lands.ranges.fits(nbytes)

    async def land(self, peer: PeerInfo, export: Export) -> Export | None:
        """Write the export's bytes into the landing ``peer`` lent us, with one batch
        write from where they are (a pool slot, a dedicated buffer, the lent tensors);
        None when it lent none, none of its ranges is free, or the write failed."""
        engine = self._check_open()
        nbytes = export.nbytes
        lands = self._lands_for(peer, nbytes)
        if lands is None or export.released:
            return None
        local = self._local_spans(export)
        if local is None:
            return None
        session = engine.session

        def ref(offset: int) -> bytes:
            return blobs.encode(blobs.LandedRef(session, offset, nbytes, landing=lands.token))

        async def write(writes: list[tuple[int, int, int]]) -> None:
            await self._write(engine, peer, lands.owner, writes, nbytes)

        return await land_into(
            self,
            lands,
            export,
            local,
            write,
            ref,
            self.counters,
            # a write that timed out or was given up may still land
            abandoned=lambda exc: isinstance(exc, (TransferTimeoutError, TransferAbandonedError)),
        )

    def _local_spans(self, export: Export) -> list[tuple[int, int, int]] | None:
        """Where an export's bytes are in our registered memory: ``(at, address,
        length)`` per span; None for an export of another kind."""
        if isinstance(export, _Export):
            lease = export.lease
            addr = lease.buffer.addr if lease.buffer is not None else self._pool_addr + lease.offset
            return [(0, addr, export.nbytes)]
        if isinstance(export, LentExport) and export.backend is self and export.spans:
            return export.spans
        return None

    async def _write(
        self,
        engine: Engine,
        peer: PeerInfo,
        session: str,
        writes: list[tuple[int, int, int]],
        nbytes: int,
    ) -> None:
        """Write each ``(local, remote, length)`` to ``session`` and wait, watched by the
        completion thread (shielded, as a read).

        Submitted on the event loop while the session is *warm* (a transfer to it
        ended well less than :data:`WARM_S` ago: the tcp transport then has a pooled
        connection, and its submit only queues the write, ~10 µs), else in a worker
        thread: the transport connects inside its submit call, which blocks while a
        link is down. A worker thread's hop cost ~0.1 ms of a 1 MiB write's ~0.9."""
        timeout = self.timeout + nbytes / 100e6
        stall = LAND_STALL_S + nbytes / LAND_STALL_RATE
        what = f"mooncake: write of {nbytes} bytes to session {session}"

        def lost() -> bool:
            return peer.key not in self._peers

        def start() -> Reads:
            hops.mark("engine: submit write (worker thread)")
            return submit(engine, session, writes, timeout, write=True)

        self._enter()
        try:
            with anyio.CancelScope(shield=True):
                if time.monotonic() - self._warm.get(session, -WARM_S) < WARM_S:
                    hops.mark("engine: submit write (event loop)")
                    batch = submit(engine, session, writes, timeout, write=True)
                    await self._completions.wait(
                        batch.done,
                        timeout=timeout,
                        what=what,
                        cancelled=lost,
                        nbytes=nbytes,
                        stall_after=stall,
                    )
                else:
                    batch = await self._completions.start_and_wait(
                        self._threads,
                        start,
                        timeout=timeout,
                        what=what,
                        cancelled=lost,
                        nbytes=nbytes,
                        stall_after=stall,
                    )
        except BaseException:
            self._warm.pop(session, None)
            raise
        finally:
            self._leave()
        hops.mark("engine: back on the loop")
        try:
            batch.check()
        except BackendError:
            self._warm.pop(session, None)
            raise
        self._warm[session] = time.monotonic()

    # -- receiver ----------------------------------------------------------------------

    async def delivery_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of the registered receive pool: reads land in it with no
        registration of their own."""
        self._check_open()
        pool = self._recv_pool
        if pool is None:
            return None
        return await pool.delivery_buffer(nbytes, self.counters, "mooncake")

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        self._check_open()
        hello = self._peers.get(peer.key)
        if hello is None:
            raise BackendError(f"{peer.name!r} did not announce mooncake in its Hello")
        decoded = blobs.decode_ref(ref, hello, nbytes, peer.name)
        if decoded.landing:
            landing = self._landings.get(peer.name)
            if landing is None:
                raise BackendError(f"{peer.name!r} named a landing this endpoint never lent it")
            offset, _ = blobs.landed_range(decoded, landing.token, landing.size, peer.name)
            self.counters["landed_in"] += 1
            view = landing.memory.tensor[offset : offset + nbytes]
            return LandedImport(self, peer, nbytes, self._landings, landing, view)
        spans = blobs.spans(decoded, hello, nbytes, peer.name)
        return SpanImport(self, peer, nbytes, hello.session, spans)
