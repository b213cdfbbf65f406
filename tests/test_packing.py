"""Tensor packing: alignment, every dtype, ranges, views vs copies."""

from __future__ import annotations

import ctypes
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omniwire import packing, wire
from omniwire.errors import WireFormatError
from omniwire.testing.strategies import WIRE_DTYPES, assert_payload_equal, tensors


@given(st.lists(tensors(), max_size=6))
def test_plan_aligns_every_offset(ts: list[torch.Tensor]) -> None:
    layout = packing.plan(ts)
    end = 0
    for t, meta in zip(ts, layout.metas, strict=True):
        assert meta.offset % 64 == 0 and meta.offset >= end
        assert meta.nbytes == t.numel() * t.element_size()
        end = meta.offset + meta.nbytes
    assert layout.nbytes == end


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
def test_every_dtype_packs_and_unpacks(dtype: torch.dtype) -> None:
    raw = torch.arange(64, dtype=torch.uint8)
    if dtype is torch.bool:
        raw = raw % 2
    t = raw.view(dtype).reshape(-1)
    cases = [t, t[0].clone().reshape(()), t[:0], t.reshape(2, -1).t(), t[::2]]
    layout = packing.plan(cases)
    buf = bytearray(layout.nbytes)
    packing.pack_into(buf, cases, layout)
    for copy in (True, False):
        assert_payload_equal(cases, packing.unpack(buf, layout.metas, copy=copy))


def test_views_share_the_buffer_and_copies_do_not() -> None:
    t = torch.arange(16, dtype=torch.float32)
    layout = packing.plan([t])
    buf = bytearray(layout.nbytes)
    packing.pack_into(buf, [t], layout)
    view = packing.unpack(buf, layout.metas, copy=False)[0]
    owned = packing.unpack(buf, layout.metas, copy=True)[0]
    buf[0:4] = b"\x00\x00\x80\x3f"  # 1.0
    assert view[0].item() == 1.0 and owned[0].item() == 0.0


@given(st.lists(tensors(), min_size=1, max_size=5), st.integers(1, 200))
def test_packing_by_ranges_equals_packing_at_once(ts: list[torch.Tensor], chunk: int) -> None:
    layout = packing.plan(ts)
    whole = bytearray(layout.nbytes)
    packing.pack_into(whole, ts, layout)
    parts = bytearray(layout.nbytes)
    points = packing.split_points(ts, layout, chunk)
    assert points[-1] == layout.nbytes and points == sorted(points)
    lo = 0
    for hi in points:
        packing.pack_into(parts, ts, layout, lo, hi)
        lo = hi
    for meta in layout.metas:
        a, b = meta.offset, meta.offset + meta.nbytes
        assert parts[a:b] == whole[a:b]


def test_split_points_never_cut_non_contiguous_tensors() -> None:
    nc = torch.zeros(64, 64).t()
    c = torch.zeros(4096)
    layout = packing.plan([c, nc])
    points = packing.split_points([c, nc], layout, 1000)
    nc_meta = layout.metas[1]
    assert not any(nc_meta.offset < p < nc_meta.offset + nc_meta.nbytes for p in points)
    assert any(0 < p < 4096 * 4 for p in points)


def test_pack_into_a_uint8_tensor_and_reject_short_buffers() -> None:
    t = torch.ones(10, dtype=torch.float64)
    layout = packing.plan([t])
    dest = torch.zeros(layout.nbytes, dtype=torch.uint8)
    packing.pack_into(dest, [t], layout)
    assert torch.equal(packing.unpack(dest, layout.metas, copy=True)[0], t)
    with pytest.raises(ValueError, match="holds"):
        packing.pack_into(bytearray(8), [t], layout)


def test_unpack_rejects_tensors_outside_the_buffer() -> None:
    meta = wire.TensorMeta(dtype="float32", shape=(100,), offset=0, nbytes=400)
    with pytest.raises(WireFormatError, match="beyond"):
        packing.unpack(bytearray(64), [meta], copy=False)


