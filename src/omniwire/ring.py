"""Shared-memory frame rings: a same-host control channel that skips the socket.

One :class:`RingReader` and one :class:`RingWriter` form a single-producer,
single-consumer channel of byte frames from one process to another process of
the same host (same kernel, same /dev/shm). A peer pair uses two, one per
direction. Frames are variable-length records in a byte ring in a POSIX
shared-memory segment; a frame larger than the free space (or than the whole
ring) travels as fragments that the reader joins, so one channel carries every
frame, in order. Each side sleeps in its event loop on a doorbell (a FIFO read
with ``loop.add_reader``): nothing polls, and an idle channel costs no CPU.

Roles. The **reader creates** the ring (:meth:`RingReader.create`) and gives its
:attr:`~RingReader.name` to the one peer that will write; that peer attaches
(:meth:`RingWriter.attach`). The reader owns every name in /dev/shm and unlinks
them as soon as it sees the writer attached (or at close), so once a channel is
up nothing of it is left to leak whatever process dies; until then the names
are ``omniwire-<reader pid>-<hex>-<n>`` files that the reader keeps ``flock``-ed,
exactly like the shm backend's segments, so ``sweep_stale_segments`` removes
them if the reader dies first:

- ``<name>-0`` the segment (header + data), created by ``Segment.create``
  (0600, ``posix_fallocate``, pre-faulted);
- ``<name>-1`` the reader's doorbell, a FIFO the writer rings when there are frames;
- ``<name>-2`` the writer's doorbell, a FIFO the reader rings when there is room.

Usage (reader in one process, writer in the other)::

    reader = RingReader.create()                  # name goes to the peer (Hello)
    reader.start(on_frames=handle_batch)          # on the event loop
    ...
    writer = RingWriter.attach(name, owner_pid=peer_pid)   # in the loop
    if not writer.send_nowait(frame):             # False: full; keep order yourself
        queue.append(frame)                       # ... and, in a drain task:
        await writer.wait_writable()              # then send_nowait(queue[0]) again

Theory of operation
-------------------

Shared state (all fields are 8-byte words, each written by one side only)::

    block 0  magic, version, capacity, reader pid        (set once, before the name is given)
    block 1  tail  want  writer_pid  writer_closed        (written by the writer only)
    block 2  head  sleeping  reader_closed                (written by the reader only)
    4096…    data: ``capacity`` bytes (a power of two)

``tail`` and ``head`` count bytes ever written / consumed (they never wrap; the
position is ``index & (capacity - 1)``), so ``tail - head`` is the bytes in use.
A record is an 8-byte header ``<u32 length, u32 flags>`` (flag 1: more fragments
of this frame follow) and the payload, padded to 8 bytes; a payload may wrap
around the end of the data area, a header never does (every record starts at a
multiple of 8 and the capacity is one).

What we rely on. Python has no atomics, so:

1. *Single-copy atomicity.* Index and flag words are read and written through a
   ``memoryview`` cast to native ``'Q'``. CPython implements those as a
   ``memcpy`` of ``sizeof(unsigned long long)`` bytes, which C compilers emit as
   one 8-byte load or store; aligned 8-byte accesses are single-copy atomic on
   x86-64 and AArch64. So a word is never seen torn. (64-bit platforms only.)
2. *Ordering.* x86-64 is TSO: loads are not reordered with loads, stores not with
   stores, and a load not with a later store; only a store followed by a load of
   another address may be reordered (the store buffer). AArch64 may reorder all
   four. ``_ordered()`` is the barrier for the first three cases: a no-op on
   x86-64, a full barrier elsewhere. ``_fence()`` is the full (store→load) barrier
   everywhere: CPython has none, so it takes and releases a ``threading.Lock``.
   Taking and releasing an uncontended lock are atomic read-modify-writes (any
   lock needs them; on CPython 3.11 with glibc, the compare-and-swap of
   ``sem_trywait`` and of ``sem_post``), with acquire and release semantics. On
   x86-64 each is a ``lock``-prefixed instruction, which is a full barrier. On
   AArch64 we take and release it twice, so that a release (unlock 1) is followed
   by an acquire (lock 2), which ARMv8 keeps in order (RCsc): every access before
   the fence is then ordered before every access after it. The interpreter adds
   no reordering of its own: every access is a separate call through the eval
   loop. Cost here: 0.1 µs per ``_fence()``.
3. *Doorbells synchronise.* A byte written to a FIFO and read by the other side
   goes through the kernel's pipe lock, so everything the ringer stored before
   the write is visible to the woken side after its read.

Data. Writer: write header and payload, ``_ordered()``, store ``tail``.
Reader: load ``tail``, ``_ordered()``, read the records up to it, ``_ordered()``,
store ``head``. Writer, before reusing space: load ``head``, ``_ordered()``, then
overwrite. So the reader never sees a record before its bytes, and the writer
never overwrites bytes the reader has not copied out.

No lost wakeup (the reader). The writer rings the reader's doorbell only when the
reader has said it is going to sleep, and once per sleep, so a stream of frames
costs no syscall per frame. ``sleeping`` is 0 while the reader is awake and a new
number (its sleep count, ``E``) each time it goes to sleep::

    writer W                          reader R (about to wait in epoll)
    w1  store tail                    r1  store sleeping = E
    w2  _fence()                      r2  _fence()
    w3  s = load sleeping             r3  if load tail != head: sleeping = 0, go on
        if s and s != rung:               else: return to the event loop
            rung = s; ring

This is the store-buffering litmus test with a full fence on both sides, which
forbids both loads from missing the other side's store: either w3 sees ``E`` or
r3 sees the new tail. If r3 sees it, R does not sleep. If w3 sees ``E`` it rings,
unless it rang for ``E`` already; either way a byte for sleep ``E`` is in the FIFO
(it stays there until R reads it, so a ring that comes before R reaches epoll
still wakes it), and R, woken by it, takes frames and then runs r1–r3 again with
``E + 1`` — which w3 did not see, so, by the same litmus test, that r3 sees our
tail. Spurious wakeups are possible and cost one empty pass. While R is awake it
keeps ``sleeping == 0``; when it stays awake to let other tasks run it reschedules
itself with ``call_soon``.

No lost wakeup (the writer, when the ring is full). Same pattern with roles
swapped: the writer stores ``want = (seq << 32) | bytes_needed``, fences, and loads
``head``; if the room is there after all it does not wait. The reader, after
every batch, stores ``head``, fences, loads ``want``, and rings the writer's
doorbell once per ``want`` value when the room it asks for is free. ``bytes_needed``
never exceeds the capacity and a waiting writer does not advance ``tail``, so the
reader, which consumes everything it finds, frees enough room eventually.

Close and death. ``close()`` on either side sets its ``*_closed`` word and rings the
other side unconditionally; the reader hands out what was written before the
writer closed, then reports the end. Neither side ever waits on the other except
in its event loop, so a dead peer wedges nothing: frames to a dead reader pile up
until the ring is full (then ``send_nowait`` returns False), and a dead writer just
stops. :meth:`~RingReader.peer_alive` tells a dead peer (its ``flock`` on its
doorbell FIFO is gone), and the endpoint's own process-liveness check applies.
A reader that finds the shared state inconsistent (a buggy or hostile writer)
stops and reports a :class:`RingError`; it never reads outside its mapping.

Doorbell choice, measured on the team's shared 2-core VM (asyncio ping-pong of a
bare doorbell between two processes, ``scripts/ring_bench.py --doorbells``, seven
interleaved rounds in two runs): p50 FIFO 30–56 µs, eventfd 29–51 µs, unix
datagram (abstract name) 38–121 µs; ring + drain with nobody waiting: eventfd
0.7–1.0 µs, FIFO 1.1–1.6 µs, datagram 3.5–3.8 µs. A FIFO is
as fast as an eventfd within noise, is opened by path (an eventfd cannot be: it
would need a unix-socket rendezvous to pass it with ``SCM_RIGHTS``), lives in
/dev/shm beside the segment — so it reaches exactly the processes the segment
reaches (our ``host_id`` is the boot id plus the /dev/shm device), where an
abstract socket needs a shared network namespace — and has file permissions
(0600), where any process may connect to an abstract socket.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import logging
import os
import platform
import re
import secrets
import stat
import struct
import sys
import threading
from collections.abc import Callable
from typing import Final

from .backends.shm import SHM_DIR, Segment
from .errors import BackendError, OmniwireError, ShmFullError
from .wire import MAX_FRAME_SIZE

__all__ = [
    "DEFAULT_CAPACITY",
    "RingClosedError",
    "RingError",
    "RingReader",
    "RingWriter",
]

log = logging.getLogger("omniwire.ring")

#: Bytes of frame data a ring holds by default (one direction of one peer pair).
DEFAULT_CAPACITY: Final = 1 << 20
_MIN_CAPACITY: Final = 4096
_MAX_CAPACITY: Final = 1 << 31  # a fragment's u32 length must hold any payload

_MAGIC: Final = 0x31474E4952574F  # "OWRING1", little-endian
_VERSION: Final = 1
_DATA_OFFSET: Final = 4096
# Word indices into the header (8-byte words); blocks are 128 bytes apart.
_W_MAGIC, _W_VERSION, _W_CAPACITY, _W_READER_PID = 0, 1, 2, 3
_W_TAIL, _W_WANT, _W_WRITER_PID, _W_WRITER_CLOSED = 16, 17, 18, 19
_W_HEAD, _W_SLEEPING, _W_READER_CLOSED = 32, 33, 34

_REC: Final = struct.Struct("<II")
_MORE: Final = 1
_NAME = re.compile(r"^omniwire-(\d+)-([0-9a-f]{8,32})$")
_BELL = b"\0"


class RingError(OmniwireError):
    """A ring cannot be created or attached, or its shared state is inconsistent."""


class RingClosedError(RingError):
    """This side, or the peer, closed the ring."""


# -- barriers (see "What we rely on" above) ------------------------------------------

_fence_lock = threading.Lock()
_acquire, _release = _fence_lock.acquire, _fence_lock.release

if platform.machine().lower() in ("x86_64", "amd64"):

    def _fence() -> None:
        _acquire()
        _release()

    def _ordered() -> None:
        pass

else:

    def _fence() -> None:
        _acquire()
        _release()
        _acquire()
        _release()

    _ordered = _fence


def _check_platform() -> None:
    if sys.maxsize < 2**63 - 1:
        raise RingError("shared-memory rings need a 64-bit platform (8-byte atomic words)")


def _pad(n: int) -> int:
    return (n + 7) & ~7


class _Mapping:
    """The views of one ring segment; ``release()`` drops them and unmaps."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self._array = segment.base.numpy()
        self._mv = self._array.data
        self.words = self._mv[:_DATA_OFFSET].cast("Q")
        self.data = self._mv[_DATA_OFFSET:]

    def release(self) -> None:
        for view in (self.words, self.data, self._mv):
            view.release()
        del self._array
        self.segment.close()


