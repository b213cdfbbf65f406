#!/usr/bin/env python3
"""Write the test vectors of specs/wire-v1.md into specs/vectors/.

Every file is produced here from omniwire's own code — messages by ``wire.encode``,
headers by ``codec.dumps``, tensor tables by ``packing.plan``, backend blobs by each
backend's own structs, the CURVE keys by ``control.CurveKey`` — so the vectors are
what omniwire writes. ``tests/test_vectors.py`` checks that this script's output
equals the files (CI fails on drift), that every positive vector decodes and
re-encodes byte for byte, and that every negative vector raises the error its
manifest names.

Run it only when the wire format changes on purpose (with a version bump and a
CHANGELOG "Wire format" entry)::

    python scripts/make_vectors.py          # rewrite specs/vectors/
    python scripts/make_vectors.py --check  # exit 1 if the files differ
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
from typing import Any

import msgspec

from omniwire import codec, packing, wire

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "specs" / "vectors"

# -- fixed facts the vectors share -------------------------------------------------

PID = 4242
SHM_PREFIX = f"omniwire-{PID}-9b1f0c2d"  # omniwire-<pid>-<8..32 hex>
SHM_PREFIX_ENCODER = "omniwire-4343-5a0e7c1b"
RING_THINKER = f"omniwire-{PID}-3c9d5e7f0a1b2c4d"  # omniwire-<pid>-<16 hex>: a ring (§3.6)
RING_ENCODER = "omniwire-4343-8e6f4a2b1c0d9e7f"
HOST_ID = "4f1c2a3b-0000-4000-8000-000000000001/22"  # <boot id>/<st_dev of /dev/shm>
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CURVE_SECRET = "omniwire test vector key"
MOONCAKE_SESSION = "10.0.0.1:15002"
MOONCAKE_POOL = (0x7F0000000000, 64 << 20)  # address, size
MOONCAKE_RECEIVER_SESSION = "10.0.0.2:15002"
MOONCAKE_LANDING = (0x7F4000000000, 16 << 20, 0x2F1E2D3C4B5A6978)  # address, size, token
NIXL_AGENT = f"ow-thinker-{PID}-0123456789ab"
NIXL_RECEIVER_AGENT = f"ow-talker-{PID + 1}-ba9876543210"
NIXL_LANDING = (0x7F7000000000, 16 << 20, 0x1D2C3B4A59687766)  # address, size, token
NIXL_POOL = (0x7F0000000000, 128 << 20)
#: A lent object (§9.1): int32[6] at 0 and float32[1024] at 64, read in place from
#: the caller's tensors. (at, address, length) per piece; the image is 4160 bytes.
PIECES = ((0, 0x7F3000000040, 24), (64, 0x7F3000101000, 4096))
PIECES_LENGTH = 4160
#: The thinker's token for its session with the encoder (§10.7).
SESSION_THINKER = 0x5E55_1011_2233_4455


class Span(msgspec.Struct):
    """A registered payload type used by the header vector."""

    start: int
    end: int


codec.register_type(Span, name="omniwire.vectors.Span")


def _shm_hello(prefix: str = SHM_PREFIX) -> bytes:
    from omniwire.backends.shm import _blobs as shm

    return msgspec.msgpack.encode(shm._HelloInfo(prefix=prefix))


def _shm_ref(segment: str, offset: int, size: int, dedicated: bool) -> bytes:
    from omniwire.backends.shm import _blobs as shm

    return msgspec.msgpack.encode(
        shm._Ref(segment=segment, offset=offset, size=size, dedicated=dedicated)
    )


def _ref_payload() -> tuple[bytes, tuple[wire.TensorMeta, ...], int]:
    """A payload with three tensors (one 0-dim, one empty): header, table, length."""
    import torch

    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    y = torch.tensor(1.5, dtype=torch.bfloat16)
    z = torch.zeros((0, 4), dtype=torch.int64)
    enc = codec.dumps({"x": x, "y": [y], "z": z})
    plan = packing.plan(enc.tensors, enc.paths)
    return enc.header, plan.metas, plan.nbytes


def _inline(value: Any) -> wire.InlineStreamChunkRef:
    """An inline body as omniwire's sender builds it: header, table, packed bytes."""
    enc = codec.dumps(value)
    plan = packing.plan(enc.tensors, enc.paths)
    data = bytearray(plan.nbytes)
    packing.pack_into(data, enc.tensors, plan)
    return wire.InlineStreamChunkRef(header=enc.header, tensors=plan.metas, data=bytes(data))


