"""Opening memory a same-host peer shares, without trusting the peer (spec §9.2, §13).

A name under /dev/shm is one of two things, and nothing else is opened:

- a **symlink** ``<name> -> /proc/<peer pid>/fd/<n>``: the peer's *sealed memfd*
  (what omniwire writes since issue 19). What is opened must be a memfd (on the
  kernel's internal shm mount, the ``st_dev`` of a memfd of our own), owned by our
  uid, named ``<name>`` by its creator (``/proc/self/fd`` shows ``/memfd:<name>``),
  and sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``) —
  or, for a *forwarded* reference (``origin``: the peer re-names a sealed memfd of
  another omniwire segment that it holds, spec §9.2 "Forwarding"), named ``origin``
  by its creator, every other check unchanged. Its
  size is then fixed for its whole life, so a mapping of it can never fault
  (SIGBUS) whatever the peer does; it may be mapped and viewed in place.
- a **regular file** in /dev/shm itself (what every 1.1 writer made): opened with
  ``O_NOFOLLOW``; it must be on the shm filesystem (``st_dev`` of the directory),
  owned by our uid and have one link (a hard link to another process's segment has
  two). Its owner can still truncate it at any moment, so it is never mapped: it is
  read with ``pread``, where a truncation is a short read, not a fault.

Anything else — a link to another place, a FIFO, a device, another process's memfd
reached through the peer's /proc, a hugetlb memfd (whose faults can SIGBUS when the
pool runs dry) — is refused before anything is mapped.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import stat
import struct
from dataclasses import dataclass

from ..errors import BackendError, BadReferenceError

__all__ = [
    "SEALING",
    "SEALS",
    "Opened",
    "OwnerGoneError",
    "memfd_device",
    "open_shared",
    "pread_into",
    "range_read_locked",
    "read_lock",
]

#: The seals a shared memfd must carry: its size is fixed (Linux's values).
SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)
#: Whether this platform has sealed memfds (Linux ≥ 3.17); else only plain files.
SEALING = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
_LINK = re.compile(r"^/proc/(\d+)/fd/(\d+)$")


class OwnerGoneError(BackendError):
    """The process that shares a sealed segment has ended (its descriptor is gone)."""


@functools.cache
def memfd_device() -> int:
    """The ``st_dev`` of every memfd on this kernel (its internal shm mount)."""
    fd = os.memfd_create("omniwire-probe", os.MFD_CLOEXEC)
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


@dataclass
class Opened:
    """A descriptor of a peer's segment: ``sealed`` (a memfd whose ``size`` cannot
    change: safe to map) or not (a plain file: read it with :func:`pread_into`)."""

    name: str
    fd: int
    size: int
    sealed: bool
    #: A sealed one's memfd name, given by its creator: ``name``, or a forward's origin.
    memfd: str = ""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_shared(
    directory: str, name: str, pid: int, write: bool = False, origin: str = ""
) -> Opened:
    """Open the segment ``name`` of process ``pid`` in ``directory``, checked as the
    module docstring says; ``write``: read-write (to map it so); ``origin``: the
    link is a forward, its memfd named ``origin`` (an omniwire segment name the
    caller checked) by its creator. Blocking (a few syscalls): call it off the
    event loop.

    Raises:
        BadReferenceError: the name is not a segment ``pid`` may share (a link
            elsewhere, not sealed, not a plain file of ours on the shm filesystem).
        BackendError: it does not exist (any more) or cannot be opened.
    """
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return _open_memfd(path, origin or name, pid, st, write)
        if origin:
            raise BadReferenceError(f"forwarded shared memory {path} is not a link to a memfd")
        flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(path, flags | os.O_CLOEXEC)
    except BadReferenceError:
        raise
    except OSError as exc:
        raise BackendError(f"cannot open shared memory {path}: {exc}") from exc
    try:
        fst = os.fstat(fd)
        why = ""
        if not stat.S_ISREG(fst.st_mode):
            why = "is not a regular file"
        elif fst.st_dev != os.stat(directory).st_dev:
            why = f"is not on the filesystem of {directory}"
        elif fst.st_uid != os.geteuid():
            why = f"belongs to uid {fst.st_uid}"
        elif fst.st_nlink != 1:
            why = f"has {fst.st_nlink} links (a hard link to another segment?)"
        if why:
            raise BadReferenceError(f"shared memory {path} {why}")
    except BaseException:
        os.close(fd)
        raise
    return Opened(name, fd, fst.st_size, sealed=False)


def _open_memfd(path: str, name: str, pid: int, st: os.stat_result, write: bool) -> Opened:
    # ``name``: what its creator must have named the memfd (the segment, or a
    # forward's origin)
    target = os.readlink(path)
    m = _LINK.match(target)
    if m is None or int(m.group(1)) != pid or st.st_uid != os.geteuid():
        raise BadReferenceError(
            f"shared memory {path} links to {target[:120]!r}, not to a descriptor of process {pid}"
        )
    try:
        fd = os.open(target, (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise OwnerGoneError(f"the process that shared {path} is gone ({target})") from exc
    try:
        fst = os.fstat(fd)
        seals = 0
        with contextlib.suppress(OSError):  # EINVAL: not a file that takes seals
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        shown = os.readlink(f"/proc/self/fd/{fd}")
        why = ""
        if not stat.S_ISREG(fst.st_mode) or fst.st_dev != memfd_device():
            why = f"is {shown[:120]!r}, not a memfd"
        elif shown != f"/memfd:{name} (deleted)":
            why = f"is the memfd {shown[:120]!r}, not one named {name!r} by its creator"
        elif fst.st_uid != os.geteuid():
            why = f"belongs to uid {fst.st_uid}"
        elif seals & SEALS != SEALS:
            why = "is not sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW)"
        if why:
            raise BadReferenceError(f"shared memory {path} -> {target} {why}")
    except BaseException:
        os.close(fd)
        raise
    return Opened(os.path.basename(path), fd, fst.st_size, sealed=True, memfd=name)


def pread_into(fd: int, dest: memoryview, offset: int, what: str) -> None:
    """Fill ``dest`` from ``fd`` at ``offset``; a short read (the file was truncated
    under us) is an error, never a fault.

    Raises:
        BackendError: the file ended early or could not be read.
    """
    done, n = 0, len(dest)
    while done < n:
        try:
            got = os.preadv(fd, [dest[done:]], offset + done)
        except OSError as exc:
            raise BackendError(f"cannot read {what}: {exc}") from exc
        if got == 0:
            raise BackendError(
                f"{what} was truncated under the reader: {done} of {n} bytes at offset "
                f"{offset} were there"
            )
        done += got


# Forwarded segments (spec §9.2 "Forwarding"): a reader of a forwarded reference holds
# a shared (read) open-file-description lock on the object's bytes while it reads
# them; the segment's creator reuses a slot only once no such lock covers it. OFD
# locks belong to one open file description (not to the process, as POSIX record
# locks do), so each hold opens its own, and closing it is the unlock; they are
# independent of the creator's ``flock``.
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux (l_type, l_whence, l_start, l_len, l_pid)


def read_lock(fd: int, offset: int, length: int) -> int:
    """A new descriptor of the file ``fd`` is open on, holding a read lock on bytes
    ``[offset, offset + length)``; close it to unlock.

    Raises:
        BackendError: the lock cannot be taken (a writer holds a write lock on it).
    """
    try:
        hold = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise BackendError(f"cannot reopen shared memory to hold it: {exc}") from exc
    try:
        fcntl.fcntl(
            hold, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, offset, max(length, 1), 0)
        )
    except OSError as exc:
        os.close(hold)
        raise BackendError(
            f"cannot hold bytes [{offset}, {offset + length}) of shared memory: {exc}"
        ) from exc
    return hold


def range_read_locked(fd: int, offset: int, length: int) -> bool:
    """Whether another open file description holds a lock on bytes ``[offset, offset
    + length)`` of the file ``fd`` is open on (a forward's reader still reads them)."""
    try:
        got = fcntl.fcntl(
            fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, max(length, 1), 0)
        )
    except OSError:
        return False
    kind: int = _FLOCK.unpack(got)[0]
    return kind != fcntl.F_UNLCK