def _open_bell(path: str, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise RingError(f"cannot open the {what} doorbell {path}: {exc}") from exc
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise RingError(f"the {what} doorbell {path} is not a FIFO")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _ring(fd: int) -> None:
    """One byte into a doorbell; a full FIFO already has a wakeup pending."""
    with contextlib.suppress(BlockingIOError):
        os.write(fd, _BELL)


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.read(fd, 4096)


def _held_by_other(fd: int) -> bool:
    """Whether another open file description holds an flock on this file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class RingReader:
    """The consuming end of a ring; it creates the ring and owns its names.

    Use from one event loop thread. Frames come either through the callback given to
    :meth:`start` or through :meth:`recv`, not both.
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        mapping: _Mapping,
        bell_fd: int,
        writer_bell_fd: int,
        directory: str,
        max_frame: int,
    ) -> None:
        self.name = name
        self.capacity = capacity
        self.max_frame = max_frame
        self.directory = directory
        #: Times the doorbell woke this reader (for measurements).
        self.wakeups = 0
        self._map: _Mapping | None = mapping
        self._words = mapping.words
        self._data = mapping.data
        self._bell = bell_fd
        self._writer_bell = writer_bell_fd
        self._head = 0
        self._parts: list[bytes] = []
        self._partial = 0
        self._last_want = 0
        self._epoch = 1  # the value of ``sleeping`` while asleep: one more per sleep
        self._names_unlinked = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_frames: Callable[[list[bytes]], None] | None = None
        self._on_closed: Callable[[RingError | None], None] | None = None
        self._scheduled = False
        self._ended: RingError | None = None  # set once the ring is over (closed or broken)
        self._done = False
        self._closed = False
        self._queue: collections.deque[list[bytes]] = collections.deque()
        self._recv_waiter: asyncio.Future[None] | None = None

    @classmethod
    def create(
        cls,
        capacity: int = DEFAULT_CAPACITY,
        *,
        directory: str = SHM_DIR,
        max_frame: int = MAX_FRAME_SIZE,
    ) -> RingReader:
        """Create a ring this process will read: its segment and both doorbells.

        ``capacity`` (a power of two, 4 KiB … 2 GiB) is the bytes of frame data it
        holds; larger frames pass in fragments. ``max_frame`` is the largest frame
        the reader accepts (a writer sending more is treated as broken).

        Returns:
            the reader; give :attr:`name` to the one peer that will attach its writer.

        Raises:
            ValueError: ``capacity`` is not a power of two in range.
            ShmFullError: /dev/shm has no room for the segment.
            RingError: the segment or a doorbell cannot be created.
        """
        _check_platform()
        if capacity & (capacity - 1) or not _MIN_CAPACITY <= capacity <= _MAX_CAPACITY:
            raise ValueError(
                f"ring capacity {capacity} is not a power of two between "
                f"{_MIN_CAPACITY} and {_MAX_CAPACITY}"
            )
        name = f"omniwire-{os.getpid()}-{secrets.token_hex(8)}"
        bells: list[str] = []
        fds: list[int] = []
        segment: Segment | None = None
        try:
            for n in (1, 2):
                path = os.path.join(directory, f"{name}-{n}")
                os.mkfifo(path, 0o600)
                bells.append(path)
                fds.append(_open_bell(path, "new"))
            # The reader's own doorbell carries its lock: the sweep of dead processes'
            # files and the writer's liveness check both read it.
            fcntl.flock(fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            segment = Segment.create(f"{name}-0", _DATA_OFFSET + capacity, directory)
            mapping = _Mapping(segment)
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            for path in bells:
                _unlink_quietly(path)
            if segment is not None:
                segment.unlink(directory)
                segment.close()
            if isinstance(exc, OSError | BackendError) and not isinstance(exc, ShmFullError):
                raise RingError(f"cannot create ring {name} in {directory}: {exc}") from exc
            raise
        w = mapping.words
        w[_W_CAPACITY] = capacity
        w[_W_READER_PID] = os.getpid()
        w[_W_SLEEPING] = 1  # not started: the writer rings, the FIFO keeps the wakeup
        w[_W_VERSION] = _VERSION
        w[_W_MAGIC] = _MAGIC
        return cls(name, capacity, mapping, fds[0], fds[1], directory, max_frame)

    # -- public ------------------------------------------------------------------------

    @property
    def writer_attached(self) -> bool:
        """Whether a writer has attached (it may have closed since)."""
        return self.writer_pid is not None

    @property
    def writer_pid(self) -> int | None:
        """The pid the writer wrote when it attached (None: not attached, or closed
        here). Compare it with the peer's before trusting frames as the peer's."""
        if self._map is None:
            return None
        return self._words[_W_WRITER_PID] or None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def start(
        self,
        on_frames: Callable[[list[bytes]], None],
        on_closed: Callable[[RingError | None], None] | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Deliver frames from now on: ``on_frames(batch)`` runs in the event loop with
        every frame available at a wakeup, oldest first (frames the writer sent before
        ``start`` come at once). ``on_closed(None)`` runs once after the last frame when
        the writer closed; ``on_closed(error)`` once if the shared state turned out
        inconsistent (the ring then stops). Neither runs after :meth:`close`. An
        exception from a callback is logged and does not stop the ring.

        Raises:
            RingClosedError: the reader is closed.
            RingError: it was started already.
            RuntimeError: no ``loop`` given and no event loop is running.
        """
        if self._closed:
            raise RingClosedError(f"ring {self.name} is closed")
        if self._loop is not None:
            raise RingError(f"ring {self.name} is started already")
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._on_frames = on_frames
        self._on_closed = on_closed
        self._loop.add_reader(self._bell, self._on_bell)
        self._schedule()  # frames may be waiting, and a ring may have been consumed

    async def recv(self) -> list[bytes]:
        """The next batch of frames (at least one), oldest first; an alternative to
        :meth:`start` (the first call starts the reader on the running loop).

        Raises:
            RingClosedError: the writer closed and every frame was received, or this
                reader is closed.
            RingError: the shared state is inconsistent.
        """
        if self._loop is None and not self._closed:
            self.start(self._queue.append, self._ended_by)
        while not self._queue:
            if self._closed:
                raise RingClosedError(f"ring {self.name} is closed")
            if self._done:
                raise self._ended or RingClosedError(f"the writer of ring {self.name} closed")
            assert self._loop is not None
            self._recv_waiter = self._loop.create_future()
            try:
                await self._recv_waiter
            finally:
                self._recv_waiter = None
        return self._queue.popleft()

    def peer_alive(self) -> bool:
        """False if the writer attached and is now gone (closed or dead): its ``flock``
        on its doorbell is released when its process ends. True before it attaches."""
        if self._closed or self._map is None:
            return False
        if self._words[_W_WRITER_PID] == 0:
            return True
        if self._words[_W_WRITER_CLOSED]:
            return False
        return _held_by_other(self._writer_bell)

    def close(self) -> None:
        """Stop reading, tell the writer, and release every fd, mapping and name.
        Idempotent; frames not yet delivered are dropped."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._bell)
        if self._map is not None:
            self._words[_W_READER_CLOSED] = 1
            _fence()
            _ring(self._writer_bell)
        self._unlink_names()
        os.close(self._bell)
        os.close(self._writer_bell)
        if self._map is not None:
            self._map.release()
            self._map = None
        self._queue.clear()
        self._parts.clear()
        self._wake_recv()

    def __repr__(self) -> str:
        return f"<RingReader {self.name} capacity={self.capacity} closed={self._closed}>"

    # -- the loop ----------------------------------------------------------------------

    def _ended_by(self, error: RingError | None) -> None:
        self._wake_recv()

    def _wake_recv(self) -> None:
        if self._recv_waiter is not None and not self._recv_waiter.done():
            self._recv_waiter.set_result(None)

    def _on_bell(self) -> None:
        self.wakeups += 1
        _drain(self._bell)
        self._run()

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._run_scheduled)

    def _run_scheduled(self) -> None:
        self._scheduled = False
        self._run()

    def _run(self) -> None:
        """Take every frame there is, then go to sleep — or, if more came meanwhile,
        stay awake and come back after the loop has run the others."""
        if self._closed or self._done:
            return
        words = self._words
        words[_W_SLEEPING] = 0
        writer_closed = words[_W_WRITER_CLOSED]
        _ordered()
        try:
            frames = self._take()
        except RingError as exc:
            self._end(exc)
            return
        if frames:
            self._deliver(frames)
            if self._map is None:  # the callback closed this reader
                return
        if not self._names_unlinked and words[_W_WRITER_PID]:
            self._unlink_names()
        if writer_closed:  # read before the tail: everything it wrote is taken now
            if self._parts:
                log.info("ring %s: the writer closed in the middle of a frame", self.name)
            self._end(None)
            return
        self._epoch += 1
        words[_W_SLEEPING] = self._epoch
        _fence()
        if words[_W_TAIL] != self._head or words[_W_WRITER_CLOSED]:
            words[_W_SLEEPING] = 0
            self._schedule()

    def _take(self) -> list[bytes]:
        """Copy out every complete frame up to the tail, free the space, and ring the
        writer if it waits for that room."""
        words, data, cap = self._words, self._data, self.capacity
        head = self._head
        tail = words[_W_TAIL]
        _ordered()
        used = tail - head
        if used == 0:
            return []
        if used < 0 or used > cap or used & 7:
            raise RingError(
                f"ring {self.name}: the writer published tail {tail} with head at {head} "
                f"(capacity {cap})"
            )
        mask = cap - 1
        frames: list[bytes] = []
        parts = self._parts
        while head != tail:
            pos = head & mask
            n, flags = _REC.unpack_from(data, pos)
            size = 8 + _pad(n)
            if size > tail - head or flags & ~_MORE:
                raise RingError(
                    f"ring {self.name}: a record of {n} bytes (flags {flags:#x}) at {head} "
                    f"overruns the tail {tail}"
                )
            start = (pos + 8) & mask
            end = start + n
            if end <= cap:
                chunk = bytes(data[start:end])
            else:
                chunk = bytes(data[start:]) + bytes(data[: end - cap])
            head += size
            if flags & _MORE or parts:
                self._partial += n
                if self._partial > self.max_frame:
                    raise RingError(
                        f"ring {self.name}: a frame of more than {self._partial} bytes "
                        f"exceeds the limit of {self.max_frame}"
                    )
                parts.append(chunk)
                if not flags & _MORE:
                    frames.append(b"".join(parts))
                    parts.clear()
                    self._partial = 0
            elif n > self.max_frame:
                raise RingError(
                    f"ring {self.name}: a frame of {n} bytes exceeds the limit of {self.max_frame}"
                )
            else:
                frames.append(chunk)
        _ordered()
        self._head = head
        words[_W_HEAD] = head
        _fence()
        want = words[_W_WANT]
        if want and want != self._last_want:
            free = cap - (words[_W_TAIL] - head)
            if free >= want & 0xFFFFFFFF:
                self._last_want = want
                _ring(self._writer_bell)
        return frames

    def _deliver(self, frames: list[bytes]) -> None:
        assert self._on_frames is not None
        try:
            self._on_frames(frames)
        except Exception:
            log.exception("ring %s: the frame callback failed", self.name)
        self._wake_recv()

    def _end(self, error: RingError | None) -> None:
        self._done = True
        self._ended = error
        if error is not None:
            log.warning("%s", error)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._bell)
        if self._on_closed is not None:
            try:
                self._on_closed(error)
            except Exception:
                log.exception("ring %s: the close callback failed", self.name)
        self._wake_recv()

    def _unlink_names(self) -> None:
        if self._names_unlinked:
            return
        self._names_unlinked = True
        if self._map is not None:
            self._map.segment.unlink(self.directory)
        for n in (1, 2):
            _unlink_quietly(os.path.join(self.directory, f"{self.name}-{n}"))