def test_unsendable_dtypes_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="no wire name"):
        packing.plan([torch.empty(0, dtype=torch.bits8)])


def test_one_element_tensor_with_a_stride_packs_by_range() -> None:
    t = torch.arange(4, dtype=torch.int16)[::2][:1]  # shape (1,), stride (2,), "contiguous"
    assert t.is_contiguous() and t.stride() == (2,)
    layout = packing.plan([t])
    buf = bytearray(layout.nbytes)
    packing.pack_into(buf, [t], layout, 0, 1)
    packing.pack_into(buf, [t], layout, 1, 2)
    assert torch.equal(packing.unpack(buf, layout.metas, copy=True)[0], t)


# -- hostile tensor tables: unpack raises WireFormatError, never a torch error ------------


def _raw_meta(**fields: object) -> wire.TensorMeta:
    """A TensorMeta with ``fields`` set past its validation: what a buggy decoder, a
    future reader or a caller building metas by hand could hand to ``unpack``."""
    meta = wire.TensorMeta(dtype="uint8", shape=(0,), offset=0, nbytes=0)
    for name, value in fields.items():
        msgspec.structs.force_setattr(meta, name, value)
    return meta


HOSTILE_METAS = [
    pytest.param({"shape": (2**63, 0)}, id="dim-over-int64"),
    pytest.param({"shape": (2**64, 0)}, id="dim-over-uint64"),
    pytest.param({"shape": (2**62, 4, 0)}, id="product-over-int64"),
    pytest.param({"shape": (-1,)}, id="negative-dim"),
    pytest.param({"shape": (-1, 0)}, id="negative-dim-zero"),
    pytest.param({"shape": (1.5,), "nbytes": 1}, id="float-dim"),
    pytest.param({"shape": ("1",), "nbytes": 1}, id="str-dim"),
    pytest.param({"shape": (0,) * 65}, id="65-dims"),
    pytest.param({"dtype": "float32", "shape": (1,), "offset": 2, "nbytes": 4}, id="misaligned"),
    pytest.param({"dtype": "float32", "shape": (2,), "nbytes": 4}, id="nbytes-short"),
    pytest.param({"dtype": "uint8", "shape": (1,), "nbytes": 0}, id="nbytes-zero"),
    pytest.param({"dtype": "float32", "shape": (1,), "nbytes": 5}, id="nbytes-odd"),
    pytest.param({"offset": -4, "shape": (4,), "nbytes": 4}, id="negative-offset"),
    pytest.param({"nbytes": -1}, id="negative-nbytes"),
    pytest.param({"dtype": "float128", "shape": (1,), "nbytes": 16}, id="unknown-dtype"),
    pytest.param({"offset": 2**64, "shape": (0,), "nbytes": 0}, id="offset-beyond"),
]


@pytest.mark.parametrize("fields", HOSTILE_METAS)
@pytest.mark.parametrize("copy", [False, True], ids=["view", "copy"])
def test_unpack_refuses_a_tensor_it_cannot_build_with_wire_format_error(
    fields: dict[str, object], copy: bool
) -> None:
    meta = _raw_meta(path="payload.x", **fields)
    with pytest.raises(WireFormatError, match=r"payload\.x"):
        packing.unpack(bytearray(256), [meta], copy=copy)


@pytest.mark.parametrize(
    "shape",
    [(2**62, 0), (2**63 - 1, 0), (0, 2**61), (2**31, 2**31, 0), (0,) * 64],
    ids=str,
)
def test_unpack_builds_huge_empty_shapes_the_wire_allows(shape: tuple[int, ...]) -> None:
    meta = wire.TensorMeta(dtype="float32", shape=shape, offset=0, nbytes=0)  # valid on the wire
    for copy in (False, True):
        (t,) = packing.unpack(bytearray(64), [meta], copy=copy)
        assert tuple(t.shape) == shape and t.numel() == 0 and t.dtype is torch.float32


