"""A foreign omniwire peer, written from specs/wire-v1.md alone.

Raw pyzmq, the ``msgpack`` package (not msgspec), numpy and the POSIX calls the
spec names; it imports no omniwire code (a test checks). It validates every frame
it receives — and every frame it sends — against specs/wire-v1.cddl.

Synchronous on purpose: every wait is a bounded ``poll``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import stat
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

import wire_cddl

MAGIC = b"OWIR"
VERSION = (1, 1)
ALIGN = 64
SHM_DIR = "/dev/shm"
SEGMENT = re.compile(r"^omniwire-(\d+)-([0-9a-f]{8,32})-(\d+)$")
EXT_TUPLE, EXT_TENSOR, EXT_NDARRAY, EXT_STRUCT, EXT_PICKLE = 1, 2, 3, 4, 5
#: wire dtype name → numpy dtype (the ones numpy has; spec §11.4)
DTYPES = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "bool": np.bool_,
    "complex64": np.complex64,
    "complex128": np.complex128,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class Timeout(AssertionError):
    """An expected frame did not come."""


#: Frames never numbered in a resuming session (§10.7).
UNNUMBERED = frozenset({"hello", "goodbye", "refusal"})
#: An ack alone after this many unacknowledged frames, or once the sockets are idle
#: for ACK_IDLE seconds while we wait for frames (§10.7: "within its housekeeping period").
ACK_FRAMES = 32
ACK_IDLE = 0.05


def new_token() -> int:
    """A session token: random, 1 … 2^64 − 1 (§10.7)."""
    return secrets.randbits(64) or 1


def host_id() -> str:
    """omniwire's host identity (spec §4.1): ``<boot id>/<st_dev of /dev/shm>``."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}/{os.stat(SHM_DIR).st_dev}"


def frame(body: dict[str, Any], version: tuple[int, int] = VERSION) -> bytes:
    """Prefix (§3) + the body in the encoding of §2.3 (msgpack's smallest forms)."""
    return MAGIC + bytes([version[0], version[1], 0, 0]) + msgpack.packb(body, use_bin_type=True)


# -- payloads (§5, §6) -------------------------------------------------------------------


def pack(arrays: list[np.ndarray]) -> tuple[list[dict[str, Any]], bytes]:
    """The tensor table and packed bytes of ``arrays`` (64-byte aligned, §5)."""
    metas: list[dict[str, Any]] = []
    out = bytearray()
    for i, a in enumerate(arrays):
        a = np.ascontiguousarray(a)
        offset = -(-len(out) // ALIGN) * ALIGN
        out.extend(bytes(offset - len(out)))
        out.extend(a.tobytes())
        metas.append(
            {
                "dtype": _NAMES[a.dtype],
                "shape": list(a.shape),
                "offset": offset,
                "nbytes": a.nbytes,
                "device": "cpu",
                "path": f"payload[{i}]",
            }
        )
    return metas, bytes(out)


def unpack(buffer: bytes | memoryview, metas: list[dict[str, Any]]) -> list[np.ndarray]:
    out = []
    for m in metas:
        raw = bytes(buffer[m["offset"] : m["offset"] + m["nbytes"]])
        out.append(np.frombuffer(raw, dtype=DTYPES[m["dtype"]]).reshape(m["shape"]))
    return out


def header(value: Any) -> bytes:
    """A header (§6) in which every ``TensorIndex`` is ext 2."""

    def walk(v: Any) -> Any:
        if isinstance(v, TensorIndex):
            return msgpack.ExtType(EXT_TENSOR, msgpack.packb(v.index))
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return msgpack.ExtType(EXT_TUPLE, msgpack.packb([walk(x) for x in v]))
        return v

    return msgpack.packb(walk(value), use_bin_type=True)


@dataclass(frozen=True)
class TensorIndex:
    index: int


def read_header(data: bytes, tensors: list[np.ndarray]) -> Any:
    """Decode a header (§6): ext 1 → tuple, ext 2/3 → the table's array; no pickle."""

    def ext(code: int, payload: bytes) -> Any:
        if code == EXT_TUPLE:
            return tuple(read_header(payload, tensors))
        if code in (EXT_TENSOR, EXT_NDARRAY):
            return tensors[msgpack.unpackb(payload)]
        raise ValueError(f"header ext type {code} refused")

    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext)


# -- shared memory (§9.2) ---------------------------------------------------------------


