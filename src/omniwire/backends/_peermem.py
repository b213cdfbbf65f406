"""Opening memory a same-host peer shares, without trusting the peer (spec §9.2, §13).

A name under /dev/shm is one of two things, and nothing else is opened:

- a **symlink** ``<name> -> /proc/<peer pid>/fd/<n>``: the peer's *sealed memfd*
  (what omniwire writes since issue 19). What is opened must be a memfd (on the
  kernel's internal shm mount, the ``st_dev`` of a memfd of our own), owned by our
  uid, named ``<name>`` by its creator (``/proc/self/fd`` shows ``/memfd:<name>``),
  and sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``). Its
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

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_shared(directory: str, name: str, pid: int, write: bool = False) -> Opened:
    """Open the segment ``name`` of process ``pid`` in ``directory``, checked as the
    module docstring says; ``write``: read-write (to map it so). Blocking (a few
    syscalls): call it off the event loop.

    Raises:
        BadReferenceError: the name is not a segment ``pid`` may share (a link
            elsewhere, not sealed, not a plain file of ours on the shm filesystem).
        BackendError: it does not exist (any more) or cannot be opened.
    """
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return _open_memfd(path, name, pid, st, write)
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
    return Opened(name, fd, fst.st_size, sealed=True)


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
