#!/usr/bin/env python3
"""Write the golden test vectors of specs/wire-v1.md into specs/vectors/.

Run it only when the wire format changes on purpose (with a version bump and a
CHANGELOG "Wire format" entry): tests/test_vectors.py checks that the current
code decodes these files and re-encodes them byte for byte.
"""

from __future__ import annotations

import json
import pathlib

import msgspec

from omniwire import codec, wire

OUT = pathlib.Path(__file__).resolve().parent.parent / "specs" / "vectors"

_TABLE = (
    wire.TensorMeta(dtype="float32", shape=(2, 3), offset=0, nbytes=24, path="payload['x']"),
    wire.TensorMeta(dtype="bfloat16", shape=(), offset=64, nbytes=2, path="payload['y'][0]"),
    wire.TensorMeta(dtype="int64", shape=(0, 4), offset=128, nbytes=0, path="payload['z']"),
)

VECTORS: dict[str, wire.Message] = {
    "hello": wire.HelloMessage(
        endpoint="thinker",
        wire_min=(1, 0),
        wire_max=(1, 0),
        features=("pickle",),
        host_id="4f1c2a3b-0000-4000-8000-000000000001/22",
        hostname="node-a",
        pid=4242,
        process_token="9b1f0c2d4e6a8b0c",
        instance=1234567890123,
        address="ipc:///tmp/omniwire/thinker",
        abort_address="ipc:///tmp/omniwire/thinker.abort",
        devices=(wire.DeviceInfo(kind="cpu"), wire.DeviceInfo(kind="cuda", index=0, uuid="GPU-1")),
        backends=(
            wire.BackendInfo(name="local"),
            wire.BackendInfo(name="shm", info=b"\x81\xa6prefix\xb0omniwire-4242-9b"),
        ),
        is_reply=False,
    ),
    "data_ready_ref": wire.DataReadyMessage(
        request_id="req-0",
        from_stage="encoder",
        to_stage="thinker",
        chunk_id=0,
        data_ref=wire.DataRef(
            object_id=17,
            kind="payload",
            backend="shm",
            layout="packed",
            ref=wire.BackendRef(backend="shm", info=b"\x92\xa4seg0\xcd\x10\x00", length=130),
            header=b"\x83\xa1x\xc7\x01\x02\x00\xa1y\x91\xc7\x01\x02\x01\xa1z\xc7\x01\x02\x02",
            tensors=_TABLE,
            ready=64,
        ),
        metadata=b"\x80",
    ),
    "data_ready_inline": wire.DataReadyMessage(
        request_id="req-0",
        from_stage="thinker",
        to_stage="talker",
        chunk_id=3,
        inline=wire.InlineStreamChunkRef(
            header=b"\xc7\x01\x02\x00",
            tensors=(wire.TensorMeta(dtype="int32", shape=(4,), offset=0, nbytes=16),),
            data=bytes(range(16)),
        ),
        metadata=b"\x81\xa4step\x03",
    ),
    "data_ready_end": wire.DataReadyMessage(
        request_id="req-0", from_stage="thinker", to_stage="talker", chunk_id=4, is_done=True
    ),
    "data_ready_error": wire.DataReadyMessage(
        request_id="req-1",
        from_stage="thinker",
        to_stage="talker",
        chunk_id=0,
        is_done=True,
        error="CUDA out of memory",
    ),
    "data_progress": wire.DataProgressMessage(
        object_id=17, from_stage="encoder", to_stage="thinker", ready=130
    ),
    "data_ack": wire.DataAckMessage(object_id=17, from_stage="thinker", to_stage="encoder"),
    "data_ack_failed": wire.DataAckMessage(
        object_id=18,
        from_stage="thinker",
        to_stage="encoder",
        success=False,
        error="request aborted",
    ),
    "abort": wire.AbortMessage(request_id="req-0", from_stage="encoder", reason="client went away"),
}


class Span(msgspec.Struct):
    """A registered payload type used by the header vector."""

    start: int
    end: int


codec.register_type(Span, name="omniwire.vectors.Span")


def header_value() -> dict[object, object]:
    """One payload using every header encoding of spec §6 (its tensor: zeros(2))."""
    import torch

    t = torch.zeros(2)
    value = {
        "none": None,
        "bool": True,
        "int": -(2**63),
        "uint": 2**64 - 1,
        "float": -0.0,
        "str": "héllo",
        "bytes": b"\x00\xff",
        "list": [1, 2],
        "tuple": (1, (2, "x")),
        (1, "key"): "tuple key",
        "tensor": t,
        "same_tensor": t,
    }
    value["span"] = Span(3, 9)
    return value


class _Ext(msgspec.Struct):
    code: int
    value: object


def _readable(code: int, data: memoryview) -> object:
    """A header extension, decoded for humans."""
    return _Ext(code, msgspec.msgpack.decode(data, ext_hook=_readable))


def _jsonable(value: object) -> object:
    """msgpack data as JSON: ext → {"ext", "value"}, bin → {"bin": hex},
    a map with non-string keys → {"map": [[key, value], ...]}."""
    if isinstance(value, _Ext):
        return {"ext": value.code, "value": _jsonable(value.value)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _jsonable(v) for k, v in value.items()}
        return {"map": [[_jsonable(k), _jsonable(v)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    return value


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, msg in VECTORS.items():
        (OUT / f"{name}.bin").write_bytes(wire.encode(msg))
        decoded = json.loads(msgspec.json.encode(msg))  # bytes fields appear as base64
        (OUT / f"{name}.json").write_text(json.dumps(decoded, indent=2) + "\n")
    header = codec.dumps(header_value()).header
    (OUT / "payload_header.bin").write_bytes(header)
    readable = _jsonable(msgspec.msgpack.decode(header, ext_hook=_readable))
    (OUT / "payload_header.json").write_text(json.dumps(readable, indent=1) + "\n")
    print(f"wrote {len(VECTORS) + 1} vectors to {OUT}")


if __name__ == "__main__":
    main()