def messages() -> dict[str, wire.Message]:
    """The positive message vectors, by file stem."""
    import torch

    header, table, length = _ref_payload()
    hello = wire.HelloMessage(
        endpoint="thinker",
        wire_min=(1, 0),
        wire_max=(1, 1),
        features=("zero_copy",),
        host_id=HOST_ID,
        hostname="node-a",
        pid=PID,
        process_token="9b1f0c2d4e6a8b0c",
        instance=1234567890123,
        address="ipc:///tmp/omniwire/thinker",
        abort_address="ipc:///tmp/omniwire/thinker.abort",
        devices=(wire.DeviceInfo(kind="cpu"), wire.DeviceInfo(kind="cuda", index=0, uuid="GPU-1")),
        backends=(
            wire.BackendInfo(name="local"),
            wire.BackendInfo(name="shm", info=_shm_hello()),
        ),
        is_reply=False,
        to_endpoint="encoder",
        window=4 << 20,
    )
    progressive = wire.DataReadyMessage(
        request_id="req-0",
        from_stage="thinker",
        to_stage="encoder",
        chunk_id=0,
        data_ref=wire.DataRef(
            object_id=17,
            kind="payload",
            backend="shm",
            layout="packed",
            ref=wire.BackendRef(
                backend="shm",
                info=_shm_ref(f"{SHM_PREFIX}-0", 8192, length, False),
                length=length,
            ),
            header=header,
            tensors=table,
            ready=64,
        ),
        metadata=codec.dumps({"step": 1}).header,
        traceparent=TRACEPARENT,
    )
    return {
        "hello": hello,
        "hello_reply": msgspec.structs.replace(
            hello,
            endpoint="encoder",
            pid=4343,
            process_token="0c8b6a4e2d0c1f9b",
            instance=42,
            address="tcp://10.0.0.2:5555",
            abort_address="tcp://10.0.0.2:5556",
            host_id="7e2d1c0b-0000-4000-8000-000000000002/22",
            hostname="node-b",
            features=(),
            devices=(wire.DeviceInfo(kind="cpu"),),
            backends=(wire.BackendInfo(name="local"),),
            is_reply=True,
            to_endpoint="thinker",
        ),
        "hello_ring": msgspec.structs.replace(
            hello,
            features=("ring",),
            backends=(wire.BackendInfo(name="shm", info=_shm_hello()),),
            is_reply=True,
            ring=RING_THINKER,
        ),
        "hello_ring_attached": msgspec.structs.replace(
            hello,
            endpoint="encoder",
            pid=4343,
            process_token="0c8b6a4e2d0c1f9b",
            instance=42,
            address="ipc:///tmp/omniwire/encoder",
            abort_address="ipc:///tmp/omniwire/encoder.abort",
            features=("ring",),
            devices=(wire.DeviceInfo(kind="cpu"),),
            backends=(wire.BackendInfo(name="shm", info=_shm_hello(SHM_PREFIX_ENCODER)),),
            is_reply=True,
            to_endpoint="thinker",
            ring=RING_ENCODER,
            ring_attached=RING_THINKER,
        ),
        "data_ready_ref": progressive,
        # feature "digest" (§7.6): XXH3-64 of the tensor bytes, here a fixed value
        "data_ready_ref_digest": msgspec.structs.replace(
            progressive,
            request_id="req-2",
            data_ref=msgspec.structs.replace(
                progressive.data_ref, object_id=19, ready=None, digest=0x9E3779B97F4A7C15
            ),
        ),
        "data_ready_ref_dedicated": msgspec.structs.replace(
            progressive,
            request_id="req-1",
            data_ref=msgspec.structs.replace(
                progressive.data_ref,
                object_id=18,
                ref=wire.BackendRef(
                    backend="shm",
                    info=_shm_ref(f"{SHM_PREFIX}-7", 0, length, True),
                    length=length,
                ),
                ready=None,
            ),
            metadata=b"",
            traceparent="",
        ),
        "data_ready_inline": wire.DataReadyMessage(
            request_id="req-0",
            from_stage="thinker",
            to_stage="talker",
            chunk_id=3,
            inline=_inline(torch.arange(4, dtype=torch.int32)),
            metadata=codec.dumps({"step": 3}).header,
        ),
        "data_ready_inline_payload": wire.DataReadyMessage(
            request_id="req-2",
            from_stage="thinker",
            to_stage="talker",
            inline=msgspec.structs.replace(
                _inline({"ids": torch.tensor([7, 8], dtype=torch.int64), "text": "hi"}),
                kind="payload",
            ),
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
            object_id=17, from_stage="thinker", to_stage="encoder", ready=length
        ),
        "data_ack": wire.DataAckMessage(object_id=17, from_stage="encoder", to_stage="thinker"),
        "data_ack_nack": wire.DataAckMessage(
            object_id=18,
            from_stage="encoder",
            to_stage="thinker",
            success=False,
            error="request 'req-1' was aborted by 'client'",
            reason="aborted",
        ),
        "data_ack_misaddressed": wire.DataAckMessage(
            object_id=19,
            from_stage="encoder",
            to_stage="thinker",
            success=False,
            error="DataReady addressed to 'vocoder', not 'encoder'",
            reason="misaddressed",
        ),
        "abort": wire.AbortMessage(
            request_id="req-0", from_stage="encoder", reason="client went away"
        ),
        "abort_forwarded": wire.AbortMessage(
            request_id="req-0", from_stage="thinker", reason="client went away", origin="encoder"
        ),
        "window": wire.WindowMessage(from_stage="encoder", to_stage="thinker", increment=1 << 20),
        "goodbye": wire.GoodbyeMessage(
            from_stage="thinker", instance=1234567890123, reason="endpoint closed"
        ),
        "refusal": wire.RefusalMessage(
            from_stage="thinker",
            to_stage="encoder",
            code="name_mismatch",
            detail="this endpoint is 'thinker', not 'talker'",
            addressed="talker",
        ),
        "batch": wire.BatchMessage(
            messages=(
                wire.DataAckMessage(object_id=17, from_stage="encoder", to_stage="thinker"),
                wire.DataAckMessage(
                    object_id=18,
                    from_stage="encoder",
                    to_stage="thinker",
                    success=False,
                    error="receiver queue full",
                    reason="queue_full",
                ),
                wire.DataReadyMessage(
                    request_id="req-3", from_stage="encoder", to_stage="thinker", is_done=True
                ),
                wire.AbortMessage(request_id="req-4", from_stage="encoder"),
            )
        ),
        # §10.7: frame 42 of the encoder's session with the thinker, whose token it
        # carries; the encoder has applied the thinker's frames up to 7
        "batch_numbered": wire.BatchMessage(
            messages=(wire.DataAckMessage(object_id=19, from_stage="encoder", to_stage="thinker"),),
            from_stage="encoder",
            session=SESSION_THINKER,
            seq=42,
            ack=7,
        ),
        "batch_ack": wire.BatchMessage(
            messages=(), from_stage="encoder", session=SESSION_THINKER, ack=8
        ),
        "hello_resume": msgspec.structs.replace(
            hello, features=(*hello.features, "resume"), session=SESSION_THINKER
        ),
    }


def header_value() -> dict[object, object]:
    """One payload using every header encoding of spec §6 (its tensor: zeros(2))."""
    import numpy as np
    import torch

    t = torch.zeros(2)
    value: dict[object, object] = {
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
        "ndarray": np.arange(3, dtype=np.uint8),
    }
    value["span"] = Span(3, 9)
    return value


