"""The shared-memory frame ring: order and content, fragments, full rings, doorbells,
two processes, leaks, idle CPU, close and dead peers."""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import deque
from collections.abc import Iterator

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniwire.backends.shm import Segment, sweep_stale_segments
from omniwire.ring import RingClosedError, RingError, RingReader, RingWriter

from conftest import omniwire_segments


def frame(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


class Sender:
    """An ordered queue in front of a writer, the way the endpoint's outbox is."""

    def __init__(self, writer: RingWriter) -> None:
        self.writer = writer
        self.pending: deque[bytes | bytearray | memoryview] = deque()
        self.refused = 0
        self._task: asyncio.Task[None] | None = None

    def send(self, data: bytes | bytearray | memoryview) -> None:
        if not self.pending and self.writer.send_nowait(data):
            return
        self.refused += 1
        self.pending.append(data)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self.pending:
            if self.writer.send_nowait(self.pending[0]):
                self.pending.popleft()
            else:
                await self.writer.wait_writable()

    async def flushed(self) -> None:
        while self.pending:
            await asyncio.sleep(0.001)


async def receive(reader: RingReader, count: int) -> list[bytes]:
    got: list[bytes] = []
    with anyio.fail_after(30):
        while len(got) < count:
            got += await reader.recv()
    return got


def _fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return name in f.read()


def _files_of(name: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(name + "-")}


# -- one process ------------------------------------------------------------------------


sizes = st.one_of(
    st.integers(0, 64), st.integers(65, 3000), st.integers(3000, 20000)
)  # ≥ 3 rings of 4 KiB: fragments


@settings(max_examples=40)
@given(
    capacity=st.sampled_from([4096, 8192]),
    lengths=st.lists(sizes, min_size=1, max_size=40),
    late_start=st.integers(0, 40),
)
@pytest.mark.asyncio
async def test_frames_arrive_whole_and_in_order(
    capacity: int, lengths: list[int], late_start: int
) -> None:
    """Random sizes — empty, small, larger than the ring — through a small ring, with
    the reader starting late so the writer finds the ring full; every frame arrives
    whole, once, in order, and the indices wrap around the ring many times."""
    frames = [frame(i, n) for i, n in enumerate(lengths)]
    reader = RingReader.create(capacity)
    writer = RingWriter.attach(reader.name, owner_pid=os.getpid())
    try:
        sender = Sender(writer)
        for i, f in enumerate(frames):
            if i == late_start:
                got_task = asyncio.ensure_future(receive(reader, len(frames)))
            sender.send(f)
        if late_start >= len(frames):
            got_task = asyncio.ensure_future(receive(reader, len(frames)))
        got = await got_task
        assert got == frames
        with anyio.fail_after(10):
            await sender.flushed()
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_a_full_ring_refuses_then_wait_writable_resumes() -> None:
    reader = RingReader.create(4096)
    writer = RingWriter.attach(reader.name)
    try:
        sent = 0
        while writer.send_nowait(frame(sent, 500)):
            sent += 1
        assert 0 < sent < 9  # 4096 / 512 records
        assert not writer.send_nowait(b"x"), "still full"
        waiting = asyncio.ensure_future(writer.wait_writable())
        await asyncio.sleep(0.05)
        assert not waiting.done(), "nothing was read: the writer must wait"
        got = await receive(reader, sent)
        with anyio.fail_after(10):
            await waiting
        assert writer.send_nowait(frame(sent, 500))
        assert got + await receive(reader, 1) == [frame(i, 500) for i in range(sent + 1)]
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_a_frame_larger_than_the_ring_goes_in_fragments_on_its_own() -> None:
    """send_nowait takes a 100 KiB frame into a 4 KiB ring at once; the rest follows
    as the reader frees room, with nobody calling the writer again."""
    reader = RingReader.create(4096)
    writer = RingWriter.attach(reader.name)
    try:
        big = frame(1, 100_000)
        assert writer.send_nowait(big)
        assert not writer.send_nowait(b"after"), "order: the rest of the big frame first"
        assert await receive(reader, 1) == [big]
        with anyio.fail_after(10):
            await writer.wait_writable()
        assert writer.send_nowait(b"after")
        assert await receive(reader, 1) == [b"after"]
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_a_stream_rings_the_doorbell_far_less_than_once_per_frame() -> None:
    """While the reader is awake the writer does not ring: frames written in one loop
    iteration cost one doorbell, not one each."""
    reader = RingReader.create(1 << 20)
    writer = RingWriter.attach(reader.name)
    try:
        reader.start(lambda frames: None)
        await asyncio.sleep(0.01)
        before = writer.bells_rung
        for i in range(200):
            assert writer.send_nowait(frame(i, 1024))
        assert writer.bells_rung - before <= 1
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_any_bytes_like_frame_travels_as_its_bytes() -> None:
    """bytearray and memoryviews of any format (whose len() counts items, not bytes),
    whole and in fragments."""
    reader = RingReader.create(4096)
    writer = RingWriter.attach(reader.name)
    words = array.array("Q", range(100))
    frames: list[bytes | bytearray | memoryview] = [
        bytearray(b"abc"),
        memoryview(words),
        memoryview(words * 20),  # 16 000 bytes: fragments
        memoryview(b"0123456789")[2:7],
    ]
    try:
        sender = Sender(writer)
        for f in frames:
            sender.send(f)
        assert await receive(reader, len(frames)) == [bytes(f) for f in frames]
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_frame_over_the_limit_is_refused_at_the_writer() -> None:
    reader = RingReader.create(4096, max_frame=1000)
    writer = RingWriter.attach(reader.name, max_frame=1000)
    try:
        with pytest.raises(RingError, match="1001 bytes exceeds"):
            writer.send_nowait(bytes(1001))
        assert writer.send_nowait(bytes(1000))
        assert await receive(reader, 1) == [bytes(1000)]
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_close_is_idempotent_and_releases_fds_mappings_and_names() -> None:
    fds = _fds()
    reader = RingReader.create(8192)
    name = reader.name
    assert len(_files_of(name)) == 3, "segment and two doorbells until a writer attaches"
    assert reader.writer_pid is None and not reader.writer_attached
    writer = RingWriter.attach(name)
    assert reader.writer_pid == os.getpid()
    reader.start(lambda frames: None)
    with anyio.fail_after(10):
        while _files_of(name):  # the reader unlinks its names once the writer is in
            await asyncio.sleep(0.005)
    assert writer.send_nowait(b"x")
    assert _mapped(name)
    writer.close()
    writer.close()
    reader.close()
    reader.close()
    assert _fds() == fds
    assert not _mapped(name)
    assert not _files_of(name)
    assert not writer.send_nowait(b"y")
    with pytest.raises(RingClosedError):
        await writer.wait_writable()
    with pytest.raises(RingClosedError):
        await reader.recv()


def test_an_unattached_ring_leaves_nothing_after_close() -> None:
    fds = _fds()
    reader = RingReader.create()
    reader.close()
    reader.close()
    assert _fds() == fds and not _files_of(reader.name) and not _mapped(reader.name)


@pytest.mark.asyncio
async def test_writer_close_ends_the_reader_after_the_last_frame() -> None:
    reader = RingReader.create(4096)
    writer = RingWriter.attach(reader.name)
    ended: list[RingError | None] = []
    got: list[bytes] = []
    try:
        for i in range(3):
            assert writer.send_nowait(frame(i, 100))
        writer.close()
        reader.start(got.extend, ended.append)
        with anyio.fail_after(10):
            while not ended:
                await asyncio.sleep(0.005)
        assert got == [frame(i, 100) for i in range(3)]
        assert ended == [None]
        assert not reader.peer_alive()
    finally:
        reader.close()


@pytest.mark.asyncio
async def test_reader_close_wakes_a_waiting_writer_with_an_error() -> None:
    reader = RingReader.create(4096)
    writer = RingWriter.attach(reader.name)
    try:
        while writer.send_nowait(bytes(1000)):
            pass
        waiting = asyncio.ensure_future(writer.wait_writable())
        await asyncio.sleep(0.01)
        assert writer.peer_alive()
        reader.close()
        with anyio.fail_after(10), pytest.raises(RingClosedError, match="reader"):
            await waiting
        assert writer.closed and not writer.peer_alive()
        assert not writer.send_nowait(b"x")
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_writer_close_while_waiting_raises_in_the_waiter() -> None:
    reader = RingReader.create(4096)
    writer = RingWriter.attach(reader.name)
    try:
        while writer.send_nowait(bytes(1000)):
            pass
        waiting = asyncio.ensure_future(writer.wait_writable())
        await asyncio.sleep(0.01)
        writer.close()
        with anyio.fail_after(10), pytest.raises(RingClosedError):
            await waiting
    finally:
        reader.close()


@pytest.mark.asyncio
async def test_attach_checks_the_name_the_owner_and_a_single_writer() -> None:
    reader = RingReader.create(4096)
    try:
        with pytest.raises(RingError, match="not 'omniwire-<pid>-<hex>'"):
            RingWriter.attach("omniwire-../etc")
        with pytest.raises(RingError, match="not a ring of process 1"):
            RingWriter.attach(reader.name, owner_pid=1)
        with pytest.raises(RingError, match="cannot attach"):
            RingWriter.attach(f"omniwire-{os.getpid()}-0123456789abcdef")
        writer = RingWriter.attach(reader.name)
        with pytest.raises(RingError, match="has a writer already"):
            RingWriter.attach(reader.name)
        writer.close()
    finally:
        reader.close()
    with pytest.raises(RingError, match="cannot attach"):
        RingWriter.attach(reader.name)


@pytest.mark.asyncio
@pytest.mark.parametrize("bell", [1, 2])
@pytest.mark.parametrize("change", ["mode", "owner", "regular_file"])
async def test_attach_refuses_a_doorbell_that_is_not_a_private_fifo(bell: int, change: str) -> None:
    """Spec §3.6: a writer opens each doorbell with ``O_NOFOLLOW`` and checks, on the
    descriptor, that it is a FIFO owned by its own uid with mode 0600; else it does
    not attach (a FIFO others may open lets them ring, drain, or take its lock)."""
    reader = RingReader.create(4096)
    path = f"/dev/shm/{reader.name}-{bell}"
    try:
        if change == "mode":
            os.chmod(path, 0o666)
        elif change == "owner":
            if os.geteuid() != 0:
                pytest.skip("chown to another uid needs root")
            os.chown(path, os.geteuid() + 4242, -1)
        else:
            os.unlink(path)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.close(fd)
        with pytest.raises(RingError, match="doorbell"):
            RingWriter.attach(reader.name)
    finally:
        reader.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [100, 8192])