_DIMS = st.one_of(
    st.integers(0, 4),
    st.integers(-3, -1),
    st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64]),
)


@given(
    dtype=st.sampled_from([*sorted(wire.DTYPE_ITEMSIZE), "float128", ""]),
    shape=st.lists(_DIMS, max_size=5).map(tuple),
    offset=st.one_of(st.integers(0, 130), st.sampled_from([-8, 2**63])),
    nbytes=st.one_of(st.integers(0, 64), st.sampled_from([-1, 2**63])),
    size=st.integers(0, 200),
    copy=st.booleans(),
)
def test_unpack_of_any_table_returns_exact_views_or_raises_wire_format_error(
    dtype: str, shape: tuple[int, ...], offset: int, nbytes: int, size: int, copy: bool
) -> None:
    meta = _raw_meta(dtype=dtype, shape=shape, offset=offset, nbytes=nbytes, path="t")
    try:
        (t,) = packing.unpack(bytearray(size), [meta], copy=copy)
    except WireFormatError as exc:
        assert str(exc).startswith("tensor 't'")
        return
    assert tuple(t.shape) == shape
    assert t.numel() * t.element_size() == nbytes
    assert offset >= 0 and offset + nbytes <= size


@pytest.mark.parametrize(
    "buffer",
    [bytearray(), memoryview(bytearray()), torch.empty(0, dtype=torch.uint8)],
    ids=["bytearray", "memoryview", "tensor"],
)
def test_an_empty_buffer_unpacks_empty_tensors_and_refuses_the_rest(buffer: object) -> None:
    empty = wire.TensorMeta(dtype="int64", shape=(0, 3), offset=0, nbytes=0)
    (t,) = packing.unpack(buffer, [empty], copy=False)  # type: ignore[arg-type]
    assert t.shape == (0, 3)
    one = wire.TensorMeta(dtype="int64", shape=(1,), offset=0, nbytes=8)
    with pytest.raises(WireFormatError, match="beyond"):
        packing.unpack(buffer, [one], copy=False)  # type: ignore[arg-type]


def test_as_byte_tensor_views_odd_buffers_or_says_why_not() -> None:
    ints = memoryview(bytearray(range(16))).cast("i")  # itemsize 4: still 16 bytes
    assert packing.as_byte_tensor(ints).tolist() == list(range(16))
    grid = memoryview(bytearray(range(12))).cast("B", (3, 4))  # 2-D, C-contiguous
    assert packing.as_byte_tensor(grid).tolist() == list(range(12))
    with pytest.raises(TypeError, match="contiguous"):
        packing.as_byte_tensor(memoryview(bytearray(16))[::2])
    with pytest.raises(TypeError, match="contiguous 1-D uint8"):
        packing.as_byte_tensor(torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize(
    "tensors",
    [
        [torch.arange(5, dtype=torch.int16), torch.ones(2, 3), torch.zeros(0, 4)],
        [torch.arange(7, dtype=torch.float64)],  # one 1-D tensor: torch.frombuffer
        [torch.ones(2, 3)],
    ],
    ids=["several", "one-1d", "one-2d"],
)
def test_unpack_inline_views_a_private_copy_of_the_chunk(tensors: list[torch.Tensor]) -> None:
    """The inline fast path (table checked when the chunk was decoded) gives the same
    tensors as ``unpack``, writable, and sharing nothing with the message's bytes."""
    layout = packing.plan(tensors)
    data = packing.pack_bytes(tensors, layout)
    inline = wire.InlineStreamChunkRef(tensors=layout.metas, data=data)
    got = packing.unpack_inline(inline)
    assert [g.dtype for g in got] == [t.dtype for t in tensors]
    for g, t in zip(got, tensors, strict=True):
        assert torch.equal(g, t)
    got[0][0] = 99
    assert inline.data == data


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
        lambda: torch._neg_view(torch.arange(3.0)),
        lambda: torch.arange(6, dtype=torch.int32).view(2, 3).t(),
        lambda: torch.arange(8, dtype=torch.int16)[::3],
        lambda: torch.ones(3, dtype=torch.bfloat16, requires_grad=True),
        lambda: torch.ones(3, requires_grad=True),
        lambda: torch.tensor(7, dtype=torch.int64),
        lambda: torch.tensor([True, False, True]),
        lambda: torch._efficientzerotensor(5),
    ],
    ids=["conj", "neg", "transposed", "strided", "bf16-grad", "f32-grad", "0-dim", "bool", "zero"],
)
def test_a_single_tensor_packs_to_the_values_it_reads_as(make: Any) -> None:
    """One tensor (the path that asks numpy for its bytes first) packs to the bytes of
    its values in C order, whichever way numpy refuses it."""
    t = make()
    want = t.detach().clone().resolve_conj().resolve_neg().contiguous()  # (clone: a zero
    # tensor has no memory at all)
    layout = packing.plan([t])
    data = packing.pack_bytes([t], layout)
    assert data == ctypes.string_at(want.data_ptr(), want.numel() * want.element_size())
    (got,) = packing.unpack_inline(wire.InlineStreamChunkRef(tensors=layout.metas, data=data))
    assert torch.equal(got, want)