def blobs() -> dict[str, msgspec.Struct]:
    """Each built-in backend's Hello info and reference blobs, by file stem."""
    from omniwire.backends.cuda_ipc import _blobs as cuda_ipc
    from omniwire.backends.mooncake import _blobs as mooncake
    from omniwire.backends.nccl import _blobs as nccl
    from omniwire.backends.nixl import _blobs as nixl
    from omniwire.backends.shm import _blobs as shm

    share = cuda_ipc.Share(
        device="GPU-5f2c1a9e-0000-4000-8000-000000000001",
        handle=bytes(range(66)),
        nbytes=1 << 20,
        offset=0,
        counter=f"/torch_{PID}_1234567890_0",
        counter_offset=3,
        event=bytes(64),
        event_sync=True,
    )
    nixl_md = _nixl_metadata(b"...")
    pool = nixl.Region(addr=NIXL_POOL[0], length=NIXL_POOL[1], dev=0, mem="DRAM")
    # Lent tensors (send(..., lend=True)): the packed image of PIECES read where the
    # caller's tensors are, one piece per tensor.
    lent = [
        nixl.Lent(
            nixl.Region(addr=0x7F3000000000, length=4096, dev=0, mem="DRAM"),
            _nixl_metadata(b"lent-0..."),
        ),
        nixl.Lent(
            nixl.Region(addr=0x7F3000100000, length=1 << 20, dev=0, mem="DRAM"),
            _nixl_metadata(b"lent-1..."),
        ),
    ]
    return {
        "shm_hello": shm._HelloInfo(prefix=SHM_PREFIX),
        "shm_ref": shm._Ref(segment=f"{SHM_PREFIX}-0", offset=8192, size=128, dedicated=False),
        "shm_ref_dedicated": shm._Ref(
            segment=f"{SHM_PREFIX}-7", offset=0, size=128, dedicated=True
        ),
        # forwarding (§9.2): the reader says it reads forwards; the forwarder (this
        # prefix) names, by its link -3, the memfd another process made as segment 0
        "shm_hello_forwards": shm._Hello(prefix=SHM_PREFIX, forwards=True),
        "shm_ref_forward": shm._ForwardRef(
            segment=f"{SHM_PREFIX}-3",
            offset=8192,
            size=128,
            dedicated=False,
            origin=f"omniwire-{PID + 1}-5e0d7a11-0",
        ),
        "cuda_ipc_hello": cuda_ipc.HelloInfo(
            pid=PID, device="GPU-5f2c1a9e-0000-4000-8000-000000000001", release_event=bytes(64)
        ),
        "cuda_ipc_ref_tensors": cuda_ipc.TensorsRef(
            shares=[share],
            tensors=[
                cuda_ipc.TensorRef(share=0, dtype="float16", shape=[2, 3], stride=[3, 1], offset=0),
                cuda_ipc.TensorRef(share=0, dtype="float16", shape=[4], stride=[1], offset=32),
            ],
        ),
        "cuda_ipc_ref_slot": cuda_ipc.SlotRef(
            buffer=share,
            buffer_id=0,
            dedicated=False,
            offset=65536,
            size=4096,
            event=bytes(64),
            event_id=5,
        ),
        "mooncake_hello": mooncake.HelloInfo(
            session=MOONCAKE_SESSION,
            protocol="tcp",
            pool_addr=MOONCAKE_POOL[0],
            pool_size=MOONCAKE_POOL[1],
        ),
        "mooncake_ref": mooncake.Ref(session="10.0.0.1:15002", offset=4096, length=128),
        "mooncake_ref_dedicated": mooncake.Ref(
            session="10.0.0.1:15002", offset=0, length=128 << 20, dedicated=0x7F1000000000
        ),
        "nixl_hello": nixl.HelloInfo(agent=NIXL_AGENT, metadata=nixl_md, pools=[pool]),
        "nixl_ref": nixl.Ref(pool=0, offset=4096, length=128),
        "nixl_ref_dedicated": nixl.Ref(
            pool=-1,
            offset=0,
            length=256 << 20,
            region=nixl.Region(addr=0x7F2000000000, length=256 << 20, dev=0, mem="DRAM"),
            metadata=nixl_md,
        ),
        "nccl_hello": nccl.HelloInfo(host="10.0.0.1", port=29500, cuda=False),
        "nccl_ref": nccl.Ref(gen=0, tag=1, nbytes=128, device="cpu", ordered=False),
        # -- lent tensors: a receiver announces that it reads pieces; a sender's pieces
        "mooncake_hello_pieces": mooncake.PiecesHello(
            session=MOONCAKE_SESSION,
            protocol="tcp",
            pool_addr=MOONCAKE_POOL[0],
            pool_size=MOONCAKE_POOL[1],
            pieces=True,
        ),
        "mooncake_ref_pieces": mooncake.PiecesRef(
            session=MOONCAKE_SESSION,
            offset=0,
            length=PIECES_LENGTH,
            pieces=[mooncake.Piece(at, addr, n) for at, addr, n in PIECES],
        ),
        # -- a landing (§9.4): the receiver lends it in its Hello to the sender; the
        # sender's landed reference names it (its own session, the landing's token)
        "mooncake_hello_landing": mooncake.LandingHello(
            session=MOONCAKE_RECEIVER_SESSION,
            protocol="tcp",
            pool_addr=0x7F5000000000,
            pool_size=64 << 20,
            pieces=True,
            landing=mooncake.Landing(*MOONCAKE_LANDING),
        ),
        "mooncake_ref_landed": mooncake.LandedRef(
            session=MOONCAKE_SESSION,
            offset=1 << 20,
            length=PIECES_LENGTH,
            landing=MOONCAKE_LANDING[2],
        ),
        "nixl_hello_landing": nixl.LandingHello(
            agent=NIXL_RECEIVER_AGENT,
            metadata=_nixl_metadata(b"receiver", NIXL_RECEIVER_AGENT),
            pools=[nixl.Region(addr=0x7F6000000000, length=128 << 20, dev=0, mem="DRAM")],
            pieces=True,
            landing=nixl.Landing(
                nixl.Region(addr=NIXL_LANDING[0], length=NIXL_LANDING[1], dev=0, mem="DRAM"),
                _nixl_metadata(b"landing", NIXL_RECEIVER_AGENT),
                NIXL_LANDING[2],
            ),
        ),
        "nixl_ref_landed": nixl.LandedRef(
            pool=nixl.LANDED, offset=1 << 20, length=PIECES_LENGTH, landing=NIXL_LANDING[2]
        ),
        "nixl_hello_pieces": nixl.PiecesHello(
            agent=NIXL_AGENT, metadata=nixl_md, pools=[pool], pieces=True
        ),
        "nixl_ref_pieces": nixl.PiecesRef(
            pool=-2,
            offset=0,
            length=PIECES_LENGTH,
            lent=lent,
            pieces=[nixl.Piece(at, addr, n, i) for i, (at, addr, n) in enumerate(PIECES)],
        ),
        "nccl_hello_pieces": nccl.PiecesHello(host="10.0.0.1", port=29500, cuda=False, pieces=True),
        "nccl_ref_pieces": nccl.PiecesRef(
            gen=0,
            tag=2,
            nbytes=PIECES_LENGTH,
            device="cpu",
            ordered=False,
            pieces=[(at, n) for at, _, n in PIECES],
        ),
    }


