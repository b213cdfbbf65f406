"""``shm``: POSIX shared memory between processes of one host.

Each sending endpoint owns one **arena**: a segment in /dev/shm created on its
first send (space reserved with ``posix_fallocate`` so a full /dev/shm is a clear
``ShmFullError``, never a SIGBUS), pre-faulted (``MAP_POPULATE``), and carved into
reusable slots by the shared slot pool (:mod:`omniwire.backends.pool`). Packing
writes straight into a slot; the receiver maps the arena once and reads views of
the slot. An endpoint that only receives creates no arena.

Objects over half the arena never wait behind others (a 1 KiB slot anywhere in
the arena would keep them waiting): up to ``large_segments`` extra segments of the
arena's size are made for them on first need, pre-faulted and kept, and the
receiver keeps them mapped like the arena. An object that finds no room either
way — or is larger than the arena — gets a dedicated segment, unlinked when it is
acknowledged.

Ownership (as in ``multiprocessing.shared_memory``, but without its resource
tracker): the creator owns a segment, holds an exclusive ``flock`` on it for its
lifetime, and unlinks it exactly once. Readers only map and unmap.

Segments are named ``omniwire-<pid>-<token>-<n>``. A segment whose owner died
(its pid is gone and its ``flock`` can be taken) is swept by the next endpoint
that starts, and by the peer that mapped it when that peer closes or sees the
owner die — so nothing is left in /dev/shm after a SIGKILL.

Hello info (``BackendInfo.info``): msgpack ``{"prefix": "omniwire-<pid>-<token>"}``.
Reference (``BackendRef.info``): msgpack ``{"segment": str, "offset": u64, "size": u64,
"dedicated": bool}``; a dedicated segment is unmapped by the reader right after use,
any other (the arena, a kept segment for large objects) stays mapped until the
peer is gone.
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

from ..errors import BackendClosedError, BackendError, BadReferenceError, ShmFullError
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
from .pool import Lease, SlotPool
from .support import decode_blob, mib

__all__ = ["Segment", "ShmBackend", "sweep_stale_segments"]

log = logging.getLogger("omniwire.shm")

SHM_DIR = "/dev/shm"
PREFIX = "omniwire-"
_NAME = re.compile(r"^omniwire-(\d+)-([0-9a-f]{8,32})-(\d+)$")
#: A sender's segment prefix (spec §9.2), also the name of a control ring (§3.6).
PREFIX_RE = re.compile(r"^omniwire-(\d+)-([0-9a-f]{8,32})$")
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
                        f"{directory} has no room for a {mib(size)} shared-memory segment "
                        f"({mib(free)} free): enlarge {directory} or lower the shm "
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
    """A slot of the arena, a kept segment, or a dedicated segment, until the peer's ACK."""

    def __init__(self, backend: ShmBackend, lease: Lease[Segment], segment: Segment) -> None:
        offset = max(lease.offset, 0)
        super().__init__(backend, lease.nbytes, segment.view(offset, lease.nbytes))
        self.lease = lease
        self.segment = segment
        self.offset = offset
        self.dedicated = lease.dedicated and not lease.kept  # the reader unmaps it after use

    @property
    def ref(self) -> bytes:
        return _encoder.encode(_Ref(self.segment.name, self.offset, self.nbytes, self.dedicated))

    def _release(self) -> None:
        self.lease.release()


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
    64 MiB), ``directory`` (default /dev/shm), ``arena_wait`` (seconds an object of at
    most half the arena waits for a free slot before it gets a dedicated segment,
    default 1), ``large_segments`` (how many kept segments of the arena's size carry
    objects over half the arena, default 2; 0: a dedicated segment each).

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
        opts = ctx.options
        try:
            self.arena_size = int(opts.get("arena_size", 64 << 20))
            self.directory = str(opts.get("directory", SHM_DIR))
            self.arena_wait = float(opts.get("arena_wait", 1.0))
            large = int(opts.get("large_segments", 2))
        except (TypeError, ValueError) as exc:
            raise BackendError(f"shm: bad options {dict(opts)!r}: {exc}") from None
        self.prefix = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._seq = itertools.count()
        self._arena: Segment | None = None
        self._arena_lock = anyio.Lock()
        self._arena_error = ""
        self.pool: SlotPool[Segment] = SlotPool(
            "shm arena",
            create=self._new_segment,
            destroy=self._drop_segment,
            option="backend_options['shm']['arena_size']",
            keep=max(large, 0),
        )
        # receiver side: peer key -> the segments of it mapped here
        self._mapped: dict[tuple[str, int], dict[str, Segment]] = {}
        self._prefixes: dict[tuple[str, int], str] = {}
        self._closed = False

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
        m = PREFIX_RE.match(prefix)
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

    def _new_segment(self, size: int) -> Segment:
        return Segment.create(f"{self.prefix}-{next(self._seq)}", size, self.directory)

    def _drop_segment(self, seg: Segment) -> None:
        seg.unlink(self.directory)
        seg.close()

    async def _ensure_arena(self) -> None:
        """Create the arena on the first send. If /dev/shm has no room for it, say so
        once and carry on with dedicated segments (each of which fails with
        ShmFullError if it, too, does not fit)."""
        if self._arena is not None or self.arena_size <= 0 or self._arena_error:
            return
        async with self._arena_lock:
            if self._arena is None and not self._arena_error and not self._closed:
                try:
                    arena = await anyio.to_thread.run_sync(self._new_segment, self.arena_size)
                except ShmFullError as exc:
                    self._arena_error = str(exc)
                    log.warning("shm arena not created: %s; using per-object segments", exc)
                    return
                if self.pool.closed:  # closed meanwhile
                    self._drop_segment(arena)
                    return
                self.pool.attach(arena.size)
                self._arena = arena

    # -- sender --------------------------------------------------------------------

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        if self._closed:
            raise BackendClosedError("shm backend is closed")
        await self._ensure_arena()
        lease = await self.pool.take(nbytes, wait=self.arena_wait, purpose=f"to {peer.name!r}")
        segment = lease.buffer if lease.buffer is not None else self._arena
        if segment is None:  # closed meanwhile
            lease.release()
            raise BackendClosedError("shm backend is closed")
        return _ShmExport(self, lease, segment)

    # -- receiver ----------------------------------------------------------------------

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        if self._closed:
            raise BackendClosedError("shm backend is closed")
        prefix = self._prefixes.get(peer.key)
        if prefix is None:
            raise BadReferenceError(f"{peer.name!r} did not announce shm in its Hello")
        r = decode_blob(_ref_decoder, ref, f"shm reference from {peer.name!r}")
        if not _NAME.match(r.segment) or not r.segment.startswith(prefix + "-"):
            raise BadReferenceError(
                f"shm reference from {peer.name!r} names segment {r.segment[:80]!r}, "
                "which is not one of its own"
            )
        if r.size != nbytes or r.offset < 0:
            raise BadReferenceError(
                f"shm reference from {peer.name!r} has size {r.size} != {nbytes}"
            )
        segments = self._mapped.setdefault(peer.key, {})
        seg = segments.get(r.segment)
        if seg is None:
            seg = await anyio.to_thread.run_sync(Segment.attach, r.segment, self.directory)
            segments[r.segment] = seg
        if r.offset + r.size > seg.size:
            raise BadReferenceError(
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
        await self.pool.aclose()
        async with self._arena_lock:
            if self._arena is not None:
                self._drop_segment(self._arena)
                self._arena = None

    def detail(self) -> dict[str, int]:
        return {
            **self.pool.detail("arena_"),
            "mapped_segments": sum(len(m) for m in self._mapped.values()),
        }
