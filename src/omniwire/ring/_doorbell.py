"""The doorbells: a FIFO in /dev/shm per side, that the other side rings.

A side sleeps in its event loop on its own doorbell (``loop.add_reader``) and the
peer writes a byte to wake it; the byte stays in the FIFO until read, so a ring
that comes before the sleeper reaches epoll still wakes it, and a full FIFO means
a wakeup is pending already. Why a FIFO rather than an eventfd or a socket, and why
ringing only when the other side says it sleeps (and once per sleep) loses no
wakeup, are in the package docstring. The owner of a doorbell holds an ``flock``
on it for as long as its process lives: that is how the peer tells it is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat

from ._errors import RingError

__all__ = ["Doorbell"]

_BELL = b"\0"


class Doorbell:
    """One open doorbell FIFO (ours to sleep on, or the peer's to ring)."""

    __slots__ = ("fd", "rung_for")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        #: The last token :meth:`ring_once` rang for (a sleep epoch, a ``want`` word).
        self.rung_for = 0

    @classmethod
    def open(cls, path: str, what: str) -> Doorbell:
        """Open the FIFO at ``path`` (``what`` names it in errors), non-blocking."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise RingError(f"cannot open the {what} doorbell {path}: {exc}") from exc
        try:
            # On the descriptor (the object opened, not the name): a FIFO of our own uid
            # that no other user may open (spec §3.6) — else another user could ring,
            # drain, or take the lock that is this ring's liveness.
            st = os.fstat(fd)
            if not stat.S_ISFIFO(st.st_mode):
                raise RingError(f"the {what} doorbell {path} is not a FIFO")
            if st.st_uid != os.geteuid():
                raise RingError(f"the {what} doorbell {path} belongs to uid {st.st_uid}")
            if st.st_mode & 0o077:
                raise RingError(
                    f"the {what} doorbell {path} has mode {stat.S_IMODE(st.st_mode):04o}, not 0600"
                )
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)

    def ring(self) -> None:
        """One byte into the doorbell; a full FIFO already has a wakeup pending."""
        with contextlib.suppress(BlockingIOError):
            os.write(self.fd, _BELL)

    def ring_once(self, token: int) -> bool:
        """Ring for ``token`` unless it is 0 or was rung for last; True if it rang.

        The sleeper publishes a new token each time it waits (the reader its sleep
        epoch, the writer its ``want`` word), so one byte per wait is enough."""
        if not token or token == self.rung_for:
            return False
        self.rung_for = token
        self.ring()
        return True

    def drain(self) -> None:
        """Take the pending wakeups (before looking at the shared words)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 4096)

    def lock(self) -> None:
        """Take the owner's ``flock``, without waiting (OSError if another holds it)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def held_by_other(self) -> bool:
        """Whether another open file description holds an flock on this FIFO."""
        try:
            self.lock()
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        os.close(self.fd)
