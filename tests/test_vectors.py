"""Golden vectors: the files in specs/vectors/ decode, and re-encode byte for byte.

An accidental wire change fails here. A deliberate one regenerates the vectors
with scripts/make_vectors.py, bumps the version and adds a CHANGELOG entry.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import sys

import msgspec
import pytest
import torch

from omniwire import codec, wire

ROOT = pathlib.Path(__file__).resolve().parent.parent
VECTORS = ROOT / "specs" / "vectors"
MESSAGE_FILES = sorted(p for p in VECTORS.glob("*.bin") if p.stem != "payload_header")


@functools.cache
def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "make_vectors", ROOT / "scripts" / "make_vectors.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_vectors"] = module
    spec.loader.exec_module(module)
    return module


def test_every_message_type_has_a_vector() -> None:
    kinds = {wire.decode(p.read_bytes()).__struct_config__.tag for p in MESSAGE_FILES}
    assert kinds == {"hello", "data_ready", "data_progress", "data_ack", "abort"}


@pytest.mark.parametrize("path", MESSAGE_FILES, ids=lambda p: p.stem)
def test_vector_decodes_and_reencodes_byte_for_byte(path: pathlib.Path) -> None:
    frame = path.read_bytes()
    msg = wire.decode(frame)
    assert wire.encode(msg) == frame
    readable = json.loads(path.with_suffix(".json").read_text())
    assert json.loads(msgspec.json.encode(msg)) == readable


def test_vectors_match_the_generator() -> None:
    gen = _generator()
    for name, msg in gen.VECTORS.items():
        assert (VECTORS / f"{name}.bin").read_bytes() == wire.encode(msg), name


def test_payload_header_vector() -> None:
    gen = _generator()
    header = (VECTORS / "payload_header.bin").read_bytes()
    value = codec.loads(header, [torch.zeros(2)])
    expected = gen.header_value()
    assert value["tensor"] is value["same_tensor"]
    assert torch.equal(value["tensor"], expected["tensor"])
    assert value[(1, "key")] == "tuple key" and value["tuple"] == (1, (2, "x"))
    assert value["span"] == expected["span"]
    assert codec.dumps(value).header == header
