"""A ring's files in /dev/shm: names, creating and attaching them, unlinking them.

A ring ``omniwire-<reader pid>-<hex>`` is three files: ``-0`` the segment (header +
data, by ``Segment.create``: a sealed memfd behind a link), ``-1`` the reader's
doorbell and ``-2`` the writer's.
The reader creates all three and keeps its doorbell ``flock``-ed, so that
``sweep_stale_segments`` removes them if it dies before unlinking them itself; the
writer attaches and locks its own doorbell. :class:`RingFiles` is one side's hold
on them.
"""

from __future__ import annotations

import contextlib
import os
import secrets

from ..backends._peermem import OwnerGoneError, open_shared
from ..backends.shm import PREFIX_RE, Segment
from ..errors import BackendError, OmniwireError, ShmFullError
from ._doorbell import Doorbell
from ._errors import RingClosedError, RingError
from ._fences import fence
from ._layout import (
    DATA_OFFSET,
    W_READER_CLOSED,
    W_WRITER_CLOSED,
    W_WRITER_PID,
    check_header,
    check_size,
    init_header,
)

__all__ = ["Mapping", "RingFiles", "check_name"]


def check_name(name: str, owner_pid: int | None) -> int:
    """Refuse a malformed ring name, or (given ``owner_pid``) one of another process;
    the pid in the name."""
    m = PREFIX_RE.match(name)
    if m is None:
        raise RingError(f"ring name {name[:80]!r} is not 'omniwire-<pid>-<hex>'")
    if owner_pid is not None and int(m.group(1)) != owner_pid:
        raise RingError(f"ring {name!r} is not a ring of process {owner_pid}")
    return int(m.group(1))


