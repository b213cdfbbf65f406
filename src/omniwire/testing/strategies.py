"""Hypothesis strategies for payloads: every shape a pipeline stage may send.

Needs the ``test`` extra (hypothesis). Used by omniwire's own tests and by the
conformance suite that third-party backends run.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from ..packing import _TORCH_DTYPES

__all__ = [
    "WIRE_DTYPES",
    "assert_payload_equal",
    "payloads",
    "tensors",
]

#: Every wire dtype this torch build has.
WIRE_DTYPES: tuple[torch.dtype, ...] = tuple(_TORCH_DTYPES.values())

_shapes = st.one_of(
    st.just(()),  # 0-dim
    st.lists(st.integers(0, 5), min_size=1, max_size=4).map(tuple),  # may contain 0: zero-size
)


@st.composite
def tensors(
    draw: st.DrawFn,
    dtypes: tuple[torch.dtype, ...] = WIRE_DTYPES,
    max_side: int = 5,
) -> torch.Tensor:
    """A CPU tensor of any wire dtype with random bytes (NaNs included), possibly
    non-contiguous (transposed or sliced with a step), 0-dim or zero-size, possibly a
    lazily conjugated or negated view (its memory holds other values than it reads as)
    or torch's lazy zeros (no memory at all)."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(_shapes)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    if dtype is torch.bool:  # only 0 and 1 are bool values
        raw = bytes(b & 1 for b in raw)
    base = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    t = base.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    if dtype.is_floating_point and numel and draw(st.booleans()):
        # A quiet NaN with a payload, and -0.0, where the dtype can hold them.
        if dtype is torch.float64:
            t.view(-1)[0] = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
        elif dtype in (torch.float32, torch.float16, torch.bfloat16):
            t.view(-1)[0] = float("nan")
            t.view(-1)[-1] = -0.0
    how = draw(st.sampled_from(["plain", "transpose", "step"]))
    if how == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif how == "step" and t.dim() >= 1 and t.shape[0] >= 2:
        t = t[::2]
    lazy = draw(st.sampled_from(["none", "conj", "neg", "zero"]))
    if lazy == "conj" and dtype.is_complex:
        t = t.conj()  # a conjugate bit over memory that holds the other values
    elif lazy == "neg" and dtype in _NEGATABLE and _neg_view:
        t = _neg_view(t)  # a negative bit, likewise
    elif lazy == "zero" and how == "plain" and _zeros is not None:
        t = _zeros(shape, dtype=dtype)  # torch's lazy zeros: no memory at all
    return t


#: torch's lazy zeros (a tensor with no memory, as autograd makes), where it has them.
_zeros = getattr(torch, "_efficientzerotensor", None)
#: torch's lazily negated view (what ``x.conj().imag`` makes), where it has one, and
#: the dtypes torch can resolve one of (not the float8 and float4 ones).
_neg_view = getattr(torch, "_neg_view", None)
_NEGATABLE = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16}
    | {torch.complex32, torch.complex64, torch.complex128}
)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_keys = st.one_of(
    st.text(max_size=8),
    st.integers(-(2**63), 2**63 - 1),
    st.tuples(st.integers(0, 9), st.text(max_size=3)),
)


def payloads(max_leaves: int = 12, tensor_strategy: Any = None) -> st.SearchStrategy[Any]:
    """Nested dict / list / tuple trees of scalars, tensors and numpy arrays."""
    leaf_tensors = tensor_strategy if tensor_strategy is not None else tensors()
    arrays: st.SearchStrategy[np.ndarray] = st.sampled_from(
        [np.float32, np.float64, np.int64, np.uint8, np.bool_, np.complex64]
    ).flatmap(
        lambda dt: st.lists(st.integers(0, 3), min_size=0, max_size=3).map(
            lambda shape: np.arange(math.prod(shape), dtype=np.int64).astype(dt).reshape(shape)
        )
    )
    leaves = st.one_of(_scalars, leaf_tensors, arrays)
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(_keys, children, max_size=4),
        ),
        max_leaves=max_leaves,
    )


def _bits(t: torch.Tensor) -> bytes:
    if not t.numel():
        return b""
    c = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().cpu().reshape(-1))
    return bytes(c.view(torch.uint8).numpy().tobytes())


def assert_payload_equal(expected: Any, actual: Any, path: str = "payload") -> None:
    """Assert two payloads are equal bit for bit: types, container kinds, tensor
    dtype/shape/bytes (NaN payloads included), float bits (-0.0 vs 0.0)."""
    assert type(actual) is type(expected) or (
        isinstance(expected, torch.Tensor) and type(actual) is torch.Tensor
    ), f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert tuple(actual.shape) == tuple(expected.shape), f"{path}: shape differs"
        assert _bits(actual) == _bits(expected), f"{path}: tensor bytes differ"
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.tobytes() == expected.tobytes(), f"{path}: array bytes differ"
    elif isinstance(expected, float):
        assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{path}: float bits"
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{path}: length differs"
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            assert_payload_equal(a, b, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()) or set(actual) == set(expected), (
            f"{path}: keys differ"
        )
        for k in expected:
            assert_payload_equal(expected[k], actual[k], f"{path}[{k!r}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
