"""Payloads that travel inside their DataReady (spec §4.6): the message, its charge
and whether it fits in one frame, and the receipt it gets (no ACK)."""

from __future__ import annotations

from typing import Literal

import torch

from .. import codec, packing, wire
from ..delivery import SendReceipt
from ..errors import FrameTooLargeError, WireFormatError
from ..routing import INLINE, PayloadInfo
from ._records import Peer
from ._stats import RouteStats

__all__ = ["Kind", "carried_inline", "fit", "inline_message", "payload_info", "unaccount"]

Kind = Literal["payload", "stream_chunk"]


def inline_message(
    name: str,
    peer: Peer,
    enc: codec.Encoded,
    layout: packing.PackPlan,
    request_id: str,
    kind: Kind,
    chunk_id: int,
    meta: bytes,
    traceparent: str,
) -> tuple[wire.DataReadyMessage, int]:
    """The inline DataReady from stage ``name`` carrying ``enc`` packed by ``layout``,
    and its charge (spec §7.6).

    Raises:
        FrameTooLargeError: it would not fit in a frame.
    """
    data = packing.pack_bytes(enc.tensors, layout)
    metas = layout.metas
    msg = wire.DataReadyMessage(
        request_id=request_id,
        from_stage=name,
        to_stage=peer.name,
        chunk_id=chunk_id,
        inline=wire.InlineStreamChunkRef(header=enc.header, tensors=metas, data=data, kind=kind),
        metadata=meta,
        traceparent=traceparent,
    )
    # wire.charge(msg), from the parts at hand (this runs for every small message)
    charge = (
        wire.CHARGE_BASE
        + len(meta)
        + len(enc.header)
        + len(data)
        + wire.CHARGE_PER_TENSOR * len(metas)
    )
    if charge >= _SURELY_FITS or len(metas) >= 256:
        fit(msg)
    return msg, charge


def unaccount(peer: Peer, request_id: str, chunk_id: int) -> None:
    """A stream chunk that was accounted never went: its id is the stream's next again
    (unless later chunks of the stream were accounted meanwhile); a first chunk leaves
    no entry (nothing of the stream went)."""
    if peer.chunk_ids.get(request_id) == chunk_id + 1:
        if chunk_id:
            peer.chunk_ids[request_id] = chunk_id
        else:
            del peer.chunk_ids[request_id]


#: A DataReady charged less than this, with fewer than 256 tensor entries, fits in a
#: frame (so it is not encoded to find out).
_SURELY_FITS = 1 << 20


def fit(msg: wire.DataReadyMessage) -> int:
    """``msg``'s charge (spec §7.6); FrameTooLargeError if it cannot travel in one frame
    (spec §3.1). Exact for the messages that might not fit; small ones are not encoded."""
    charge = wire.charge(msg)
    if charge < _SURELY_FITS and len((msg.data_ref or msg.inline or _EMPTY).tensors) < 256:
        return charge
    try:
        wire.encode(msg)
    except WireFormatError as exc:
        raise FrameTooLargeError(
            f"a {'stream chunk' if msg.chunk_id or msg.is_done else 'payload'} of request "
            f"{msg.request_id!r} to {msg.to_stage!r} is too large for one frame ({exc}; "
            f"frames hold at most {wire.MAX_FRAME_SIZE >> 20} MiB): send bulk bytes as a tensor, "
            "which travels by a backend"
        ) from None
    return charge


_EMPTY = wire.InlineStreamChunkRef()


def carried_inline(
    peer: Peer, request_id: str, layout: packing.PackPlan, stats: RouteStats
) -> SendReceipt:
    """The receipt of an inline send: complete when handed on (inline data has no ACK)."""
    stats.count += 1
    stats.nbytes += layout.nbytes
    return SendReceipt.completed(peer.name, request_id, INLINE.name, layout.nbytes)


_INFOS: dict[tuple[int, int, frozenset[str], str], PayloadInfo] = {}


def payload_info(kind: Kind, tensors: list[torch.Tensor], layout: packing.PackPlan) -> PayloadInfo:
    """What routing may know of a payload (one object per shape: routes are cached by it)."""
    key = (layout.nbytes, len(tensors), layout.devices, kind)
    info = _INFOS.get(key)
    if info is None:
        if len(_INFOS) >= packing.PLANS_MAX:
            _INFOS.clear()
        info = _INFOS[key] = PayloadInfo(kind, layout.nbytes, layout.devices, len(tensors))
    return info
