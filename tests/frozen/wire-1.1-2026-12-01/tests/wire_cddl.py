"""Validate msgpack (frames, headers, backend blobs) against specs/wire-v1.cddl.

pycddl validates CBOR, so a msgpack document is first mapped to the CBOR data
model as the spec says (§12.4): scalars, str, bin, arrays and maps one to one; an
ext value of type t becomes the CBOR tag ``EXT_TAG_BASE + t`` wrapping its content
decoded as msgpack (types 1–4) or its raw bytes (type 5 and unknown types).

Built from the spec alone, like the foreign peer that uses it: it imports no
omniwire code.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import cbor2
import msgpack
import pycddl

SCHEMA_PATH = pathlib.Path(__file__).resolve().parent.parent / "specs" / "wire-v1.cddl"
EXT_TAG_BASE = 0x4F570000
#: Ext types whose content is itself msgpack (tuple, tensor, ndarray, registered type).
_NESTED_EXT = frozenset({1, 2, 3, 4})
PREFIX_SIZE = 8

#: backend name → (rule of its Hello blob, rule of its reference blob)
BLOB_RULES = {
    "shm": ("shm-hello-info", "shm-ref"),
    "cuda_ipc": ("cuda-ipc-hello-info", "cuda-ipc-ref"),
    "mooncake": ("mooncake-hello-info", "mooncake-ref"),
    "nixl": ("nixl-hello-info", "nixl-ref"),
    "nccl": ("nccl-hello-info", "nccl-ref"),
}


class SchemaError(AssertionError):
    """A document does not match its rule; says which rule and where."""


def _ext(code: int, data: bytes) -> cbor2.CBORTag:
    if code in _NESTED_EXT:
        return cbor2.CBORTag(EXT_TAG_BASE + code, unpack(data))
    return cbor2.CBORTag(EXT_TAG_BASE + code, bytes(data))


def unpack(data: bytes) -> Any:
    """msgpack → Python, keeping what CBOR needs: arrays as tuples (hashable keys),
    non-string keys, ext values as CBOR tags."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=False, ext_hook=_ext)


def to_cbor(data: bytes) -> bytes:
    return cbor2.dumps(unpack(data))


@functools.cache
def schema(rule: str) -> pycddl.Schema:
    """The schema with ``rule`` as its root (CDDL's root is the first rule)."""
    return pycddl.Schema(f"omniwire-root = {rule}\n" + SCHEMA_PATH.read_text())


# FROZEN-KIT CHANGE (see ../NOTE.md): frames this peer *receives* are checked against
# the current schema, because §2.4 of the text it was written to says a reader ignores
# map keys it does not know, which this schema of its time (closed maps) cannot say.
CURRENT_SCHEMA_PATH = pathlib.Path(__file__).resolve().parents[4] / "specs" / "wire-v1.cddl"


def validate_received(frame: bytes) -> dict[str, Any]:
    """:func:`validate_frame` against the current schema (FROZEN-KIT CHANGE)."""
    global SCHEMA_PATH
    saved = SCHEMA_PATH
    SCHEMA_PATH = CURRENT_SCHEMA_PATH
    schema.cache_clear()
    try:
        return validate_frame(frame)
    finally:
        SCHEMA_PATH = saved
        schema.cache_clear()


def validate(rule: str, data: bytes) -> None:
    """Raise SchemaError unless the msgpack document ``data`` matches ``rule``."""
    try:
        schema(rule).validate_cbor(to_cbor(data))
    except (pycddl.ValidationError, ValueError, msgpack.ExtraData) as exc:
        raise SchemaError(f"does not match CDDL rule {rule!r}: {exc}") from None


def validate_blobs(body: dict[str, Any]) -> None:
    """The payload headers and backend blobs nested in a message body."""
    kind = body.get("type")
    if kind == "hello":
        for b in body["backends"]:
            rules = BLOB_RULES.get(b["name"])
            if rules is not None:
                validate(rules[0], b["info"])
    elif kind == "data_ready":
        if body["metadata"]:
            validate("payload-header", body["metadata"])
        ref = body["data_ref"]
        if ref is not None:
            if ref["header"]:
                validate("payload-header", ref["header"])
            rules = BLOB_RULES.get(ref["backend"])
            if rules is not None:
                validate(rules[1], ref["ref"]["info"])
        if body["inline"] is not None and body["inline"]["header"]:
            validate("payload-header", body["inline"]["header"])
    elif kind == "batch":
        for inner in body["messages"]:
            validate_blobs(inner)


def validate_frame(frame: bytes) -> dict[str, Any]:
    """Validate one frame's body (and everything nested in it) against the schema;
    returns the body as plain msgpack data (bin as bytes, arrays as lists)."""
    if len(frame) < PREFIX_SIZE or frame[:4] != b"OWIR":
        raise SchemaError(f"not a frame: {frame[:8]!r}")
    body = frame[PREFIX_SIZE:]
    validate("message", body)
    plain: dict[str, Any] = msgpack.unpackb(body, raw=False)
    validate_blobs(plain)
    return plain