async def test_attach_refuses_a_segment_that_is_not_a_ring(size: int) -> None:
    name = f"omniwire-{os.getpid()}-00c0ffee00c0ffee"
    segment = Segment.create(name + "-0", size)
    try:
        with pytest.raises(RingError, match="is not a version-1 omniwire ring"):
            RingWriter.attach(name)
    finally:
        segment.unlink()
        segment.close()


def test_capacity_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        RingReader.create(5000)
    with pytest.raises(ValueError, match="power of two"):
        RingReader.create(2048)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("tail", "record", "match"),
    [
        (12_345, None, "published tail"),  # not a multiple of 8
        (1 << 40, None, "published tail"),  # more than the capacity in use
        (16, (4000, 0), "overruns the tail"),  # a record longer than what was published
        (16, (8, 0x80), "flags"),  # unknown flag
        (8, (0, 1), "empty fragment"),  # a fragment of nothing: a chain of them never ends
    ],
)
async def test_a_corrupt_ring_stops_the_reader_with_an_error_not_a_crash(
    tail: int, record: tuple[int, int] | None, match: str
) -> None:
    """A writer that publishes nonsense (a bug, or hostile) cannot make the reader read
    outside the ring or raise into the event loop: the reader reports and stops."""
    reader = RingReader.create(4096)
    segment = Segment.attach(reader.name + "-0")
    mv = memoryview(segment.base.numpy())
    words = mv[:4096].cast("Q")
    ended: list[RingError | None] = []
    got: list[list[bytes]] = []
    try:
        if record is not None:
            mv[4096 : 4096 + 8] = record[0].to_bytes(4, "little") + record[1].to_bytes(4, "little")
        words[16] = tail
        reader.start(got.append, ended.append)
        with anyio.fail_after(10):
            while not ended:
                await asyncio.sleep(0.005)
        assert isinstance(ended[0], RingError) and match in str(ended[0])
        assert got == []
        with pytest.raises(RingError, match=match):
            await reader.recv()
    finally:
        words.release()
        mv.release()
        segment.close()
        reader.close()


