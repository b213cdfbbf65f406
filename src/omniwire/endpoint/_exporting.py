"""Making an outbound object's bytes available to its backend (spec §5): lend the
caller's tensors where the engine reads them in place, else pack them into a buffer
the backend exports — the first piece now, the rest by :func:`publish_rest` for a
progressive object (spec §5.2).
"""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import torch

from .. import packing, wire
from ..backends.base import THREAD_COPY_THRESHOLD, ByteBackend, Export, in_parts
from ._core import Core
from ._records import OutRecord, Peer

__all__ = ["export_bytes", "pack", "publish_rest"]


async def export_bytes(
    backend: ByteBackend,
    info: Any,
    tensors: list[torch.Tensor],
    layout: packing.PackPlan,
    *,
    lend: bool,
    piece: int = 0,
) -> tuple[Export, list[int]]:
    """An export holding the tensors' bytes, and the progressive split points (one
    point, ``layout.nbytes``, unless ``piece`` > 0 splits it). Only the first piece
    is packed; the export is released if packing fails."""
    export = await backend.export_tensors(info, tensors, lent=lend)
    if export is not None:
        return export, [layout.nbytes]
    device = next((str(t.device) for t in tensors if t.device.type != "cpu"), "cpu")
    export = await backend.export(info, layout.nbytes, device)
    points = packing.split_points(tensors, layout, piece) if piece > 0 else [layout.nbytes]
    try:
        assert export.buffer is not None
        await pack(export.buffer, tensors, layout, 0, points[0])
    except BaseException:
        export.release()
        raise
    return export, points


async def publish_rest(
    core: Core,
    peer: Peer,
    record: OutRecord,
    tensors: list[torch.Tensor],
    layout: packing.PackPlan,
    points: list[int],
) -> None:
    """Pack and announce the rest of a progressive object, piece by piece."""
    for lo, hi in itertools.pairwise(points):
        export = record.export
        if record.released or export is None or export.buffer is None:
            return  # released meanwhile (NACK, peer lost): the receiver drops it
        await pack(export.buffer, tensors, layout, lo, hi)
        await export.publish(lo, hi)
        if record.released or peer.generation != record.generation:
            return
        peer.session.advance(record.object_id, hi)
        core.outbox.post(
            peer,
            wire.DataProgressMessage(
                object_id=record.object_id, from_stage=core.name, to_stage=peer.name, ready=hi
            ),
        )


async def pack(
    dest: torch.Tensor, tensors: list[torch.Tensor], layout: packing.PackPlan, lo: int, hi: int
) -> None:
    """Copy bytes ``[lo, hi)`` of the packed layout into ``dest`` (large copies off the loop)."""
    if hi - lo < THREAD_COPY_THRESHOLD:
        packing.pack_into(dest, tensors, layout, lo, hi)
        return
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if cuda is None and dest.device.type != "cuda":
        if all(t.is_contiguous() for t in tensors):  # (a part cutting a strided one copies it)
            await in_parts(lambda a, b: packing.pack_into(dest, tensors, layout, a, b), lo, hi)
        else:
            await anyio.to_thread.run_sync(packing.pack_into, dest, tensors, layout, lo, hi)
        return
    # CUDA copies are ordered on a stream, and the current stream is per thread:
    # pack in the worker on the caller's stream, after the work that made the tensors.
    stream = torch.cuda.current_stream(cuda if cuda is not None else dest.device)

    def pack_on_stream() -> None:
        with torch.cuda.stream(stream):
            packing.pack_into(dest, tensors, layout, lo, hi)

    await anyio.to_thread.run_sync(pack_on_stream)
