"""The safe payload codec: round trips, refusals, pickle opt-in, registered types."""

from __future__ import annotations

import dataclasses
import os
import pickle
import warnings
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given

from omniwire import codec, packing
from omniwire.errors import WireFormatError
from omniwire.testing.strategies import assert_payload_equal, payloads


def _round_trip(value: Any, *, copy: bool = True) -> Any:
    enc = codec.dumps(value)
    layout = packing.plan(enc.tensors, enc.paths)
    buf = bytearray(layout.nbytes)
    packing.pack_into(buf, enc.tensors, layout)
    tensors = packing.unpack(buf, layout.metas, copy=copy)
    return codec.loads(enc.header, tensors)


@given(payloads())
def test_every_payload_round_trips_bit_exactly(value: Any) -> None:
    assert_payload_equal(value, _round_trip(value))


@given(payloads(max_leaves=6))
def test_zero_copy_unpack_round_trips(value: Any) -> None:
    assert_payload_equal(value, _round_trip(value, copy=False))


_SCALAR_TYPES = (str, bool, float, int, type(None))


@given(payloads(max_leaves=6))
def test_the_scalar_dict_header_is_the_one_dumps_writes(value: Any) -> None:
    """``scalars_header`` (the metadata fast path) writes dumps' bytes for a dict of str
    keys and plain scalars, and declines any other dict."""
    for candidate in (value, {"v": value}, {"t": 2**63, "last": True, "g": "x", "f": 0.5}):
        if type(candidate) is not dict:
            continue
        header = codec.scalars_header(candidate)
        plain = all(type(k) is str and type(v) in _SCALAR_TYPES for k, v in candidate.items())
        assert (header is not None) == plain  # (the strategy's ints fit in 64 bits)
        if header is not None:
            assert header == codec.dumps(candidate, root="metadata").header


def test_containers_kept_distinct_and_shared_tensor_stays_shared() -> None:
    t = torch.arange(4.0)
    value = {"list": [1, t], "tuple": (1, t), (2, "k"): t, "nested": [(t,)]}
    enc = codec.dumps(value)
    assert len(enc.tensors) == 1
    out = _round_trip(value)
    assert type(out["list"]) is list and type(out["tuple"]) is tuple
    assert out["list"][1] is out["tuple"][1] is out[(2, "k")] is out["nested"][0][0]


def test_floats_keep_their_bits() -> None:
    value = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 5e-324]
    assert_payload_equal(value, _round_trip(value))


def test_numpy_arrays_come_back_as_numpy() -> None:
    a = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]  # non-contiguous
    out = _round_trip({"a": a})
    assert isinstance(out["a"], np.ndarray)
    np.testing.assert_array_equal(out["a"], a)


#: What ext 3 (numpy array) may carry (wire-v1.md §6.1): the dtypes numpy has.
NUMPY_DTYPES = [
    "float16", "float32", "float64", "complex64", "complex128", "bool",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
]  # fmt: skip


def test_ext3_carries_exactly_the_dtypes_numpy_has() -> None:
    assert sorted(codec.NDARRAY_DTYPES) == sorted(NUMPY_DTYPES)
    for name in NUMPY_DTYPES:
        array = np.zeros(2, dtype=name)
        enc = codec.dumps({"a": array})
        back = codec.loads(enc.header, enc.tensors)["a"]
        assert type(back) is np.ndarray and back.dtype == array.dtype


@pytest.mark.parametrize("dtype", ["bfloat16", "complex32", "float8_e4m3fn", "float4_e2m1fn_x2"])
def test_ext3_with_a_dtype_numpy_lacks_is_a_wire_format_error(dtype: str) -> None:
    header = msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_NDARRAY, b"\x00"))
    table = [torch.zeros(2, dtype=getattr(torch, dtype))]
    with pytest.raises(WireFormatError, match=f"ext 3 .numpy array. cannot carry {dtype}"):
        codec.loads(header, table)


def test_a_numpy_array_of_a_dtype_the_wire_lacks_is_refused_at_the_sender() -> None:
    with pytest.raises(TypeError, match=r"payload\['a'\]: numpy dtype \|V2 cannot be sent: ext 3"):
        codec.dumps({"a": np.zeros(2, dtype=np.dtype("V2"))})


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"a": [1, 2, {3}]}, r"payload\['a'\]\[2\]: values of type set"),
        ({"a": [1, 2, 2**64]}, r"payload\['a'\]\[2\]: int .* 64 bits"),
        ({"a": [-(2**63) - 1]}, r"payload\['a'\]\[0\]"),
        ([object()], r"payload\[0\]: values of type object"),
        ({frozenset(): 1}, r"dict key of type frozenset"),
        ({"x": np.float32(1.0)}, r"payload\['x'\].*\.item\(\)"),
        ({"x": bytearray(b"1")}, r"payload\['x'\]: values of type bytearray"),
    ],
)
def test_unsupported_values_name_their_path(value: Any, path: str) -> None:
    with pytest.raises(TypeError, match=path):
        codec.dumps(value)


