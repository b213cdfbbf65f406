"""``mooncake``: the Mooncake Transfer Engine, peer to peer (``P2PHANDSHAKE``), pull model.

A process runs one engine per ``(host, protocol, device_name)``
(``TransferEngine().initialize(host, "P2PHANDSHAKE", protocol, device_name)``; no
metadata server; session id ``f"{host}:{engine.get_rpc_port()}"``), shared by its
mooncake backends and kept until the process exits: stopping an engine holds the
GIL for about a second (its handshake listener polls once a second), which would
freeze every thread of the process. Each backend registers one **pool** of host
memory with the engine, once (``register_memory``), carves it into reusable slots
with a buddy allocator and unregisters it in ``aclose()``. An object that does not
fit in the free part of the pool gets a dedicated buffer, registered for that
object and released on ``free()``.

Data flow (pull): the sender packs into its slot and announces it; the receiver
**reads** the announced byte ranges ``[lo, hi)`` from the sender's slot with
``batch_transfer_async_read`` and waits for that one transfer's status
(``transfer_check_status``, polled with a short sleep in a worker thread: the
engine's synchronous calls spin a core while they wait, which costs a third to a
half of the throughput on a 2-core machine). Each read has its own batch id: no
shared notification names, no lost wake-ups. The ACK frees the slot.

Where the receiver reads into:

- zero-copy (no ``dest``): a slot of its own registered pool (or a dedicated
  registered buffer); the delivered tensors view it until ``close()``;
- copy mode (``dest`` given): by default (``register_dest``, on for ``tcp``) the
  destination range itself is registered for the read and unregistered after it,
  about 10 µs on tcp against 5–9 ms for an extra copy of 64 MiB. With
  ``register_dest=False`` (the default for ``rdma``, where registering pins pages)
  the bytes are read into an own registered slot and copied into ``dest``.

Hello info (``BackendInfo.info``): msgpack ``{"session": "host:rpc_port",
"protocol": str, "pool_addr": u64, "pool_size": u64}``.

Reference (``BackendRef.info``): msgpack ``{"session": str, "offset": u64,
"length": u64, "dedicated": u64}``. ``session`` must be the one the peer announced
and ``length`` the object's length. ``dedicated == 0`` names bytes
``[offset, offset + length)`` of the peer's pool, which must lie inside the pool it
announced; otherwise ``dedicated`` is the address of a buffer the peer registered
for this object (``offset`` is then 0), which must lie outside its pool — the
receiver cannot check more, the engine refuses reads of memory the peer has not
registered. Unknown fields are ignored.

Options (``backend_options={"mooncake": {...}}``): ``protocol`` (``"tcp"``, the
default, or ``"rdma"``); ``device_name`` (RDMA device filter, e.g. ``"mlx5_0"``;
empty: the engine discovers); ``host`` (the address peers reach this engine at;
default: the host of the endpoint's address, 127.0.0.1 for ``ipc://`` and
``tcp://*``); ``pool_size`` (bytes, default 64 MiB); ``register_dest`` (above);
``timeout`` (seconds a single read may take before it is abandoned; default 60,
plus 1 s per 100 MB).

Engine caveats (0.3.13): its handshake and data listeners bind every interface,
whatever ``host`` is; a read that is abandoned (timeout) may still land later, so
its local buffer is quarantined until ``aclose()`` (a registered ``dest`` cannot
be: it belongs to the caller).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, ClassVar, Literal

import anyio
import msgspec
import torch

from ..alloc import BuddyAllocator
from ..errors import BackendClosedError, BackendError
from .base import (
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    InboundBuffer,
    Locality,
    OutboundBuffer,
    PeerInfo,
    copy_range,
)

__all__ = ["MooncakeBackend", "raw_bench"]

log = logging.getLogger("omniwire.mooncake")

MODULE = "omniwire.backends.mooncake"
INSTALL_HINT = 'pip install "omniwire[mooncake]"'
APT_HINT = "apt-get install libibverbs1 libnl-3-200 libnl-route-3-200"

_U64_MAX = 2**64 - 1
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
#: Released dedicated buffers kept mapped (emptied) so a late reader never faults.
_RETIRED_MAX = 32
_POLL_MIN_S = 10e-6
_POLL_MAX_S = 250e-6

U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack integers stop at 2**64 - 1


class _HelloInfo(msgspec.Struct, frozen=True):
    session: str
    protocol: str
    pool_addr: U64
    pool_size: U64


class _Ref(msgspec.Struct, frozen=True):
    session: str
    offset: U64
    length: U64
    dedicated: U64 = 0


_hello_decoder = msgspec.msgpack.Decoder(_HelloInfo)
_ref_decoder = msgspec.msgpack.Decoder(_Ref)
_encoder = msgspec.msgpack.Encoder()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- the engine ------------------------------------------------------------------------


@functools.cache
def _import_error() -> str | None:
    """Why ``mooncake.engine`` cannot be imported here, or None (cached)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as exc:
        return f"cannot import mooncake.engine: {exc}"
    return None


