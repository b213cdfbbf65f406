"""A hostile same-host peer and the memory it shares (issue 19, spec §9.2, §13).

The victim endpoint runs in its own process (``shm_victim.py``): a SIGBUS would
kill it, not pytest. The hostile peer, Mallory, is this process, speaking raw
ZeroMQ with frames made by hand; the friend, an ordinary endpoint here too, checks
that the victim keeps serving another peer through every attack. Each attack once
killed the victim (SIGBUS), made it allocate what Mallory declared, or made it
deliver memory that was not Mallory's; now it costs Mallory her object or her ring.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import secrets
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from omniwire import codec, wire
from omniwire.endpoint import Endpoint
from omniwire.hostinfo import host_id
from omniwire.testing import _warm as warm
from omniwire.testing.conformance import ipc_address

from foreign_peer import RingWriter as RawRingWriter

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

SHM = "/dev/shm"
MiB = 1 << 20
SPARSE = 256 * MiB
VICTIM = str(Path(__file__).with_name("shm_victim.py"))


# -- the victim, in its own process --------------------------------------------------


class Victim:
    """The endpoint ``victim`` in a child process; its events come as JSON lines."""

    def __init__(self, *, zero_copy: bool, ring: bool) -> None:
        self.address = ipc_address(f"victim-{secrets.token_hex(3)}")
        args = [VICTIM, self.address]
        args += ["--zero-copy"] if zero_copy else []
        args += [] if ring else ["--no-ring"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = warm.start(args, env, stdin=True)  # forked: torch is imported already
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(line))

    async def expect(
        self, match: Callable[[dict[str, Any]], bool], timeout: float = 30
    ) -> dict[str, Any]:
        """The next event that matches (earlier ones are kept in ``seen``)."""
        with anyio.fail_after(timeout):
            while True:
                if self.proc.poll() is not None and self.events.empty():
                    raise AssertionError(f"the victim died: {self.status()}")
                try:
                    event = self.events.get_nowait()
                except queue.Empty:
                    await anyio.sleep(0.01)
                    continue
                self.seen.append(event)
                if match(event):
                    return event

    def command(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def status(self) -> str:
        rc = self.proc.poll()
        if rc is None:
            return "alive"
        if rc < 0:
            return f"killed by {signal.Signals(-rc).name}"
        return f"exited with status {rc}"

    async def still_serves(self, friend: Endpoint, tag: str) -> None:
        """The friend's payload arrives whole, and the victim has not died."""
        t = torch.arange(65536, dtype=torch.int32)  # 256 KiB: by shm, not inline
        receipt = await friend.send("victim", {"t": t}, request_id=tag)
        event = await self.expect(lambda e: e.get("request") == tag)
        assert event["data"] == bytes(t.view(torch.uint8).numpy()).hex()
        await receipt.wait(30)
        self.command("touch")  # every byte of every delivery it holds is still readable
        await self.expect(lambda e: "touched" in e)
        assert self.status() == "alive"

    def quit(self) -> int:
        with contextlib.suppress(OSError):
            self.command("quit")
        try:
            return self.proc.wait(30)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


@contextlib.asynccontextmanager
async def scene(
    *, zero_copy: bool = True, ring: bool = False
) -> AsyncIterator[tuple[Victim, Endpoint, Mallory]]:
    victim = Victim(zero_copy=zero_copy, ring=ring)
    mallory: Mallory | None = None
    try:
        ready = await victim.expect(lambda e: "ready" in e)
        async with Endpoint(
            "friend",
            address=ipc_address("friend"),
            peers={"victim": ready["ready"]},
            routes={"victim": "shm"},
            control_ring=False,
        ) as friend:
            await friend.wait_peer("victim", 30)
            await victim.still_serves(friend, "before")
            mallory = Mallory(victim.address, ring=ring)
            yield victim, friend, mallory
            await victim.still_serves(friend, "after")
            mallory.close()
            mallory = None
        assert victim.quit() == 0, victim.status()
    finally:
        if mallory is not None:
            mallory.close()
        victim.stop()


