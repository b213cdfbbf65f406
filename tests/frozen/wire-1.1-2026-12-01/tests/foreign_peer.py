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
    """Check a peer's shm reference as §9.2 says, then copy its bytes out."""
    name = info["segment"]
    if not SEGMENT.match(name) or not name.startswith(prefix + "-"):
        raise ValueError(f"segment {name!r} is not under the peer's prefix {prefix!r}")
    if info["size"] != length:
        raise ValueError(f"size {info['size']} != length {length}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if info["offset"] + info["size"] > size:
            raise ValueError("reference outside its segment")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            return bytes(m[info["offset"] : info["offset"] + info["size"]])
    finally:
        os.close(fd)


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
        fd = os.open(os.path.join(SHM_DIR, f"{name}-0"), os.O_RDWR)
        try:
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
    features: tuple[str, ...] = ()  # advertised in every Hello (§11.2)
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

    def send(self, body: dict[str, Any], version: tuple[int, int] = VERSION) -> None:
        """To the peer: by its ring once we attached to one (§3.6), else by ZeroMQ."""
        data = frame(body, version)
        wire_cddl.validate_frame(data)  # what we send follows the schema too
        if self.ring is not None:
            self.log.append(("sent (ring)", body))
            self.ring.send(data)
            return
        assert self.push is not None
        self.log.append(("sent", body))
        self.push.send(data)

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
        one, in order (§4.10); Hellos are answered as §10.1 says."""
        if self.batched:
            return self.batched.popleft()
        events = dict(self.poller.poll(int(timeout * 1000)))
        if not events:
            return None
        sock, channel = (self.pull, "control") if self.pull in events else (self.sub, "abort")
        data = sock.recv()
        body = wire_cddl.validate_received(data)  # FROZEN-KIT CHANGE (../NOTE.md)
        self.log.append((f"received ({channel}, {data[4]}.{data[5]})", body))
        if body["type"] == "batch":
            for inner in body["messages"]:
                self.log.append((f"received ({channel}, {data[4]}.{data[5]}, in a batch)", inner))
                self.batched.append(Received(channel, inner))
            return self.batched.popleft()
        if body["type"] == "hello":
            self.peer = body
            if body["abort_address"]:
                self.sub.connect(body["abort_address"])
            if not body["is_reply"] and self.push is not None:
                self.send(self.hello(is_reply=True, to_endpoint=body["endpoint"]))
        return Received(channel, body)

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
