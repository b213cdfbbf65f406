"""The shared layout of a ring segment (spec §3.6): sizes, header words, records.

Header: 8-byte words in three 128-byte blocks, each block written by one side only
(block 0 by the reader before it gives the name out, block 1 by the writer, block 2
by the reader); the data area starts at :data:`DATA_OFFSET`. A record is a header
``<u32 length, u32 flags>`` (:data:`MORE`: more fragments of this frame follow) and
the payload, padded to 8 bytes. See the package docstring for the protocol.
"""

from __future__ import annotations

import struct
import sys
from typing import Final

from ._errors import RingError

__all__ = [
    "DATA_OFFSET",
    "DEFAULT_CAPACITY",
    "MAX_CAPACITY",
    "MIN_CAPACITY",
    "MORE",
    "REC",
    "VERSION",
    "W_HEAD",
    "W_READER_CLOSED",
    "W_SLEEPING",
    "W_TAIL",
    "W_WANT",
    "W_WRITER_CLOSED",
    "W_WRITER_PID",
    "capacity_ok",
    "check_header",
    "check_platform",
    "check_size",
    "init_header",
    "pad",
    "want_word",
    "wanted",
]

#: Bytes of frame data a ring holds by default (one direction of one peer pair).
DEFAULT_CAPACITY: Final = 1 << 20
MIN_CAPACITY: Final = 4096
MAX_CAPACITY: Final = 1 << 31  # a fragment's u32 length must hold any payload

MAGIC: Final = 0x31474E4952574F  # "OWRING1", little-endian
VERSION: Final = 1
DATA_OFFSET: Final = 4096
# Word indices into the header (8-byte words); blocks are 128 bytes apart.
W_MAGIC, W_VERSION, W_CAPACITY, W_READER_PID = 0, 1, 2, 3
W_TAIL, W_WANT, W_WRITER_PID, W_WRITER_CLOSED = 16, 17, 18, 19
W_HEAD, W_SLEEPING, W_READER_CLOSED = 32, 33, 34

REC: Final = struct.Struct("<II")
MORE: Final = 1


def check_platform() -> None:
    if sys.maxsize < 2**63 - 1:
        raise RingError("shared-memory rings need a 64-bit platform (8-byte atomic words)")


def pad(n: int) -> int:
    return (n + 7) & ~7


def capacity_ok(capacity: int) -> bool:
    """Whether ``capacity`` is a power of two in range."""
    return not capacity & (capacity - 1) and MIN_CAPACITY <= capacity <= MAX_CAPACITY


def init_header(words: memoryview, capacity: int, reader_pid: int) -> None:
    """Fill block 0 of a new ring (before its name is given to anyone)."""
    words[W_CAPACITY] = capacity
    words[W_READER_PID] = reader_pid
    words[W_SLEEPING] = 1  # not started: the writer rings, the FIFO keeps the wakeup
    words[W_VERSION] = VERSION
    words[W_MAGIC] = MAGIC


def check_size(size: int, name: str) -> None:
    """Refuse a segment too small to hold a header and the smallest ring."""
    if size < DATA_OFFSET + MIN_CAPACITY:
        raise RingError(f"{name} is not a version-{VERSION} omniwire ring (too small)")


def check_header(words: memoryview, size: int, name: str) -> int:
    """Check block 0 of a ring another process made, against its segment's ``size``;
    the capacity."""
    capacity: int = words[W_CAPACITY]
    if (
        words[W_MAGIC] != MAGIC
        or words[W_VERSION] != VERSION
        or not capacity_ok(capacity)
        or size != DATA_OFFSET + capacity
    ):
        raise RingError(f"{name} is not a version-{VERSION} omniwire ring")
    return capacity


def want_word(seq: int, need: int) -> int:
    """The ``want`` word: a writer's request number ``seq`` and the bytes it needs."""
    return (seq << 32) | need


def wanted(want: int) -> int:
    """The bytes a ``want`` word asks for."""
    return want & 0xFFFFFFFF
