"""Frames: an 8-byte prefix, then one msgpack-encoded message (spec §3).

    offset  size  field
    0       4     magic  b"OWIR"
    4       1     major  (uint8)
    5       1     minor  (uint8)
    6       2     reserved, written as zero, ignored by readers of major 1
    8       n     msgpack body: one message map, tagged by its "type" key

Sans-I/O: bytes in, messages out. No asyncio, no sockets, no backends.
"""

from __future__ import annotations

import struct
from typing import Final

import msgspec

from ..errors import UnsupportedVersionError, WireFormatError
from ._constants import MAGIC, MAX_FRAME_SIZE, PREFIX_SIZE, SUPPORTED_MAJORS, WIRE_VERSION
from ._messages import Message

__all__ = ["decode", "encode", "peek_version"]

_PREFIX: Final = struct.Struct(">4sBBH")
_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(Message)


def encode(msg: Message, *, version: tuple[int, int] = WIRE_VERSION) -> bytes:
    """Encode ``msg`` as one frame.

    ``version`` exists for tests and for talking to an older minor; it is written
    into the prefix as is.

    Raises:
        WireFormatError: the frame would exceed ``MAX_FRAME_SIZE``.
        TypeError: ``msg`` is not a wire message.
    """
    if not isinstance(msg, Message.__args__):
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    major, minor = version
    body = _encoder.encode(msg)
    size = PREFIX_SIZE + len(body)
    if size > MAX_FRAME_SIZE:
        raise WireFormatError(
            f"{type(msg).__name__} frame would be {size} bytes; the limit is {MAX_FRAME_SIZE}"
        )
    return _PREFIX.pack(MAGIC, major, minor, 0) + body


def peek_version(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """Return the (major, minor) of a frame's prefix without decoding the body.

    Raises:
        WireFormatError: shorter than the prefix, or the magic is wrong.
    """
    if len(data) < PREFIX_SIZE:
        raise WireFormatError(f"frame is {len(data)} bytes; the prefix alone is {PREFIX_SIZE}")
    magic, major, minor, _reserved = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise WireFormatError(f"bad magic {bytes(magic)!r}; expected {MAGIC!r}")
    return major, minor


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode one frame into a message.

    Readers of major 1 accept any minor version: unknown fields are ignored.

    Raises:
        UnsupportedVersionError: the frame's major version is not one this reader speaks.
        WireFormatError: anything else wrong: truncated, oversized, bad magic,
            malformed msgpack, unknown message type, wrong field types or values.
            No other exception escapes.
    """
    size = len(data)
    if size > MAX_FRAME_SIZE:
        raise WireFormatError(f"frame is {size} bytes; the limit is {MAX_FRAME_SIZE}")
    major, minor = peek_version(data)
    if major not in SUPPORTED_MAJORS:
        raise UnsupportedVersionError(
            f"wire version {major}.{minor} is not supported: this reader speaks "
            f"major {', '.join(map(str, sorted(SUPPORTED_MAJORS)))}",
            major=major,
            minor=minor,
        )
    body = memoryview(data)[PREFIX_SIZE:]
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise WireFormatError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireFormatError(f"malformed msgpack body: {exc}") from None
    except RecursionError:
        raise WireFormatError("msgpack body is nested too deeply") from None
    except Exception as exc:  # any other failure is still the input's fault
        raise WireFormatError(f"undecodable frame ({type(exc).__name__}: {exc})") from None