def _nixl_metadata(tail: bytes, agent: str = NIXL_AGENT) -> bytes:
    """A stand-in for NIXL's metadata blob: its real head (``nixlSerDes|Agent``, the
    name's length, the agent name, ``|``), then ``tail``."""
    name = agent.encode()
    return b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name + b"|" + tail


def curve() -> dict[str, str]:
    """The CURVE key derivation test vector (spec §3.5)."""
    from omniwire.control import CurveKey

    key = CurveKey.from_shared_secret(CURVE_SECRET)
    digest = hashlib.sha256(b"omniwire-curve-v1\0" + CURVE_SECRET.encode()).digest()
    return {
        "auth_key": CURVE_SECRET,
        "sha256_input_hex": (b"omniwire-curve-v1\0" + CURVE_SECRET.encode()).hex(),
        "secret_key_hex": digest.hex(),
        "secret_key_z85": key.secret.decode(),
        "public_key_z85": key.public.decode(),
    }


# -- 1.0 frames a 1.1 reader must accept ---------------------------------------------


def _frame(body: Any, major: int = 1, minor: int = 1) -> bytes:
    return b"OWIR" + bytes([major, minor, 0, 0]) + msgspec.msgpack.encode(body)


def _without(msg: wire.Message, *fields: str) -> dict[str, Any]:
    """``msg`` as a msgpack map in field order, without ``fields``."""
    body: dict[str, Any] = {"type": msg.__struct_config__.tag}
    body.update(msgspec.structs.asdict(msg))
    for f in fields:
        body.pop(f)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body))  # type: ignore[no-any-return]


def compat() -> dict[str, tuple[bytes, wire.Message]]:
    """1.0 frames (no 1.1 field, minor 0) and what a 1.1 reader decodes them to."""
    msgs = messages()
    hello10 = msgspec.structs.replace(msgs["hello"], wire_max=(1, 0), to_endpoint="", window=0)
    ack10 = wire.DataAckMessage(
        object_id=18, from_stage="encoder", to_stage="thinker", success=False, error="x"
    )
    abort10 = wire.AbortMessage(request_id="req-0", from_stage="encoder", reason="gone")
    ready10 = msgspec.structs.replace(msgs["data_ready_inline"], traceparent="")
    ref10 = msgspec.structs.replace(msgs["data_ready_ref"], traceparent="")
    return {
        "hello_1_0": (
            _frame(
                _without(
                    hello10, "to_endpoint", "ring", "ring_attached", "window", "epoch", "session"
                ),
                minor=0,
            ),
            hello10,
        ),
        "data_ack_1_0": (_frame(_without(ack10, "reason"), minor=0), ack10),
        "abort_1_0": (_frame(_without(abort10, "origin"), minor=0), abort10),
        "data_ready_inline_1_0": (
            _frame(_without(ready10, "traceparent") | {"inline": _inline_10(ready10)}, minor=0),
            ready10,
        ),
        # a DataRef without DataRef.digest (a 1.0 writer, or one before the feature
        # "digest") reads as one with no digest
        "data_ready_ref_1_0": (_frame(_without_digest(ref10), minor=0), ref10),
    }


def _without_digest(msg: wire.Message) -> dict[str, Any]:
    body = _without(msg, "traceparent")
    body["data_ref"].pop("digest")
    return body


def _inline_10(msg: wire.DataReadyMessage) -> dict[str, Any]:
    assert msg.inline is not None
    body = msgspec.structs.asdict(msg.inline)
    body.pop("kind")
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body))  # type: ignore[no-any-return]


# -- negative vectors ------------------------------------------------------------------


def _body(msg: wire.Message) -> dict[str, Any]:
    return _without(msg)


#: The rejection code (wire-v1.md §11.8) of each negative vector: what a reader in any
#: language checks, instead of omniwire's error classes and messages.
REJECTION_CODES: dict[str, str] = {
    "bad_magic": "frame.bad_magic",
    "short_prefix": "frame.short",
    "empty_body": "frame.bad_msgpack",
    "trailing_bytes": "frame.bad_msgpack",
    "unknown_major": "frame.unsupported_major",
    "reserved_ignored_but_major_0": "frame.unsupported_major",
    "not_a_map": "message.not_a_map",
    "unknown_type": "message.unknown_type",
    "nesting_in_frame": "frame.too_deep",
    "invalid_utf8": "frame.bad_msgpack",
    "hello_missing_instance": "message.missing_field",
    "hello_wire_min_above_max": "hello.version_range",
    "hello_empty_endpoint": "message.bad_value",
    "batch_with_hello": "batch.bad_member",
    "batch_empty": "batch.size",
    "batch_ack_with_messages": "batch.size",
    "batch_numbered_without_session": "batch.resume",
    "batch_numbered_foreign_member": "batch.resume",
    "batch_nested": "batch.bad_member",
    "unknown_dtype": "tensor.unknown_dtype",
    "nbytes_mismatch": "tensor.nbytes",
    "shape_dim_over_i64": "tensor.shape",
    "shape_product_overflow": "tensor.shape",
    "negative_dim": "tensor.shape",
    "oversized_inline": "inline.too_large",
    "unaligned_offset": "tensor.unaligned",
    "tensor_beyond_buffer": "tensor.out_of_bounds",
    "data_ref_and_inline": "data_ready.both",
    "data_ready_empty": "data_ready.empty",
    "ack_success_with_reason": "ack.reason_on_success",
    "object_id_negative": "message.bad_value",
    "data_ref_version_2": "data_ref.version",
    "header_nesting_65": "header.too_deep",
    "header_nesting_65_tuples": "header.too_deep",
    "header_pickle": "header.pickle_refused",
    "header_unknown_ext": "header.unknown_ext",
    "header_tensor_index_out_of_range": "header.tensor_index",
    "header_tensor_index_not_int": "header.tensor_index",
    "header_unregistered_type": "header.unregistered_type",
    "header_tuple_not_array": "header.bad_ext",
    "header_trailing_bytes": "header.bad_msgpack",
    "header_ndarray_bfloat16": "header.ndarray_dtype",
    "shm_ref_foreign_segment": "ref.not_the_peers",
    "shm_ref_bad_name": "ref.not_the_peers",
    "shm_ref_prefix_only": "ref.not_the_peers",
    "shm_ref_size_mismatch": "ref.length",
    "shm_ref_array_form": "ref.bad_form",
    "shm_ref_offset_not_int": "ref.bad_form",
    "mooncake_pieces_overlap": "pieces.layout",
    "mooncake_pieces_unsorted": "pieces.layout",
    "mooncake_piece_past_the_end": "pieces.layout",
    "mooncake_piece_empty": "pieces.layout",
    "mooncake_piece_in_the_pool": "ref.not_the_peers",
    "mooncake_pieces_with_offset": "ref.bad_form",
    "nixl_pieces_with_region": "ref.bad_form",
    "nixl_pieces_none": "ref.bad_form",
    "nixl_piece_outside_its_region": "ref.not_the_peers",
    "nixl_piece_region_index": "ref.bad_form",
    "nixl_lent_region_in_the_pool": "ref.not_the_peers",
    "nixl_more_regions_than_pieces": "ref.bad_form",
    "nixl_pieces_in_the_pool_form": "ref.bad_form",
    "nixl_pool_minus_3": "ref.bad_form",
    "nccl_pieces_ordered": "ref.bad_form",
    "nccl_pieces_tags_past_the_limit": "ref.bad_value",
    "nccl_pieces_overlap": "pieces.layout",
}


