"""Numbers fixed by specs/wire-v1.md. Changing any of them is a wire change."""

from __future__ import annotations

from typing import Final

#: The wire version this implementation writes: (major, minor).
WIRE_VERSION: Final = (1, 1)
#: Majors this implementation reads. Any other major is refused.
SUPPORTED_MAJORS: Final = frozenset({1})

#: First four bytes of every frame.
MAGIC: Final = b"OWIR"
#: Bytes before the msgpack body: magic (4), major (1), minor (1), reserved (2).
PREFIX_SIZE: Final = 8

#: Largest frame (prefix included) a reader accepts and a writer produces.
MAX_FRAME_SIZE: Final = 16 * 1024 * 1024
#: Deepest nesting of containers in a payload header (the top level is depth 1).
MAX_HEADER_DEPTH: Final = 64
#: Most tensor bytes an InlineStreamChunkRef may carry (sum of TensorMeta.nbytes).
INLINE_MAX_TENSOR_BYTES: Final = 16 * 1024
#: Alignment of every tensor offset inside a packed buffer.
ALIGNMENT: Final = 64
#: Most entries in one tensor table.
MAX_TENSORS: Final = 65536
#: Most dimensions of one tensor.
MAX_NDIM: Final = 64
#: Longest endpoint / stage / backend name, in UTF-8 bytes.
MAX_NAME_BYTES: Final = 256
#: Longest request id, in UTF-8 bytes.
MAX_REQUEST_ID_BYTES: Final = 1024
#: Longest free-text field (error, reason, address), in UTF-8 bytes.
MAX_TEXT_BYTES: Final = 4096
#: Largest unsigned 64-bit value.
U64_MAX: Final = 2**64 - 1
#: Largest signed 64-bit value: the bound of a tensor dimension and of an element count.
I64_MAX: Final = 2**63 - 1
#: Most messages in one BatchMessage (1.1).
MAX_BATCH_MESSAGES: Final = 4096

#: Wire name → item size in bytes, for every tensor dtype the wire carries.
#: ``float4_e2m1fn_x2`` packs two 4-bit values per byte; its shape counts bytes.
DTYPE_ITEMSIZE: Final[dict[str, int]] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
}


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Round ``n`` up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment
