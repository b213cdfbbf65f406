"""Test vectors (specs/vectors/, spec §12): positive frames decode and re-encode byte
for byte, match the CDDL schema and a second msgpack encoder; negative ones raise
the error the manifest names; 1.0 frames are read by this 1.1 reader; the files are
exactly what scripts/make_vectors.py produces from the code (CI fails on drift).

An accidental wire change fails here. A deliberate one regenerates the vectors
with scripts/make_vectors.py, bumps the version and adds a CHANGELOG entry.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import json
import pathlib
import re
import sys
from typing import Any

import msgpack
import msgspec
import pytest
import torch
import zmq
from zmq.utils import z85

from omniwire import codec, errors, wire
from omniwire.backends.base import BackendContext, Locality, PeerInfo
from omniwire.backends.shm import ShmBackend
from omniwire.control import CurveKey

import wire_cddl

ROOT = pathlib.Path(__file__).resolve().parent.parent
VECTORS = ROOT / "specs" / "vectors"
MESSAGE_FILES = sorted(p for p in VECTORS.glob("*.bin") if p.stem != "payload_header")
BLOB_FILES = sorted((VECTORS / "blobs").glob("*.bin"))
COMPAT_FILES = sorted((VECTORS / "compat").glob("*.bin"))
MANIFEST = json.loads((VECTORS / "negative" / "manifest.json").read_text())["vectors"]


@functools.cache
def _generator() -> Any:
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
    assert kinds == {
        "hello",
        "data_ready",
        "data_progress",
        "data_ack",
        "abort",
        "goodbye",
        "window",
        "refusal",
        "batch",
    }


@pytest.mark.parametrize("path", MESSAGE_FILES, ids=lambda p: p.stem)
def test_vector_decodes_and_reencodes_byte_for_byte(path: pathlib.Path) -> None:
    frame = path.read_bytes()
    assert frame[4:6] == bytes(wire.WIRE_VERSION)
    msg = wire.decode(frame)
    assert wire.encode(msg) == frame
    readable = json.loads(path.with_suffix(".json").read_text())
    assert json.loads(msgspec.json.encode(msg)) == readable


@pytest.mark.parametrize("path", MESSAGE_FILES, ids=lambda p: p.stem)
def test_vector_matches_the_cddl_schema(path: pathlib.Path) -> None:
    wire_cddl.validate_frame(path.read_bytes())


def test_payload_header_matches_the_cddl_schema() -> None:
    wire_cddl.validate("payload-header", (VECTORS / "payload_header.bin").read_bytes())


@pytest.mark.parametrize(
    "path", [*MESSAGE_FILES, VECTORS / "payload_header.bin"], ids=lambda p: p.stem
)
def test_a_second_encoder_writes_the_same_bytes(path: pathlib.Path) -> None:
    """The msgpack package, given the decoded body, writes the vector again: the
    encoding rules of spec §2.3 (smallest forms, float64, fixext) determine it."""
    data = path.read_bytes()
    prefix, body = (data[:8], data[8:]) if path.stem != "payload_header" else (b"", data)
    plain = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=False)
    assert prefix + msgpack.packb(plain, use_bin_type=True) == data


def test_ring_hello_vectors() -> None:
    """A ring offer names a ring of the offering process (§3.6); the fence Hello names
    the peer's ring as attached and is a reply."""
    offer = wire.decode((VECTORS / "hello_ring.bin").read_bytes())
    fence = wire.decode((VECTORS / "hello_ring_attached.bin").read_bytes())
    assert isinstance(offer, wire.HelloMessage) and isinstance(fence, wire.HelloMessage)
    for hello in (offer, fence):
        assert "ring" in hello.features
        assert re.fullmatch(rf"omniwire-{hello.pid}-[0-9a-f]{{16}}", hello.ring)
    assert fence.is_reply and fence.ring_attached == offer.ring
    assert offer.ring_attached == ""


def test_shm_reference_in_the_ref_vector_is_the_real_form() -> None:
    """ref.length is the end of the last tensor; the shm blob is the map omniwire
    writes, its segment under the Hello vector's prefix, size == length."""
    hello = wire.decode((VECTORS / "hello.bin").read_bytes())
    msg = wire.decode((VECTORS / "data_ready_ref.bin").read_bytes())
    assert isinstance(hello, wire.HelloMessage) and isinstance(msg, wire.DataReadyMessage)
    ref = msg.data_ref
    assert ref is not None
    last = ref.tensors[-1]
    assert ref.ref.length == last.offset + last.nbytes == 128
    prefix = msgspec.msgpack.decode(next(b.info for b in hello.backends if b.name == "shm"))
    assert re.fullmatch(rf"omniwire-{hello.pid}-[0-9a-f]{{8,32}}", prefix["prefix"])
    blob = msgspec.msgpack.decode(ref.ref.info)
    assert list(blob) == ["segment", "offset", "size", "dedicated"]
    assert blob["segment"].startswith(prefix["prefix"] + "-")
    assert blob["size"] == ref.ref.length


