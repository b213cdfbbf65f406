"""The consuming end of a ring: it creates the ring, owns its names, and sleeps on its
doorbell between batches (see "No lost wakeup (the reader)" in the package docstring)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from ..backends.shm import SHM_DIR
from ..wire import MAX_FRAME_SIZE
from ._errors import RingClosedError, RingError
from ._fences import fence, ordered
from ._files import RingFiles
from ._layout import (
    DEFAULT_CAPACITY,
    MAX_CAPACITY,
    MIN_CAPACITY,
    MORE,
    REC,
    W_HEAD,
    W_SLEEPING,
    W_TAIL,
    W_WANT,
    W_WRITER_CLOSED,
    W_WRITER_PID,
    capacity_ok,
    check_platform,
    pad,
    wanted,
)

__all__ = ["RingReader"]

log = logging.getLogger("omniwire.ring")


#: Bytes of records one turn of the event loop takes from a ring at most: one default
#: ring's worth (a larger ring is read over several turns; a frame larger than this
#: is taken record by record). A smaller budget cost the 20-stream mix ~15 % (the
#: writer, waiting for room, was woken more often for less).
TURN_BYTES = DEFAULT_CAPACITY
#: Records one turn takes at most, whatever their size: 131,072 empty frames fit in
#: TURN_BYTES, and the endpoint decodes each (a writer sending them held the loop 1 s).
TURN_RECORDS = 512


class RingReader:
    """The consuming end of a ring; it creates the ring and owns its names.

    Use from one event loop thread. Frames come either through the callback given to
    :meth:`start` or through :meth:`recv`, not both.
    """

    def __init__(self, files: RingFiles, max_frame: int) -> None:
        self.name = files.name
        self.capacity = files.capacity
        self.max_frame = max_frame
        self.directory = files.directory
        #: Times the doorbell woke this reader (for measurements).
        self.wakeups = 0
        self._files = files
        self._words = files.words
        self._data = files.data
        self._bell = files.bell
        self._writer_bell = files.peer_bell
        self._head = 0
        #: the fragments of a frame so far (``more``), joined as they come: no object
        #: per fragment, whatever their number
        self._parts = bytearray()
        self._partial = 0
        self._epoch = 1  # the value of ``sleeping`` while asleep: one more per sleep
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_frames: Callable[[list[bytes]], list[bytes] | None] | None = None
        self._on_closed: Callable[[RingError | None], None] | None = None
        self._scheduled = False
        #: frames the callback left for later (its turn's budget was spent): delivered
        #: before any record is taken from the ring again
        self._held: list[bytes] = []
        self._paused = False  # pause() until resume(): nothing delivered or taken
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
        check_platform()
        if not capacity_ok(capacity):
            raise ValueError(
                f"ring capacity {capacity} is not a power of two between "
                f"{MIN_CAPACITY} and {MAX_CAPACITY}"
            )
        return cls(RingFiles.create(capacity, directory), max_frame)

    # -- public ------------------------------------------------------------------------

    @property
    def writer_attached(self) -> bool:
        """Whether a writer has attached (it may have closed since)."""
        return self.writer_pid is not None

    @property
    def writer_pid(self) -> int | None:
        """The pid the writer wrote when it attached (None: not attached, or closed
        here). Compare it with the peer's before trusting frames as the peer's."""
        if self._closed:
            return None
        return self._words[W_WRITER_PID] or None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def start(
        self,
        on_frames: Callable[[list[bytes]], list[bytes] | None],
        on_closed: Callable[[RingError | None], None] | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Deliver frames from now on: ``on_frames(batch)`` runs in the event loop with
        every frame available at a wakeup, oldest first (frames the writer sent before
        ``start`` come at once). It returns the frames it did not take (a tail of
        ``batch``; None or empty: all): they come back first, at a later turn of the
        loop, and the ring's room stays taken meanwhile (the writer waits for it).
        ``on_closed(None)`` runs once after the last frame when
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
        self._loop.add_reader(self._bell.fd, self._on_bell)
        self._schedule()  # frames may be waiting, and a ring may have been consumed

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Deliver nothing and take nothing from the ring until :meth:`resume` (the
        consumer works on a frame it took, e.g. in a worker thread)."""
        self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._schedule()

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
        if self._closed:
            return False
        if self._words[W_WRITER_PID] == 0:
            return True
        if self._words[W_WRITER_CLOSED]:
            return False
        return self._writer_bell.held_by_other()

    def close(self) -> None:
        """Stop reading, tell the writer, and release every fd, mapping and name.
        Idempotent; frames not yet delivered are dropped."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._bell.fd)
        self._files.say_closed()
        self._files.unlink()
        self._files.close()
        self._queue.clear()
        self._held = []
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
        self._bell.drain()
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
        if self._closed or self._done or self._paused:
            return  # (paused: awake for the writer, which so rings no bell)
        words = self._words
        words[W_SLEEPING] = 0
        if self._held:
            frames, self._held = self._held, []
            self._deliver(frames)
            if not self._closed and not self.paused:
                self._schedule()  # what is left, or the ring, after the others
            return
        writer_closed = words[W_WRITER_CLOSED]
        ordered()
        try:
            frames = self._take()
        except RingError as exc:
            self._end(exc)
            return
        if frames:
            self._deliver(frames)
            if self.closed:  # the callback closed this reader
                return
            if self.paused:  # (the callback paused it)
                return
            if self._held:
                self._schedule()  # the rest after the others
                return
        if not self._files.unlinked and words[W_WRITER_PID]:
            self._files.unlink()
        if writer_closed and self._head != words[W_TAIL]:
            self._schedule()  # a turn's budget was taken: the rest after the others
            return
        if writer_closed:  # read before the tail: everything it wrote is taken now
            if self._parts:
                log.info("ring %s: the writer closed in the middle of a frame", self.name)
            self._end(None)
            return
        self._epoch += 1
        words[W_SLEEPING] = self._epoch
        fence()
        if words[W_TAIL] != self._head or words[W_WRITER_CLOSED]:
            words[W_SLEEPING] = 0
            self._schedule()

    def _take(self) -> list[bytes]:
        """Copy out the complete frames up to the tail — at most ``TURN_BYTES`` of
        records a turn, so one peer's full ring cannot hold the event loop — free the
        space, and ring the writer if it waits for that room."""
        words, data, cap = self._words, self._data, self.capacity
        head = self._head
        tail = words[W_TAIL]
        ordered()
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
        budget = head + TURN_BYTES  # bounded work per turn: the rest on the next one
        records = 0
        while head != tail and head < budget and records < TURN_RECORDS:
            records += 1
            pos = head & mask
            n, flags = REC.unpack_from(data, pos)
            size = 8 + pad(n)
            if size > tail - head or flags & ~MORE:
                raise RingError(
                    f"ring {self.name}: a record of {n} bytes (flags {flags:#x}) at {head} "
                    f"overruns the tail {tail}"
                )
            if flags & MORE and not n:
                raise RingError(f"ring {self.name}: an empty fragment (flag more) at {head}")
            start = (pos + 8) & mask
            end = start + n
            head += size
            if flags & MORE or parts:
                self._partial += n
                if self._partial > self.max_frame:
                    raise RingError(
                        f"ring {self.name}: a frame of more than {self._partial} bytes "
                        f"exceeds the limit of {self.max_frame}"
                    )
                if end <= cap:
                    parts += data[start:end]
                else:
                    parts += data[start:]
                    parts += data[: end - cap]
                if not flags & MORE:
                    frames.append(bytes(parts))
                    parts.clear()
                    self._partial = 0
                continue
            if n > self.max_frame:
                raise RingError(
                    f"ring {self.name}: a frame of {n} bytes exceeds the limit of {self.max_frame}"
                )
            if end <= cap:
                frames.append(bytes(data[start:end]))
            else:
                frames.append(bytes(data[start:]) + bytes(data[: end - cap]))
        ordered()
        self._head = head
        words[W_HEAD] = head
        fence()
        want = words[W_WANT]
        # Once per ``want`` value, and only when the room it asks for is free.
        bell = self._writer_bell
        if want and want != bell.rung_for and cap - (words[W_TAIL] - head) >= wanted(want):
            bell.ring_once(want)
        return frames

    def _deliver(self, frames: list[bytes]) -> None:
        assert self._on_frames is not None
        try:
            left = self._on_frames(frames)
        except Exception:
            log.exception("ring %s: the frame callback failed", self.name)
        else:
            if left:
                self._held = list(left)
        self._wake_recv()

    def _end(self, error: RingError | None) -> None:
        self._done = True
        self._ended = error
        if error is not None:
            log.warning("%s", error)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._bell.fd)
        if self._on_closed is not None:
            try:
                self._on_closed(error)
            except Exception:
                log.exception("ring %s: the close callback failed", self.name)
        self._wake_recv()