def _path(directory: str, name: str, n: int) -> str:
    return os.path.join(directory, f"{name}-{n}")


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Mapping:
    """The views of one ring segment; ``release()`` drops them and unmaps."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self._array = segment.base.numpy()
        self._mv = self._array.data
        self.words = self._mv[:DATA_OFFSET].cast("Q")
        self.data = self._mv[DATA_OFFSET:]

    def release(self) -> None:
        for view in (self.words, self.data, self._mv):
            view.release()
        del self._array
        self.segment.close()


class RingFiles:
    """One side's hold on a ring: the mapped segment, the doorbell this side sleeps on
    (and holds the ``flock`` of), and the peer's doorbell, which it rings.
    ``closed_word`` is this side's ``*_closed`` word."""

    def __init__(
        self,
        name: str,
        directory: str,
        capacity: int,
        mapping: Mapping,
        bell: Doorbell,
        peer_bell: Doorbell,
        closed_word: int,
    ) -> None:
        self.name = name
        self.directory = directory
        self.capacity = capacity
        self.mapping = mapping
        self.words = mapping.words
        self.data = mapping.data
        self.bell = bell
        self.peer_bell = peer_bell
        self.closed_word = closed_word
        self.unlinked = False

    @classmethod
    def create(cls, capacity: int, directory: str) -> RingFiles:
        """Create a new ring's three files, as its reader (``capacity`` checked already)."""
        name = f"omniwire-{os.getpid()}-{secrets.token_hex(8)}"
        paths: list[str] = []
        bells: list[Doorbell] = []
        segment: Segment | None = None
        try:
            for n in (1, 2):
                path = _path(directory, name, n)
                os.mkfifo(path, 0o600)
                paths.append(path)
                bells.append(Doorbell.open(path, "new"))
            # The reader's own doorbell carries its lock: the sweep of dead processes'
            # files and the writer's liveness check both read it.
            bells[0].lock()
            segment = Segment.create(f"{name}-0", DATA_OFFSET + capacity, directory)
            mapping = Mapping(segment)
        except BaseException as exc:
            for bell in bells:
                bell.close()
            for path in paths:
                _unlink_quietly(path)
            if segment is not None:
                segment.unlink(directory)
                segment.close()
            if isinstance(exc, OSError | BackendError) and not isinstance(exc, ShmFullError):
                raise RingError(f"cannot create ring {name} in {directory}: {exc}") from exc
            raise
        init_header(mapping.words, capacity, os.getpid())
        return cls(name, directory, capacity, mapping, bells[0], bells[1], W_READER_CLOSED)

    @classmethod
    def attach(cls, name: str, directory: str, owner_pid: int) -> RingFiles:
        """Attach to the ring ``name`` of process ``owner_pid`` (checked by
        :func:`check_name`) as its writer: check that its segment is sealed, its size
        and its header — read with ``pread``, before anything is mapped — that it has
        no writer and that its reader lives, and lock the writer's doorbell.

        A segment that is not a sealed memfd (a plain file, as 1.1 made them) is
        refused: its owner could truncate it under our mapping (SIGBUS)."""
        try:
            opened = open_shared(directory, f"{name}-0", owner_pid, write=True)
        except OwnerGoneError as exc:
            raise RingClosedError(f"the reader of ring {name} is gone: {exc}") from exc
        except OmniwireError as exc:
            raise RingError(f"cannot attach ring {name}: {exc}") from exc
        try:
            if not opened.sealed:
                raise RingError(
                    f"ring {name} is a plain file, not a sealed memfd: its reader could "
                    "shrink it under the writer's mapping"
                )
            check_size(opened.size, name)
            header = os.pread(opened.fd, DATA_OFFSET, 0)
            if len(header) != DATA_OFFSET:
                raise RingError(f"ring {name}: its header cannot be read")
            check_header(memoryview(header).cast("Q"), opened.size, name)
            segment = Segment.map(opened)  # sealed: its size cannot change from now on
        except OSError as exc:
            raise RingError(f"cannot attach ring {name}: {exc}") from exc
        except BackendError as exc:
            raise RingError(f"cannot attach ring {name}: {exc}") from exc
        finally:
            opened.close()
        mapping = Mapping(segment)
        bells: list[Doorbell] = []
        try:
            w = mapping.words
            capacity = check_header(w, segment.size, name)  # again: it is shared memory
            if w[W_WRITER_PID] != 0:
                raise RingError(f"ring {name} has a writer already (pid {w[W_WRITER_PID]})")
            if w[W_READER_CLOSED]:
                raise RingClosedError(f"the reader of ring {name} closed it")
            bells.append(Doorbell.open(_path(directory, name, 2), "writer"))
            bells.append(Doorbell.open(_path(directory, name, 1), "reader"))
            try:
                bells[0].lock()
            except OSError as exc:
                raise RingError(f"ring {name} has a writer already: {exc}") from exc
            if not bells[1].held_by_other():
                raise RingClosedError(f"the reader of ring {name} is gone (its process ended)")
        except BaseException:
            for bell in bells:
                bell.close()
            mapping.release()
            raise
        return cls(name, directory, capacity, mapping, bells[0], bells[1], W_WRITER_CLOSED)

    def claim(self) -> None:
        """Store this process's pid as the writer's and ring the reader, which unlinks
        the names now that nobody else needs them (the writer, once attached)."""
        self.words[W_WRITER_PID] = os.getpid()
        fence()
        self.peer_bell.ring()

    def say_closed(self) -> None:
        """Set this side's ``*_closed`` word and ring the peer to see it."""
        self.words[self.closed_word] = 1
        fence()
        self.peer_bell.ring()

    def unlink(self) -> None:
        """Remove the three names, once (the reader, when the writer attached or at
        close)."""
        if self.unlinked:
            return
        self.unlinked = True
        self.mapping.segment.unlink(self.directory)
        for n in (1, 2):
            _unlink_quietly(_path(self.directory, self.name, n))

    def close(self) -> None:
        """Close both doorbells and unmap the segment."""
        self.bell.close()
        self.peer_bell.close()
        self.mapping.release()