def test_vectors_match_the_generator() -> None:
    files = _generator().build()
    on_disk = {str(p.relative_to(VECTORS)) for p in VECTORS.rglob("*") if p.is_file()}
    assert on_disk == set(files), "run scripts/make_vectors.py"
    for rel, data in files.items():
        assert (VECTORS / rel).read_bytes() == data, f"{rel} differs: run scripts/make_vectors.py"


def test_payload_header_vector() -> None:
    gen = _generator()
    header = (VECTORS / "payload_header.bin").read_bytes()
    value = codec.loads(header, [torch.zeros(2), torch.arange(3, dtype=torch.uint8)])
    expected = gen.header_value()
    assert value["tensor"] is value["same_tensor"]
    assert torch.equal(value["tensor"], expected["tensor"])
    assert value["ndarray"].tolist() == [0, 1, 2]
    assert value[(1, "key")] == "tuple key" and value["tuple"] == (1, (2, "x"))
    assert value["span"] == expected["span"]
    assert codec.dumps(value).header == header


# -- backend blobs ---------------------------------------------------------------------


def _blob_rule(path: pathlib.Path) -> str:
    backend = next(b for b in wire_cddl.BLOB_RULES if path.stem.startswith(b))
    hello_rule, ref_rule = wire_cddl.BLOB_RULES[backend]
    return hello_rule if "_hello" in path.stem else ref_rule


def test_every_engine_has_pieces_vectors() -> None:
    stems = {p.stem for p in BLOB_FILES}
    for backend in ("mooncake", "nixl", "nccl"):
        assert {f"{backend}_hello_pieces", f"{backend}_ref_pieces"} <= stems


def _peer_info(name: str, info: bytes) -> PeerInfo:
    return PeerInfo(
        name=name,
        instance=1,
        pid=4242,
        host_id="h",
        process_token="t",
        locality=Locality.CROSS_HOST,
        info=info,
    )


def _check_engine_ref(backend: str, hello_blob: bytes, ref: bytes, length: int) -> None:
    """The receiver's check of an engine reference (§9.4–9.6) from the peer whose Hello
    info is ``hello_blob``, for an object of ``length`` bytes.

    Raises:
        BackendError: the check refuses it.
    """
    blobs = _blob_module(backend)
    peer = _peer_info("thinker", hello_blob)
    if backend == "mooncake":
        hello = blobs.decode_hello(peer, "tcp")
        blobs.spans(blobs.decode_ref(ref, hello, length, peer.name), hello, length, peer.name)
    elif backend == "nixl":
        blobs.resolve(ref, blobs.decode_hello(peer).pools, length, peer.name)
    else:
        hello = blobs.decode_hello(peer)
        blobs.decode_ref(ref, length, peer.name, hello.cuda)


@pytest.mark.parametrize(
    "path",
    [
        p
        for p in BLOB_FILES
        if p.stem.split("_")[0] in ("mooncake", "nixl", "nccl") and "_ref" in p.stem
    ],
    ids=lambda p: p.stem,
)
def test_engine_reference_vectors_pass_the_receivers_check(path: pathlib.Path) -> None:
    """Every engine reference vector is accepted by the receiving backend's own check,
    against the Hello vector of its form (a pieces reference against the Hello that
    says ``pieces``) and the length it names."""
    backend = path.stem.split("_")[0]
    form = "_pieces" if "pieces" in path.stem or "landed" in path.stem else ""
    hello = VECTORS / "blobs" / f"{backend}_hello{form}.bin"
    plain = msgspec.msgpack.decode(path.read_bytes())
    length = plain["nbytes"] if backend == "nccl" else plain["length"]
    if "landed" in path.stem:
        _check_landed_ref(backend, hello.read_bytes(), path.read_bytes(), plain["offset"], length)
        return
    _check_engine_ref(backend, hello.read_bytes(), path.read_bytes(), length)
    if "pieces" in path.stem:  # every piece lies inside the object, sorted, disjoint
        pieces = [(p[0], p[-1] if backend == "nccl" else p[2]) for p in plain["pieces"]]
        assert pieces == sorted(pieces)
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(pieces))
        assert pieces[-1][0] + pieces[-1][1] <= length