class Segment:
    """A segment this peer owns: named under its prefix, 0600, exclusively flocked
    for its whole life, unlinked once."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(self.fd, max(size, 1))
        self.map = mmap.mmap(self.fd, max(size, 1))
        self.unlinked = self.closed = False

    def unlink(self) -> None:
        if not self.unlinked:
            self.unlinked = True
            os.unlink(self.path)

    def close(self) -> None:
        """Unlink (once) and release the mapping and the lock."""
        self.unlink()
        if not self.closed:
            self.closed = True
            self.map.close()
            os.close(self.fd)


def read_segment(prefix: str, info: dict[str, Any], length: int) -> bytes:
    """Check a peer's shm reference as §9.2 says, then copy its bytes out: a sealed
    memfd (behind its link) is mapped, a plain file is read with ``pread``."""
    name = info["segment"]
    if not SEGMENT.match(name) or not name.startswith(prefix + "-"):
        raise ValueError(f"segment {name!r} is not under the peer's prefix {prefix!r}")
    if info["size"] != length:
        raise ValueError(f"size {info['size']} != length {length}")
    fd, sealed = open_segment(name, int(name.split("-")[1]))
    try:
        size = os.fstat(fd).st_size
        start, n = info["offset"], info["size"]
        if start + n > size:
            raise ValueError("reference outside its segment")
        if not sealed:
            data = os.pread(fd, n, start)
            if len(data) != n:
                raise ValueError(f"segment {name} was truncated under us")
            return data
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            return bytes(m[start : start + n])
    finally:
        os.close(fd)


def open_segment(name: str, pid: int, flags: int = os.O_RDONLY) -> tuple[int, bool]:
    """Open ``/dev/shm/<name>`` of process ``pid`` as §9.2 "Reading a segment" says:
    a link only to a sealed memfd of ``pid`` named ``name``, else a plain file of ours
    with one link. Returns the descriptor and whether it is sealed (may be mapped)."""
    path = os.path.join(SHM_DIR, name)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        if not re.fullmatch(rf"/proc/{pid}/fd/\d+", target) or st.st_uid != os.geteuid():
            raise ValueError(f"{name} links to {target!r}, not to a descriptor of {pid}")
        fd = os.open(target, flags)
        try:
            probe = os.memfd_create("probe")
            memfd_dev = os.fstat(probe).st_dev
            os.close(probe)
            fst = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            if (
                fst.st_dev != memfd_dev
                or fst.st_uid != os.geteuid()
                or os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{name} (deleted)"
                or seals & need != need
            ):
                raise ValueError(f"{name} is not a sealed memfd of process {pid}")
        except BaseException:
            os.close(fd)
            raise
        return fd, True
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    fst = os.fstat(fd)
    if (
        not stat.S_ISREG(fst.st_mode)
        or fst.st_dev != os.stat(SHM_DIR).st_dev
        or fst.st_uid != os.geteuid()
        or fst.st_nlink != 1
    ):
        os.close(fd)
        raise ValueError(f"{name} is not a plain segment of ours")
    return fd, False


# -- a same-host ring, the writer's end (§3.6) -------------------------------------------

RING_NAME = re.compile(r"^omniwire-(\d+)-([0-9a-f]{16})$")
RING_MAGIC = 0x0031474E4952574F  # b"OWRING1\0" as a little-endian word
RING_HEADER = 4096
W_MAGIC, W_VERSION, W_CAPACITY = 0, 1, 2
W_TAIL, W_WANT, W_WRITER_PID, W_WRITER_CLOSED = 16, 17, 18, 19
W_HEAD, W_SLEEPING, W_READER_CLOSED = 32, 33, 34


class RingWriter:
    """The writing end of a ring the peer created for our frames (§3.6), kept simple:
    every frame is written whole (no fragments) and the reader's doorbell is rung
    after every frame, which the spec allows (a spurious wake-up costs one empty pass)
    and which needs no store-load fence. Words are 8-byte native stores through a
    ``memoryview`` cast (single-copy atomic); x86-64 keeps stores in program order."""

    def __init__(self, name: str, owner_pid: int) -> None:
        m = RING_NAME.match(name)
        if m is None or int(m.group(1)) != owner_pid:
            raise ValueError(f"ring {name!r} is not a ring of process {owner_pid}")
        self.name = name
        fd, sealed = open_segment(f"{name}-0", owner_pid, os.O_RDWR)
        try:
            if not sealed:  # its reader could shrink it under our mapping (SIGBUS)
                raise ValueError(f"ring {name} is not sealed")
            size = os.fstat(fd).st_size
            if size < 2 * RING_HEADER:
                raise ValueError(f"{name}: {size} bytes is too small for a ring")
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping stays
        self.words = memoryview(self.map)[:RING_HEADER].cast("Q")
        self.data = memoryview(self.map)[RING_HEADER:]
        w = self.words
        self.capacity = w[W_CAPACITY]
        if (
            w[W_MAGIC] != RING_MAGIC
            or w[W_VERSION] != 1
            or self.capacity & (self.capacity - 1)
            or not 4096 <= self.capacity <= 1 << 31
            or size != RING_HEADER + self.capacity
        ):
            raise ValueError(f"{name} is not a version-1 ring")
        if w[W_WRITER_PID] or w[W_READER_CLOSED]:
            raise ValueError(f"ring {name} has a writer already, or its reader closed it")
        flags = os.O_RDWR | os.O_NONBLOCK
        self.own_bell = os.open(os.path.join(SHM_DIR, f"{name}-2"), flags)
        fcntl.flock(self.own_bell, fcntl.LOCK_EX | fcntl.LOCK_NB)  # we are its one writer
        self.reader_bell = os.open(os.path.join(SHM_DIR, f"{name}-1"), flags)
        try:  # the reader holds its doorbell's lock while it lives
            fcntl.flock(self.reader_bell, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            raise ValueError(f"the reader of ring {name} is gone")
        self.tail = w[W_TAIL]
        w[W_WRITER_PID] = os.getpid()
        self._ring()  # the reader may unlink the names now

    def _ring(self) -> None:
        try:
            os.write(self.reader_bell, b"\0")
        except BlockingIOError:
            pass  # the FIFO is full: a wake-up is pending anyway

    def send(self, frame: bytes, timeout: float = 10.0) -> None:
        """One record (§3.6): ``<u32 length, u32 flags=0>``, the frame, padding to 8."""
        size = 8 + (-(-len(frame) // 8) * 8)
        if size > self.capacity:
            raise ValueError("a frame larger than the ring needs fragments; not done here")
        deadline = time.monotonic() + timeout
        while self.capacity - (self.tail - self.words[W_HEAD]) < size:  # full: wait for room
            if self.words[W_READER_CLOSED] or time.monotonic() > deadline:
                raise Timeout(f"no room in ring {self.name}")
            time.sleep(0.001)
        mask = self.capacity - 1
        pos = self.tail & mask
        self.data[pos : pos + 8] = struct.pack("<II", len(frame), 0)
        start = (pos + 8) & mask
        first = min(len(frame), self.capacity - start)  # the frame may wrap, a header never
        self.data[start : start + first] = frame[:first]
        self.data[: len(frame) - first] = frame[first:]
        self.tail += size
        self.words[W_TAIL] = self.tail  # publish: after the bytes
        self._ring()

    def close(self) -> None:
        """``writer_closed``, then a ring: the reader takes what is there, then ends."""
        if self.map.closed:
            return
        self.words[W_WRITER_CLOSED] = 1
        self._ring()
        self.words.release()
        self.data.release()
        self.map.close()
        os.close(self.own_bell)
        os.close(self.reader_bell)


# -- the peer ---------------------------------------------------------------------------


@dataclass
class Received:
    channel: str  # "control" (PULL) or "abort" (SUB)
    body: dict[str, Any]


@dataclass
class ForeignPeer:
    name: str
    address: str  # ipc://...
    instance: int = field(default_factory=lambda: secrets.randbits(63))
    process_token: str = field(default_factory=lambda: secrets.token_hex(8))
    #: advertised in every Hello (§11.2): "sealed", it reads sealed segments (§9.2)
    features: tuple[str, ...] = ("sealed",)
    #: offer the feature "resume" (§10.7): number our frames, retain them until
    #: acknowledged, apply only the next number of our session. Off: a peer of the
    #: earlier 1.1 text, which neither sends nor expects numbered frames.
    resume: bool = False
    log: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.abort_address = self.address + ".abort"
        self.prefix = f"omniwire-{os.getpid()}-{secrets.token_hex(8)}"
        self._n = 0
        self.segments: dict[str, Segment] = {}
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.address)
        # XPUB is PUB on the wire; it also tells us when a subscriber has joined.
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind(self.abort_address)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.push: zmq.Socket[bytes] | None = None
        self.peer: dict[str, Any] | None = None  # the reference's latest Hello
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self.poller.register(self.sub, zmq.POLLIN)
        self.batched: deque[Received] = deque()  # messages of a batch not yet returned
        self.ring: RingWriter | None = None  # once attached, our frames go through it
        if self.resume and "resume" not in self.features:
            self.features = (*self.features, "resume")
        # -- resumption (§10.7): one session, with the one peer this kit talks to
        self.token = new_token()  # ours: the peer's numbered frames must carry it
        self.peer_instance: int | None = None  # the instance our session is with
        self._new_session()
        #: numbered frames dropped: of another session (stale), or not the next number
        self.frames_stale = self.frames_duplicate = 0
        self.errors: list[str] = []  # protocol errors of the peer we saw (§7.3)
        self.acking = True  # False: hold our acks back (a test of the peer's resends)

    def _new_session(self) -> None:
        self.next_seq = 1  # the number of our next numbered frame
        self.retained: deque[dict[str, Any]] = deque()  # numbered, not yet acknowledged
        self.acked = 0  # the highest of our numbers the peer acknowledged
        self.received = 0  # the highest of the peer's numbers applied, in order
        self.ack_sent = 0  # the last ``received`` we told the peer

    def _end_session(self) -> None:
        """Our side of the session ended: a new token, numbering from 1 again."""
        self.token = new_token()
        self._new_session()

    @property
    def resuming(self) -> bool:
        """Both Hellos offer "resume" with a token: every frame but Hellos, Goodbyes
        and Refusals is numbered (§10.7)."""
        p = self.peer
        return (
            self.resume and p is not None and "resume" in p["features"] and bool(p.get("session"))
        )

    # -- messages (field order of §4) -------------------------------------------------

    def hello(
        self,
        *,
        is_reply: bool = False,
        to_endpoint: str = "",
        wire_min: tuple[int, int] = (1, 0),
        wire_max: tuple[int, int] = VERSION,
        address: str | None = None,
        name: str | None = None,
        features: tuple[str, ...] | None = None,
        ring_attached: str = "",
    ) -> dict[str, Any]:
        return {
            "type": "hello",
            "endpoint": name or self.name,
            "wire_min": list(wire_min),
            "wire_max": list(wire_max),
            "features": list(self.features if features is None else features),
            "host_id": host_id(),
            "hostname": "foreign",
            "pid": os.getpid(),
            "process_token": self.process_token,
            "instance": self.instance,
            "address": address or self.address,
            "abort_address": self.abort_address,
            "devices": [{"kind": "cpu", "index": 0, "uuid": ""}],
            "backends": [
                {"name": "shm", "info": msgpack.packb({"prefix": self.prefix}, use_bin_type=True)}
            ],
            "is_reply": is_reply,
            "to_endpoint": to_endpoint,
            "ring": "",  # this peer offers no ring for the reference's frames (§3.6)
            "ring_attached": ring_attached,
            **({"window": 0, "epoch": 0, "session": self.token} if self.resume else {}),
        }

    def data_ready(
        self,
        request_id: str,
        *,
        chunk_id: int = 0,
        data_ref: dict[str, Any] | None = None,
        inline: dict[str, Any] | None = None,
        is_done: bool = False,
        error: str | None = None,
        to_stage: str | None = None,
        metadata: bytes = b"",
    ) -> dict[str, Any]:
        assert self.peer is not None
        return {
            "type": "data_ready",
            "request_id": request_id,
            "from_stage": self.name,
            "to_stage": to_stage or self.peer["endpoint"],
            "chunk_id": chunk_id,
            "data_ref": data_ref,
            "inline": inline,
            "is_done": is_done,
            "error": error,
            "metadata": metadata,
            "traceparent": "",
        }

    @staticmethod
    def inline(arrays: list[np.ndarray], value: Any, kind: str = "stream_chunk") -> dict[str, Any]:
        metas, data = pack(arrays)
        return {"header": header(value), "tensors": metas, "data": data, "kind": kind}

    def ack(
        self, object_id: int, *, success: bool = True, reason: str | None = None
    ) -> dict[str, Any]:
        assert self.peer is not None
        return {
            "type": "data_ack",
            "object_id": object_id,
            "from_stage": self.name,
            "to_stage": self.peer["endpoint"],
            "success": success,
            "error": None if success else f"refused: {reason}",
            "reason": None if success else reason,
        }

    def abort(self, request_id: str, reason: str = "") -> dict[str, Any]:
        return {
            "type": "abort",
            "request_id": request_id,
            "from_stage": self.name,
            "reason": reason,
            "origin": "",
        }

    # -- shm objects -----------------------------------------------------------------------

    def shm_object(
        self, object_id: int, arrays: list[np.ndarray], value: Any, *, ready: int | None = None
    ) -> dict[str, Any]:
        """Write ``arrays`` into a new dedicated segment; return the DataRef (§4.5)."""
        metas, data = pack(arrays)
        name = f"{self.prefix}-{self._n}"
        self._n += 1
        seg = Segment(name, len(data))
        seg.map[: len(data)] = data
        self.segments[name] = seg
        info = {"segment": name, "offset": 0, "size": len(data), "dedicated": True}
        return {
            "version": 1,
            "object_id": object_id,
            "kind": "payload",
            "backend": "shm",
            "layout": "packed",
            "ref": {
                "backend": "shm",
                "info": msgpack.packb(info, use_bin_type=True),
                "length": len(data),
            },
            "header": header(value),
            "tensors": metas,
            "ready": ready,
        }

    def read_object(self, data_ref: dict[str, Any]) -> Any:
        """Fetch an object the reference announced over shm and rebuild its value."""
        assert self.peer is not None and data_ref["backend"] == "shm"
        prefix = self.peer_backend_info("shm")["prefix"]
        info = msgpack.unpackb(data_ref["ref"]["info"], raw=False)
        raw = read_segment(prefix, info, data_ref["ref"]["length"])
        return read_header(data_ref["header"], unpack(raw, data_ref["tensors"]))

    def peer_backend_info(self, backend: str) -> dict[str, Any]:
        assert self.peer is not None
        for b in self.peer["backends"]:
            if b["name"] == backend:
                return msgpack.unpackb(b["info"], raw=False)  # type: ignore[no-any-return]
        raise KeyError(backend)

    # -- sockets ---------------------------------------------------------------------------

    def connect(self, address: str) -> None:
        """One PUSH to the peer's PULL (§3.2)."""
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 500)
        self.push.connect(address)

    def send(
        self, body: dict[str, Any], version: tuple[int, int] = VERSION, *, lose: bool = False
    ) -> None:
        """To the peer: by its ring once we attached to one (§3.6), else by ZeroMQ. In a
        resuming session (§10.7) the message (or the messages of a batch) goes in a
        numbered frame, retained until acknowledged; ``lose``: numbered and retained
        but never sent — a frame a dropped connection lost."""
        if body["type"] == "goodbye":
            self._end_session()  # after our Goodbye, a new session needs a new token
        elif self.resuming and body["type"] not in UNNUMBERED:
            body = self.number(body)
            if lose:
                self.log.append(("lost", body))
                return
        self.transmit(body, version)

    def number(self, body: dict[str, Any]) -> dict[str, Any]:
        """The next numbered frame holding ``body`` (a message, or a batch's messages),
        retained until an ack covers it (§10.7, field order of §4.10)."""
        assert self.peer is not None
        numbered = {
            "type": "batch",
            "messages": body["messages"] if body["type"] == "batch" else [body],
            "from_stage": self.name,
            "session": self.peer["session"],
            "seq": self.next_seq,
            "ack": self.received,
        }
        self.next_seq += 1
        self.ack_sent = self.received
        self.retained.append(numbered)
        return numbered

    def transmit(self, body: dict[str, Any], version: tuple[int, int] = VERSION) -> None:
        """One frame as it is: no numbering."""
        data = frame(body, version)
        wire_cddl.validate_frame(data)  # what we send follows the schema too
        if self.ring is not None:
            self.log.append(("sent (ring)", body))
            self.ring.send(data)
            return
        assert self.push is not None
        self.log.append(("sent", body))
        self.push.send(data)

    def send_ack(self) -> None:
        """An ack alone (§10.7): no message, not numbered, not retained."""
        assert self.peer is not None
        self.ack_sent = self.received
        self.transmit(
            {
                "type": "batch",
                "messages": [],
                "from_stage": self.name,
                "session": self.peer["session"],
                "seq": 0,
                "ack": self.received,
            }
        )

    def resend(self) -> int:
        """Every retained frame again, in order, addressed to the peer's current token
        (§10.7 "Sending again"); returns how many."""
        assert self.peer is not None
        token = self.peer["session"]
        self.retained = deque({**b, "session": token} for b in self.retained)
        for body in self.retained:
            self.transmit(body)
        return len(self.retained)

    def reconnect(self, address: str) -> int:
        """A dropped link that comes back: close our PUSH (what it still holds may
        arrive or not), connect a new one, say Hello again and, resuming, send every
        retained frame again. Returns how many were sent again."""
        assert self.push is not None and self.peer is not None
        self.push.close()  # LINGER 500 ms: ZeroMQ may still deliver what it queued
        self.connect(address)
        self.send(self.hello(to_endpoint=self.peer["endpoint"]))
        return self.resend() if self.resuming else 0

    def _ack_due(self) -> bool:
        return (
            self.acking
            and self.resuming
            and self.received > self.ack_sent
            and (self.push is not None or self.ring is not None)
        )

    def rebind(self) -> None:
        """Drop the peer's link to us: close our PULL and bind a new one at the same
        address. ZeroMQ reconnects the peer's PUSH, which says Hello again and, in a
        resuming session, sends what we had not acknowledged again (§10.7)."""
        self.poller.unregister(self.pull)
        self.pull.close(linger=0)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.address)
        self.poller.register(self.pull, zmq.POLLIN)

    def attach_ring(self) -> RingWriter:
        """Attach to the ring the peer's latest Hello offers, then send the fence: a
        Hello with ``ring_attached``, our last frame on ZeroMQ (§3.6)."""
        assert self.peer is not None and self.peer["ring"]
        writer = RingWriter(self.peer["ring"], self.peer["pid"])
        self.send(
            self.hello(
                is_reply=True,
                to_endpoint=self.peer["endpoint"],
                ring_attached=writer.name,
            )
        )
        self.ring = writer
        return writer

    def publish(self, body: dict[str, Any], subscriber_timeout: float = 10.0) -> None:
        """Publish on the abort channel once a subscriber has joined (XPUB tells)."""
        if self.pub.poll(int(subscriber_timeout * 1000)):
            self.pub.recv()  # b"\x01": subscribe to everything
        data = frame(body)
        wire_cddl.validate_frame(data)
        self.log.append(("published", body))
        self.pub.send(data)

    def recv(self, timeout: float) -> Received | None:
        """The next message, validated against the CDDL; a batch's messages come one by
        one, in order (§4.10); Hellos are answered as §10.1 says; numbered frames are
        applied or dropped as §10.7 says, and acknowledged while we wait."""
        deadline = time.monotonic() + timeout
        while not self.batched:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            wait = min(left, ACK_IDLE) if self._ack_due() else left
            events = dict(self.poller.poll(max(1, int(wait * 1000))))
            if not events:
                if self._ack_due():
                    self.send_ack()
                continue
            sock, channel = (self.pull, "control") if self.pull in events else (self.sub, "abort")
            data = sock.recv()
            body = wire_cddl.validate_frame(data)
            self.log.append((f"received ({channel}, {data[4]}.{data[5]})", body))
            if body["type"] == "batch":
                if body.get("session", 0) and not self._take_numbered(body, channel):
                    continue
                for inner in body["messages"]:
                    self.log.append(
                        (f"received ({channel}, {data[4]}.{data[5]}, in a batch)", inner)
                    )
                    self.batched.append(Received(channel, inner))
                if self._ack_due() and self.received - self.ack_sent >= ACK_FRAMES:
                    self.send_ack()
                continue
            if body["type"] == "hello":
                self._on_hello(body)
            return Received(channel, body)
        return self.batched.popleft()

    def _on_hello(self, body: dict[str, Any]) -> None:
        """A Hello of the peer (§10.1, §10.6, §10.7)."""
        before = self.peer
        self.peer = body
        if body["abort_address"]:
            self.sub.connect(body["abort_address"])
        replaced = False
        if self.peer_instance is None:
            self.peer_instance = body["instance"]  # our session starts
        elif body["instance"] != self.peer_instance:  # a restart: the session ends
            self.peer_instance = body["instance"]
            self._end_session()
            replaced = self.resume
        elif (
            self.resuming
            and before is not None
            and body["session"] != before.get("session")
            and self.retained
        ):
            # the peer ended its side while ours goes on: what it dropped comes again,
            # addressed to its new token (§10.7 "Sending again")
            self.resend()
        if self.push is not None and (not body["is_reply"] or replaced):
            # after a new token the peer must learn it, even from a reply (§10.7)
            self.send(self.hello(is_reply=True, to_endpoint=body["endpoint"]))

    def _take_numbered(self, body: dict[str, Any], channel: str) -> bool:
        """Whether to apply a numbered frame or an ack alone (§10.7); else it is
        dropped whole and counted."""
        if channel != "control" or not self.resuming:
            self.errors.append(f"a numbered frame out of place ({channel}): {body}")
            self.log.append(("dropped (out of place)", body))
            return False
        if body["session"] != self.token:
            self.frames_stale += 1
            self.log.append(("dropped (stale)", body))
            return False
        if body.get("from_stage") != self.peer_name or any(
            m["from_stage"] != body["from_stage"] for m in body["messages"]
        ):
            self.errors.append(f"a numbered frame of another stage: {body}")
            self.log.append(("dropped (misnamed)", body))
            return False
        seq = body.get("seq", 0)
        if seq:
            if seq != self.received + 1:  # one we have, or one past a gap
                self.frames_duplicate += 1
                self.log.append(("dropped (duplicate)", body))
                return False
            self.received = seq
        elif body["messages"]:
            self.errors.append(f"messages in an ack alone: {body}")
        ack = body.get("ack", 0)
        if ack >= self.next_seq:
            self.errors.append(f"ack of frame {ack}, but we sent {self.next_seq - 1}")
        elif ack > self.acked:  # acks only grow: an older one changes nothing
            self.acked = ack
            while self.retained and self.retained[0]["seq"] <= ack:
                self.retained.popleft()
        return True

    @property
    def peer_name(self) -> str:
        assert self.peer is not None
        return str(self.peer["endpoint"])

    def settle(self, timeout: float = 10.0) -> None:
        """Receive (and ack) until the peer acknowledged every frame we retain and we
        acknowledged every frame we applied; messages that come meanwhile stay in the
        log only."""
        deadline = time.monotonic() + timeout
        while self.retained or self._ack_due():
            if time.monotonic() > deadline:
                raise Timeout(
                    f"{self.name}: {len(self.retained)} frames still unacknowledged; "
                    f"saw:\n{self.trace()}"
                )
            self.recv(ACK_IDLE)

    def expect(
        self, match: Callable[[dict[str, Any]], bool], timeout: float = 10.0, what: str = ""
    ) -> dict[str, Any]:
        """Receive until a frame matches (answering Hellos meanwhile)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            got = self.recv(left)
            if got is not None and match(got.body):
                return got.body
        raise Timeout(
            f"{self.name}: no {what or 'matching frame'} within {timeout:g} s; saw:\n{self.trace()}"
        )

    def seen(
        self, match: Callable[[dict[str, Any]], bool], timeout: float = 10.0, what: str = ""
    ) -> dict[str, Any]:
        """A matching frame received already, or the next one to come."""
        for direction, body in self.log:
            if direction.startswith("received") and match(body):
                return body
        return self.expect(match, timeout, what)

    def own_hello(self, timeout: float = 10.0) -> dict[str, Any]:
        """The peer's own Hello (``is_reply`` false), received already or still to come."""
        return self.seen(
            lambda b: b["type"] == "hello" and not b["is_reply"], timeout, "the peer's own Hello"
        )

    def handshake(self, peer_name: str, address: str, timeout: float = 10.0) -> dict[str, Any]:
        """Hello both ways (§10.1); returns the reference's Hello."""
        self.connect(address)
        self.send(self.hello(to_endpoint=peer_name))
        self.expect(
            lambda b: b["type"] == "hello" and b["endpoint"] == peer_name,
            timeout,
            "Hello from the reference",
        )
        assert self.peer is not None
        return self.peer

    def trace(self) -> str:
        return "\n".join(
            f"  {d}: {b.get('type')} { ({k: v for k, v in b.items() if k not in ('type', 'backends', 'devices')}) }"[
                :300
            ]
            for d, b in self.log
        )

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
        for s in (self.pull, self.pub, self.sub, self.push):
            if s is not None:
                s.close(linger=0)
        self.ctx.term()
        for a in (self.address, self.abort_address):
            path = a[len("ipc://") :]
            if os.path.exists(path):
                os.unlink(path)