@pytest.mark.asyncio
async def test_a_turn_of_the_reader_takes_a_bounded_number_of_records() -> None:
    """Was: a turn took up to 1 MiB of records whatever their count: a writer filling
    the ring with empty frames (8 bytes each) had 131,072 of them copied and handed
    over in one turn of the event loop, each decoded by the endpoint (a 1 s stall
    of its other peers). A turn now takes at most ``TURN_RECORDS`` records."""
    from omniwire.ring._reader import TURN_RECORDS

    capacity = 1 << 16
    reader = RingReader.create(capacity)
    segment = Segment.attach(reader.name + "-0")
    mv = memoryview(segment.base.numpy())
    words = mv[:4096].cast("Q")
    batches: list[int] = []
    try:
        mv[4096 : 4096 + capacity] = bytes(capacity)  # 8,192 empty frames
        words[16] = capacity
        reader.start(lambda frames: batches.append(len(frames)), lambda _e: None)
        with anyio.fail_after(10):
            while sum(batches) < capacity // 8:
                await asyncio.sleep(0.005)
        assert max(batches) <= TURN_RECORDS < capacity // 8
    finally:
        words.release()
        mv.release()
        segment.close()
        reader.close()


@pytest.mark.asyncio
async def test_a_reader_publishing_an_impossible_head_breaks_the_ring_not_the_writer() -> None:
    """The writer trusts nothing it reads either: a head beyond its tail refuses further
    frames and fails the waiter, instead of writing outside the ring."""
    reader = RingReader.create(4096)
    segment = Segment.attach(reader.name + "-0")
    words = memoryview(segment.base.numpy()).cast("B")[:4096].cast("Q")
    writer = RingWriter.attach(reader.name)
    try:
        words[32] = 1 << 40  # the head
        sent = 0
        while writer.send_nowait(bytes(500)):
            sent += 1
        assert sent < 9
        with anyio.fail_after(10), pytest.raises(RingError, match="published head"):
            await writer.wait_writable()
        assert writer.closed and not writer.send_nowait(b"x")
    finally:
        words.release()
        segment.close()
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_an_oversized_frame_from_a_writer_with_a_higher_limit_stops_the_reader() -> None:
    reader = RingReader.create(4096, max_frame=10_000)
    writer = RingWriter.attach(reader.name, max_frame=1 << 20)
    ended: list[RingError | None] = []
    try:
        reader.start(lambda frames: None, ended.append)
        assert writer.send_nowait(bytes(20_000))
        with anyio.fail_after(10):
            while not ended:
                await asyncio.sleep(0.005)
        assert isinstance(ended[0], RingError) and "exceeds the limit" in str(ended[0])
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_a_failing_callback_is_logged_and_the_ring_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reader = RingReader.create(4096)
    writer = RingWriter.attach(reader.name)
    seen: list[bytes] = []

    def on_frames(frames: list[bytes]) -> None:
        seen.extend(frames)
        if frames[0] == b"boom":
            raise RuntimeError("callback bug")

    try:
        reader.start(on_frames)
        assert writer.send_nowait(b"boom")
        with anyio.fail_after(10):
            while not seen:
                await asyncio.sleep(0.005)
        assert writer.send_nowait(b"next")
        with anyio.fail_after(10):
            while seen[-1] != b"next":
                await asyncio.sleep(0.005)
        assert "callback failed" in caplog.text
    finally:
        writer.close()
        reader.close()