def negatives() -> list[dict[str, Any]]:
    """Each: name, bytes, layer, why; and what omniwire raises: error class, message
    fragment (a regex). The manifest gives REJECTION_CODES[name] instead of the last two."""
    msgs = messages()
    abort = wire.encode(msgs["abort"])
    hello = _body(msgs["hello"])
    ready = _body(msgs["data_ready_ref"])
    inline = _body(msgs["data_ready_inline"])
    ack = _body(msgs["data_ack"])

    def with_tensor(**meta: Any) -> bytes:
        body = _body(msgs["data_ready_inline"])  # a fresh copy
        body["inline"]["tensors"][0].update(meta)
        return _frame(body)

    hello_missing = dict(hello)
    del hello_missing["instance"]
    batch_hello = {"type": "batch", "messages": [ack, hello]}
    over = inline | {
        "inline": inline["inline"]
        | {
            "tensors": [
                {
                    "dtype": "uint8",
                    "shape": [16385],
                    "offset": 0,
                    "nbytes": 16385,
                    "device": "cpu",
                    "path": "",
                }
            ],
            "data": bytes(16385),
        }
    }
    unaligned = ready | {
        "data_ref": ready["data_ref"]
        | {"tensors": [ready["data_ref"]["tensors"][0] | {"offset": 8}]}
    }
    beyond = ready | {
        "data_ref": ready["data_ref"] | {"ref": ready["data_ref"]["ref"] | {"length": 100}}
    }
    both = ready | {"inline": inline["inline"]}
    empty = ready | {"data_ref": None, "inline": None, "error": None, "is_done": False}
    ext_tuple = msgspec.msgpack.Ext(codec.EXT_TUPLE, msgspec.msgpack.encode([1]))

    def nest(depth: int) -> bytes:
        return b"\x91" * (depth - 1) + b"\x90"

    v = "wire.decode"
    c = "codec.loads"
    s = "shm.import"
    wfe = "WireFormatError"
    return [
        # -- frame layer
        dict(
            name="bad_magic",
            data=b"OWIQ" + abort[4:],
            layer=v,
            error=wfe,
            match="bad magic",
            why="the first four bytes are not OWIR",
        ),
        dict(
            name="short_prefix",
            data=b"OWIR\x01",
            layer=v,
            error=wfe,
            match="prefix",
            why="fewer than the 8 prefix bytes",
        ),
        dict(
            name="empty_body",
            data=b"OWIR\x01\x01\x00\x00",
            layer=v,
            error=wfe,
            match="malformed msgpack",
            why="a prefix and no body",
        ),
        dict(
            name="trailing_bytes",
            data=abort + b"\xc0",
            layer=v,
            error=wfe,
            match="malformed msgpack",
            why="one msgpack object followed by another byte",
        ),
        dict(
            name="unknown_major",
            data=b"OWIR\x02\x00" + abort[6:],
            layer=v,
            error="UnsupportedVersionError",
            match=r"wire version 2\.0 is not supported",
            why="major 2 (UnsupportedVersionError is a WireFormatError)",
        ),
        dict(
            name="reserved_ignored_but_major_0",
            data=b"OWIR\x00\x01\xff\xff" + abort[8:],
            layer=v,
            error="UnsupportedVersionError",
            match=r"wire version 0\.1",
            why="major 0 does not exist",
        ),
        dict(
            name="not_a_map",
            data=_frame([1, 2]),
            layer=v,
            error=wfe,
            match="invalid message",
            why="the body is an array, not a message map",
        ),
        dict(
            name="unknown_type",
            data=_frame({"type": "gossip"}),
            layer=v,
            error=wfe,
            match="gossip",
            why="a message type no 1.x version defines",
        ),
        dict(
            name="nesting_in_frame",
            data=b"OWIR\x01\x01\x00\x00" + nest(5000),
            layer=v,
            error=wfe,
            match="nested too deeply|invalid message",
            why="5000 nested arrays",
        ),
        dict(
            name="invalid_utf8",
            data=_frame(
                {"type": "abort", "request_id": "r", "from_stage": "s", "reason": "Z", "origin": ""}
            ).replace(b"\xa1Z", b"\xa1\xff"),
            layer=v,
            error=wfe,
            match="malformed msgpack|invalid message",
            why="a str whose bytes are not UTF-8",
        ),
        dict(
            name="hello_missing_instance",
            data=_frame(hello_missing),
            layer=v,
            error=wfe,
            match="missing required field `instance`",
            why="a Hello without a required field",
        ),
        dict(
            name="hello_wire_min_above_max",
            data=_frame(hello | {"wire_min": [1, 2], "wire_max": [1, 1]}),
            layer=v,
            error=wfe,
            match="wire_min",
            why="wire_min > wire_max",
        ),
        dict(
            name="hello_empty_endpoint",
            data=_frame(hello | {"endpoint": ""}),
            layer=v,
            error=wfe,
            match="endpoint must not be empty",
            why="an empty stage name",
        ),
        dict(
            name="batch_with_hello",
            data=_frame(batch_hello),
            layer=v,
            error=wfe,
            match="invalid message",
            why="a Hello inside a batch",
        ),
        dict(
            name="batch_empty",
            data=_frame({"type": "batch", "messages": []}),
            layer=v,
            error=wfe,
            match="carries 0 messages",
            why="a batch must carry 1 to 4096",
        ),
        dict(
            name="batch_ack_with_messages",
            data=_frame(
                {
                    "type": "batch",
                    "messages": [ack],
                    "from_stage": "encoder",
                    "session": 5,
                    "seq": 0,
                    "ack": 3,
                }
            ),
            layer=v,
            error=wfe,
            match="an ack alone",
            why="a batch with an ack and no number carries no message (§10.7)",
        ),
        dict(
            name="batch_numbered_without_session",
            data=_frame(
                {
                    "type": "batch",
                    "messages": [ack],
                    "from_stage": "encoder",
                    "session": 0,
                    "seq": 1,
                    "ack": 0,
                }
            ),
            layer=v,
            error=wfe,
            match="needs a session token",
            why="a numbered frame names the addressee's session (§10.7)",
        ),
        dict(
            name="batch_numbered_foreign_member",
            data=_frame(
                {
                    "type": "batch",
                    "messages": [ack],
                    "from_stage": "talker",
                    "session": 5,
                    "seq": 1,
                    "ack": 0,
                }
            ),
            layer=v,
            error=wfe,
            match="holds a message from",
            why="every message of a numbered frame is its sender's (§10.7)",
        ),
        dict(
            name="batch_nested",
            data=_frame({"type": "batch", "messages": [{"type": "batch", "messages": [ack]}]}),
            layer=v,
            error=wfe,
            match="invalid message",
            why="a batch inside a batch",
        ),
        dict(
            name="unknown_dtype",
            data=with_tensor(dtype="float7"),
            layer=v,
            error=wfe,
            match="float7",
            why="a dtype no 1.x version defines",
        ),
        dict(
            name="nbytes_mismatch",
            data=with_tensor(nbytes=15),
            layer=v,
            error=wfe,
            match="needs 16",
            why="nbytes != prod(shape) * itemsize",
        ),
        dict(
            name="shape_dim_over_i64",
            data=with_tensor(shape=[2**63], nbytes=0),
            layer=v,
            error=wfe,
            match=r"outside \[0, 2\*\*63-1\]",
            why="a dimension of 2**63",
        ),
        dict(
            name="shape_product_overflow",
            data=with_tensor(shape=[2**32, 2**32, 0], nbytes=0),
            layer=v,
            error=wfe,
            match=r"exceeds 2\*\*63-1",
            why="the non-zero dims multiply to 2**64 (the tensor is empty, still refused)",
        ),
        dict(
            name="negative_dim",
            data=with_tensor(shape=[-1], nbytes=0),
            layer=v,
            error=wfe,
            match="shape",
            why="a negative dimension",
        ),
        dict(
            name="oversized_inline",
            data=_frame(over),
            layer=v,
            error=wfe,
            match="the limit is 16384",
            why="16385 tensor bytes inline",
        ),
        dict(
            name="unaligned_offset",
            data=_frame(unaligned),
            layer=v,
            error=wfe,
            match="not 64-aligned",
            why="a packed tensor offset that is not a multiple of 64",
        ),
        dict(
            name="tensor_beyond_buffer",
            data=_frame(beyond),
            layer=v,
            error=wfe,
            match="beyond",
            why="a packed tensor ending past ref.length",
        ),
        dict(
            name="data_ref_and_inline",
            data=_frame(both),
            layer=v,
            error=wfe,
            match="both data_ref and inline",
            why="data_ref and inline together",
        ),
        dict(
            name="data_ready_empty",
            data=_frame(empty),
            layer=v,
            error=wfe,
            match="carries no data, no error and is not is_done",
            why="a DataReady with neither data (data_ref, inline), is_done nor error",
        ),
        dict(
            name="ack_success_with_reason",
            data=_frame(ack | {"reason": "aborted"}),
            layer=v,
            error=wfe,
            match="success=true must have no reason",
            why="a NACK reason on a successful ACK",
        ),
        dict(
            name="object_id_negative",
            data=_frame(ack | {"object_id": -5}),
            layer=v,
            error=wfe,
            match="object_id",
            why="a u64 field holding -5",
        ),
        dict(
            name="data_ref_version_2",
            data=_frame(ready | {"data_ref": ready["data_ref"] | {"version": 2}}),
            layer=v,
            error=wfe,
            match="DataRef.version 2",
            why="a DataRef layout version this spec does not define",
        ),
        # -- header layer (codec.loads with a table of `tensors` tensors)
        dict(
            name="header_nesting_65",
            data=nest(65),
            layer=c,
            error=wfe,
            tensors=0,
            match="deeper than 64",
            why="65 nested arrays",
        ),
        dict(
            name="header_nesting_65_tuples",
            data=_nest_ext(65),
            layer=c,
            error=wfe,
            tensors=0,
            match="deeper than 64",
            why="65 nested tuples (ext 1)",
        ),
        dict(
            name="header_pickle",
            data=msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_PICKLE, b"\x80\x05N.")),
            layer=c,
            error=wfe,
            tensors=0,
            match="did not opt in",
            why="a pickled object (ext 5) without the receiver's opt-in: refused, not unpickled",
        ),
        dict(
            name="header_unknown_ext",
            data=msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b"\x00")),
            layer=c,
            error=wfe,
            tensors=0,
            match="unknown header extension type 9",
            why="ext type 9",
        ),
        dict(
            name="header_tensor_index_out_of_range",
            data=msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_TENSOR, b"\x01")),
            layer=c,
            error=wfe,
            tensors=1,
            match="refers to tensor 1",
            why="tensor index 1 with a table of one",
        ),
        dict(
            name="header_tensor_index_not_int",
            data=msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_TENSOR, b"\xa1x")),
            layer=c,
            error=wfe,
            tensors=1,
            match="refers to tensor 'x'",
            why="a tensor index that is not an integer (the string 'x')",
        ),
        dict(
            name="header_unregistered_type",
            data=msgspec.msgpack.encode(
                msgspec.msgpack.Ext(codec.EXT_STRUCT, msgspec.msgpack.encode(["nobody.Type", {}]))
            ),
            layer=c,
            error=wfe,
            tensors=0,
            match="not registered",
            why="a registered-type name the reader does not know",
        ),
        dict(
            name="header_tuple_not_array",
            data=msgspec.msgpack.encode(
                msgspec.msgpack.Ext(codec.EXT_TUPLE, msgspec.msgpack.encode({"a": 1}))
            ),
            layer=c,
            error=wfe,
            tensors=0,
            match="does not hold an array",
            why="ext 1 holding a map",
        ),
        dict(
            name="header_trailing_bytes",
            data=msgspec.msgpack.encode([ext_tuple]) + b"\xc0",
            layer=c,
            error=wfe,
            tensors=0,
            match="malformed payload header",
            why="a header followed by another byte",
        ),
        dict(
            name="header_ndarray_bfloat16",
            data=msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_NDARRAY, b"\x00")),
            layer=c,
            error=wfe,
            tensors=1,
            dtype="bfloat16",
            match="ext 3 .numpy array. cannot carry bfloat16",
            why="a numpy array (ext 3) of a dtype numpy lacks; it travels as ext 2",
        ),
        # -- the shm backend's reference check (against the Hello vector's shm info)
        dict(
            name="shm_ref_foreign_segment",
            data=_shm_ref("omniwire-999-deadbeef-0", 0, 128, False),
            layer=s,
            error="BackendError",
            length=128,
            match="not one of its own",
            why="a segment of another prefix (another process's memory)",
        ),
        dict(
            name="shm_ref_bad_name",
            data=_shm_ref(f"{SHM_PREFIX}-0/../../etc/passwd", 0, 128, False),
            layer=s,
            error="BackendError",
            length=128,
            match="not one of its own",
            why="a name that does not match omniwire-<pid>-<hex>-<n>",
        ),
        dict(
            name="shm_ref_prefix_only",
            data=_shm_ref(f"{SHM_PREFIX}0-1", 0, 128, False),
            layer=s,
            error="BackendError",
            length=128,
            match="not one of its own",
            why="a name that extends the prefix instead of following it with -<n>",
        ),
        dict(
            name="shm_ref_size_mismatch",
            data=_shm_ref(f"{SHM_PREFIX}-0", 0, 64, False),
            layer=s,
            error="BackendError",
            length=128,
            match="has size 64 != 128",
            why="size differs from BackendRef.length",
        ),
        dict(
            name="shm_ref_array_form",
            data=msgspec.msgpack.encode([f"{SHM_PREFIX}-0", 4096]),
            layer=s,
            error="BackendError",
            length=128,
            match="malformed shm reference",
            why="the array form of the 1.0 vector; the reference is a map",
        ),
        dict(
            name="shm_ref_offset_not_int",
            data=msgspec.msgpack.encode(
                {"segment": f"{SHM_PREFIX}-0", "offset": "0", "size": 128, "dedicated": False}
            ),
            layer=s,
            error="BackendError",
            length=128,
            match="malformed shm reference",
            why="offset is a string: a field of the wrong type is not the form (ref.bad_form)",
        ),
        *_piece_negatives(),
    ]