def _check_landed_ref(backend: str, sender: bytes, data: bytes, offset: int, length: int) -> None:
    """A landed reference (§9.4, §9.5): checked against the landing the receiver lent
    (its own Hello vector with a landing): the right token and range pass, another
    token or a smaller landing do not, and the read path refuses it."""
    blobs = _blob_module(backend)
    lender = (VECTORS / "blobs" / f"{backend}_hello_landing.bin").read_bytes()
    if backend == "mooncake":
        hello = blobs.decode_hello(_peer_info("thinker", sender), "tcp")
        ref = blobs.decode_ref(data, hello, length, "thinker")
        landing = blobs.decode_hello(_peer_info("talker", lender), "tcp").landing
        assert landing is not None

        def check(token: int, size: int) -> tuple[int, int] | None:
            return blobs.landed_range(ref, token, size, "thinker")  # type: ignore[no-any-return]

        size = landing.length
        with pytest.raises(errors.BackendError, match="did not lend it"):
            blobs.spans(ref, hello, length, "thinker")
    else:
        landing = blobs.decode_hello(_peer_info("talker", lender)).landing
        assert landing is not None

        def check(token: int, size: int) -> tuple[int, int] | None:
            return blobs.landed_range(data, token, size, length, "thinker")  # type: ignore[no-any-return]

        size = landing.region.length
        pools = blobs.decode_hello(_peer_info("thinker", sender)).pools
        with pytest.raises(errors.BackendError):
            blobs.resolve(data, pools, length, "thinker")
    assert check(landing.token, size) == (offset, length)
    with pytest.raises(errors.BackendError, match="not the one lent to it"):
        check(landing.token ^ 1, size)
    with pytest.raises(errors.BackendError, match="outside its"):
        check(landing.token, offset + length - 1)


def _blob_module(backend: str) -> Any:
    import importlib

    module = importlib.import_module(f"omniwire.backends.{backend}")
    if hasattr(module, "__path__"):  # an engine package: its blobs are in _blobs
        module = importlib.import_module(f"omniwire.backends.{backend}._blobs")
    return module


@pytest.mark.parametrize("path", BLOB_FILES, ids=lambda p: p.stem)
def test_blob_vector_matches_its_backend_and_the_schema(path: pathlib.Path) -> None:
    """Each blob is what the backend's own struct writes (the documented 1.1 form, or,
    for ``*_pieces``, the form with lent-tensor pieces, §9.1) and matches the CDDL."""
    backend = next(b for b in wire_cddl.BLOB_RULES if path.stem.startswith(b))
    module = _blob_module(backend)
    hello = "_hello" in path.stem
    if path.stem.endswith("_pieces"):
        decoder = module._pieces_hello_decoder if hello else module._pieces_ref_decoder
    elif path.stem.endswith(("_landing", "_landed")):  # mooncake's landing (§9.4)
        decoder = module._landing_hello_decoder if hello else module._landed_ref_decoder
    elif path.stem.endswith(("_forwards", "_forward")):  # shm forwarding (§9.2)
        decoder = module._forwards_hello_decoder if hello else module._forward_ref_decoder
    else:
        decoder = module._hello_decoder if hello else module._ref_decoder
    data = path.read_bytes()
    assert msgspec.msgpack.encode(decoder.decode(data)) == data
    wire_cddl.validate(_blob_rule(path), data)
    assert json.loads(path.with_suffix(".json").read_text()) == json.loads(
        msgspec.json.encode(decoder.decode(data))
    )


# -- 1.0 frames -------------------------------------------------------------------------


@pytest.mark.parametrize("path", COMPAT_FILES, ids=lambda p: p.stem)
def test_a_1_0_frame_is_read_with_the_1_1_defaults(path: pathlib.Path) -> None:
    frame = path.read_bytes()
    assert frame[4:6] == b"\x01\x00"
    msg = wire.decode(frame)
    assert json.loads(msgspec.json.encode(msg)) == json.loads(path.with_suffix(".json").read_text())


# -- negative vectors --------------------------------------------------------------------


def _shm_open(data: bytes, length: int) -> None:
    import anyio

    hello = wire.decode((VECTORS / "hello.bin").read_bytes())
    assert isinstance(hello, wire.HelloMessage)
    info = next(b.info for b in hello.backends if b.name == "shm")
    peer = PeerInfo(
        name=hello.endpoint,
        instance=hello.instance,
        pid=hello.pid,
        host_id=hello.host_id,
        process_token=hello.process_token,
        locality=Locality.CROSS_HOST,  # no arena of our own is created
        info=info,
    )

    async def attempt() -> None:
        backend = ShmBackend(BackendContext(endpoint="encoder", instance=1))
        await backend.connect(peer)
        try:
            await backend.import_(peer, data, length)
        finally:
            await backend.aclose()

    anyio.run(attempt)