# -- two processes --------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, os, sys
    from collections import deque
    from omniwire.ring import RingReader, RingWriter

    async def main():
        loop = asyncio.get_running_loop()
        reader = writer = None
        pending = deque()
        task = None

        async def drain():
            while pending:
                if writer.send_nowait(pending[0]):
                    pending.popleft()
                else:
                    await writer.wait_writable()

        def echo(frames):
            nonlocal task
            for f in frames:
                if pending or not writer.send_nowait(f):
                    pending.append(f)
                    if task is None or task.done():
                        task = loop.create_task(drain())

        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line or line[0] == "quit":
                break
            if line[0] == "attach":  # attach to the parent's ring, offer ours
                if writer is not None:
                    writer.close()
                    reader.close()
                pending.clear()
                writer = RingWriter.attach(line[1], owner_pid=os.getppid())
                reader = RingReader.create(int(line[2]))
                reader.start(echo)
                print(reader.name, flush=True)
            elif line[0] == "offer":  # a ring nobody will attach to (then we get killed)
                print(RingReader.create(4096).name, flush=True)
        if writer is not None:
            writer.close()
            reader.close()

    asyncio.run(main())
    """
)


class Child:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture(scope="module")
def child() -> Iterator[Child]:
    c = Child()
    yield c
    c.stop()
    assert c.proc.returncode == 0


async def _echo_pair(child: Child, capacity: int) -> tuple[RingReader, RingWriter]:
    reader = RingReader.create(capacity)
    name = await asyncio.to_thread(child.ask, f"attach {reader.name} {capacity}")
    assert name.startswith(f"omniwire-{child.proc.pid}-"), name
    return reader, RingWriter.attach(name, owner_pid=child.proc.pid)


@settings(max_examples=15)
@given(
    capacity=st.sampled_from([4096, 65536]),
    lengths=st.lists(sizes, min_size=1, max_size=60),
)
@pytest.mark.asyncio
async def test_echo_through_another_process(
    child: Child, capacity: int, lengths: list[int]
) -> None:
    """Frames to a child process and back through two rings (each side's writer sees
    the other's ring full at times): all arrive whole and in order."""
    frames = [frame(i, n) for i, n in enumerate(lengths)]
    reader, writer = await _echo_pair(child, capacity)
    try:
        assert reader.writer_pid == child.proc.pid
        sender = Sender(writer)
        for f in frames:
            sender.send(f)
        assert await receive(reader, len(frames)) == frames
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_a_long_stream_through_another_process(child: Child) -> None:
    """Thousands of frames both ways at once, so that each side's reader keeps going to
    sleep and waking while the other writes: a lost wakeup would stall the stream."""
    rng = random.Random(7)
    frames = [frame(i, rng.choice((0, 8, 100, 1000, 5000, 70_000))) for i in range(3000)]
    reader, writer = await _echo_pair(child, 65536)
    try:
        sender = Sender(writer)
        got_task = asyncio.ensure_future(receive(reader, len(frames)))
        for i, f in enumerate(frames):
            sender.send(f)
            if i % 7 == 0:
                await asyncio.sleep(0)
        assert await got_task == frames
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_idle_rings_use_no_cpu(child: Child) -> None:
    """An idle reader sleeps in epoll: over one idle second neither this process nor
    the child (each with a started reader and an attached writer) spends CPU."""
    reader, writer = await _echo_pair(child, 65536)
    try:
        sender = Sender(writer)
        sender.send(b"warm")
        assert await receive(reader, 1) == [b"warm"]
        ours, theirs = time.process_time(), child.cpu_seconds()
        await asyncio.sleep(1.0)
        assert time.process_time() - ours < 0.05
        assert child.cpu_seconds() - theirs < 0.05
        sender.send(b"still there")
        assert await receive(reader, 1) == [b"still there"]
    finally:
        writer.close()
        reader.close()


@pytest.mark.asyncio
async def test_a_killed_peer_wedges_nothing_and_leaks_nothing() -> None:
    """The child is SIGKILLed with rings in both directions and one it never gave out.
    Our writer sees the reader gone and refuses once the ring is full, without
    blocking; our reader sees the writer gone; the sweep removes the dead child's
    unattached ring (its FIFOs do not block it); closing leaves no fd behind."""
    fds = _fds()
    c = Child()
    try:
        reader, writer = await _echo_pair(c, 4096)
        offered = await asyncio.to_thread(c.ask, "offer")
        assert len(_files_of(offered)) == 3
        sender = Sender(writer)
        sender.send(b"ping")
        assert await receive(reader, 1) == [b"ping"]
        assert writer.peer_alive() and reader.peer_alive()
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait()
        for pipe in (c.proc.stdin, c.proc.stdout):
            assert pipe is not None
            pipe.close()
        assert not writer.peer_alive()
        assert not reader.peer_alive()
        for i in range(100):
            if not writer.send_nowait(frame(i, 500)):
                break
        else:
            pytest.fail("a ring nobody reads must fill up")
        with pytest.raises(RingClosedError, match="is gone"):
            RingWriter.attach(offered)
        removed = sweep_stale_segments()
        assert _files_of(offered) == set()
        assert {f"{offered}-{n}" for n in range(3)} <= set(removed)
        writer.close()
        reader.close()
        assert not {s for s in omniwire_segments() if s.startswith(f"omniwire-{c.proc.pid}-")}
        assert _fds() == fds
    finally:
        c.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("yields", [0, 1, 50], ids=["at-once", "soon", "late"])
async def test_an_attach_cancelled_midway_leaves_no_file_open(yields: int) -> None:
    """``RingWriter.open`` checks and maps the ring in a worker thread; a task
    cancelled meanwhile (an endpoint closing) must not drop what the thread opened:
    its descriptors and its mapping are closed, whoever finishes first."""
    reader = RingReader.create(4096)
    try:
        with_reader = _fds()
        task = asyncio.ensure_future(RingWriter.open(reader.name))
        for _ in range(yields):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if not task.cancelled():  # it won the race: an ordinary writer, closed here
            task.result().close()
        with anyio.fail_after(10):
            while _fds() != with_reader or _mappings(reader.name) != 1:
                await asyncio.sleep(0.01)
    finally:
        reader.close()


def _mappings(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(f"{name}-0" in line for line in f)


@pytest.mark.asyncio
async def test_frames_the_callback_leaves_come_back_first_and_pause_holds_the_ring() -> None:
    """The consumer bounds its own turn: the frames its callback returns come back, in
    order, at a later turn and before any newer frame; while it is paused nothing is
    delivered, and the writer's room stays taken."""
    reader = RingReader.create(4096)
    writer = RingWriter.attach(reader.name)
    calls: list[list[bytes]] = []
    turn = 0

    def on_frames(frames: list[bytes]) -> list[bytes]:
        calls.append(frames)
        return frames[2:]  # two a turn

    async def ticker() -> None:
        nonlocal turn
        while True:
            turn += 1
            await asyncio.sleep(0)

    try:
        for i in range(7):
            assert writer.send_nowait(b"%d" % i)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            reader.start(on_frames, lambda _e: None)
            with anyio.fail_after(10):
                while sum(min(2, len(c)) for c in calls) < 7:
                    await asyncio.sleep(0)
            taken = [f for c in calls for f in c[:2]]
            assert taken == [b"%d" % i for i in range(7)]
            assert [len(c) for c in calls] == [7, 5, 3, 1]
            reader.pause()
            assert writer.send_nowait(b"late")
            before, seen = len(calls), turn
            with anyio.fail_after(10):
                while turn < seen + 20:
                    await asyncio.sleep(0)
            assert len(calls) == before  # paused: nothing delivered
            reader.resume()
            with anyio.fail_after(10):
                while len(calls) == before:
                    await asyncio.sleep(0)
            assert calls[-1] == [b"late"]
            tg.cancel_scope.cancel()
    finally:
        writer.close()
        reader.close()
