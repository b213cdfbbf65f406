"""Tensor packing: alignment, every dtype, ranges, views vs copies."""

from __future__ import annotations

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