def _piece_negatives() -> list[dict[str, Any]]:
    """References of lent tensors (§9.1) a receiver must refuse, each checked against
    the Hello info ``blobs/<backend>_hello_pieces.bin`` for an object of ``length``
    bytes. Each breaks one rule of the valid ``blobs/<backend>_ref_pieces.bin``."""
    enc = msgspec.msgpack.encode
    n = PIECES_LENGTH
    (at0, addr0, n0), (at1, addr1, n1) = PIECES

    def mooncake(pieces: list[list[int]], **fields: int) -> bytes:
        ref = {"session": MOONCAKE_SESSION, "offset": 0, "length": n, "dedicated": 0}
        return enc(ref | fields | {"pieces": pieces})

    lent0 = [[0x7F3000000000, 4096, 0, "DRAM"], _nixl_metadata(b"lent-0...")]
    lent1 = [[0x7F3000100000, 1 << 20, 0, "DRAM"], _nixl_metadata(b"lent-1...")]

    def nixl(pieces: list[list[int]], lent: list[Any], **fields: Any) -> bytes:
        ref = {"pool": -2, "offset": 0, "length": n, "region": None, "metadata": b""}
        return enc(ref | fields | {"lent": lent, "pieces": pieces})

    def nccl(pieces: list[list[int]], **fields: Any) -> bytes:
        ref = {"gen": 0, "tag": 2, "nbytes": n, "device": "cpu", "ordered": False}
        return enc(ref | fields | {"pieces": pieces})

    bad_piece = "overlaps another or lies outside"
    m, x, c = "mooncake.ref", "nixl.ref", "nccl.ref"
    err = "BackendError"
    return [
        dict(
            name="mooncake_pieces_overlap",
            data=mooncake([[at0, addr0, 80], [at1, addr1, n1]]),
            layer=m,
            error=err,
            length=n,
            match=bad_piece,
            why="the first piece [0, 80) overlaps the second [64, 4160)",
        ),
        dict(
            name="mooncake_pieces_unsorted",
            data=mooncake([[at1, addr1, n1], [at0, addr0, n0]]),
            layer=m,
            error=err,
            length=n,
            match=bad_piece,
            why="pieces not sorted by their offset in the object",
        ),
        dict(
            name="mooncake_piece_past_the_end",
            data=mooncake([[at0, addr0, n0], [at1, addr1, n1 + 1]]),
            layer=m,
            error=err,
            length=n,
            match=bad_piece,
            why="a piece ends at 4161, past the 4160-byte object",
        ),
        dict(
            name="mooncake_piece_empty",
            data=mooncake([[at0, addr0, 0], [at1, addr1, n1]]),
            layer=m,
            error=err,
            length=n,
            match=bad_piece,
            why="a piece of length 0",
        ),
        dict(
            name="mooncake_piece_in_the_pool",
            data=mooncake([[at0, MOONCAKE_POOL[0] + 4096, n0], [at1, addr1, n1]]),
            layer=m,
            error=err,
            length=n,
            match="not memory of its own outside its pool",
            why="a piece inside the sender's announced pool (only lent memory is read in place)",
        ),
        dict(
            name="mooncake_pieces_with_offset",
            data=mooncake([[at0, addr0, n0], [at1, addr1, n1]], offset=64),
            layer=m,
            error=err,
            length=n,
            match="mixes pieces with a pool offset",
            why="pieces with a non-zero offset (offset and dedicated are 0 in the pieces form)",
        ),
        dict(
            name="nixl_pieces_with_region",
            data=nixl([[at0, addr0, n0, 0]], [lent0], region=lent0[0]),
            layer=x,
            error=err,
            length=n,
            match="mixes pieces with a pool or a region",
            why="pool -2 with a dedicated region as well",
        ),
        dict(
            name="nixl_pieces_none",
            data=nixl([], [lent0]),
            layer=x,
            error=err,
            length=n,
            match="mixes pieces with a pool or a region",
            why="pool -2 without a piece",
        ),
        dict(
            name="nixl_piece_outside_its_region",
            data=nixl([[at0, addr0, n0, 0], [at1, addr1, n1, 0]], [lent0, lent1]),
            layer=x,
            error=err,
            length=n,
            match="piece outside its region",
            why="the second piece names region 0, which does not hold its bytes",
        ),
        dict(
            name="nixl_piece_region_index",
            data=nixl([[at0, addr0, n0, 0], [at1, addr1, n1, 2]], [lent0, lent1]),
            layer=x,
            error=err,
            length=n,
            match="names region 2 of 2",
            why="a piece names a registration the reference does not carry",
        ),
        dict(
            name="nixl_lent_region_in_the_pool",
            data=nixl(
                [[at0, NIXL_POOL[0] + 64, n0, 0]],
                [[[NIXL_POOL[0], 4096, 0, "DRAM"], _nixl_metadata(b"lent-0...")]],
            ),
            layer=x,
            error=err,
            length=n,
            match="region inside its own pool",
            why="a lent registration that overlaps an announced pool",
        ),
        dict(
            name="nixl_more_regions_than_pieces",
            data=nixl([[at0, addr0, n0, 0]], [lent0, lent1]),
            layer=x,
            error=err,
            length=n,
            match="has 1 pieces, 2 regions",
            why="more registrations than pieces",
        ),
        dict(
            name="nixl_pieces_in_the_pool_form",
            data=nixl([[at0, addr0, n0, 0]], [lent0], pool=0),
            layer=x,
            error=err,
            length=n,
            match="has pieces but names pool 0",
            why="pieces with pool 0 (pieces need pool -2)",
        ),
        dict(
            name="nixl_pool_minus_3",
            data=nixl([[at0, addr0, n0, 0]], [lent0], pool=-3),
            layer=x,
            error=err,
            length=n,
            match="malformed nixl reference",
            why="pool -3 (the landed form) with lent registrations and pieces and no "
            "landing: fields of two forms mixed",
        ),
        dict(
            name="nccl_pieces_ordered",
            data=nccl([[at0, n0], [at1, n1]], ordered=True),
            layer=c,
            error=err,
            length=n,
            match="pieces on the ordered channel",
            why="pieces travel on the tagged channel only",
        ),
        dict(
            name="nccl_pieces_tags_past_the_limit",
            data=nccl([[at0, n0], [at1, n1]], tag=2**31 - 2),
            layer=c,
            error=err,
            length=n,
            match="has tag 2147483646",
            why="two pieces from tag 2**31-2: the second tag would be 2**31-1",
        ),
        dict(
            name="nccl_pieces_overlap",
            data=nccl([[at0, 80], [at1, n1]]),
            layer=c,
            error=err,
            length=n,
            match=bad_piece,
            why="the first piece overlaps the second",
        ),
    ]