def test_nesting_limit_both_sides() -> None:
    deep: list[Any] = []
    cur = deep
    for _ in range(63):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    assert _round_trip(deep) == deep  # depth 64 is the limit
    cur.append([])
    with pytest.raises(ValueError, match="deeper than 64"):
        codec.dumps(deep)
    header = b"\x91" * 70 + b"\x90"
    with pytest.raises(WireFormatError, match="deeper than 64"):
        codec.loads(header, [])


class Holder(msgspec.Struct):
    items: Any


def _nested(levels: int) -> list[Any]:
    deep: list[Any] = []
    cur = deep
    for _ in range(levels - 1):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    return deep


def test_nesting_limit_counts_registered_types_alike_on_both_sides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A registered type is a level wherever it is, for the reader as for the writer:
    a header nested too deeply inside one, inside a list, is refused on the way in."""
    codec.register_type(Holder, name="tests.Holder")
    try:
        ok = [Holder(items=_nested(62))]  # list, Holder, then 62 lists: 64 levels
        assert _round_trip(ok) == ok
        deep = [Holder(items=_nested(63))]
        with pytest.raises(ValueError, match="deeper than 64"):
            codec.dumps(deep)
        monkeypatch.setattr(codec, "MAX_HEADER_DEPTH", 100)  # a writer that ignores the limit
        header = codec.dumps(deep).header
        monkeypatch.undo()
        with pytest.raises(WireFormatError, match="deeper than 64"):
            codec.loads(header, [])
    finally:
        codec.unregister_type(Holder)


@dataclasses.dataclass
class Point:
    x: int
    label: str
    data: torch.Tensor


class Config(msgspec.Struct):
    name: str
    sizes: tuple[int, ...]


def test_registered_types_round_trip_and_unregistered_are_refused() -> None:
    value = {"p": Point(1, "a", torch.ones(2)), "c": Config("m", (1, 2))}
    with pytest.raises(TypeError, match="register_type"):
        codec.dumps(value)
    codec.register_type(Point)
    codec.register_type(Config, name="tests.Config")
    try:
        out = _round_trip(value)
        assert isinstance(out["p"], Point) and out["p"].label == "a"
        assert torch.equal(out["p"].data, torch.ones(2))
        assert out["c"] == Config("m", (1, 2))
        header = codec.dumps(value).header
    finally:
        codec.unregister_type(Point)
        codec.unregister_type(Config)
    with pytest.raises(WireFormatError, match="not registered"):
        codec.loads(header, [torch.ones(2)])


def test_register_type_refuses_plain_classes_and_name_clashes() -> None:
    with pytest.raises(TypeError):
        codec.register_type(object)

    @dataclasses.dataclass
    class A:
        x: int

    @dataclasses.dataclass
    class B:
        x: int

    codec.register_type(A, name="clash")
    try:
        with pytest.raises(ValueError, match="already registered"):
            codec.register_type(B, name="clash")
    finally:
        codec.unregister_type(A)


class _Bomb:
    """Unpickling this would create a file: the test checks it never happens."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def test_pickle_needs_opt_in_on_both_sides(tmp_path: Any) -> None:
    marker = tmp_path / "executed"
    with pytest.raises(TypeError):
        codec.dumps({"x": _Bomb(str(marker))})
    enc = codec.dumps({"x": _Bomb(str(marker))}, allow_pickle=True)
    with pytest.raises(WireFormatError, match="did not opt in"):
        codec.loads(enc.header, [])
    assert not marker.exists()
    ok = codec.dumps({"x": complex(1, 2)}, allow_pickle=True)
    assert codec.loads(ok.header, [], allow_pickle=True) == {"x": complex(1, 2)}


