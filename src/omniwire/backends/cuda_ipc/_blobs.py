"""cuda_ipc's wire blobs (spec §9), msgpack maps of typed structs validated on
receipt, and the pure helpers that turn tensors into shares and back.

- Hello (``BackendInfo.info``): ``{"pid": int, "device": <uuid of the GPU this
  endpoint receives on>, "release_event": <64-byte IPC event handle>}``.
- Reference (``BackendRef.info``), tagged by ``"type"``:
  ``{"type": "tensors", "shares": [Share], "tensors": [{"share", "dtype", "shape",
  "stride", "offset"}]}`` or ``{"type": "slot", "buffer": Share, "buffer_id",
  "dedicated", "offset", "size", "event", "event_id"}``, where a Share is
  ``{"device": <GPU uuid>, "handle": <torch shareable IPC handle>, "nbytes",
  "offset" (of the storage in its CUDA allocation), "counter" (torch's ref-counter
  file, ``/torch_<sender pid>_…``), "counter_offset", "event", "event_sync"}``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import msgspec
import torch

from ...errors import BackendError
from ...packing import dtype_name, holds_its_values, torch_dtype
from ...wire import DTYPE_ITEMSIZE, MAX_NDIM, MAX_TENSORS, align_up
from ..base import PeerInfo
from ..support import decode_blob

__all__ = [
    "IPC_EVENT_HANDLE_SIZE",
    "HelloInfo",
    "Ref",
    "Share",
    "SlotRef",
    "TensorRef",
    "TensorsRef",
    "build_views",
    "byte_view",
    "decode_hello",
    "decode_ref",
    "encode",
    "packed_length",
    "plan_shares",
]

#: Size of a CUDA IPC event handle (cudaIpcEventHandle_t).
IPC_EVENT_HANDLE_SIZE = 64
#: torch's shareable memory handles are a 64-byte cudaIpcMemHandle plus a small
#: header, or a longer descriptor for expandable segments; anything beyond this is junk.
MAX_MEM_HANDLE_SIZE = 1024
#: Slots in one of torch's ref-counter files (CUDA_IPC_REF_COUNTER_FILE_SIZE).
TORCH_REF_COUNTER_SLOTS = 10000
#: torch names its ref-counter files ``/torch_<pid>_<random>[_<counter>]``.
_COUNTER = re.compile(r"^/torch_(\d{1,10})_\d{1,20}(?:_\d{1,20})?$")
_MAX_BYTES = 1 << 50
_MAX_ID = 1 << 32


class HelloInfo(msgspec.Struct, frozen=True):
    pid: int
    device: str
    release_event: bytes = b""


class Share(msgspec.Struct, frozen=True):
    """One storage shared by ``UntypedStorage._share_cuda_``."""

    device: str
    handle: bytes
    nbytes: int
    offset: int
    counter: str = ""
    counter_offset: int = 0
    event: bytes = b""
    event_sync: bool = False


class TensorRef(msgspec.Struct, frozen=True):
    share: int
    dtype: str
    shape: list[int]
    stride: list[int]
    offset: int


class TensorsRef(msgspec.Struct, frozen=True, tag="tensors", tag_field="type"):
    shares: list[Share]
    tensors: list[TensorRef]


class SlotRef(msgspec.Struct, frozen=True, tag="slot", tag_field="type"):
    buffer: Share
    buffer_id: int
    dedicated: bool
    offset: int
    size: int
    event: bytes
    event_id: int


Ref = TensorsRef | SlotRef

encode = msgspec.msgpack.Encoder().encode
_hello_decoder = msgspec.msgpack.Decoder(HelloInfo)
_ref_decoder = msgspec.msgpack.Decoder(Ref)


def decode_hello(peer: PeerInfo) -> HelloInfo:
    """Decode and validate a peer's Hello info.

    Raises:
        BackendError: it is malformed or does not match the peer.
    """
    hello = decode_blob(_hello_decoder, peer.info, f"cuda_ipc hello info from {peer.name!r}")
    if hello.pid != peer.pid:
        raise BackendError(
            f"cuda_ipc hello info from {peer.name!r} names pid {hello.pid}, not {peer.pid}"
        )
    if not 0 < len(hello.device.encode()) <= 256:
        raise BackendError(f"cuda_ipc hello info from {peer.name!r} names no GPU")
    if len(hello.release_event) not in (0, IPC_EVENT_HANDLE_SIZE):
        raise BackendError(f"cuda_ipc hello info from {peer.name!r} has a malformed event handle")
    return hello


def decode_ref(info: bytes, peer: PeerInfo, nbytes: int) -> Ref:
    """Decode and validate a reference from ``peer`` for an object of ``nbytes``.

    Checks every field: handles and events have sane sizes, torch's ref counter
    belongs to the peer's process and its slot exists, each tensor lies inside its
    storage, a slot lies inside its buffer, and the sizes add up to ``nbytes``.

    Raises:
        BackendError: the reference is malformed, or names memory the peer does not
            own, or lies outside it.
    """
    where = f"cuda_ipc reference from {peer.name!r}"
    ref = decode_blob(_ref_decoder, info, where)
    if isinstance(ref, TensorsRef):
        _check_tensors(ref, peer, nbytes, where)
    else:
        _check_share(ref.buffer, peer, where)
        if not (0 <= ref.buffer_id < _MAX_ID and 0 <= ref.event_id < _MAX_ID):
            raise BackendError(f"{where} has an id out of range")
        if ref.size != nbytes:
            raise BackendError(f"{where} has size {ref.size} != {nbytes}")
        if ref.offset < 0 or ref.offset + ref.size > ref.buffer.nbytes:
            raise BackendError(
                f"{where} spans [{ref.offset}, {ref.offset + ref.size}) outside its "
                f"{ref.buffer.nbytes}-byte buffer"
            )
        if ref.size and not ref.buffer.handle:
            raise BackendError(f"{where} names no buffer")
        if len(ref.event) != IPC_EVENT_HANDLE_SIZE:
            raise BackendError(f"{where} has a malformed event handle")
    return ref


def _check_share(share: Share, peer: PeerInfo, where: str) -> None:
    if not 0 < len(share.device.encode()) <= 256:
        raise BackendError(f"{where} names no GPU")
    if not (0 <= share.nbytes <= _MAX_BYTES and 0 <= share.offset <= _MAX_BYTES):
        raise BackendError(f"{where} has a storage size or offset out of range")
    if len(share.handle) > MAX_MEM_HANDLE_SIZE:
        raise BackendError(f"{where} has a {len(share.handle)}-byte memory handle")
    if not share.handle:
        if share.nbytes or share.counter:
            raise BackendError(f"{where} shares {share.nbytes} bytes without a memory handle")
        return
    m = _COUNTER.match(share.counter)
    if m is None:
        raise BackendError(f"{where} names ref counter {share.counter[:80]!r}, not torch's")
    if int(m.group(1)) != peer.pid:
        raise BackendError(
            f"{where} names ref counter {share.counter!r} of pid {m.group(1)}, "
            f"which is not the peer's process ({peer.pid})"
        )
    if not 0 <= share.counter_offset < TORCH_REF_COUNTER_SLOTS:
        raise BackendError(f"{where} has ref counter slot {share.counter_offset} out of range")
    if len(share.event) not in (0, IPC_EVENT_HANDLE_SIZE) or (share.event_sync and not share.event):
        raise BackendError(f"{where} has a malformed event handle")


def _check_tensors(ref: TensorsRef, peer: PeerInfo, nbytes: int, where: str) -> None:
    if len(ref.tensors) > MAX_TENSORS or len(ref.shares) > len(ref.tensors):
        raise BackendError(f"{where} has {len(ref.tensors)} tensors, {len(ref.shares)} shares")
    for share in ref.shares:
        _check_share(share, peer, where)
    end = 0
    raw = 0
    for i, t in enumerate(ref.tensors):
        if not 0 <= t.share < len(ref.shares):
            raise BackendError(f"{where}: tensor {i} names share {t.share} of {len(ref.shares)}")
        itemsize = DTYPE_ITEMSIZE.get(t.dtype)
        if itemsize is None:
            raise BackendError(f"{where}: tensor {i} has unknown dtype {t.dtype[:40]!r}")
        if len(t.shape) != len(t.stride) or len(t.shape) > MAX_NDIM:
            raise BackendError(f"{where}: tensor {i} has a malformed shape/stride")
        if any(not 0 <= d <= _MAX_BYTES for d in (*t.shape, *t.stride, t.offset)):
            raise BackendError(f"{where}: tensor {i} has a size, stride or offset out of range")
        numel = 1
        for d in t.shape:
            numel *= d
        if numel > _MAX_BYTES:
            raise BackendError(f"{where}: tensor {i} is too large")
        size = numel * itemsize
        if numel:
            last = t.offset + sum((d - 1) * s for d, s in zip(t.shape, t.stride, strict=True))
            if (last + 1) * itemsize > ref.shares[t.share].nbytes:
                raise BackendError(
                    f"{where}: tensor {i} reaches byte {(last + 1) * itemsize} of a "
                    f"{ref.shares[t.share].nbytes}-byte storage"
                )
        end = align_up(end) + size
        raw += size
    if nbytes not in (end, raw):
        raise BackendError(f"{where} describes {end} bytes of tensors, not {nbytes}")


def packed_length(tensors: Sequence[torch.Tensor]) -> int:
    """The packed length of ``tensors`` (spec §5): what the DataRef's length will be."""
    end = 0
    for t in tensors:
        end = align_up(end) + t.numel() * t.element_size()
    return end