class RingWriter:
    """The producing end of a ring created by another process's :class:`RingReader`.

    Use from the event loop thread it was attached in. Frames are ``bytes``-like.
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        mapping: _Mapping,
        bell_fd: int,
        reader_bell_fd: int,
        loop: asyncio.AbstractEventLoop,
        max_frame: int,
    ) -> None:
        self.name = name
        self.capacity = capacity
        self.max_frame = max_frame
        #: Times this writer rang the reader's doorbell (for measurements).
        self.bells_rung = 0
        self._rung = 0  # the reader's sleep we rang for
        self._map: _Mapping | None = mapping
        self._words = mapping.words
        self._data = mapping.data
        self._bell = bell_fd
        self._reader_bell = reader_bell_fd
        self._loop = loop
        self._tail = mapping.words[_W_TAIL]
        self._head_seen = mapping.words[_W_HEAD]
        # Up to this much free space a frame that does not fit whole starts in fragments.
        self._low_water = min(capacity // 4, 64 << 10)
        self._need = self._low_water  # room the last refused frame needed
        self._remainder: memoryview | None = None  # the unsent part of a taken frame
        self._want_seq = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._reader_closed = False
        self._error: RingError | None = None  # the reader broke the ring
        self._closed = False
        loop.add_reader(bell_fd, self._on_bell)

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        owner_pid: int | None = None,
        directory: str = SHM_DIR,
        max_frame: int = MAX_FRAME_SIZE,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RingWriter:
        """Attach as the one writer of the ring ``name`` (from :attr:`RingReader.name`).

        ``owner_pid``, when given, must be the pid in the name (a peer may only offer
        rings of its own process). The writer watches its doorbell on ``loop`` (by
        default the running loop).

        Raises:
            RingClosedError: the reader closed the ring or its process ended.
            RingError: the name is malformed or not ``owner_pid``'s, the ring does not
                exist (any more) or is not a ring, or it has a writer already.
            RuntimeError: no ``loop`` given and no event loop is running.
        """
        _check_platform()
        m = _NAME.match(name)
        if m is None:
            raise RingError(f"ring name {name[:80]!r} is not 'omniwire-<pid>-<hex>'")
        if owner_pid is not None and int(m.group(1)) != owner_pid:
            raise RingError(f"ring {name!r} is not a ring of process {owner_pid}")
        loop = loop if loop is not None else asyncio.get_running_loop()
        try:
            segment = Segment.attach(f"{name}-0", directory)
        except OmniwireError as exc:
            raise RingError(f"cannot attach ring {name}: {exc}") from exc
        if segment.size < _DATA_OFFSET + _MIN_CAPACITY:
            segment.close()
            raise RingError(f"{name} is not a version-{_VERSION} omniwire ring (too small)")
        mapping = _Mapping(segment)
        fds: list[int] = []
        try:
            w = mapping.words
            capacity = w[_W_CAPACITY]
            if (
                w[_W_MAGIC] != _MAGIC
                or w[_W_VERSION] != _VERSION
                or capacity & (capacity - 1)
                or not _MIN_CAPACITY <= capacity <= _MAX_CAPACITY
                or segment.size != _DATA_OFFSET + capacity
            ):
                raise RingError(f"{name} is not a version-{_VERSION} omniwire ring")
            if w[_W_WRITER_PID] != 0:
                raise RingError(f"ring {name} has a writer already (pid {w[_W_WRITER_PID]})")
            if w[_W_READER_CLOSED]:
                raise RingClosedError(f"the reader of ring {name} closed it")
            fds.append(_open_bell(os.path.join(directory, f"{name}-2"), "writer"))
            fds.append(_open_bell(os.path.join(directory, f"{name}-1"), "reader"))
            try:
                fcntl.flock(fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                raise RingError(f"ring {name} has a writer already: {exc}") from exc
            if not _held_by_other(fds[1]):
                raise RingClosedError(f"the reader of ring {name} is gone (its process ended)")
            writer = cls(name, capacity, mapping, fds[0], fds[1], loop, max_frame)
        except BaseException:
            for fd in fds:
                os.close(fd)
            mapping.release()
            raise
        w[_W_WRITER_PID] = os.getpid()
        _fence()
        _ring(fds[1])  # the reader unlinks the names now that nobody else needs them
        return writer

    # -- public ------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether this writer or the reader closed the ring."""
        return self._closed or self._reader_closed

    def send_nowait(self, frame: bytes | bytearray | memoryview) -> bool:
        """Put ``frame`` in the ring if there is room, without waiting.

        A frame is taken when it fits whole, or when a quarter of the ring (at most
        64 KiB) is free: then it goes in fragments, the rest following on its own as
        the reader frees room. Taken frames arrive whole and in order.

        Returns:
            True if the frame was taken. False if not — the ring is full, the rest of
            an earlier frame is still going in, or the ring is closed: keep the frame
            (and those after it, in order) and call :meth:`wait_writable`.

        Raises:
            RingError: the frame is larger than ``max_frame``.
        """
        if self._remainder is not None or self._closed or self._reader_closed:
            return False
        if type(frame) is not bytes:  # exact type: the common case stays cheap
            frame = memoryview(frame).cast("B")
        n = len(frame)
        size = 8 + _pad(n)
        cap = self.capacity
        tail = self._tail
        if size > cap - (tail - self._head_seen):
            free = self._free()
            if size > free:
                if n > self.max_frame:
                    raise RingError(
                        f"a frame of {n} bytes exceeds the ring's limit of {self.max_frame}"
                    )
                if free < self._low_water:
                    self._need = min(size, self._low_water)
                    return False
                self._remainder = memoryview(frame)
                self._pump()
                return True
        elif n > self.max_frame:
            raise RingError(f"a frame of {n} bytes exceeds the ring's limit of {self.max_frame}")
        self._tail = self._put(tail, frame, n, 0)
        self._publish()
        return True

    async def wait_writable(self) -> None:
        """Wait until :meth:`send_nowait` will take the frame it last refused (or any
        frame of up to a quarter of the ring): until the rest of a fragmented frame is
        in and the reader has freed the room.

        Raises:
            RingClosedError: this writer or the reader closed the ring.
            RingError: the reader published an impossible head (a bug, or hostile).
        """
        while True:
            self._check_open()
            if self._writable():
                return
            fut = self._loop.create_future()
            self._waiters.append(fut)
            try:
                if self._remainder is None and self._arm(self._need):
                    self._disarm()
                    continue
                await fut
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)

    def peer_alive(self) -> bool:
        """False if the reader is gone: it closed, or its process died (its ``flock`` on
        its doorbell is released when the process ends)."""
        if self._closed or self._map is None:
            return False
        if self._reader_closed or self._words[_W_READER_CLOSED]:
            return False
        return _held_by_other(self._reader_bell)

    def close(self) -> None:
        """Tell the reader no more frames come (it gets those already in the ring, not
        the unsent rest of a fragmented frame) and release every fd and mapping.
        Idempotent; waiters of :meth:`wait_writable` get :class:`RingClosedError`."""
        if self._closed:
            return
        self._closed = True
        self._remainder = None
        if not self._loop.is_closed():
            self._loop.remove_reader(self._bell)
        if self._map is not None:
            _ordered()
            self._words[_W_WRITER_CLOSED] = 1
            _fence()
            _ring(self._reader_bell)
            self._map.release()
            self._map = None
        os.close(self._bell)
        os.close(self._reader_bell)
        self._fail_waiters()

    def __repr__(self) -> str:
        return f"<RingWriter {self.name} capacity={self.capacity} closed={self.closed}>"

    # -- internals ---------------------------------------------------------------------

    def _put(self, tail: int, frame: bytes | bytearray | memoryview, n: int, flags: int) -> int:
        """Write one record at ``tail`` (room checked by the caller); the new tail."""
        data, cap = self._data, self.capacity
        pos = tail & (cap - 1)
        _REC.pack_into(data, pos, n, flags)
        start = pos + 8
        if start == cap:
            start = 0
        end = start + n
        if end <= cap:
            data[start:end] = frame
        else:
            view = memoryview(frame)
            k = cap - start
            data[start:] = view[:k]
            data[: end - cap] = view[k:]
        return tail + 8 + _pad(n)

    def _publish(self) -> None:
        _ordered()
        words = self._words
        words[_W_TAIL] = self._tail
        _fence()
        asleep = words[_W_SLEEPING]
        if asleep and asleep != self._rung:  # once per sleep of the reader
            self._rung = asleep
            self.bells_rung += 1
            _ring(self._reader_bell)

    def _pump(self) -> None:
        """Write as much of the pending fragmented frame as there is room for."""
        rest = self._remainder
        cap = self.capacity
        wrote = False
        while rest is not None:
            free = cap - (self._tail - self._head_seen)
            if free < min(8 + _pad(len(rest)), self._low_water):
                free = self._free()
                if free < min(8 + _pad(len(rest)), self._low_water):
                    if wrote:
                        self._publish()
                        wrote = False
                    if not self._arm(min(8 + _pad(len(rest)), self._low_water)):
                        break
                    continue  # the room came while we armed: go on
            m = min(len(rest), free - 8)
            last = m == len(rest)
            self._tail = self._put(self._tail, rest[:m], m, 0 if last else _MORE)
            wrote = True
            rest = None if last else rest[m:]
            self._remainder = rest
        if wrote:
            self._publish()
        if rest is None:
            self._disarm()

    def _arm(self, need: int) -> bool:
        """Ask the reader to ring when ``need`` bytes are free; True if they are already
        (then nobody will ring)."""
        self._want_seq = (self._want_seq + 1) & 0xFFFFFFFF or 1
        self._words[_W_WANT] = (self._want_seq << 32) | need
        _fence()
        return self._free() >= need

    def _free(self) -> int:
        """Free bytes, from the reader's current head; -1 if the reader published a head
        that cannot be (then the ring is marked broken)."""
        if self._error is not None:
            return -1
        head = self._words[_W_HEAD]
        _ordered()
        used = self._tail - head
        if not 0 <= used <= self.capacity:
            self._fail(
                RingError(
                    f"ring {self.name}: the reader published head {head} with the tail at "
                    f"{self._tail} (capacity {self.capacity})"
                )
            )
            return -1
        self._head_seen = head
        return self.capacity - used

    def _disarm(self) -> None:
        if self._map is not None and self._words[_W_WANT]:
            self._words[_W_WANT] = 0

    def _writable(self) -> bool:
        if self._remainder is not None:
            return False
        free = self.capacity - (self._tail - self._head_seen)
        if free < self._need:
            free = self._free()
        return free >= self._need

    def _check_open(self) -> None:
        if self._closed:
            raise RingClosedError(f"ring {self.name} is closed")
        if self._error is not None:
            raise self._error
        if self._reader_closed:
            raise RingClosedError(f"the reader of ring {self.name} closed it")

    def _on_bell(self) -> None:
        _drain(self._bell)
        if self._closed:
            return
        if self._words[_W_READER_CLOSED]:
            self._reader_closed = True
            self._remainder = None
            self._loop.remove_reader(self._bell)
            self._fail_waiters()
            return
        if self._remainder is not None:
            self._pump()
        # _arm: the reader may have rung for room for a fragment, less than we need.
        if (
            self._waiters
            and self._remainder is None
            and (self._writable() or self._arm(self._need))
        ):
            self._disarm()
            for fut in self._waiters:
                if not fut.done():
                    fut.set_result(None)

    def _fail(self, error: RingError) -> None:
        log.warning("%s", error)
        self._error = error
        self._reader_closed = True
        self._remainder = None
        self._fail_waiters()

    def _fail_waiters(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)  # the waiter wakes and raises RingClosedError
