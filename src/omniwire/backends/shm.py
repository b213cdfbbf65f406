"""``shm``: POSIX shared memory between processes of one host.

Each sending endpoint owns one **arena**: a segment in /dev/shm created once
(space reserved with ``posix_fallocate`` so a full /dev/shm is a clear
``ShmFullError``, never a SIGBUS), pre-faulted (``MAP_POPULATE``), and carved
into reusable slots by a buddy allocator. Packing writes straight into a slot;
the receiver maps the arena once and reads views of the slot. An object that
does not fit in the free part of the arena gets a dedicated segment, unlinked
when it is acknowledged.

Ownership (as in ``multiprocessing.shared_memory``, but without its resource
tracker): the creator owns a segment, holds an exclusive ``flock`` on it for its
lifetime, and unlinks it exactly once. Readers only map and unmap.

Segments are named ``omniwire-<pid>-<token>-<n>``. A segment whose owner died
(its pid is gone and its ``flock`` can be taken) is swept by the next endpoint
that starts, and by the peer that mapped it when that peer closes or sees the
owner die — so nothing is left in /dev/shm after a SIGKILL.

Hello info (``BackendInfo.info``): msgpack ``{"prefix": "omniwire-<pid>-<token>"}``.
Reference (``BackendRef.info``): msgpack ``{"segment": str, "offset": u64, "size": u64,
"dedicated": bool}``; a dedicated segment is unmapped by the reader right after use.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
from typing import ClassVar

import anyio
import msgspec
import numpy as np
import torch

from ..alloc import BuddyAllocator
from ..errors import BackendClosedError, BackendError, ShmFullError
from ..hostinfo import pid_alive
from .base import (
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    Export,
    Import,
    Locality,
    PeerInfo,
)

__all__ = ["Segment", "ShmBackend", "sweep_stale_segments"]

log = logging.getLogger("omniwire.shm")

SHM_DIR = "/dev/shm"
PREFIX = "omniwire-"
_NAME = re.compile(r"^omniwire-(\d+)-([0-9a-f]{8,32})-(\d+)$")
_PREFIX = re.compile(r"^omniwire-(\d+)-([0-9a-f]{8,32})$")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class _HelloInfo(msgspec.Struct, frozen=True):
    prefix: str


class _Ref(msgspec.Struct, frozen=True):
    segment: str
    offset: int
    size: int
    dedicated: bool = False


_hello_decoder = msgspec.msgpack.Decoder(_HelloInfo)
_ref_decoder = msgspec.msgpack.Decoder(_Ref)
_encoder = msgspec.msgpack.Encoder()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Segment:
    """One mapped shared-memory segment. ``base`` is a uint8 tensor over all of it."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, fd: int | None) -> None:
        self.name = name
        self.size = size
        self._mm: mmap.mmap | None = mm
        self._fd = fd  # kept open by the owner: it holds the flock
        # Through numpy, not torch.frombuffer: a numpy array holds a buffer export, so
        # the mapping cannot be closed under a live view (torch.frombuffer holds none,
        # and closing would unmap memory that zero-copy tensors still point at).
        self.base = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        self.unlinked = False

    @classmethod
    def create(cls, name: str, size: int, directory: str = SHM_DIR) -> Segment:
        """Create, reserve and pre-fault a segment this process owns.

        Raises:
            ShmFullError: /dev/shm has no room for ``size`` bytes.
            BackendError: any other OS error.
        """
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    free = _free_bytes(directory)
                    raise ShmFullError(
                        f"{directory} has no room for a {_mib(size)} shared-memory segment "
                        f"({_mib(free)} free): enlarge {directory} or lower the shm "
                        "backend's arena_size"
                    ) from exc
                raise
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        except BaseException as exc:
            os.close(fd)
            _unlink_quietly(path)
            if isinstance(exc, OSError):
                raise BackendError(f"cannot create shared memory {path}: {exc}") from exc
            raise
        return cls(name, size, mm, fd)

    @classmethod
    def attach(cls, name: str, directory: str = SHM_DIR) -> Segment:
        """Map an existing segment owned by another process.

        Raises:
            BackendError: it does not exist or cannot be mapped.
        """
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise BackendError(f"cannot open shared memory {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE) if size else None
        except OSError as exc:
            raise BackendError(f"cannot map shared memory {path}: {exc}") from exc
        finally:
            os.close(fd)
        if mm is None:
            raise BackendError(f"shared memory {path} is empty")
        return cls(name, size, mm, None)

    def view(self, offset: int, length: int) -> torch.Tensor:
        return self.base[offset : offset + length]

    def close(self) -> None:
        """Unmap (now if no view is alive, else when the last view is collected)."""
        self.base = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            # If zero-copy views are still alive this fails; the GC unmaps later.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def unlink(self, directory: str = SHM_DIR) -> None:
        """Remove the name (owner only, once). Mappings stay valid until closed."""
        if not self.unlinked:
            self.unlinked = True
            _unlink_quietly(os.path.join(directory, self.name))


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _owner_dead(path: str, pid: int) -> bool:
    """True if the segment's creator is gone: its pid is dead and nobody holds its lock."""
    if pid == os.getpid() or pid_alive(pid):
        return False
    try:  # O_NONBLOCK: a ring's doorbell is a FIFO, which would block a plain open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # locked: the owner lives (e.g. in another PID namespace)
    finally:
        os.close(fd)
    return True


def sweep_stale_segments(directory: str = SHM_DIR, names: set[str] | None = None) -> list[str]:
    """Unlink omniwire segments whose owner process is dead. Returns the names removed.

    ``names`` limits the sweep to those segments (a peer's, say); by default every
    ``omniwire-*`` segment in ``directory`` is checked.
    """
    removed: list[str] = []
    try:
        candidates = names if names is not None else set(os.listdir(directory))
    except OSError:
        return removed
    for name in candidates:
        m = _NAME.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        if _owner_dead(path, int(m.group(1))):
            _unlink_quietly(path)
            removed.append(name)
    if removed:
        log.info("swept %d stale shared-memory segment(s) of dead processes", len(removed))
    return removed


class _ShmExport(Export):
    """A slot of the arena, or a dedicated segment, until the peer's ACK."""

    def __init__(
        self, backend: ShmBackend, segment: Segment, offset: int, nbytes: int, dedicated: bool
    ) -> None:
        super().__init__(backend, nbytes, segment.view(offset, nbytes))
        self.shm = backend
        self.segment = segment
        self.offset = offset
        self.dedicated = dedicated

    @property
    def ref(self) -> bytes:
        return _encoder.encode(_Ref(self.segment.name, self.offset, self.nbytes, self.dedicated))

    def _release(self) -> None:
        self.shm._free(self)


class _ShmImport(Import):
    """A view of the sender's segment (mapped once per segment and peer)."""

    def __init__(
        self, backend: ShmBackend, peer: PeerInfo, nbytes: int, view: torch.Tensor, ref: _Ref
    ) -> None:
        super().__init__(backend, peer, nbytes, buffer=view)
        self.shm = backend
        self.ref = ref

    def _close(self) -> None:
        if self.ref.dedicated:  # used once: unmap now (views alive keep it until collected)
            seg = self.shm._mapped.get(self.peer.key, {}).pop(self.ref.segment, None)
            if seg is not None:
                seg.close()


class ShmBackend(ByteBackend):
    """Options (``backend_options={"shm": {...}}``): ``arena_size`` (bytes, default
    64 MiB), ``directory`` (default /dev/shm), ``arena_wait`` (seconds an object that
    fits the arena waits for a free slot before it gets a dedicated segment, default 1).

    An object larger than the arena always gets a dedicated segment. One that fits
    but finds the arena full waits for ACKs to free a slot (warm memory beats a
    fresh segment, which page-faults at a fraction of memcpy speed).
    """

    name: ClassVar[str] = "shm"
    summary: ClassVar[str] = "POSIX shared memory, one pre-faulted arena per sender"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu"}),
        localities=frozenset({Locality.SAME_PROCESS, Locality.SAME_HOST}),
        progressive=True,
        zero_copy=True,
        mapped=True,
        shared_refs=True,
        preference=80,
    )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.arena_size = int(ctx.options.get("arena_size", 64 << 20))
        self.directory = str(ctx.options.get("directory", SHM_DIR))
        self.arena_wait = float(ctx.options.get("arena_wait", 1.0))
        self._freed = anyio.Event()
        self.prefix = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._seq = itertools.count()
        self._arena: Segment | None = None
        self._alloc: BuddyAllocator | None = None
        self._arena_lock = anyio.Lock()
        self._dedicated: dict[str, Segment] = {}
        # receiver side: peer key -> its arena; every segment name we have mapped
        self._mapped: dict[tuple[str, int], dict[str, Segment]] = {}
        self._prefixes: dict[tuple[str, int], str] = {}
        self._closed = False
        self._warned_dedicated = False
        self._arena_error = ""

    @classmethod
    def availability(cls) -> Availability:
        if not os.path.isdir(SHM_DIR):
            return Availability.missing(f"{SHM_DIR} does not exist on this system")
        return Availability.ok()

    async def start(self) -> None:
        sweep_stale_segments(self.directory)

    def hello(self) -> bytes:
        return _encoder.encode(_HelloInfo(self.prefix))

    def accepts(self, peer: PeerInfo) -> str | None:
        try:
            prefix = _hello_decoder.decode(peer.info).prefix
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return f"malformed shm hello info: {exc}"
        # A peer may only claim segments of its own process (spec §9.2): the prefix
        # carries its pid, and no other live peer holds the same prefix.
        m = _PREFIX.match(prefix)
        if m is None or int(m.group(1)) != peer.pid:
            return f"shm prefix {prefix[:80]!r} is not 'omniwire-{peer.pid}-<hex>' (its own pid)"
        if prefix == self.prefix or any(
            p == prefix and key[0] != peer.name for key, p in self._prefixes.items()
        ):
            return f"shm prefix {prefix!r} is already held by another endpoint"
        return None

    async def connect(self, peer: PeerInfo) -> None:
        why = self.accepts(peer)
        if why is not None:
            raise BackendError(f"{peer.name!r}: {why}")
        prefix = _hello_decoder.decode(peer.info).prefix
        self._prefixes[peer.key] = prefix
        if peer.locality is not Locality.CROSS_HOST and not self._closed:
            await self._ensure_arena()  # first same-host peer: fault the arena in now

    async def _ensure_arena(self) -> None:
        """Create the arena once. If /dev/shm has no room for it, say so once and carry
        on with dedicated segments (each of which fails with ShmFullError if it, too,
        does not fit)."""
        if self._arena is not None or self.arena_size <= 0 or self._arena_error:
            return
        async with self._arena_lock:
            if self._arena is None and not self._arena_error:
                name = f"{self.prefix}-{next(self._seq)}"
                try:
                    arena = await anyio.to_thread.run_sync(
                        Segment.create, name, self.arena_size, self.directory
                    )
                except ShmFullError as exc:
                    self._arena_error = str(exc)
                    log.warning("shm arena not created: %s; using per-object segments", exc)
                    return
                self._alloc = BuddyAllocator(arena.size, min_block=4096)
                self._arena = arena

    # -- sender --------------------------------------------------------------------

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        if self._closed:
            raise BackendClosedError("shm backend is closed")
        await self._ensure_arena()
        offset = await self._arena_slot(nbytes)
        if offset is not None and self._arena is not None:
            return _ShmExport(self, self._arena, offset, nbytes, dedicated=False)
        if not self._warned_dedicated:
            self._warned_dedicated = True
            log.info(
                "shm arena (%s) has no free slot for %s: using a dedicated segment; "
                "raise backend_options['shm']['arena_size'] if this is common",
                _mib(self.arena_size),
                _mib(nbytes),
            )
        name = f"{self.prefix}-{next(self._seq)}"
        seg = await anyio.to_thread.run_sync(Segment.create, name, max(nbytes, 1), self.directory)
        self._dedicated[name] = seg
        return _ShmExport(self, seg, 0, nbytes, dedicated=True)

    async def _arena_slot(self, nbytes: int) -> int | None:
        """A slot of the arena, waiting up to ``arena_wait`` for one to be freed."""
        alloc = self._alloc
        if alloc is None or alloc.block_size(max(nbytes, 1)) > alloc.capacity:
            return None
        offset = alloc.allocate(max(nbytes, 1))
        if offset is not None:
            return offset
        with anyio.move_on_after(self.arena_wait):
            while True:
                offset = alloc.allocate(max(nbytes, 1))
                if offset is not None or self._closed:
                    return offset
                self._freed = anyio.Event()
                await self._freed.wait()
        return None

    def _free(self, exp: _ShmExport) -> None:
        if exp.dedicated:
            seg = self._dedicated.pop(exp.segment.name, None)
            if seg is not None:
                seg.unlink(self.directory)
                seg.close()
        elif self._alloc is not None and not self._closed:
            self._alloc.free(exp.offset)
            self._freed.set()

    # -- receiver ----------------------------------------------------------------------

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        if self._closed:
            raise BackendClosedError("shm backend is closed")
        prefix = self._prefixes.get(peer.key)
        if prefix is None:
            raise BackendError(f"{peer.name!r} did not announce shm in its Hello")
        try:
            r = _ref_decoder.decode(ref)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError(f"malformed shm reference from {peer.name!r}: {exc}") from None
        if not _NAME.match(r.segment) or not r.segment.startswith(prefix + "-"):
            raise BackendError(
                f"shm reference from {peer.name!r} names segment {r.segment[:80]!r}, "
                "which is not one of its own"
            )
        if r.size != nbytes or r.offset < 0:
            raise BackendError(f"shm reference from {peer.name!r} has size {r.size} != {nbytes}")
        segments = self._mapped.setdefault(peer.key, {})
        seg = segments.get(r.segment)
        if seg is None:
            seg = await anyio.to_thread.run_sync(Segment.attach, r.segment, self.directory)
            segments[r.segment] = seg
        if r.offset + r.size > seg.size:
            raise BackendError(
                f"shm reference from {peer.name!r} spans [{r.offset}, {r.offset + r.size}) "
                f"outside segment {r.segment} of {seg.size} bytes"
            )
        return _ShmImport(self, peer, nbytes, seg.view(r.offset, r.size), r)

    async def disconnect(self, peer: PeerInfo) -> None:
        for seg in self._mapped.pop(peer.key, {}).values():
            seg.close()
        prefix = self._prefixes.pop(peer.key, None)
        if prefix is not None:  # if the peer died, nobody else will unlink its segments
            self._sweep_prefix(prefix)

    def _sweep_prefix(self, prefix: str) -> None:
        try:
            names = {n for n in os.listdir(self.directory) if n.startswith(prefix + "-")}
        except OSError:
            return
        if names:
            sweep_stale_segments(self.directory, names)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for segments in self._mapped.values():
            for seg in segments.values():
                seg.close()
        self._mapped.clear()
        for prefix in self._prefixes.values():
            self._sweep_prefix(prefix)
        self._prefixes.clear()
        for seg in self._dedicated.values():
            seg.unlink(self.directory)
            seg.close()
        self._dedicated.clear()
        if self._arena is not None:
            self._arena.unlink(self.directory)
            self._arena.close()
            self._arena = None

    def detail(self) -> dict[str, int]:
        return {
            "dedicated_segments": len(self._dedicated),
            "arena_bytes_in_use": self._alloc.bytes_in_use if self._alloc else 0,
        }