def _nest_ext(depth: int) -> bytes:
    """``depth`` tuples, each holding the next (the innermost is empty)."""
    data = msgspec.msgpack.encode([])
    for _ in range(depth - 1):
        data = msgspec.msgpack.encode([msgspec.msgpack.Ext(codec.EXT_TUPLE, data)])
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_TUPLE, data))


# -- files -----------------------------------------------------------------------------


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


def _json(value: object) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode()


def build() -> dict[str, bytes]:
    """Every file under specs/vectors/, by relative path."""
    files: dict[str, bytes] = {}
    for name, msg in messages().items():
        files[f"{name}.bin"] = wire.encode(msg)
        files[f"{name}.json"] = _json(json.loads(msgspec.json.encode(msg)))
    header = codec.dumps(header_value()).header
    files["payload_header.bin"] = header
    files["payload_header.json"] = _json(
        _jsonable(msgspec.msgpack.decode(header, ext_hook=_readable))
    )
    for name, blob in blobs().items():
        files[f"blobs/{name}.bin"] = msgspec.msgpack.encode(blob)
        files[f"blobs/{name}.json"] = _json(json.loads(msgspec.json.encode(blob)))
    files["curve.json"] = _json(curve())
    for name, (frame, msg) in compat().items():
        files[f"compat/{name}.bin"] = frame
        files[f"compat/{name}.json"] = _json(json.loads(msgspec.json.encode(msg)))
    manifest = []
    for entry in negatives():
        entry = dict(entry)
        data = entry.pop("data")
        name = entry.pop("name")
        files[f"negative/{name}.bin"] = data
        # what omniwire raises (error, match) stays here, for tests/test_vectors.py
        del entry["error"], entry["match"]
        manifest.append({"file": f"{name}.bin", "code": REJECTION_CODES[name], **entry})
    files["negative/manifest.json"] = _json(
        {
            "about": "Frames and blobs a reader MUST reject (specs/wire-v1.md §12.3). "
            "layer: wire.decode (a whole frame), codec.loads (a payload header, with a "
            "table of `tensors` tensors), shm.import (an shm BackendRef.info from the peer of "
            "vectors/hello.bin, for an object of `length` bytes), mooncake.ref / nixl.ref / "
            "nccl.ref (a BackendRef.info from the peer whose Hello info is "
            "blobs/<backend>_hello_pieces.bin, for an object of `length` bytes). code: the "
            "rejection code of specs/wire-v1.md §11.8, the reason a reader in any language "
            "rejects the input for. dtype: the dtype of the table's tensors (default "
            "float32).",
            "vectors": manifest,
        }
    )
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    files = build()
    if args.check:
        stale = sorted(
            p
            for p, data in files.items()
            if not (OUT / p).is_file() or (OUT / p).read_bytes() != data
        )
        extra = sorted(
            str(p.relative_to(OUT))
            for p in OUT.rglob("*")
            if p.is_file() and str(p.relative_to(OUT)) not in files
        )
        for p in stale:
            print(f"differs: specs/vectors/{p}")
        for p in extra:
            print(f"not generated: specs/vectors/{p}")
        return 1 if stale or extra else 0
    for old in OUT.rglob("*"):
        if old.is_file() and str(old.relative_to(OUT)) not in files:
            old.unlink()
    for path, data in files.items():
        (OUT / path).parent.mkdir(parents=True, exist_ok=True)
        (OUT / path).write_bytes(data)
    print(f"wrote {len(files)} files to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