def _engine_module() -> Any:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    return importlib.import_module("mooncake.engine")


class _Engine:
    """A started ``TransferEngine`` with checked, blocking calls (run them in a thread)."""

    def __init__(self, host: str, protocol: str, device_name: str) -> None:
        try:
            engine = _engine_module().TransferEngine()
        except (ImportError, OSError) as exc:
            raise BackendError(f"mooncake: cannot load the transfer engine: {exc}") from exc
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise BackendError(
                f"mooncake: TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) failed with code {rc}"
            )
        self.te: Any = engine
        self.session = f"{host}:{engine.get_rpc_port()}"

    def register(self, addr: int, length: int) -> None:
        rc = self.te.register_memory(addr, length)
        if rc != 0:
            raise BackendError(
                f"mooncake: register_memory(0x{addr:x}, {length}) failed with code {rc}"
            )

    def unregister(self, addr: int) -> None:
        rc = self.te.unregister_memory(addr)
        if rc != 0:
            raise BackendError(f"mooncake: unregister_memory(0x{addr:x}) failed with code {rc}")

    def read(self, session: str, local: int, remote: int, length: int, timeout: float) -> None:
        """Read ``length`` bytes at ``remote`` of ``session`` into ``local``; wait for it.

        Raises:
            BackendError: the engine refused or failed the transfer (message has the code).
            TimeoutError: it did not finish within ``timeout`` seconds (it may still land).
        """
        te = self.te
        batch = te.batch_transfer_async_read(session, [local], [remote], [length])
        if batch == 0 or batch >= 2**63:  # 0: submit failed; (uint64)-1: no such segment
            raise BackendError(
                f"mooncake: cannot submit a read of {length} bytes at 0x{remote:x} from "
                f"session {session} (code {batch if batch < 2**63 else batch - 2**64})"
            )
        deadline = time.monotonic() + timeout
        delay = _POLL_MIN_S
        # sleep at most ~1/8 of the expected duration (at ~8 GB/s) between checks
        longest = min(_POLL_MAX_S, max(2 * _POLL_MIN_S, length / 8e9))
        while True:
            rc = te.transfer_check_status(batch)
            if rc == 1:
                return
            if rc == -2:
                raise TimeoutError(
                    f"mooncake: read of {length} bytes at 0x{remote:x} from session {session} "
                    f"timed out in the engine (code {rc})"
                )
            if rc < 0:
                raise BackendError(
                    f"mooncake: read of {length} bytes at 0x{remote:x} from session {session} "
                    f"failed (code {rc})"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"mooncake: read of {length} bytes at 0x{remote:x} from session {session} "
                    f"did not finish within {timeout:g} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, longest)


_engines: dict[tuple[str, str, str], _Engine] = {}
_engines_lock = threading.Lock()
_inherited: list[_Engine] = []  # engines of the parent of a fork: never touched again


def _forget_engines_after_fork() -> None:
    # Their threads did not survive the fork; destroying them would join ghosts.
    _inherited.extend(_engines.values())
    _engines.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_engines_after_fork)


def _shared_engine(host: str, protocol: str, device_name: str) -> _Engine:
    """This process's engine for ``(host, protocol, device_name)``, started on first use.

    Blocking (run it in a thread). Raises BackendError if the engine cannot start.
    """
    key = (host, protocol, device_name)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = _Engine(host, protocol, device_name)
        return engine