def _reject(entry: dict[str, Any]) -> None:
    data = (VECTORS / "negative" / entry["file"]).read_bytes()
    if entry["layer"] == "wire.decode":
        wire.decode(data)
    elif entry["layer"] == "codec.loads":
        dtype = getattr(torch, entry.get("dtype", "float32"))
        codec.loads(data, [torch.zeros(1, dtype=dtype)] * entry["tensors"])
    elif entry["layer"] == "shm.import":
        _shm_open(data, entry["length"])
    elif entry["layer"] in ("mooncake.ref", "nixl.ref", "nccl.ref"):
        backend = entry["layer"].split(".")[0]
        hello = (VECTORS / "blobs" / f"{backend}_hello_pieces.bin").read_bytes()
        _check_engine_ref(backend, hello, data, entry["length"])
    else:
        raise AssertionError(f"unknown layer {entry['layer']!r}")


def _omniwire_error(file: str) -> tuple[type[Exception], str]:
    """What omniwire raises for a negative vector: its class and a regex of its message
    (scripts/make_vectors.py keeps them; the manifest names a language-neutral code)."""
    (entry,) = [e for e in _generator().negatives() if f"{e['name']}.bin" == file]
    error: type[Exception] = getattr(errors, entry["error"])
    return error, entry["match"]


@pytest.mark.parametrize("entry", MANIFEST, ids=lambda e: e["file"])
def test_negative_vector_raises_the_named_error(entry: dict[str, Any]) -> None:
    error, match = _omniwire_error(entry["file"])
    with pytest.raises(error, match=match):
        _reject(entry)


def test_every_rejection_code_is_registered_in_the_spec() -> None:
    """The manifest names codes of wire-v1.md §11.8 only, and the registry lists no
    code that no vector or rule uses twice over (each row is a code in backticks)."""
    text = (ROOT / "specs" / "wire-v1.md").read_text()
    section = text.split("### 11.8 Rejection codes", 1)[1].split("\n## ", 1)[0]
    registered = set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", section, re.MULTILINE))
    used = {e["code"] for e in MANIFEST}
    assert used <= registered, used - registered
    assert all("error" not in e and "match" not in e for e in MANIFEST)


def test_every_negative_vector_is_in_the_manifest() -> None:
    files = {p.name for p in (VECTORS / "negative").glob("*.bin")}
    assert files == {e["file"] for e in MANIFEST}


# -- CURVE ------------------------------------------------------------------------------


def test_curve_key_derivation_vector() -> None:
    vector = json.loads((VECTORS / "curve.json").read_text())
    secret = vector["auth_key"].encode()
    data = b"omniwire-curve-v1\0" + secret
    assert data.hex() == vector["sha256_input_hex"]
    digest = hashlib.sha256(data).digest()
    assert digest.hex() == vector["secret_key_hex"]
    assert z85.encode(digest).decode() == vector["secret_key_z85"]
    assert zmq.curve_public(vector["secret_key_z85"].encode()).decode() == vector["public_key_z85"]
    key = CurveKey.from_shared_secret(vector["auth_key"])
    assert (key.secret.decode(), key.public.decode()) == (
        vector["secret_key_z85"],
        vector["public_key_z85"],
    )


# -- registries ---------------------------------------------------------------------------


def _cddl_choice(rule: str) -> set[str]:
    text = wire_cddl.SCHEMA_PATH.read_text()
    m = re.search(rf"^{re.escape(rule)} = \(([^)]*)\)", text, re.MULTILINE)
    assert m is not None, rule
    return set(re.findall(r'"([^"]+)"', m.group(1)))


def test_schema_registries_match_the_code() -> None:
    assert _cddl_choice("nack-reason") == wire.NACK_REASONS
    assert _cddl_choice("refusal-code") == wire.REFUSAL_CODES
    assert _cddl_choice("dtype") == set(wire.DTYPE_ITEMSIZE)


def test_spec_registries_match_the_code() -> None:
    """Every registered code, dtype and ext type appears in the spec's registry tables."""
    spec = (ROOT / "specs" / "wire-v1.md").read_text()
    for name in (*wire.NACK_REASONS, *wire.REFUSAL_CODES, *wire.DTYPE_ITEMSIZE):
        assert re.search(rf"^\| (`[^`]+`, )*`{name}`[,| ]", spec, re.MULTILINE), name
    for code in (codec.EXT_TUPLE, codec.EXT_TENSOR, codec.EXT_NDARRAY, codec.EXT_STRUCT):
        assert re.search(rf"^\| {code} \|", spec, re.MULTILINE), code
    assert re.search(rf"\*\*Version: {wire.WIRE_VERSION[0]}\.{wire.WIRE_VERSION[1]}\*\*", spec)
