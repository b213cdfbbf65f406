"""Tensor packing: every tensor of a payload at a 64-byte aligned offset of one buffer.

``plan`` lays tensors out (spec §5); ``pack_into`` copies them into a buffer a
backend hands in — one copy per tensor, straight from the (possibly
non-contiguous) source, no intermediate ``torch.cat``; ``unpack`` rebuilds them
as views of a received buffer (zero copy) or as owned copies.

A byte range ``[lo, hi)`` may be packed at a time so that a large payload can be
announced progressively (spec §4.4): the receiver copies early bytes while the
sender still fills later ones. ``split_points`` picks ranges that never cut
through a non-contiguous tensor.
"""

from __future__ import annotations

import collections
import ctypes
import math
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgspec
import numpy as np
import torch

from .errors import WireFormatError
from .wire import DTYPE_ITEMSIZE, I64_MAX, MAX_NDIM, InlineStreamChunkRef, TensorMeta, align_up

__all__ = [
    "PLANS_MAX",
    "PackPlan",
    "as_byte_tensor",
    "dtype_name",
    "holds_its_values",
    "pack_bytes",
    "pack_into",
    "plan",
    "resolved",
    "split_points",
    "torch_dtype",
    "unpack",
    "unpack_inline",
]

#: wire name → torch dtype, for the names this torch build knows.
_TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    name: getattr(torch, name) for name in DTYPE_ITEMSIZE if hasattr(torch, name)
}
_WIRE_NAMES: Final[dict[torch.dtype, str]] = {d: n for n, d in _TORCH_DTYPES.items()}
#: wire name → numpy dtype (native byte order), for the dtypes numpy has.
_NUMPY: Final[dict[str, np.dtype[Any]]] = {
    name: np.dtype(name)
    for name in (
        "float64",
        "float32",
        "float16",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "complex128",
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype.

    Raises:
        TypeError: the dtype has no wire name (quantized, bits, sub-byte shell types).
    """
    try:
        return _WIRE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"tensor dtype {dtype} cannot be sent (no wire name)") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name.

    Raises:
        WireFormatError: the name is not a wire dtype, or this torch lacks it.
    """
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise WireFormatError(
            f"dtype {name!r} is not available in torch {torch.__version__}"
        ) from None


class PackPlan(msgspec.Struct, frozen=True, gc=False):
    """Where each tensor goes in the packed buffer, and the buffer's length (a
    msgspec struct: made for every payload shape a stream has not sent lately, it
    costs a tenth of a frozen dataclass)."""

    metas: tuple[TensorMeta, ...]
    nbytes: int
    #: Device kinds of the tensors ("cpu", "cuda"); empty when there are none.
    devices: frozenset[str] = frozenset()


_CPU: Final = frozenset({"cpu"})
#: The torch dtypes numpy holds (pack_bytes asks numpy for their bytes).
_NUMPY_TORCH: Final = frozenset(getattr(torch, name) for name in _NUMPY)

#: Plans of recent payload shapes: a pipeline sends the same shapes over and over.
#: A full cache drops its oldest plan (an OrderedDict: deleting a plain dict's first
#: key leaves a hole its next iteration skips, which made a miss cost twice as much).
_PLANS: collections.OrderedDict[tuple[object, ...], PackPlan] = collections.OrderedDict()
#: Plans kept; the caches of what a plan leads to (routes, payload infos) keep as many.
PLANS_MAX = 4096


def plan(tensors: Sequence[torch.Tensor], paths: Sequence[str] = ()) -> PackPlan:
    """Lay ``tensors`` out back to back at 64-byte aligned offsets.

    The length is the end of the last tensor (no trailing padding). Plans of the
    shapes seen lately are reused (a plan is immutable).

    Raises:
        TypeError: a tensor's dtype has no wire name.
    """
    if len(tensors) == 1:  # the common case, without a generator
        t = tensors[0]
        key: tuple[object, ...] = (t.dtype, t.shape, t.device, *paths)
        layout = _PLANS.get(key)
        if layout is None:
            layout = _remember(key, _plan_one(t, paths[0] if paths else ""))
        return layout
    key = (*((t.dtype, t.shape, t.device) for t in tensors), *paths)
    layout = _PLANS.get(key)
    if layout is not None:
        return layout
    metas = []
    offset = 0
    end = 0
    for i, t in enumerate(tensors):
        offset = align_up(end)
        nbytes = t.numel() * t.element_size()
        metas.append(
            TensorMeta(
                dtype=dtype_name(t.dtype),
                shape=tuple(t.shape),
                offset=offset,
                nbytes=nbytes,
                device="cpu" if t.is_cpu else str(t.device),
                path=paths[i] if i < len(paths) else "",
            )
        )
        end = offset + nbytes
    if all(t.is_cpu for t in tensors):  # t.device.type costs 6x as much as t.is_cpu
        devices = _CPU if tensors else frozenset()
    else:
        devices = frozenset(t.device.type for t in tensors)
    return _remember(key, PackPlan(tuple(metas), end, devices))


def _plan_one(t: torch.Tensor, path: str) -> PackPlan:
    """:func:`plan` of one tensor (a stream of varying sizes misses the cache often)."""
    nbytes = t.numel() * t.element_size()
    cpu = t.is_cpu
    meta = TensorMeta(
        dtype=dtype_name(t.dtype),
        shape=tuple(t.shape),
        offset=0,
        nbytes=nbytes,
        device="cpu" if cpu else str(t.device),
        path=path,
    )
    return PackPlan((meta,), nbytes, _CPU if cpu else frozenset((t.device.type,)))


def _remember(key: tuple[object, ...], layout: PackPlan) -> PackPlan:
    if len(_PLANS) >= PLANS_MAX:
        _PLANS.popitem(last=False)
    _PLANS[key] = layout
    return layout


def pack_bytes(tensors: Sequence[torch.Tensor], layout: PackPlan) -> bytes:
    """The packed image of ``tensors`` as ``bytes`` (for small payloads carried inline;
    padding is zero)."""
    if len(tensors) == 1 and layout.nbytes:  # at offset 0, no padding: the common case
        t = tensors[0]
        # (a lazy zero tensor has no memory: its data_ptr() is 0; see holds_its_values)
        if t.is_cpu and (at := t.data_ptr()) and not (t.is_neg() or t.is_conj()):
            if t.is_contiguous():  # the bytes as they lie, any dtype (0.75 µs less than numpy)
                return _copy_out(at, layout.nbytes)
            # numpy writes C order whatever the strides, at half the cost of the generic
            # path below; what it refuses is not tried (torch's refusal costs 18 µs)
            if t.dtype in _NUMPY_TORCH and not t.requires_grad:
                try:
                    return t.numpy().tobytes()
                except RuntimeError:
                    pass
    parts: list[bytes] = []
    at = 0
    for t, meta in zip(tensors, layout.metas, strict=True):
        if meta.offset > at:
            parts.append(bytes(meta.offset - at))
        if meta.nbytes:
            t = resolved(t)  # lazy views and zeros: the memory holds other values, or none
            if not (t.is_cpu and t.is_contiguous()):
                t = t.to("cpu").contiguous()
            # C order is the packed layout: the bytes as they lie
            parts.append(ctypes.string_at(t.data_ptr(), meta.nbytes))
        at = meta.offset + meta.nbytes
    return b"".join(parts)


def _copy_out(address: int, nbytes: int) -> bytes:
    """``nbytes`` bytes at ``address`` (through a ctypes array type per size, kept for
    the sizes seen lately: twice as fast as ``ctypes.string_at``)."""
    array = _BYTES_AT.get(nbytes)
    if array is None:
        if len(_BYTES_AT) >= PLANS_MAX:
            _BYTES_AT.clear()
        array = _BYTES_AT[nbytes] = ctypes.c_char * nbytes
    return array.from_address(address).raw


_BYTES_AT: dict[int, type[ctypes.Array[ctypes.c_char]]] = {}


def holds_its_values(t: torch.Tensor) -> bool:
    """Whether the memory under ``t`` holds the values ``t`` reads as: not a lazily
    conjugated or negated view (torch keeps those as a bit beside memory that holds
    other values, and the bit does not travel), nor a zero tensor (lazy zeros with no
    memory at all: its ``data_ptr()`` is 0). Only such a tensor's memory may be sent
    as it lies — lent, born in transport memory, forwarded, shared in place; any
    other is packed, which resolves it (:func:`resolved`)."""
    return not (t.is_conj() or t.is_neg() or _is_zero(t))


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if its memory holds its values, else a new tensor that holds them."""
    if holds_its_values(t):
        return t
    if _is_zero(t):
        t = t.clone()  # real zeros
    return t.resolve_conj().resolve_neg()


def _is_zero(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of torch's lazy zeros (where this torch has them)."""
    return _IS_ZERO is not None and bool(_IS_ZERO(t))


_IS_ZERO: Callable[[torch.Tensor], bool] | None = getattr(torch.Tensor, "_is_zerotensor", None)


def as_byte_tensor(buffer: torch.Tensor | memoryview | bytearray) -> torch.Tensor:
    """View a writable buffer (or a uint8 tensor) as a 1-D uint8 tensor, without copying.

    Any C-contiguous buffer works, whatever its item format or number of dimensions.

    Raises:
        TypeError: a tensor that is not a contiguous 1-D uint8 tensor, or a buffer
            that is not C-contiguous.
    """
    if isinstance(buffer, torch.Tensor):
        if buffer.dtype is not torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise TypeError("destination tensor must be a contiguous 1-D uint8 tensor")
        return buffer
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise TypeError("buffer must be C-contiguous to be viewed as bytes")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view.

    torch calls a 1-element tensor with any stride contiguous; its flat view then
    keeps that stride, which ``view(uint8)`` refuses, so such a tensor is copied. A
    lazily conjugated or negated view is resolved (its memory holds other values).
    """
    t = resolved(t)
    flat = t.reshape(-1)
    if not flat.numel():
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if flat.stride(0) != 1:
        flat = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)
    return flat.view(torch.uint8)


def pack_into(
    dest: torch.Tensor | memoryview | bytearray,
    tensors: Sequence[torch.Tensor],
    layout: PackPlan,
    lo: int = 0,
    hi: int | None = None,
) -> None:
    """Copy the bytes ``[lo, hi)`` of the packed image of ``tensors`` into ``dest``.

    ``dest`` is the whole packed buffer (at least ``layout.nbytes`` long). Tensors
    wholly inside the range are copied with one strided ``copy_``; a tensor cut by
    the range must be contiguous (``split_points`` guarantees it) or is made so.
    Padding bytes are left as they are.
    """
    out = as_byte_tensor(dest)
    hi = layout.nbytes if hi is None else hi
    if out.numel() < hi:
        raise ValueError(f"destination holds {out.numel()} bytes; {hi} needed")
    for t, meta in zip(tensors, layout.metas, strict=True):
        start, end = meta.offset, meta.offset + meta.nbytes
        if end <= lo or start >= hi or meta.nbytes == 0:
            continue
        if lo <= start and end <= hi:
            target = out[start:end].view(t.dtype).view(t.shape)
            target.copy_(t.detach())
            continue
        a, b = max(lo, start), min(hi, end)
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        out[a:b].copy_(_flat_bytes(src)[a - start : b - start])


def split_points(tensors: Sequence[torch.Tensor], layout: PackPlan, chunk: int) -> list[int]:
    """Increasing byte offsets ending at ``layout.nbytes``, about ``chunk`` apart.

    A cut falls inside a tensor only if that tensor is contiguous, so every range
    can be packed without an extra copy.
    """
    if chunk <= 0 or layout.nbytes <= chunk:
        return [layout.nbytes]
    points: list[int] = []
    last = 0
    for t, meta in zip(tensors, layout.metas, strict=True):
        end = meta.offset + meta.nbytes
        if t.is_contiguous():
            while last + chunk < end:
                last += chunk
                points.append(last)
        if end - last >= chunk:
            last = end
            points.append(end)
    if not points or points[-1] != layout.nbytes:
        points.append(layout.nbytes)
    return points


def _check_meta(meta: TensorMeta, size: int) -> None:
    """Refuse a tensor-table entry that cannot be viewed in a ``size``-byte buffer.

    ``TensorMeta`` validates itself when decoded, but ``unpack`` also takes tables
    built by hand; this keeps its one promise (``WireFormatError``) for any of them.
    """
    shape = meta.shape
    if not isinstance(shape, tuple) or len(shape) > MAX_NDIM:
        what = f"{len(shape)} dims" if isinstance(shape, tuple) else type(shape).__name__
        raise WireFormatError(f"shape must be a tuple of at most {MAX_NDIM} dims, not {what}")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= I64_MAX:
            raise WireFormatError(f"shape {shape!r} has a dimension outside [0, 2**63-1]")
    if math.prod(d for d in shape if d) > I64_MAX:
        raise WireFormatError(f"shape {shape!r}: the product of its dimensions exceeds 2**63-1")
    itemsize = DTYPE_ITEMSIZE.get(meta.dtype)
    if itemsize is None:
        raise WireFormatError(f"dtype {meta.dtype!r} is not a wire dtype")
    offset, nbytes = meta.offset, meta.nbytes
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        raise WireFormatError(f"offset {offset!r} and nbytes {nbytes!r} must be integers >= 0")
    if offset + nbytes > size:
        raise WireFormatError(f"spans [{offset}, {offset + nbytes}) beyond the {size}-byte buffer")
    if nbytes != math.prod(shape) * itemsize:
        raise WireFormatError(
            f"has {nbytes} bytes but shape {shape} of {meta.dtype} needs "
            f"{math.prod(shape) * itemsize}"
        )


def unpack(
    buffer: torch.Tensor | memoryview | bytearray,
    metas: Sequence[TensorMeta],
    *,
    copy: bool,
) -> list[torch.Tensor]:
    """Rebuild tensors from a packed buffer.

    Args:
        buffer: the packed bytes (a 1-D uint8 tensor, or a writable buffer).
        metas: the tensor table.
        copy: return owned tensors (True) or views of ``buffer`` (False), which are
            valid only while the buffer is.

    Returns:
        One tensor per entry of ``metas``, in order, with exactly its dtype and shape.

    Raises:
        WireFormatError: an entry cannot be viewed in the buffer: it lies outside it,
            names an unknown dtype, has a shape torch cannot build (a dimension
            outside [0, 2**63-1], too many dimensions, an overflowing product), a
            byte count that does not match its shape, or an offset the dtype cannot
            start at. The message names the tensor (its path, else its index).
        TypeError: ``buffer`` cannot be viewed as bytes (see :func:`as_byte_tensor`).
    """
    if isinstance(buffer, bytearray) and not copy:
        return _unpack_bytes(buffer, metas)
    base = as_byte_tensor(buffer)
    return [_view(base, meta, i, copy) for i, meta in enumerate(metas)]


def _view(base: torch.Tensor, meta: TensorMeta, i: int, copy: bool) -> torch.Tensor:
    """Entry ``i`` of a tensor table as a view of ``base`` (or a copy)."""
    try:
        _check_meta(meta, base.numel())
        dtype = torch_dtype(meta.dtype)
        view = base[meta.offset : meta.offset + meta.nbytes].view(dtype).view(meta.shape)
        return view.clone() if copy else view
    except (WireFormatError, RuntimeError, TypeError, ValueError, OverflowError) as exc:
        name = repr(meta.path) if meta.path else f"#{i}"
        why = str(exc).partition("\n")[0]  # torch appends a C++ trace to some errors
        raise WireFormatError(f"tensor {name} ({meta.dtype}) {why}") from exc


def unpack_inline(inline: InlineStreamChunkRef) -> list[torch.Tensor]:
    """The tensors of an inline chunk, as views of one private copy of its data.

    An ``InlineStreamChunkRef`` checks its table against its data when it is built or
    decoded (types, shapes, bounds, 64-byte alignment), so the entries are not
    checked again here.

    Raises:
        WireFormatError: an entry torch cannot view (as :func:`unpack`).
    """
    metas = inline.tensors
    if len(metas) == 1:  # the common case: one 1-D tensor filling the data
        meta = metas[0]
        dtype = _FROMBUFFER.get(meta.dtype)
        if (
            dtype is not None
            and len(meta.shape) == 1
            and meta.offset == 0
            and 0 < meta.nbytes == len(inline.data)
        ):
            # torch's view of the copy: 0.2 µs less than numpy's, its release included
            return [torch.frombuffer(bytearray(inline.data), dtype=dtype)]
    return _unpack_bytes(bytearray(inline.data), metas, checked=True)


#: The dtypes :func:`unpack_inline` has torch view directly (those numpy knows too).
_FROMBUFFER: Final[dict[str, torch.dtype]] = {name: _TORCH_DTYPES[name] for name in _NUMPY}


def _unpack_bytes(
    buffer: bytearray, metas: Sequence[TensorMeta], *, checked: bool = False
) -> list[torch.Tensor]:
    """:func:`unpack` of a small buffer (inline data): through numpy where it knows the
    dtype (several times cheaper than torch's views), torch's views otherwise.
    ``checked``: the table was validated against this buffer (see :func:`unpack_inline`)."""
    size = len(buffer)
    out = []
    base: torch.Tensor | None = None
    for i, meta in enumerate(metas):
        np_dtype = _NUMPY.get(meta.dtype)
        if np_dtype is None or not meta.nbytes:  # empty ones may have huge dims numpy refuses
            base = as_byte_tensor(buffer) if base is None else base
            out.append(_view(base, meta, i, False))
            continue
        try:
            if not checked:
                _check_meta(meta, size)
                if meta.offset % np_dtype.itemsize:
                    raise WireFormatError(f"offset {meta.offset} is not aligned to its dtype")
            count = meta.nbytes // np_dtype.itemsize
            # positional: numpy parses keywords at 2.5x the cost of the call itself
            array = np.frombuffer(buffer, np_dtype, count, meta.offset)
            shape = meta.shape
            out.append(torch.from_numpy(array if len(shape) == 1 else array.reshape(shape)))
        except (WireFormatError, ValueError, TypeError, OverflowError) as exc:
            name = repr(meta.path) if meta.path else f"#{i}"
            raise WireFormatError(f"tensor {name} ({meta.dtype}) {exc}") from exc
    return out
