"""The producing end of a ring: it attaches to a ring another process's reader made,
rings the reader once per sleep, and waits for room on its own doorbell (see "No lost
wakeup (the writer, when the ring is full)" in the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from ..backends.shm import SHM_DIR, sweep_stale_segments
from ..wire import MAX_FRAME_SIZE
from ._errors import RingClosedError, RingError
from ._fences import fence, ordered
from ._files import RingFiles, check_name
from ._layout import (
    MORE,
    REC,
    W_HEAD,
    W_READER_CLOSED,
    W_SLEEPING,
    W_TAIL,
    W_WANT,
    check_platform,
    pad,
    want_word,
)

__all__ = ["RingWriter"]

log = logging.getLogger("omniwire.ring")


class RingWriter:
    """The producing end of a ring created by another process's :class:`RingReader`.

    Use from the event loop thread it was attached in. Frames are ``bytes``-like.
    """

    def __init__(self, files: RingFiles, loop: asyncio.AbstractEventLoop, max_frame: int) -> None:
        self.name = files.name
        self.capacity = capacity = files.capacity
        self.max_frame = max_frame
        #: Times this writer rang the reader's doorbell (for measurements).
        self.bells_rung = 0
        self._files = files
        self._words = files.words
        self._data = files.data
        self._bell = files.bell
        self._reader_bell = files.peer_bell  # its ``rung_for``: the reader's sleep we rang for
        self._loop = loop
        self._tail = files.words[W_TAIL]
        self._head_seen = files.words[W_HEAD]
        # Up to this much free space a frame that does not fit whole starts in fragments.
        self._low_water = min(capacity // 4, 64 << 10)
        self._need = self._low_water  # room the last refused frame needed
        self._remainder: memoryview | None = None  # the unsent part of a taken frame
        self._want_seq = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._reader_closed = False
        self._error: RingError | None = None  # the reader broke the ring
        self._closed = False
        loop.add_reader(files.bell.fd, self._on_bell)

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
        check_platform()
        pid = check_name(name, owner_pid)
        loop = loop if loop is not None else asyncio.get_running_loop()
        files = RingFiles.attach(name, directory, pid)
        try:
            writer = cls(files, loop, max_frame)
        except BaseException:
            files.close()
            raise
        files.claim()
        return writer

    @classmethod
    async def open(
        cls,
        name: str,
        *,
        owner_pid: int | None = None,
        directory: str = SHM_DIR,
        max_frame: int = MAX_FRAME_SIZE,
    ) -> RingWriter:
        """:meth:`attach`, with the checks and the mapping (a peer's files, a few
        syscalls) in a worker thread, off the running loop.

        Raises:
            as :meth:`attach`.
        """
        check_platform()
        pid = check_name(name, owner_pid)
        loop = asyncio.get_running_loop()
        handoff = _Handoff()
        try:
            await loop.run_in_executor(
                None, handoff.give, lambda: RingFiles.attach(name, directory, pid)
            )
        except asyncio.CancelledError:
            handoff.abandon()
            raise
        files = handoff.take()
        try:
            writer = cls(files, loop, max_frame)
        except BaseException:
            files.close()
            raise
        files.claim()
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
        size = 8 + pad(n)
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
        if self._closed:
            return False
        if self._reader_closed or self._words[W_READER_CLOSED]:
            return False
        return self._reader_bell.held_by_other()

    def close(self) -> None:
        """Tell the reader no more frames come (it gets those already in the ring, not
        the unsent rest of a fragmented frame) and release every fd and mapping.
        Idempotent; waiters of :meth:`wait_writable` get :class:`RingClosedError`."""
        if self._closed:
            return
        self._closed = True
        self._remainder = None
        if not self._loop.is_closed():
            self._loop.remove_reader(self._bell.fd)
        ordered()  # every tail stored before, then ``writer_closed``
        self._files.say_closed()
        # A reader that died before it read our fence never unlinked the ring's names;
        # the sweep (which checks the pid and the locks again) removes them now.
        gone = False
        with contextlib.suppress(OSError):
            gone = not self._reader_bell.held_by_other()
        self._files.close()
        if gone:
            names = {f"{self.name}-{n}" for n in range(3)}
            sweep_stale_segments(self._files.directory, names)
        self._fail_waiters()

    def __repr__(self) -> str:
        return f"<RingWriter {self.name} capacity={self.capacity} closed={self.closed}>"

    # -- internals ---------------------------------------------------------------------

    def _put(self, tail: int, frame: bytes | bytearray | memoryview, n: int, flags: int) -> int:
        """Write one record at ``tail`` (room checked by the caller); the new tail."""
        data, cap = self._data, self.capacity
        pos = tail & (cap - 1)
        REC.pack_into(data, pos, n, flags)
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
        return tail + 8 + pad(n)

    def _publish(self) -> None:
        ordered()
        words = self._words
        words[W_TAIL] = self._tail
        fence()
        asleep = words[W_SLEEPING]
        if asleep and self._reader_bell.ring_once(asleep):  # once per sleep of the reader
            self.bells_rung += 1

    def _pump(self) -> None:
        """Write as much of the pending fragmented frame as there is room for."""
        rest = self._remainder
        cap = self.capacity
        wrote = False
        while rest is not None:
            free = cap - (self._tail - self._head_seen)
            if free < min(8 + pad(len(rest)), self._low_water):
                free = self._free()
                if free < min(8 + pad(len(rest)), self._low_water):
                    if wrote:
                        self._publish()
                        wrote = False
                    if not self._arm(min(8 + pad(len(rest)), self._low_water)):
                        break
                    continue  # the room came while we armed: go on
            m = min(len(rest), free - 8)
            last = m == len(rest)
            self._tail = self._put(self._tail, rest[:m], m, 0 if last else MORE)
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
        self._words[W_WANT] = want_word(self._want_seq, need)
        fence()
        return self._free() >= need

    def _free(self) -> int:
        """Free bytes, from the reader's current head; -1 if the reader published a head
        that cannot be (then the ring is marked broken)."""
        if self._error is not None:
            return -1
        head = self._words[W_HEAD]
        ordered()
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
        if not self._closed and self._words[W_WANT]:
            self._words[W_WANT] = 0

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
        self._bell.drain()
        if self._closed:
            return
        if self._words[W_READER_CLOSED]:
            self._reader_closed = True
            self._remainder = None
            self._loop.remove_reader(self._bell.fd)
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


class _Handoff:
    """Hands the :class:`RingFiles` a worker thread opened to the task awaiting it —
    or, if that task was cancelled meanwhile (its loop may even be gone by the time
    the thread ends), closes them, in the thread or at the cancellation, whichever
    comes second. Exactly one side ends up owning them: none are dropped open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: RingFiles | None = None
        self._abandoned = False

    def give(self, attach: Callable[[], RingFiles]) -> None:
        """In the worker thread."""
        files = attach()
        with self._lock:
            abandoned = self._abandoned
            if not abandoned:
                self._files = files
        if abandoned:
            files.close()

    def take(self) -> RingFiles:
        """On the loop, once :meth:`give` returned."""
        with self._lock:
            files, self._files = self._files, None
        assert files is not None
        return files

    def abandon(self) -> None:
        """On the loop, when the awaiting task is cancelled."""
        with self._lock:
            self._abandoned = True
            files, self._files = self._files, None
        if files is not None:
            files.close()
