"""The example_tcp data connection: its frames, with no I/O (bytes in, values out).

A receiver opens one TCP connection to each sender it fetches from and asks it
for byte ranges of the objects that sender announced. Every frame, both ways,
is a 16-byte header followed by ``length`` bytes of body::

    offset  size  field
    0       4     magic    b"OWXT"
    4       1     kind     HELLO=1, READ=2 (receiver → sender); OK=0x80, ERROR=0x81 (sender → receiver)
    5       3     zero
    8       8     length   of the body, unsigned little-endian

Bodies:

- ``HELLO``: msgpack map ``{"token": str, "endpoint": str, "instance": int}``, at most
  4 KiB: the sender token the receiver expects (from the sender's Hello info, so a
  reused port is detected) and who the receiver is. The first frame on a
  connection, exactly once. Answered by ``OK`` with an empty body, or ``ERROR``.
- ``READ``: 24 bytes, three little-endian u64: object id, ``lo``, ``hi``. Answered by
  ``OK`` carrying exactly ``hi - lo`` bytes of the object, or by ``ERROR``.
- ``ERROR``: UTF-8 text, at most 4 KiB, saying what was refused.

Requests are answered one at a time, in order. A frame the sender cannot parse
is answered with ``ERROR`` and the connection is closed (it cannot resync); a
well-formed request it refuses — an unknown or released object, a range outside
the object or not yet published, an object announced to another endpoint — is
answered with ``ERROR`` and the connection goes on.

The connection info in the endpoint Hello and the reference in each DataRef are
msgpack maps too (:class:`HelloInfo`, :class:`Ref`), decoded with typed decoders.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec
from omniwire.errors import BackendError

__all__ = [
    "ERROR",
    "HEADER",
    "HELLO",
    "MAX_TEXT",
    "OK",
    "READ",
    "FrameError",
    "Greeting",
    "HelloInfo",
    "Ref",
    "decode_error",
    "decode_greeting",
    "decode_header",
    "decode_hello_info",
    "decode_read",
    "decode_ref",
    "encode",
    "encode_error",
    "encode_read",
    "header",
]

MAGIC = b"OWXT"
HEADER = struct.Struct("<4sB3xQ")
_READ = struct.Struct("<QQQ")

HELLO = 1
READ = 2
OK = 0x80
ERROR = 0x81
_KINDS = {HELLO: "HELLO", READ: "READ", OK: "OK", ERROR: "ERROR"}

#: The largest HELLO or ERROR body.
MAX_TEXT = 4096
#: Offsets and sizes stay below 2**62 (no object is that large; no overflow on add).
_MAX_SIZE = 1 << 62

_Token = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16,64}$")]
_Size = Annotated[int, msgspec.Meta(ge=0, lt=_MAX_SIZE)]


class FrameError(BackendError):
    """A frame or a structure that breaks the example_tcp protocol."""


class HelloInfo(msgspec.Struct, frozen=True):
    """This backend's connection info in the endpoint Hello (``BackendInfo.info``).

    ``host`` is empty when the server listens on every interface: the receiver
    then uses the host of the sender's control-plane address.
    """

    host: Annotated[str, msgspec.Meta(max_length=255)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    token: _Token


class Ref(msgspec.Struct, frozen=True):
    """The reference in a DataRef (``BackendRef.info``): which object of which sender."""

    token: _Token
    object_id: Annotated[int, msgspec.Meta(ge=1, lt=_MAX_SIZE)]
    size: _Size


class Greeting(msgspec.Struct, frozen=True):
    """The body of a HELLO frame."""

    token: _Token
    endpoint: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    instance: Annotated[int, msgspec.Meta(ge=0)]  # a u64 (msgpack holds no more)


_encoder = msgspec.msgpack.Encoder()
_hello_info_decoder = msgspec.msgpack.Decoder(HelloInfo)
_ref_decoder = msgspec.msgpack.Decoder(Ref)
_greeting_decoder = msgspec.msgpack.Decoder(Greeting)


def encode(value: HelloInfo | Ref | Greeting) -> bytes:
    """msgpack bytes of a protocol structure."""
    return _encoder.encode(value)


def decode_hello_info(data: bytes) -> HelloInfo:
    """Raises: FrameError: not a valid HelloInfo."""
    try:
        return _hello_info_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"malformed example_tcp Hello info: {exc}") from None


def decode_ref(data: bytes) -> Ref:
    """Raises: FrameError: not a valid Ref."""
    try:
        return _ref_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"malformed example_tcp reference: {exc}") from None


def decode_greeting(data: bytes) -> Greeting:
    """Raises: FrameError: not a valid HELLO body."""
    try:
        return _greeting_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"malformed HELLO: {exc}") from None


def header(kind: int, length: int) -> bytes:
    """The 16-byte header of a frame of ``kind`` with a body of ``length`` bytes."""
    return HEADER.pack(MAGIC, kind, length)


def decode_header(
    data: bytes | bytearray | memoryview, *, expect: frozenset[int]
) -> tuple[int, int]:
    """``(kind, length)`` of a frame header, checked against the kinds allowed here.

    Raises:
        FrameError: bad magic, a kind not in ``expect``, or a HELLO, READ or ERROR
            body of an illegal length.
    """
    if len(data) != HEADER.size:
        raise FrameError(f"a frame header has {HEADER.size} bytes, not {len(data)}")
    magic, kind, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if kind not in expect:
        name = _KINDS.get(kind, f"0x{kind:02x}")
        allowed = ", ".join(_KINDS[k] for k in sorted(expect))
        raise FrameError(f"unexpected frame kind {name} (expected {allowed})")
    if kind in (HELLO, ERROR) and length > MAX_TEXT:
        raise FrameError(f"{_KINDS[kind]} body of {length} bytes exceeds {MAX_TEXT}")
    if kind == READ and length != _READ.size:
        raise FrameError(f"READ body has {length} bytes, not {_READ.size}")
    return kind, length


def encode_read(object_id: int, lo: int, hi: int) -> bytes:
    """A whole READ frame."""
    return header(READ, _READ.size) + _READ.pack(object_id, lo, hi)


def decode_read(body: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """``(object_id, lo, hi)`` of a READ body.

    Raises:
        FrameError: wrong length, or ``lo > hi``.
    """
    if len(body) != _READ.size:
        raise FrameError(f"READ body has {len(body)} bytes, not {_READ.size}")
    object_id, lo, hi = _READ.unpack(body)
    if lo > hi:
        raise FrameError(f"READ range [{lo}, {hi}) is reversed")
    return object_id, lo, hi


def encode_error(text: str) -> bytes:
    """A whole ERROR frame (the text cut to :data:`MAX_TEXT` bytes)."""
    body = text.encode("utf-8", "replace")[:MAX_TEXT]
    return header(ERROR, len(body)) + body


def decode_error(body: bytes | bytearray | memoryview) -> str:
    """The text of an ERROR body (undecodable bytes replaced)."""
    return bytes(body).decode("utf-8", "replace")