def test_pack_bytes_writes_the_values_of_lazy_views_and_odd_layouts() -> None:
    """The inline image holds what the tensors read as: a lazily conjugated or negated
    view's values (its memory holds others), a transposed view in C order, a tensor
    that requires grad, a 0-dim tensor."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    tensors = [
        z.conj(),
        torch._neg_view(torch.arange(3.0)),
        torch.arange(6, dtype=torch.int32).view(2, 3).t(),
        torch.ones(3, dtype=torch.bfloat16, requires_grad=True),
        torch.tensor(7, dtype=torch.int64),
        torch._efficientzerotensor(3),  # no memory at all: its data_ptr is 0
    ]
    layout = packing.plan(tensors)
    got = packing.unpack_inline(
        wire.InlineStreamChunkRef(tensors=layout.metas, data=packing.pack_bytes(tensors, layout))
    )
    for g, t in zip(got, tensors, strict=True):
        assert not g.is_conj() and not g.is_neg()
        assert torch.equal(g, t.detach().clone().resolve_conj().resolve_neg())
    # the same image packed in two ranges that cut the first two tensors
    image = torch.zeros(layout.nbytes, dtype=torch.uint8)
    assert layout.metas[1].offset < 70 < layout.metas[1].offset + layout.metas[1].nbytes
    for lo, hi in ((0, 12), (12, 70), (70, layout.nbytes)):
        packing.pack_into(image, tensors, layout, lo, hi)
    assert image.numpy().tobytes() == packing.pack_bytes(tensors, layout)


def test_the_plan_cache_keeps_the_latest_shapes_and_drops_the_oldest() -> None:
    """A stream of varying sizes (more shapes than the cache holds) gets a correct
    plan every time; the latest shapes' plans are reused, the oldest are dropped one
    at a time (not all at once)."""
    n = packing.PLANS_MAX + 10
    tensors = [torch.ones(i + 1, dtype=torch.uint8) for i in range(n)]
    plans = [packing.plan([t]) for t in tensors]
    assert [p.nbytes for p in plans] == list(range(1, n + 1))
    assert all(p.metas[0].shape == (i + 1,) and p.devices == {"cpu"} for i, p in enumerate(plans))
    assert packing.plan([tensors[-1]]) is plans[-1]  # kept
    assert packing.plan([tensors[n - packing.PLANS_MAX + 1]]) is plans[n - packing.PLANS_MAX + 1]
    again = packing.plan([tensors[0]])  # dropped: made anew, equal
    assert again is not plans[0] and again == plans[0]
    two = packing.plan([torch.ones(3), torch.ones(2, dtype=torch.int64)], ["a", "b"])
    assert [m.offset for m in two.metas] == [0, 64] and two.nbytes == 80
    assert [m.path for m in two.metas] == ["a", "b"]
