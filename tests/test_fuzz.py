"""Protocol fuzzing: random and mutated frames and headers only ever raise
WireFormatError. Budgets are fixed so CI time is bounded; the example counts are
reported in the closing note of the foundation issue."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniwire import codec, wire
from omniwire.errors import WireFormatError
from omniwire.testing.strategies import payloads

from wire_strategies import batches, goodbyes, messages, refusals

FUZZ_EXAMPLES = 1500
_fuzz = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _decode_or_wire_error(data: bytes) -> None:
    try:
        msg = wire.decode(data)
    except WireFormatError:
        return
    # Whatever decodes must be a valid message that re-encodes and decodes the same.
    assert wire.decode(wire.encode(msg)) == msg


@_fuzz
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _decode_or_wire_error(data)


@_fuzz
@given(st.binary(max_size=512))
def test_random_bodies_behind_a_valid_prefix(body: bytes) -> None:
    _decode_or_wire_error(b"OWIR\x01\x01\x00\x00" + body)


@st.composite
def mutated_frames(draw: st.DrawFn, source: st.SearchStrategy[wire.Message] = messages) -> bytes:
    frame = bytearray(wire.encode(draw(source)))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        pos = draw(st.integers(0, max(len(frame) - 1, 0)))
        if how == "flip" and frame:
            frame[pos] ^= 1 << draw(st.integers(0, 7))
        elif how == "set" and frame:
            frame[pos] = draw(st.integers(0, 255))
        elif how == "truncate":
            del frame[pos:]
        elif how == "insert":
            frame[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif how == "delete":
            del frame[pos : pos + draw(st.integers(1, 8))]
    return bytes(frame)


@_fuzz
@given(mutated_frames())
def test_mutated_valid_frames(frame: bytes) -> None:
    _decode_or_wire_error(frame)


@settings(_fuzz, max_examples=FUZZ_EXAMPLES // 3)
@given(mutated_frames(st.one_of(batches, goodbyes, refusals)))
def test_mutated_1_1_frames(frame: bytes) -> None:
    """The 1.1 messages (batch, goodbye, refusal) mutated on their own."""
    _decode_or_wire_error(frame)


@settings(_fuzz, max_examples=FUZZ_EXAMPLES // 3)
@given(payloads(max_leaves=6), st.data())
def test_mutated_payload_headers(value: Any, data: st.DataObject) -> None:
    enc = codec.dumps(value)
    header = bytearray(enc.header)
    if header:
        pos = data.draw(st.integers(0, len(header) - 1))
        header[pos] = data.draw(st.integers(0, 255))
        del header[data.draw(st.integers(0, len(header))) :]
    try:
        codec.loads(bytes(header), enc.tensors)
    except WireFormatError:
        pass


@settings(_fuzz, max_examples=FUZZ_EXAMPLES // 3)
@given(st.binary(max_size=256))
def test_random_payload_headers(header: bytes) -> None:
    try:
        codec.loads(header, [])
    except WireFormatError:
        pass


@pytest.mark.parametrize("major", [0, 2, 255])
def test_every_unknown_major_is_a_wire_format_error(major: int) -> None:
    with pytest.raises(WireFormatError, match=f"wire version {major}"):
        wire.decode(b"OWIR" + bytes([major, 0, 0, 0]) + b"\x80")