# -- Mallory, by hand --------------------------------------------------------------------


class Mallory:
    """A same-uid peer that passed the handshake: raw ZeroMQ, her own shm prefix."""

    def __init__(self, victim: str, *, ring: bool = False) -> None:
        self.ctx = zmq.asyncio.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(victim)
        self.pull = self.ctx.socket(zmq.PULL)
        self.address = ipc_address("mallory")
        self.pull.bind(self.address)
        self.prefix = f"omniwire-{os.getpid()}-{secrets.token_hex(4)}"
        self.ring = ring
        self.instance = secrets.randbits(62)
        self.received: list[Any] = []
        self.paths: list[str] = []
        self.fds: list[int] = []
        self._n = 0

    def hello(self, *, is_reply: bool = False, ring: str = "", ring_attached: str = "") -> bytes:
        info = msgspec.msgpack.encode({"prefix": self.prefix})
        return wire.encode(
            wire.HelloMessage(
                endpoint="mallory",
                wire_min=(1, 0),
                wire_max=(1, 1),
                features=("ring",) if self.ring else (),
                host_id=host_id(),
                pid=os.getpid(),
                process_token="mallory-token",
                instance=self.instance,
                address=self.address,
                backends=(wire.BackendInfo(name="shm", info=info),),
                is_reply=is_reply,
                to_endpoint="victim",
                ring=ring,
                ring_attached=ring_attached,
            )
        )

    async def recv(self, match: Callable[[Any], bool], timeout: float = 30) -> Any:
        """The next message (batches unpacked) that matches."""
        with anyio.fail_after(timeout):
            while True:
                msg = wire.decode(await self.pull.recv())
                msgs = msg.messages if isinstance(msg, wire.BatchMessage) else (msg,)
                for m in msgs:
                    self.received.append(m)
                    if match(m):
                        return m

    async def join(self, ring: str = "") -> wire.HelloMessage:
        """Hello, then the victim's answer (the victim's ring offer, if any)."""
        await self.push.send(self.hello(ring=ring))
        hello: wire.HelloMessage = await self.recv(lambda m: isinstance(m, wire.HelloMessage))
        return hello

    async def announce(
        self, object_id: int, segment: str, offset: int, size: int, **kw: Any
    ) -> None:
        enc = codec.dumps({"t": torch.zeros(size, dtype=torch.uint8)})
        info = msgspec.msgpack.encode(
            {"segment": segment, "offset": offset, "size": size, "dedicated": False, **kw}
        )
        ref = wire.DataRef(
            object_id=object_id,
            kind="payload",
            backend="shm",
            layout="packed",
            ref=wire.BackendRef(backend="shm", info=info, length=size),
            header=enc.header,
            tensors=(
                wire.TensorMeta(
                    dtype="uint8", shape=(size,), offset=0, nbytes=size, path=enc.paths[0]
                ),
            ),
        )
        await self.push.send(
            wire.encode(
                wire.DataReadyMessage(
                    request_id=f"evil-{object_id}",
                    from_stage="mallory",
                    to_stage="victim",
                    data_ref=ref,
                )
            )
        )

    async def ack(self, object_id: int, timeout: float = 30) -> wire.DataAckMessage:
        ack: wire.DataAckMessage = await self.recv(
            lambda m: isinstance(m, wire.DataAckMessage) and m.object_id == object_id, timeout
        )
        return ack

    def name(self) -> str:
        self._n += 1
        return f"{self.prefix}-{self._n}"

    def named_segment(self, size: int, data: bytes = b"") -> tuple[str, int]:
        """A plain /dev/shm file under her prefix (what every 1.1 writer made); sparse
        but for ``data`` at offset 0."""
        name = self.name()
        path = os.path.join(SHM, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.paths.append(path)
        self.fds.append(fd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        os.pwrite(fd, data, 0)
        return name, fd

    def memfd_segment(
        self, size: int, data: bytes = b"", *, sealed: bool = True
    ) -> tuple[str, int]:
        """A memfd named after her segment, behind a symlink under her prefix."""
        name = self.name()
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.fds.append(fd)
        os.ftruncate(fd, size)
        os.pwrite(fd, data, 0)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.link(name, f"/proc/{os.getpid()}/fd/{fd}")
        return name, fd

    def link(self, name: str, target: str) -> None:
        path = os.path.join(SHM, name)
        os.symlink(target, path)
        self.paths.append(path)

    def close(self) -> None:
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


async def outcome(
    victim: Victim, m: Mallory, object_id: int, timeout: float = 15
) -> tuple[str, str]:
    """What became of Mallory's object: ``("nack", error)``, ``("ack", "")``, or
    ``("delivered", hex)`` (a zero-copy victim ACKs only when it lets go).

    An object the victim fails to take comes back twice, on two channels: as the NACK
    on the wire (§7.4) and as an error delivery to its application (its stdout here).
    Nothing orders the two, so an error delivery is not an outcome of its own: it
    waits for the NACK, which must come, and must say what the delivery said."""
    result: list[tuple[str, str]] = []
    failed: list[str] = []  # the error delivery's text, when it came first
    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as tg:

            async def ack() -> None:
                a = await m.ack(object_id, timeout + 1)
                result.append(("ack", "") if a.success else ("nack", a.error or ""))
                tg.cancel_scope.cancel()

            async def delivered() -> None:
                e = await victim.expect(
                    lambda e: e.get("request") == f"evil-{object_id}", timeout + 1
                )
                if e.get("kind") == "error":
                    failed.append(e.get("error") or "")
                    return  # the NACK decides (the ack task)
                result.append(("delivered", e.get("data") or ""))
                tg.cancel_scope.cancel()

            tg.start_soon(ack)
            tg.start_soon(delivered)
        what, detail = result[0]
        if failed:  # an error delivery, then the NACK of the same failure
            assert what == "nack", f"object {object_id}: an error delivery, then an ACK"
            assert failed[0].startswith(detail), (failed[0], detail)
        return what, detail
    raise AssertionError(
        f"object {object_id}: no ACK and no delivery"
        + (f" (an error delivery without its NACK: {failed[0]!r})" if failed else "")
        + f"; the victim: {victim.status()}"
    )


def _allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def _ok(ack: wire.DataAckMessage) -> bool:
    assert ack.success, ack.error
    return True


# -- 1. truncation after mapping: SIGBUS ------------------------------------------------


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "copy"])
async def test_a_kept_segment_truncated_after_an_object_was_taken(zero_copy: bool) -> None:
    """Object 1 of a 1 MiB segment is taken (and held); Mallory truncates the segment
    to 0 and announces object 2 in it. Before: the victim mapped the segment and kept
    it mapped, so reading object 2 (or touching object 1) raised SIGBUS and killed it.
    Now: a plain file is read with ``pread``, so object 2 is a short read, NACKed."""
    async with scene(zero_copy=zero_copy) as (victim, _friend, m):
        await m.join()
        data = bytes(range(256)) * 16
        name, fd = m.named_segment(MiB, data)
        await m.announce(1, name, 0, 4096)
        if not zero_copy:  # a zero-copy receiver ACKs when the application lets go
            assert _ok(await m.ack(1))
        event = await victim.expect(lambda e: e.get("request") == "evil-1")
        assert event["data"] == data.hex()
        os.ftruncate(fd, 0)
        await m.announce(2, name, 8192, 4096)
        what, error = await outcome(victim, m, 2)
        assert what == "nack" and "truncated" in error
        victim.command("touch")  # object 1, still held: a copy, readable
        await victim.expect(lambda e: "touched" in e)