def test_smuggled_pickle_bytes_are_just_bytes(tmp_path: Any) -> None:
    marker = tmp_path / "executed"
    blob = pickle.dumps(_Bomb(str(marker)))
    # As a bytes value it is data, never executed.
    assert _round_trip({"b": blob}) == {"b": blob}
    # As raw header bytes it is malformed msgpack (or a harmless value), never unpickled.
    try:
        codec.loads(blob, [])
    except WireFormatError:
        pass
    # Inside an ext of an unknown type.
    with pytest.raises(WireFormatError, match="extension type 99"):
        codec.loads(msgspec.msgpack.encode(msgspec.msgpack.Ext(99, blob)), [])
    assert not marker.exists()
    assert not os.path.exists(str(marker))


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_TENSOR, b"\x05")), "tensor 5"),
        (msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_TENSOR, b"\xa1x")), "tensor 'x'"),
        (msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_TUPLE, b"\x01")), "array"),
        (msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_STRUCT, b"\x01")), "name"),
    ],
)
def test_malformed_headers(header: bytes, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        codec.loads(header, [])


def test_loads_keeps_no_reference_to_the_tensors() -> None:
    """Received tensors (and the receive buffers they view) are freed on last use,
    not at the next cyclic garbage collection."""
    import gc
    import weakref

    enc = codec.dumps({"t": torch.ones(3), "nested": (torch.ones(1),)})
    tensors = [torch.ones(3), torch.ones(1)]
    refs = [weakref.ref(t) for t in tensors]
    gc.disable()
    try:
        value = codec.loads(enc.header, tensors)
        del value, tensors
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(6.0).reshape(2, 3),
        {"x": torch.ones(3), "y": torch.zeros(2, dtype=torch.int8)},
        {"a": 1, "b": "s", "c": None, "d": 2.5, "e": True},
    ],
    ids=["one tensor", "flat dict of tensors", "flat dict of scalars"],
)
def test_shortcut_shapes_encode_as_the_general_path_does(value: Any) -> None:
    """One tensor and flat dicts skip the general walk both ways; the header they get is
    byte for byte the general walker's, and it decodes to the same value."""
    enc = codec.dumps(value)
    dumper = codec._Dumper(False)
    general = codec._encoder.encode(dumper.walk(value, (), 0))
    assert enc.header == general
    assert enc.paths == dumper.paths
    assert [id(t) for t in enc.tensors] == [id(t) for t in dumper.tensors]
    assert_payload_equal(value, _round_trip(value))


def _nested_tensor(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "prototype stage"
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.ones(2).to_sparse(),
        torch.empty(2, device="meta"),
        _nested_tensor(torch.strided),
        _nested_tensor(torch.jagged),
    ],
    ids=["sparse", "meta", "nested", "jagged"],
)
def test_shortcut_shapes_still_refuse_what_the_wire_cannot_carry(tensor: torch.Tensor) -> None:
    """A clear TypeError naming the payload path, never an error from torch's insides
    (a nested tensor, strided layout, passed every check and failed in torch)."""
    for value in (tensor, {"t": tensor}, [tensor]):
        with pytest.raises(TypeError, match=r"payload.* not supported"):
            codec.dumps(value)


def test_a_header_for_one_tensor_needs_exactly_one() -> None:
    header = codec.dumps(torch.ones(1)).header
    with pytest.raises(WireFormatError, match="refers to tensor 0"):
        codec.loads(header, [])
    t = torch.ones(2)
    assert codec.loads(header, [t]) is t


@pytest.mark.parametrize(
    "value",
    [
        {"t": 2**63 + 5, "last": True, "group": "g", "streams": 20, "x": 1.5, "n": None},
        {"t": -(2**63), "ok": False, "zero": 0, "f": 0.0},
        {"list": [1, 2]},
        {"blob": b"\x00\x01"},
        {"inner": {"k": 1}},
        {"tuple": (1, "a")},
        {"np": np.int32(1).item(), "s": "é" * 40},
    ],
    ids=["scalars", "edges", "list", "bytes", "map", "tuple", "unicode"],
)
def test_tensorless_headers_decode_alike_on_the_scalar_shortcut_and_the_general_path(
    value: dict[str, Any],
) -> None:
    """Metadata of str keys and scalars is decoded by one typed C call; every other
    small map falls back to the general path: both give what was sent, with its types
    (True stays bool, 0 stays int, 0.0 float, a tuple a tuple)."""
    header = codec.dumps(value).header
    got = codec.loads(header, [])
    assert got == value
    assert [type(v) for v in got.values()] == [type(v) for v in value.values()]
    with pytest.raises(WireFormatError):
        codec.loads(b"", [])
    with pytest.raises(WireFormatError):
        codec.loads(header[:-1], [])  # truncated: no shortcut answers for it