def plan_shares(
    tensors: Sequence[torch.Tensor],
    share: Callable[[torch.UntypedStorage], Share],
    release: Callable[[Share], None],
) -> TensorsRef:
    """Share each distinct storage of ``tensors`` once and describe every tensor as a
    view of its share. If a share fails, those already made are released and the
    error propagates (the caller then packs into a slot instead).

    Raises:
        BackendError: a tensor is a lazily conjugated or negated view (its storage
            holds other values; the bit is not described: pack it), or lazy zeros.
    """
    if not all(holds_its_values(t) for t in tensors):
        raise BackendError(
            "cuda_ipc: a lazily conjugated or negated tensor (or lazy zeros) cannot be shared"
        )
    shares: list[Share] = []
    index: dict[tuple[str, int, int], int] = {}
    refs: list[TensorRef] = []
    try:
        for t in tensors:
            storage = t.untyped_storage()
            key = (str(storage.device), storage.data_ptr(), storage.nbytes())
            i = index.get(key)
            if i is None:
                i = index[key] = len(shares)
                shares.append(share(storage))
            refs.append(
                TensorRef(
                    share=i,
                    dtype=dtype_name(t.dtype),
                    shape=[int(d) for d in t.shape],
                    stride=[int(d) for d in t.stride()],
                    offset=int(t.storage_offset()),
                )
            )
    except BaseException:
        for s in shares:
            release(s)
        raise
    return TensorsRef(shares=shares, tensors=refs)


def build_views(ref: TensorsRef, storages: Sequence[torch.UntypedStorage]) -> list[torch.Tensor]:
    """The tensors ``ref`` describes, as views of the mapped ``storages``."""
    out = []
    for t in ref.tensors:
        storage = storages[t.share]
        view = torch.empty(0, dtype=torch_dtype(t.dtype), device=storage.device)
        out.append(view.set_(storage, t.offset, tuple(t.shape), tuple(t.stride)))
    return out


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage``."""
    base = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return base.set_(storage, 0, (storage.nbytes(),), (1,))