def _map(size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Anonymous, pre-faulted memory and a uint8 tensor over it."""
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _MAP_POPULATE)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _unmap(mm: mmap.mmap) -> None:
    # If views are still alive this fails; the GC unmaps when the last one goes.
    with contextlib.suppress(BufferError):
        mm.close()


_retired: list[mmap.mmap] = []
_retired_lock = threading.Lock()


def _retire(mm: mmap.mmap) -> None:
    """Give the pages of released (already unregistered) memory back, keeping the
    mapping for a while: a peer's read that the engine's server accepted just
    before the memory was unregistered then reads zeros instead of faulting."""
    if _MADV_DONTNEED is not None:
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(_MADV_DONTNEED)
    with _retired_lock:
        _retired.append(mm)
        old = _retired[:-_RETIRED_MAX]
        del _retired[:-_RETIRED_MAX]
    for m in old:
        _unmap(m)


# -- memory --------------------------------------------------------------------------


class _Region:
    """Registered memory this backend owns: a pool slot or a dedicated buffer."""

    __slots__ = ("addr", "mm", "offset", "size", "view")

    def __init__(
        self,
        addr: int,
        size: int,
        view: torch.Tensor,
        offset: int = -1,
        mm: mmap.mmap | None = None,
    ) -> None:
        self.addr = addr
        self.size = size
        self.view = view
        self.offset = offset  # >= 0: a pool slot
        self.mm = mm  # a dedicated buffer

    @property
    def pooled(self) -> bool:
        return self.offset >= 0


class _Lease:
    __slots__ = ("key", "region")

    def __init__(self, key: tuple[str, int], region: _Region) -> None:
        self.key = key
        self.region = region


class _Inbound:
    __slots__ = ("busy", "closed", "key", "length", "peer_name", "region", "remote", "session")

    def __init__(
        self, key: tuple[str, int], peer_name: str, session: str, remote: int, length: int
    ) -> None:
        self.key = key
        self.peer_name = peer_name
        self.session = session
        self.remote = remote
        self.length = length
        self.region: _Region | None = None
        self.busy = 0
        self.closed = False


class MooncakeBackend(ByteBackend):
    """Options: ``protocol`` ("tcp" | "rdma"), ``device_name``, ``host``, ``pool_size``
    (bytes, default 64 MiB), ``register_dest`` (bool), ``timeout`` (s). See the module
    docstring."""

    name: ClassVar[str] = "mooncake"
    summary: ClassVar[str] = (
        "Mooncake Transfer Engine (P2P handshake): the receiver reads from the sender's "
        "registered pool"
    )
    install_hint: ClassVar[str] = INSTALL_HINT
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "tcp"
    needs_gpu: ClassVar[bool] = False
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu"}),
        localities=frozenset({Locality.SAME_HOST, Locality.CROSS_HOST}),
        progressive=True,
        zero_copy=True,
        preference=60,
    )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        opts = ctx.options
        try:
            self.protocol = str(opts.get("protocol", "tcp"))
            self.device_name = str(opts.get("device_name", ""))
            self.host = str(opts.get("host", ctx.host))
            self.pool_size = int(opts.get("pool_size", 64 << 20))
            self.register_dest = bool(opts.get("register_dest", self.protocol == "tcp"))
            self.timeout = float(opts.get("timeout", 60.0))
        except (TypeError, ValueError) as exc:
            raise BackendError(f"mooncake: bad options {dict(opts)!r}: {exc}") from None
        if not self.protocol or not self.host or self.pool_size < 0 or self.timeout <= 0:
            raise BackendError(
                f"mooncake: bad options {dict(opts)!r} (protocol and host must be non-empty, "
                "pool_size >= 0, timeout > 0)"
            )
        self._engine: _Engine | None = None
        self._hello = b""
        self._pool: _Region | None = None
        self._pool_mm: mmap.mmap | None = None
        self._alloc: BuddyAllocator | None = None
        self._peers: dict[tuple[str, int], _HelloInfo] = {}
        self._leases: set[_Lease] = set()
        self._inbound: set[_Inbound] = set()
        self._dedicated: set[_Region] = set()  # live dedicated buffers (both sides)
        self._quarantined: list[_Region] = []  # may still be written by an abandoned read
        self._releaser: ThreadPoolExecutor | None = None
        self._busy = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._closed = False
        self._warned_dedicated = False
        self._counters = {"reads": 0, "bytes_read": 0, "dedicated_allocs": 0}

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        error = _import_error()
        if error is None:
            return Availability.ok()
        hint = INSTALL_HINT
        if any(lib in error for lib in ("libibverbs", "libnl", "librdmacm")):
            hint = f"{APT_HINT} (the engine links against them), then {INSTALL_HINT}"
        return Availability.missing(error, hint)

    async def start(self) -> None:
        if self._engine is not None:
            return
        if self._closed:
            raise BackendClosedError("mooncake backend is closed")
        engine = await anyio.to_thread.run_sync(
            _shared_engine, self.host, self.protocol, self.device_name
        )
        if self.pool_size > 0:
            mm, view = await anyio.to_thread.run_sync(_map, self.pool_size)
            addr = view.data_ptr()
            try:
                await anyio.to_thread.run_sync(engine.register, addr, self.pool_size)
            except BaseException:
                del view
                _unmap(mm)
                raise
            self._pool_mm = mm
            self._pool = _Region(addr, self.pool_size, view, offset=0)
            self._alloc = BuddyAllocator(self.pool_size, min_block=4096)
        self._engine = engine
        pool = self._pool
        self._hello = _encoder.encode(
            _HelloInfo(
                session=engine.session,
                protocol=self.protocol,
                pool_addr=pool.addr if pool is not None else 0,
                pool_size=pool.size if pool is not None else 0,
            )
        )
        log.debug(
            "mooncake engine %s started (%s, pool %s)",
            engine.session,
            self.protocol,
            _mib(self.pool_size),
        )

    def local_info(self) -> bytes:
        return self._hello

    async def connect(self, peer: PeerInfo) -> None:
        try:
            hello = _hello_decoder.decode(peer.info)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError(f"malformed mooncake hello info from {peer.name!r}: {exc}") from None
        if hello.protocol != self.protocol:
            raise BackendError(
                f"{peer.name!r} runs mooncake over {hello.protocol!r}, this endpoint over "
                f"{self.protocol!r}"
            )
        if not hello.session or ":" not in hello.session:
            raise BackendError(f"{peer.name!r} announced a bad mooncake session {hello.session!r}")
        if hello.pool_addr + hello.pool_size > _U64_MAX:
            raise BackendError(f"{peer.name!r} announced a mooncake pool past the address space")
        self._peers[peer.key] = hello

    async def disconnect(self, peer: PeerInfo) -> None:
        """Forget the peer: its references no longer open, open reads of it fail.

        Buffers the endpoint still holds for it are left to ``free``/``close``, which
        the endpoint always calls: freeing them here could hand a slot to another
        object while a pack still writes into it or a zero-copy view still reads it.
        """
        self._peers.pop(peer.key, None)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # reads in flight write into our memory: let them finish (they are bounded
        # by the read timeout) before anything is unregistered or unmapped
        while self._busy:
            await self._idle.wait()
        if self._releaser is not None:
            await anyio.to_thread.run_sync(functools.partial(self._releaser.shutdown, wait=True))
            self._releaser = None
        regions = [lease.region for lease in self._leases]
        regions += [h.region for h in self._inbound if h.region is not None]
        dedicated = [r for r in {*regions, *self._dedicated} if not r.pooled]
        self._leases.clear()
        self._inbound.clear()
        self._dedicated.clear()
        self._peers.clear()
        engine, self._engine = self._engine, None
        pool, self._pool = self._pool, None
        pool_mm, self._pool_mm = self._pool_mm, None
        self._alloc = None
        quarantined, self._quarantined = self._quarantined, []

        def teardown() -> None:
            if engine is not None:
                for region in [*dedicated, *(r for r in quarantined if not r.pooled)]:
                    with contextlib.suppress(BackendError):
                        engine.unregister(region.addr)
                if pool is not None:
                    with contextlib.suppress(BackendError):
                        engine.unregister(pool.addr)
            # The engine stays (shared, see the module docstring): a peer may still be
            # reading from this memory through it, or an abandoned read of ours land in
            # it, so it is emptied and retired rather than unmapped.
            for region in [*dedicated, *quarantined]:
                region.view = torch.empty(0, dtype=torch.uint8)
                mm, region.mm = region.mm, None
                if mm is not None:
                    _retire(mm)
            if pool is not None:
                pool.view = torch.empty(0, dtype=torch.uint8)
            if pool_mm is not None:
                _retire(pool_mm)

        await anyio.to_thread.run_sync(teardown)

    def stats(self) -> dict[str, int]:
        return {
            "leases": len(self._leases),
            "open": len(self._inbound),
            "dedicated_buffers": len(self._dedicated),
            "pool_bytes_in_use": self._alloc.bytes_in_use if self._alloc is not None else 0,
            "quarantined": len(self._quarantined),
            "reads_in_flight": self._busy,
            **self._counters,
        }

    # -- memory ------------------------------------------------------------------------

    def _check_open(self) -> _Engine:
        if self._closed:
            raise BackendClosedError("mooncake backend is closed")
        if self._engine is None:
            raise BackendError("mooncake backend was not started")
        return self._engine

    async def _take_region(self, nbytes: int, purpose: str) -> _Region:
        """A registered region of at least ``nbytes``: a pool slot, else a dedicated buffer."""
        engine = self._check_open()
        pool, alloc = self._pool, self._alloc
        if pool is not None and alloc is not None:
            offset = alloc.allocate(max(nbytes, 1))
            if offset is not None:
                return _Region(
                    pool.addr + offset, nbytes, pool.view[offset : offset + nbytes], offset=offset
                )
        if not self._warned_dedicated:
            self._warned_dedicated = True
            log.info(
                "mooncake pool (%s) has no free slot for %s (%s): using a dedicated registered "
                "buffer; raise backend_options['mooncake']['pool_size'] if this is common",
                _mib(self.pool_size),
                _mib(nbytes),
                purpose,
            )
        size = max(nbytes, 1)

        def make() -> _Region:
            mm, view = _map(size)
            addr = view.data_ptr()
            try:
                engine.register(addr, size)
            except BaseException:
                del view
                _unmap(mm)
                raise
            return _Region(addr, nbytes, view[:nbytes], mm=mm)

        region = await anyio.to_thread.run_sync(make)
        if self._closed:  # closed meanwhile: aclose did not see it
            self._release_dedicated(engine, region)
            raise BackendClosedError("mooncake backend is closed")
        self._dedicated.add(region)
        self._counters["dedicated_allocs"] += 1
        return region

    def _give_back(self, region: _Region) -> None:
        """Return a region: a slot to the allocator, a dedicated buffer to the releaser."""
        if region.pooled:
            if self._alloc is not None and not self._closed:
                self._alloc.free(region.offset)
            return
        if region not in self._dedicated or self._engine is None:
            return
        self._dedicated.discard(region)
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(1, thread_name_prefix="omniwire-mooncake")
        self._releaser.submit(self._release_dedicated, self._engine, region)

    def _release_dedicated(self, engine: _Engine, region: _Region) -> None:
        """Unregister a dedicated buffer and give its pages back (worker thread)."""
        try:
            engine.unregister(region.addr)
        except BackendError as exc:
            log.warning("%s", exc)
        region.view = torch.empty(0, dtype=torch.uint8)
        mm, region.mm = region.mm, None
        if mm is not None:
            _retire(mm)

    # -- sender ------------------------------------------------------------------------

    async def allocate(self, peer: PeerInfo, nbytes: int, device: str) -> OutboundBuffer:
        self._check_open()
        region = await self._take_region(nbytes, f"an object to {peer.name!r}")
        lease = _Lease(peer.key, region)
        self._leases.add(lease)
        return OutboundBuffer(peer, nbytes, region.view[:nbytes], lease)

    def describe(self, out: OutboundBuffer) -> bytes:
        lease: _Lease = out.handle
        engine = self._engine
        if lease not in self._leases or engine is None:
            raise BackendError("mooncake: describe() of a buffer that was freed")
        region = lease.region
        if region.pooled:
            return _encoder.encode(_Ref(engine.session, region.offset, out.nbytes))
        return _encoder.encode(_Ref(engine.session, 0, out.nbytes, dedicated=region.addr))

    def free(self, out: OutboundBuffer) -> None:
        lease: _Lease | None = out.handle
        if lease is None or lease not in self._leases:
            return
        self._leases.discard(lease)
        out.buffer = None
        self._give_back(lease.region)

    # -- receiver ----------------------------------------------------------------------

    async def open(self, peer: PeerInfo, info: bytes, nbytes: int) -> InboundBuffer:
        self._check_open()
        hello = self._peers.get(peer.key)
        if hello is None:
            raise BackendError(f"{peer.name!r} did not announce mooncake in its Hello")
        try:
            ref = _ref_decoder.decode(info)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError(f"malformed mooncake reference from {peer.name!r}: {exc}") from None
        if ref.session != hello.session:
            raise BackendError(
                f"mooncake reference from {peer.name!r} names session {ref.session[:80]!r}, "
                f"not its own ({hello.session})"
            )
        if ref.length != nbytes:
            raise BackendError(
                f"mooncake reference from {peer.name!r} has length {ref.length} != {nbytes}"
            )
        if ref.dedicated == 0:
            if ref.offset + ref.length > hello.pool_size:
                raise BackendError(
                    f"mooncake reference from {peer.name!r} spans [{ref.offset}, "
                    f"{ref.offset + ref.length}) outside its {hello.pool_size}-byte pool"
                )
            remote = hello.pool_addr + ref.offset
        else:
            pool_lo, pool_hi = hello.pool_addr, hello.pool_addr + hello.pool_size
            end = ref.dedicated + ref.length
            if ref.offset != 0 or end > _U64_MAX or (ref.dedicated < pool_hi and end > pool_lo):
                raise BackendError(
                    f"mooncake reference from {peer.name!r} names a dedicated buffer "
                    f"[0x{ref.dedicated:x}, 0x{end:x}) + {ref.offset} that is not a buffer of "
                    "its own outside its pool"
                )
            remote = ref.dedicated
        handle = _Inbound(peer.key, peer.name, ref.session, remote, nbytes)
        self._inbound.add(handle)
        inb = InboundBuffer(peer, nbytes, handle=handle)
        if nbytes == 0:
            inb.buffer = torch.empty(0, dtype=torch.uint8)
        return inb

    async def fetch(
        self, inb: InboundBuffer, lo: int, hi: int, dest: torch.Tensor | None = None
    ) -> None:
        engine = self._check_open()
        h: _Inbound | None = inb.handle
        if h is None or h.closed:
            raise BackendError("mooncake: fetch() on a closed reference")
        if h.key not in self._peers:
            raise BackendError(f"mooncake: {h.peer_name!r} is gone (disconnected)")
        if not 0 <= lo <= hi <= h.length:
            raise BackendError(f"mooncake: range [{lo}, {hi}) outside a {h.length}-byte object")
        if hi == lo:
            return
        n = hi - lo
        remote = h.remote + lo
        timeout = self.timeout + n / 100e6
        direct = (
            dest is not None
            and self.register_dest
            and dest.device.type == "cpu"
            and dest.dtype == torch.uint8
            and dest.dim() == 1
            and dest.is_contiguous()
            and dest.numel() >= hi
        )
        h.busy += 1
        self._enter()
        try:
            if direct:
                assert dest is not None
                local = dest[lo:hi].data_ptr()
                await self._read(engine, h, local, remote, n, lo, hi, timeout, register=True)
            else:
                if h.region is None:
                    h.region = await self._take_region(h.length, f"an object from {h.peer_name!r}")
                    inb.buffer = h.region.view[: h.length]
                region = h.region
                try:
                    await self._read(engine, h, region.addr + lo, remote, n, lo, hi, timeout)
                except TimeoutError:
                    h.region = None  # never reused: the read may still land in it
                    self._quarantine(region)
                    raise
                if dest is not None:
                    await copy_range(dest, region.view, lo, hi)
        except TimeoutError as exc:
            raise BackendError(f"{exc} (peer {h.peer_name!r}, bytes [{lo}, {hi}))") from None
        finally:
            h.busy -= 1
            self._leave()
            self._release_if_done(h)  # close() may have run meanwhile
        self._counters["reads"] += 1
        self._counters["bytes_read"] += n

    async def _read(
        self,
        engine: _Engine,
        h: _Inbound,
        local: int,
        remote: int,
        n: int,
        lo: int,
        hi: int,
        timeout: float,
        *,
        register: bool = False,
    ) -> None:
        def run() -> None:
            if register:
                engine.register(local, n)
            try:
                engine.read(h.session, local, remote, n, timeout)
            finally:
                if register:
                    engine.unregister(local)

        try:
            await anyio.to_thread.run_sync(run)
        except BackendError as exc:
            raise BackendError(
                f"{exc} (peer {h.peer_name!r}, bytes [{lo}, {hi}) of a {h.length}-byte object)"
            ) from None

    def _enter(self) -> None:
        if self._busy == 0:
            self._idle = anyio.Event()
        self._busy += 1

    def _leave(self) -> None:
        self._busy -= 1
        if self._busy == 0:
            self._idle.set()

    def _quarantine(self, region: _Region) -> None:
        self._dedicated.discard(region)
        self._quarantined.append(region)
        log.warning(
            "mooncake: a read into %s was abandoned; the buffer is kept until the backend closes",
            _mib(region.size),
        )

    def _release_if_done(self, h: _Inbound) -> None:
        if h.closed and not h.busy:
            region, h.region = h.region, None
            if region is not None:
                self._give_back(region)

    def close(self, inb: InboundBuffer) -> None:
        h: _Inbound | None = inb.handle
        if h is None:
            return
        inb.handle = None
        inb.buffer = None
        self._inbound.discard(h)
        h.closed = True
        self._release_if_done(h)


# -- the bare engine, for `omniwire bench` -------------------------------------------------


def _pattern(n: int) -> torch.Tensor:
    return torch.arange(251, dtype=torch.uint8).repeat(n // 251 + 1)[:n]


def _serve(size: int, host: str, protocol: str) -> int:
    """Child of :func:`raw_bench`: register ``size`` bytes, print where, wait for EOF."""
    engine = _Engine(host, protocol, "")
    _mm, view = _map(size)
    view.copy_(_pattern(size))
    engine.register(view.data_ptr(), size)
    print(f"READY {engine.session} {view.data_ptr()}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    engine.unregister(view.data_ptr())
    sys.stdout.flush()
    os._exit(0)  # stopping the engine would take a second; the OS reclaims it all


def raw_bench(
    sizes: Sequence[int], iters: int, *, host: str = "127.0.0.1", protocol: str = "tcp"
) -> dict[int, float]:
    """GB/s of the bare engine reading ``size`` bytes from another process (median).

    Same operation as the backend (one ``batch_transfer_async_read`` per transfer,
    status polled in this thread), between buffers registered once, no omniwire.

    Raises:
        BackendError: the engine failed. RuntimeError: the other process failed.
    """
    if not sizes:
        return {}
    biggest = max(sizes)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            MODULE,
            "serve",
            "--size",
            str(biggest),
            "--host",
            host,
            "--protocol",
            protocol,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdin is not None and proc.stdout is not None
    results: dict[int, float] = {}
    mm: mmap.mmap | None = None
    try:
        line = proc.stdout.readline().split()
        if len(line) != 3 or line[0] != "READY":
            raise RuntimeError(f"mooncake bench peer did not start (said {line!r})")
        session, remote = line[1], int(line[2])
        engine = _shared_engine(host, protocol, "")
        mm, view = _map(biggest)
        local = view.data_ptr()
        expected = _pattern(biggest)
        engine.register(local, biggest)
        try:
            for size in sizes:
                times = []
                for i in range(max(1, iters) + 1):
                    start = time.perf_counter()
                    engine.read(session, local, remote, size, 60.0 + size / 100e6)
                    if i:  # the first one is a warm-up
                        times.append(time.perf_counter() - start)
                if not torch.equal(view[:size], expected[:size]):
                    raise BackendError(f"mooncake raw bench: {size} bytes arrived corrupted")
                view[:size].zero_()
                results[size] = size / statistics.median(times) / 1e9
        finally:
            engine.unregister(local)
            del view, expected
    finally:
        proc.stdin.close()
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        proc.stdout.close()
        if mm is not None:
            _unmap(mm)
    if code != 0:
        raise RuntimeError(f"mooncake bench peer exited with {code}")
    return results


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    for suffix, scale in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * scale)
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="the other process of raw_bench")
    serve.add_argument("--size", type=int, required=True)
    bench = sub.add_parser("bench", help="the bare engine's throughput between two processes")
    bench.add_argument("--sizes", default="1M,64M")
    bench.add_argument("--iters", type=int, default=10)
    for p in (serve, bench):
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--protocol", default="tcp")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args.size, args.host, args.protocol)
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    for size, gbps in raw_bench(sizes, args.iters, host=args.host, protocol=args.protocol).items():
        print(f"{size:>12} B  {gbps:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
