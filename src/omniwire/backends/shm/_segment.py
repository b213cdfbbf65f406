"""A segment: a sealed memfd named in /dev/shm (or a 1.1 plain file), created, owned
and unlinked by its creator; and the sweep of segments whose owner died."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import stat

import numpy as np
import torch

from ...errors import BackendError, BadReferenceError, ShmFullError
from ...hostinfo import pid_alive
from .._peermem import SEALS, Opened, open_shared
from ..support import mib

log = logging.getLogger("omniwire.shm")

SHM_DIR = "/dev/shm"
PREFIX = "omniwire-"
_NAME = re.compile(r"^omniwire-(\d+)-([0-9a-f]{8,32})-(\d+)$")
#: A sender's segment prefix (spec §9.2), also the name of a control ring (§3.6).
PREFIX_RE = re.compile(r"^omniwire-(\d+)-([0-9a-f]{8,32})$")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


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