async def test_an_unsealed_memfd_behind_a_symlink_is_refused() -> None:
    """Before: the victim followed the link, mapped the memfd and took the object;
    truncating the memfd then killed it with SIGBUS. Now: memory that comes through a
    link must be sealed against shrinking; this is refused before it is mapped."""
    async with scene() as (victim, _friend, m):
        await m.join()
        name, fd = m.memfd_segment(MiB, b"\1" * 4096, sealed=False)
        await m.announce(1, name, 0, 4096)
        first = await outcome(victim, m, 1)
        os.ftruncate(fd, 0)
        victim.command("touch")  # before: a view of the truncated memfd, SIGBUS
        await victim.expect(lambda e: "touched" in e)
        assert first[0] == "nack" and "sealed" in first[1], first


async def test_a_sealed_memfd_cannot_be_truncated_under_a_zero_copy_view() -> None:
    """The mechanism: a sealed segment is mapped and viewed in place (zero-copy), and
    nobody — its owner included — can shrink it."""
    async with scene(zero_copy=True) as (victim, _friend, m):
        await m.join()
        data = b"\x07" * 4096
        name, fd = m.memfd_segment(MiB, data)
        await m.announce(1, name, 0, 4096)
        assert (await victim.expect(lambda e: e.get("request") == "evil-1"))["data"] == data.hex()
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)


