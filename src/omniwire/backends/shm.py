"""``shm``: POSIX shared memory between processes of one host.

Each sending endpoint owns one **arena**: a segment created on its first send
(space reserved with ``posix_fallocate`` so that no memory is a clear
``ShmFullError``, never a SIGBUS), pre-faulted (``MAP_POPULATE``: our own memory),
and carved into reusable slots by the shared slot pool
(:mod:`omniwire.backends.pool`). Packing writes straight into a slot; the receiver
maps the arena once and reads views of the slot. An endpoint that only receives
creates no arena.

Objects over half the arena never wait behind others (a 1 KiB slot anywhere in
the arena would keep them waiting): up to ``large_segments`` extra segments of the
arena's size are made for them on first need, pre-faulted and kept, and the
receiver keeps them mapped like the arena. An object that finds no room either
way — or is larger than the arena — gets a dedicated segment, unlinked when it is
acknowledged.

Sealed segments (spec §9.2; ``sealed=False`` makes 1.1's plain files instead). A
segment is a memfd sealed at its size (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL``), named in /dev/shm by a symlink to ``/proc/<pid>/fd/<n>``. Nobody,
its owner included, can then shrink it, so a receiver's mapping of it can never
fault, whatever the sender does: a peer that truncates what it shares could
otherwise kill the receiving process (SIGBUS), not just its own session. The
receiver opens names only through :func:`._peermem.open_shared`, which follows
that one kind of link to a sealed memfd of the announcing pid and its name, or
opens a plain file with ``O_NOFOLLOW`` — and a plain file (a 1.1 sender's) is
read with ``pread``, never mapped (a truncation is then a short read: a NACK). It
never pre-faults a peer's memory (a sparse segment costs it only what it reads):
a dedicated segment is mapped for the object's range, a long-lived one whole,
once, untouched but for what objects use. Older readers open the link like a file
and map the memfd, so nothing on the wire changes.

Ownership (as in ``multiprocessing.shared_memory``, but without its resource
tracker): the creator owns a segment, holds an exclusive ``flock`` on it for its
lifetime, and unlinks its name exactly once (then closes it). Readers only map
and unmap.

Segments are named ``omniwire-<pid>-<token>-<n>``. A segment whose owner died
(its pid is gone and, for a plain file, its ``flock`` can be taken) is swept by
the next endpoint that starts, and by the peer that mapped it when that peer
closes or sees the owner die — so nothing is left in /dev/shm after a SIGKILL.

Forwarding (spec §9.2 "Forwarding"). A tensor this endpoint received zero-copy —
a view of another process's sealed segment — and sends on with ``lend=True`` goes
by reference: :meth:`_ShmImport.forward` names the memfd this endpoint holds (a
descriptor kept with its mapping) by a link of its own, ``<our prefix>-<n>`` →
``/proc/<our pid>/fd/<dup>``, and the reference says whose memfd it is
(``origin``, the creator's segment name). The endpoint keeps its upstream delivery
unacknowledged until the downstream ACK, so the creator does not reuse the slot
meanwhile. A reader of a forward holds a read lock (an OFD lock, its own open file
description) on the object's bytes while it reads them, and a creator reuses a
slot only once no lock covers it (:func:`~._peermem.range_read_locked`): if the
forwarder dies, the creator's ACK-less release does not hand the slot to a new
object while a reader downstream still reads it. Forward links of a kept segment
live as long as its mapping here; of a dedicated one, as long as its forwards.

Hello info (``BackendInfo.info``): msgpack ``{"prefix": "omniwire-<pid>-<token>",
"forwards": bool}`` (``forwards``: this endpoint reads forwarded references).
Reference (``BackendRef.info``): msgpack ``{"segment": str, "offset": u64, "size": u64,
"dedicated": bool}``, and ``"origin": str`` last for a forward; a dedicated segment
is unmapped by the reader right after use, any other (the arena, a kept segment for
large objects) stays mapped until the peer is gone.
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
import stat
from typing import ClassVar

import anyio
import msgspec
import numpy as np
import torch

from ..errors import BackendClosedError, BackendError, BadReferenceError, ShmFullError
from ..hostinfo import pid_alive
from ._peermem import (
    SEALING,
    SEALS,
    Opened,
    OwnerGoneError,
    open_shared,
    pread_into,
    range_read_locked,
    read_lock,
)
from .base import (
    THREAD_COPY_THRESHOLD,
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    Export,
    Import,
    Locality,
    PeerInfo,
    in_parts,
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
    """The Hello info of 1.1 (what a reader that does not read forwards writes)."""

    prefix: str


class _Hello(_HelloInfo, frozen=True):
    """The Hello info as omniwire writes it: ``forwards`` last (default false)."""

    forwards: bool = False


class _Ref(msgspec.Struct, frozen=True):
    segment: str
    offset: int
    size: int
    dedicated: bool = False


class _ForwardRef(_Ref, frozen=True):
    """A reference with ``origin`` (a forward's), or read with it defaulting to ``""``."""

    origin: str = ""


_hello_decoder = msgspec.msgpack.Decoder(_HelloInfo)  # the 1.1 forms (vectors)
_ref_decoder = msgspec.msgpack.Decoder(_Ref)
_forwards_hello_decoder = msgspec.msgpack.Decoder(_Hello)  # what a reader reads
_forward_ref_decoder = msgspec.msgpack.Decoder(_ForwardRef)
_encoder = msgspec.msgpack.Encoder()


class Segment:
    """One mapped shared-memory segment. ``base`` is a uint8 tensor over the mapping,
    which starts at byte ``start`` of the segment (0 unless a range was mapped)."""

    def __init__(
        self,
        name: str,
        size: int,
        mm: mmap.mmap,
        fd: int | None,
        start: int = 0,
        *,
        sealed: bool = False,
        origin: str = "",
    ) -> None:
        self.name = name
        self.size = size
        self.start = start
        #: A memfd whose size cannot change (a creator's sealed segment, or any mapped one).
        self.sealed = sealed
        #: The memfd's name, given by its creator (``name`` unless it came by a forward).
        self.origin = origin or name
        self._mm: mmap.mmap | None = mm
        self._fd = fd  # kept open by the owner: the memfd itself, or the flock
        # Through numpy, not torch.frombuffer: a numpy array holds a buffer export, so
        # the mapping cannot be closed under a live view (torch.frombuffer holds none,
        # and closing would unmap memory that zero-copy tensors still point at).
        self.base = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        self.unlinked = False

    @classmethod
    def create(
        cls, name: str, size: int, directory: str = SHM_DIR, *, sealed: bool = True
    ) -> Segment:
        """Create, reserve and pre-fault a segment this process owns.

        ``sealed`` (the default): a memfd sealed at its size (``F_SEAL_SHRINK |
        F_SEAL_GROW | F_SEAL_SEAL``), named ``name`` by a symlink in ``directory`` to
        ``/proc/<pid>/fd/<n>``; else a plain file ``name`` there (1.1's segments).

        Raises:
            ShmFullError: ``directory`` has no room for ``size`` bytes (a sealed
                segment is not charged to it, but may not exceed its free space).
            BackendError: any other OS error.
        """
        path = os.path.join(directory, name)
        if sealed and size > _free_bytes(directory):
            raise _full(directory, size)
        fd, named = -1, False
        try:
            if sealed:
                fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.fchmod(fd, 0o600)  # a memfd starts 0777: only our uid may reopen it
                os.ftruncate(fd, size)
            else:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                named = True
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the owner lives (§9.2)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise _full(directory, size) from exc
                raise
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
            if sealed:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
                os.symlink(f"/proc/{os.getpid()}/fd/{fd}", path)
                named = True
        except BaseException as exc:
            if fd >= 0:
                os.close(fd)
            if named:
                _unlink_quietly(path)
            if isinstance(exc, OSError):
                raise BackendError(f"cannot create shared memory {path}: {exc}") from exc
            raise
        return cls(name, size, mm, fd, sealed=sealed)

    @classmethod
    def map(cls, opened: Opened, offset: int = 0, length: int | None = None) -> Segment:
        """Map bytes ``[offset, offset + length)`` (default: all) of a sealed segment
        opened by :func:`open_shared`, read-write, page-aligned, not pre-faulted: only
        the pages the reader touches are ever allocated. The descriptor stays the
        caller's; the segment keeps a duplicate (to forward it, and to hold ranges).

        Raises:
            BackendError: the range cannot be mapped.
        """
        assert opened.sealed, "only a sealed segment may be mapped: its size cannot change"
        end = opened.size if length is None else offset + length
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        stop = min(-(-max(end, start + 1) // mmap.PAGESIZE) * mmap.PAGESIZE, opened.size)
        try:
            mm = mmap.mmap(opened.fd, stop - start, flags=mmap.MAP_SHARED, offset=start)
            fd = os.dup(opened.fd)
        except (OSError, ValueError, OverflowError) as exc:
            raise BackendError(f"cannot map shared memory {opened.name}: {exc}") from exc
        return cls(opened.name, opened.size, mm, fd, start, sealed=True, origin=opened.memfd)

    @property
    def fd(self) -> int | None:
        """The descriptor kept open with the mapping (None once closed)."""
        return self._fd

    @classmethod
    def attach(cls, name: str, directory: str = SHM_DIR) -> Segment:
        """Map, whole and read-write, the sealed segment ``name`` of the process whose
        pid it carries, checked by :func:`~._peermem.open_shared` (for tests and
        tools; receivers map only what a reference names).

        Raises:
            BadReferenceError: it is not a sealed segment of that process.
            BackendError: it does not exist or cannot be mapped.
        """
        m = _NAME.match(name)
        if m is None:
            raise BadReferenceError(f"{name[:80]!r} is not an omniwire segment name")
        opened = open_shared(directory, name, int(m.group(1)), write=True)
        try:
            if not opened.sealed:
                raise BadReferenceError(f"{name} is not sealed: read it, do not map it")
            return cls.map(opened)
        finally:
            opened.close()

    def view(self, offset: int, length: int) -> torch.Tensor:
        at = offset - self.start
        return self.base[at : at + length]

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
        """Remove the name (owner only, once, before :meth:`close`: a sealed
        segment's name points at the descriptor). Mappings stay valid until closed."""
        if not self.unlinked:
            self.unlinked = True
            _unlink_quietly(os.path.join(directory, self.name))


def _full(directory: str, size: int) -> ShmFullError:
    return ShmFullError(
        f"{directory} has no room for a {mib(size)} shared-memory segment "
        f"({mib(_free_bytes(directory))} free): enlarge {directory} or lower the shm "
        "backend's arena_size"
    )


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
    with contextlib.suppress(OSError):
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return True  # a sealed segment's name: its memfd died with its process
    try:  # O_NONBLOCK: a ring's doorbell is a FIFO, which would block a plain open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
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
        fd = self.segment.fd
        if (
            not self.dedicated
            and self.segment.sealed
            and fd is not None
            and range_read_locked(fd, self.offset, self.nbytes)
        ):
            # A reader of a forward of it still reads it (its forwarder is gone: an
            # ACK would have waited for that reader). Reuse it once the lock is gone.
            log.info(
                "shm: a forward's reader still holds %s at %d of %s: kept out of use "
                "until it lets go",
                mib(self.nbytes),
                self.offset,
                self.segment.name,
            )
            self.lease.release_when(
                lambda: (
                    self.segment.fd is None
                    or not range_read_locked(self.segment.fd, self.offset, self.nbytes)
                )
            )
            return
        self.lease.release()


class _Link:
    """A name of ours for a memfd another omniwire process made and we hold (a
    forward): ``/dev/shm/<our prefix>-<n>`` → ``/proc/<our pid>/fd/<fd>``."""

    __slots__ = ("dedicated", "dropped", "fd", "key", "name", "origin", "users")

    def __init__(self, key: object, name: str, fd: int, origin: str, dedicated: bool) -> None:
        self.key = key
        self.name = name
        self.fd = fd
        self.origin = origin
        self.dedicated = dedicated
        self.users = 0
        self.dropped = dedicated  # a dedicated one goes with its last forward


class _ForwardExport(Export):
    """Bytes of a segment another process made, forwarded by reference through one
    of our links (no buffer: nothing is packed). Released at the downstream ACK."""

    def __init__(self, backend: ShmBackend, link: _Link, offset: int, nbytes: int) -> None:
        super().__init__(backend, nbytes, None)
        self._shm = backend
        self.link = link
        self.offset = offset
        link.users += 1

    @property
    def ref(self) -> bytes:
        link = self.link
        return _encoder.encode(
            _ForwardRef(link.name, self.offset, self.nbytes, link.dedicated, link.origin)
        )

    def _release(self) -> None:
        self.link.users -= 1
        self._shm._drop_link_if_done(self.link)


class _ShmImport(Import):
    """A view of the peer's sealed segment: of its mapping kept for the peer, or of a
    mapping of this object's range only (``own``), unmapped when the import closes.
    ``hold``: the read lock on its bytes held while it is open (a forward's)."""

    def __init__(
        self,
        backend: ShmBackend,
        peer: PeerInfo,
        nbytes: int,
        view: torch.Tensor,
        own: Segment | None = None,
        *,
        segment: Segment | None = None,
        offset: int = 0,
        hold: int = -1,
    ) -> None:
        super().__init__(backend, peer, nbytes, buffer=view)
        self._shm = backend
        self._own = own
        self.segment = segment if segment is not None else own
        self.offset = offset
        self._hold = hold

    def forward(self, peer: PeerInfo, lo: int, nbytes: int) -> Export | None:
        """Bytes ``[lo, lo + nbytes)`` of this object, by reference to ``peer`` (a
        forward, spec §9.2), or None: ``peer`` does not read forwards, or we cannot
        name the memory (closed, empty, not a mapped memfd)."""
        seg = self.segment
        if self.closed or seg is None or not seg.sealed or nbytes <= 0:
            return None
        return self._shm._forward(self, seg, peer, self.offset + lo, nbytes)

    def _close(self) -> None:
        if self._hold >= 0:
            os.close(self._hold)  # the unlock
            self._hold = -1
        if self._own is not None:  # views still alive keep it mapped until collected
            self._own.close()
            self._own = None


class _ReadImport(Import):
    """An object in a plain (unsealed) file: its owner may truncate it at any time, so
    it is never mapped; :meth:`fetch` reads it with ``pread`` (a truncation is a short
    read: :class:`BackendError`). A zero-copy receiver gets a copy of its own."""

    def __init__(
        self,
        backend: ShmBackend,
        peer: PeerInfo,
        nbytes: int,
        src: Opened,
        offset: int,
        *,
        own: bool,
    ) -> None:
        super().__init__(backend, peer, nbytes)
        self._src = src
        self._offset = offset
        self._own = own  # a descriptor for this object only: closed with the import

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        if hi <= lo:
            return
        if dest is None:
            if self.buffer is None:
                self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
            dest = self.buffer
        target = dest.numpy().data
        fd, offset = self._src.fd, self._offset
        what = f"shm segment {self._src.name} of {self.peer.name!r}"

        def read(a: int, b: int) -> None:
            pread_into(fd, target[a:b], offset + a, what)

        if hi - lo >= THREAD_COPY_THRESHOLD:
            await in_parts(read, lo, hi)
        else:
            read(lo, hi)

    def _close(self) -> None:
        if self._own:
            self._src.close()


#: Long-lived segments of one peer kept open here (omniwire senders use 1 + large_segments);
#: beyond it, an object's segment is opened for that object alone.
MAX_KEPT_SEGMENTS = 16


class ShmBackend(ByteBackend):
    """Options (``backend_options={"shm": {...}}``): ``arena_size`` (bytes, default
    64 MiB), ``directory`` (default /dev/shm), ``arena_wait`` (seconds an object of at
    most half the arena waits for a free slot before it gets a dedicated segment,
    default 1), ``large_segments`` (how many kept segments of the arena's size carry
    objects over half the arena, default 2; 0: a dedicated segment each), ``sealed``
    (default True where the platform has sealed memfds: sealed memfds behind links; False: plain files, for peers in
    another PID namespace that share /dev/shm — a receiver then copies with
    ``pread``, even in zero-copy mode).

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
            self.sealed = bool(opts.get("sealed", SEALING))
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
        self._mapped: dict[tuple[str, int], dict[str, Segment | Opened]] = {}
        self._prefixes: dict[tuple[str, int], str] = {}
        # peers that read forwarded references (their Hello says ``forwards``)
        self._forwards: set[tuple[str, int]] = set()
        # forwarding: our links to memfds of other processes, by (peer key, segment)
        # for a kept segment (until it is unmapped here) or by import for a dedicated one
        self._links: dict[object, _Link] = {}
        self._closed = False

    @classmethod
    def availability(cls) -> Availability:
        if not os.path.isdir(SHM_DIR):
            return Availability.missing(f"{SHM_DIR} does not exist on this system")
        return Availability.ok()

    async def start(self) -> None:
        sweep_stale_segments(self.directory)

    def hello(self) -> bytes:
        return _encoder.encode(_Hello(self.prefix, forwards=SEALING))

    def accepts(self, peer: PeerInfo) -> str | None:
        try:
            prefix = _forwards_hello_decoder.decode(peer.info).prefix
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
        hello = _forwards_hello_decoder.decode(peer.info)
        self._prefixes[peer.key] = hello.prefix
        if hello.forwards:
            self._forwards.add(peer.key)

    def _new_segment(self, size: int) -> Segment:
        name = f"{self.prefix}-{next(self._seq)}"
        return Segment.create(name, size, self.directory, sealed=self.sealed)

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
        r = decode_blob(_forward_ref_decoder, ref, f"shm reference from {peer.name!r}")
        if not _NAME.match(r.segment) or not r.segment.startswith(prefix + "-"):
            raise BadReferenceError(
                f"shm reference from {peer.name!r} names segment {r.segment[:80]!r}, "
                "which is not one of its own"
            )
        if r.origin and (not SEALING or not _NAME.match(r.origin)):
            raise BadReferenceError(
                f"shm reference from {peer.name!r} forwards {r.origin[:80]!r}, "
                "which is not an omniwire segment name"
            )
        if r.size != nbytes or r.offset < 0:
            raise BadReferenceError(
                f"shm reference from {peer.name!r} has size {r.size} != {nbytes}"
            )
        held = self._mapped.setdefault(peer.key, {}).get(r.segment)
        if held is None and r.size == 0:
            return _ShmImport(self, peer, 0, torch.empty(0, dtype=torch.uint8))
        if held is None:
            # Checked before anything is mapped, off the loop (_peermem: a link must
            # lead to a sealed memfd of the peer's; a plain file is read, never mapped).
            # Read-write, as before: zero-copy views are writable tensors, and a write
            # into a read-only mapping would fault. We never write to it ourselves.
            opened = await anyio.to_thread.run_sync(
                open_shared, self.directory, r.segment, peer.pid, True, r.origin
            )
            segments = self._mapped.get(peer.key)  # None: the peer went meanwhile
            held = segments.get(r.segment) if segments is not None else None
            if held is not None:  # another import opened it meanwhile
                opened.close()
            else:
                keep = segments is not None and not r.dedicated
                try:
                    self._check_bounds(peer, r, opened.size)
                    if self._closed:
                        raise BackendClosedError("shm backend is closed")
                    if segments is None or not keep or len(segments) >= MAX_KEPT_SEGMENTS:
                        return self._import_once(peer, r, opened)
                    held = opened if not opened.sealed else Segment.map(opened)
                except BaseException:
                    opened.close()
                    raise
                if held is not opened:
                    opened.close()  # the mapping stays
                segments[r.segment] = held
        self._check_bounds(peer, r, held.size)
        if isinstance(held, Segment):
            if held.origin != (r.origin or r.segment):
                raise BadReferenceError(
                    f"shm reference from {peer.name!r} says {r.segment} is "
                    f"{r.origin or r.segment!r}; it is the memfd {held.origin!r}"
                )
            hold = self._hold(peer, r, held)
            return _ShmImport(
                self,
                peer,
                r.size,
                held.view(r.offset, r.size),
                segment=held,
                offset=r.offset,
                hold=hold,
            )
        if r.origin:
            raise BadReferenceError(f"{r.segment} of {peer.name!r} is not a forwarded memfd")
        return _ReadImport(self, peer, r.size, held, r.offset, own=False)

    def _import_once(self, peer: PeerInfo, r: _ForwardRef, opened: Opened) -> Import:
        """An object whose segment is not kept here: this import owns the descriptor
        (a plain file) or a mapping of the object's pages only (a sealed one)."""
        if not opened.sealed:
            return _ReadImport(self, peer, r.size, opened, r.offset, own=True)
        try:
            seg = Segment.map(opened, r.offset, r.size)
        finally:
            opened.close()
        try:
            hold = self._hold(peer, r, seg)
        except BaseException:
            seg.close()
            raise
        return _ShmImport(
            self, peer, r.size, seg.view(r.offset, r.size), seg, offset=r.offset, hold=hold
        )

    def _hold(self, peer: PeerInfo, r: _ForwardRef, seg: Segment) -> int:
        """For a forward: a read lock on the object's bytes (spec §9.2 "Forwarding"),
        taken while the forwarder lives — so if it dies later, the creator sees the
        lock before it reuses the slot. -1 for anything else."""
        if not r.origin or seg.fd is None:
            return -1
        hold = read_lock(seg.fd, r.offset, r.size)
        if not pid_alive(peer.pid):
            os.close(hold)
            raise OwnerGoneError(f"{peer.name!r} forwarded {r.origin} and is gone")
        return hold

    # -- forwarding ----------------------------------------------------------------------

    def _forward(
        self, imp: _ShmImport, seg: Segment, peer: PeerInfo, offset: int, nbytes: int
    ) -> Export | None:
        if self._closed or not self.sealed or peer.key not in self._forwards or seg.fd is None:
            return None
        dedicated = imp._own is seg
        key: object = ("own", id(seg)) if dedicated else (imp.peer.key, seg.name)
        link = self._links.get(key)
        if link is None:
            name = f"{self.prefix}-{next(self._seq)}"
            fd = os.dup(seg.fd)
            try:
                os.symlink(f"/proc/{os.getpid()}/fd/{fd}", os.path.join(self.directory, name))
            except OSError as exc:
                os.close(fd)
                log.warning("shm: cannot name %s to forward it (%s); packing it", seg.name, exc)
                return None
            link = self._links[key] = _Link(key, name, fd, seg.origin, dedicated)
        # the object's place in the segment (a range mapping starts at seg.start)
        return _ForwardExport(self, link, offset, nbytes)

    def _drop_link_if_done(self, link: _Link) -> None:
        if link.users > 0 or not link.dropped:
            return
        if self._links.get(link.key) is link:
            del self._links[link.key]
        _unlink_quietly(os.path.join(self.directory, link.name))  # the name first (§9.2)
        if link.fd >= 0:
            os.close(link.fd)
            link.fd = -1

    def _drop_links(self, peer_key: tuple[str, int] | None) -> None:
        """Our links to the kept segments of ``peer_key`` (None: all) go once unused."""
        for key, link in list(self._links.items()):
            if peer_key is None or (isinstance(key, tuple) and key[0] == peer_key):
                link.dropped = True
                if peer_key is None:
                    link.users = 0  # closing: nothing is sent any more
                self._drop_link_if_done(link)

    def _check_bounds(self, peer: PeerInfo, r: _ForwardRef, size: int) -> None:
        if r.offset + r.size > size:
            raise BadReferenceError(
                f"shm reference from {peer.name!r} spans [{r.offset}, {r.offset + r.size}) "
                f"outside segment {r.segment} of {size} bytes"
            )

    async def disconnect(self, peer: PeerInfo) -> None:
        self._forwards.discard(peer.key)
        self._drop_links(peer.key)
        for held in self._mapped.pop(peer.key, {}).values():
            held.close()
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
        self._drop_links(None)
        for segments in self._mapped.values():
            for held in segments.values():
                held.close()
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
            "forward_links": len(self._links),
        }