async def test_a_ring_writer_that_truncates_the_ring() -> None:
    """Mallory attaches to the ring the victim offers her, keeping her own descriptor
    of its segment, truncates it and rings. Before: the victim, reading its ring,
    died of SIGBUS. Now the ring is a sealed memfd: the truncation fails."""
    async with scene(ring=True) as (victim, _friend, m):
        offer = await m.join()
        assert offer.ring
        fd = os.open(os.path.join(SHM, f"{offer.ring}-0"), os.O_RDWR)
        m.fds.append(fd)
        writer = RawRingWriter(offer.ring, offer.pid)
        await m.push.send(m.hello(is_reply=True, ring_attached=offer.ring))  # the fence
        await anyio.sleep(0.5)
        writer.send(m.hello(is_reply=True))
        truncated = True
        try:
            os.ftruncate(fd, 0)
        except PermissionError:
            truncated = False
        os.write(writer.reader_bell, b"\0")  # wake the reader: it loads the words
        await anyio.sleep(1)
        assert victim.status() == "alive"
        assert not truncated
        if not truncated:
            writer.close()


def _legacy_ring(
    m: Mallory, capacity: int, size: int | None = None, header: bool = True
) -> tuple[str, int]:
    """A ring made as every 1.1 reader made it: a plain /dev/shm file and two FIFOs."""
    name = f"omniwire-{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(SHM, f"{name}-0")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    m.paths.append(path)
    m.fds.append(fd)
    os.ftruncate(fd, 4096 + capacity if size is None else size)
    if header:
        words = [0] * 512
        words[0], words[1], words[2], words[3] = 0x0031474E4952574F, 1, capacity, os.getpid()
        words[33] = 1
        os.pwrite(fd, b"".join(w.to_bytes(8, "little") for w in words), 0)
    for n in (1, 2):
        fifo = os.path.join(SHM, f"{name}-{n}")
        os.mkfifo(fifo, 0o600)
        m.paths.append(fifo)
    bell = os.open(os.path.join(SHM, f"{name}-1"), os.O_RDWR | os.O_NONBLOCK)
    m.fds.append(bell)
    fcntl.flock(bell, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the reader lives
    return name, fd


async def test_a_ring_reader_that_truncates_the_ring_it_offered() -> None:
    """Mallory offers a ring (a plain file, as 1.1 made them); the victim attaches as
    its writer; she truncates it, then makes the victim write (an ACK). Before: the
    victim died of SIGBUS. Now it does not attach to memory it cannot trust the size
    of: it stays on ZeroMQ, and the ACK comes that way."""
    async with scene(ring=True) as (victim, _friend, m):
        ring, fd = _legacy_ring(m, 1 << 16)
        await m.join(ring=ring)
        with anyio.move_on_after(3):  # the fence, if it attaches (before)
            await m.recv(lambda x: isinstance(x, wire.HelloMessage) and x.ring_attached == ring)
        os.ftruncate(fd, 0)
        name, _ = m.named_segment(4096, b"\3" * 4096)
        await m.announce(1, name, 0, 4096)
        what, _ = await outcome(victim, m, 1)  # before: the victim died writing to the ring
        assert what == "delivered"
        assert not any(
            isinstance(x, wire.HelloMessage) and x.ring_attached == ring for x in m.received
        ), "the victim attached to a ring whose size it cannot trust"


# -- 2. sparse files: the receiver allocates nothing it does not read -----------------


@pytest.mark.parametrize("kind", ["named", "memfd"])
async def test_a_sparse_segment_is_not_allocated_by_the_receiver(kind: str) -> None:
    """A 256 MiB segment with no pages, one 4 KiB object in it. Before: the victim
    mapped it whole with MAP_POPULATE, which allocated all 256 MiB."""
    async with scene() as (victim, _friend, m):
        await m.join()
        data = b"\x05" * 4096
        make = m.named_segment if kind == "named" else m.memfd_segment
        name, fd = make(SPARSE, data)
        before = _allocated(fd)
        await m.announce(1, name, 0, 4096)
        assert (await victim.expect(lambda e: e.get("request") == "evil-1"))["data"] == data.hex()
        assert _allocated(fd) - before <= MiB, f"{_allocated(fd) >> 20} MiB allocated"


@pytest.mark.parametrize("kind", ["named", "memfd"])
async def test_a_sparse_ring_offer_is_checked_before_it_is_mapped(kind: str) -> None:
    """A Hello whose ring names a 256 MiB sparse segment with no ring header. Before:
    the victim mapped and populated it (on its event loop), then refused it."""
    async with scene(ring=True) as (victim, friend, m):
        if kind == "named":
            ring, fd = _legacy_ring(m, SPARSE - 4096, header=False)
        else:
            ring, _ = _legacy_ring(m, 1 << 16)
            os.unlink(os.path.join(SHM, f"{ring}-0"))
            fd = os.memfd_create(f"{ring}-0", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            m.fds.append(fd)
            os.ftruncate(fd, SPARSE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            m.link(f"{ring}-0", f"/proc/{os.getpid()}/fd/{fd}")
        await m.join(ring=ring)
        await victim.still_serves(friend, "offered")
        assert _allocated(fd) <= MiB, f"{_allocated(fd) >> 20} MiB allocated"
        assert not any(
            isinstance(x, wire.HelloMessage) and x.ring_attached == ring for x in m.received
        )


# -- 3. names that point elsewhere -------------------------------------------------------


@pytest.mark.parametrize("target", ["file", "friend_arena", "friend_fd", "hardlink"])
async def test_a_segment_name_cannot_point_at_other_memory(target: str, tmp_path: Path) -> None:
    """``<her prefix>-N`` is a symlink to a file outside /dev/shm, to the friend's
    arena, or to the friend's descriptor of it through her own /proc; or a hard link
    to another process's segment. Before: the victim followed it and delivered those
    bytes as hers. Now: refused (NACK), nothing delivered."""
    async with scene() as (victim, friend, m):
        await m.join()
        secret = b"\x5a" * 4096
        name = m.name()
        shm = friend.backend("shm")
        arena = shm._arena  # type: ignore[attr-defined]
        assert arena is not None
        if target == "file":
            (tmp_path / "secret").write_bytes(secret)
            m.link(name, str(tmp_path / "secret"))
        elif target == "friend_arena":
            m.link(name, os.path.join(SHM, arena.name))
        elif target == "friend_fd":
            m.link(name, f"/proc/{os.getpid()}/fd/{arena._fd}")
        else:
            other = os.path.join(SHM, f"omniwire-{os.getpid()}-{secrets.token_hex(4)}-0")
            fd = os.open(other, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, secret)
            os.close(fd)
            m.paths.append(other)
            os.link(other, os.path.join(SHM, name))
            m.paths.append(os.path.join(SHM, name))
        await m.announce(1, name, 0, 4096)
        what, detail = await outcome(victim, m, 1)
        assert what == "nack", f"the victim took it: {what} {detail[:32]}..."
