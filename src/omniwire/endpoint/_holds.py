"""Holds on received memory: zero-copy deliveries lent to the application, and the
forwards of them by reference (spec §9.2 "Forwarding"), in one part that the
Receiver and the Sender share.

A zero-copy delivery views memory its sender keeps until the object's ACK. The ACK
waits for two things: the application's ``release()`` (:meth:`Holds.lend`'s
callback, from any thread), and the end of every forward of it in flight
(:meth:`Holds.forwarded`: an export naming the same memory, whose release lets go
of its hold). The Receiver lends deliveries and ACKs them (its ``finish``, called
here once both are over); the Sender asks for forwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from .. import packing, wire
from ..backends.base import ByteBackend
from ..routing import Route
from ._core import Core
from ._peers import PeerTable
from ._records import ForwardedExport, InRecord, Peer

__all__ = ["Holds"]

#: ``finish(peer, record, reason, text)``: end an inbound object (ACK, or NACK with
#: its reason)
Finish = Callable[[Peer, InRecord, "wire.NackReason | None", str], None]


class Holds:
    def __init__(self, core: Core, peers: PeerTable, finish: Finish) -> None:
        self.core = core
        self.peers = peers
        self._finish = finish

    # -- lent deliveries ----------------------------------------------------------------

    def lend(self, peer: Peer, record: InRecord) -> Callable[[], None]:
        """``record``'s delivery goes to the application as views of its memory: the
        callback its ``release()`` calls (from any thread). Its ACK waits for that
        and for the forwards of it in flight."""
        record.lent = True
        return lambda: self._released(peer, record)

    def _released(self, peer: Peer, record: InRecord) -> None:
        if threading.get_ident() != self.core.loop_thread:
            loop = self.core.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._released, peer, record)
            return
        record.app_released = True
        if record.holds == 0:
            self._done(peer, record)

    def _done(self, peer: Peer, record: InRecord) -> None:
        aborted = self.core.aborts.is_aborted(record.request_id)
        self._finish(
            peer, record, "aborted" if aborted else None, "request aborted" if aborted else ""
        )

    # -- forwards by reference ----------------------------------------------------------

    def holding(self, tensor: torch.Tensor) -> tuple[Peer, InRecord, int] | None:
        """The zero-copy delivery, not yet released, whose memory holds all of the
        (contiguous, CPU) ``tensor``, and where its bytes start in that object."""
        ptr, nbytes = tensor.data_ptr(), tensor.nbytes
        for peer in self.peers.all():
            for record in peer.session.inbound.values():
                if not record.lent or record.app_released or record.finished:
                    continue
                imp = record.imp
                buf = imp.buffer if imp is not None else None
                if buf is None or buf.device.type != "cpu":
                    continue
                lo = ptr - buf.data_ptr()
                if lo >= 0 and lo + nbytes <= buf.nbytes:
                    return peer, record, lo
        return None

    def hold(self, peer: Peer, record: InRecord) -> Callable[[], None]:
        """Keep ``record`` unacknowledged (its sender keeps the memory) until the
        returned callable is called (idempotent): a forward of it is in flight."""
        record.holds += 1
        held = True

        def let_go() -> None:
            nonlocal held
            if held:
                held = False
                record.holds -= 1
                if record.holds == 0 and record.app_released:
                    self._done(peer, record)

        return let_go

    async def forwarded(
        self, peer: Peer, route: Route, tensors: list[torch.Tensor]
    ) -> ForwardedExport | None:
        """An export naming, by reference, the memory of a zero-copy delivery that
        holds the payload's one tensor, with a hold on that delivery — its ACK waits
        until the export is released — or None: pack it.

        Only a payload whose tensors are exactly one tensor (``tensors``: every tensor
        of the payload, wherever it sits among its containers and plain values),
        non-empty, on the CPU, contiguous, holding its values, and lying wholly in the
        memory of a zero-copy delivery not yet released, goes by reference: through
        the backend that delivered it, to a peer that reads forwards
        (``Import.forward``), or through any backend that reads or writes lent memory
        in place (``export_tensors``: mooncake and nixl from the landing it arrived
        in, without registering it again; nccl). The caller drops the export's first
        share (its own) once the send has taken one.
        """
        if len(tensors) != 1:
            return None
        t = tensors[0]
        if (
            not t.is_cpu
            or t.nbytes == 0
            or not t.is_contiguous()
            or not packing.holds_its_values(t)
        ):
            return None
        found = self.holding(t)
        if found is None:
            return None
        upstream, record, lo = found
        imp = record.imp
        if imp is None:
            return None
        info = self.peers.connected_backend(peer, route.backend)
        export = imp.forward(info, lo, t.nbytes) if record.ref.backend == route.backend else None
        if export is None:
            backend = self.core.backends.get(route.backend)
            if isinstance(backend, ByteBackend):
                export = await backend.export_tensors(info, [t], lent=True)
            if export is not None and (export.buffer is not None or record.finished):
                export.release()  # (a copy, or the delivery ended meanwhile): packed
                export = None
        if export is None:
            return None
        counters = self.core.counters
        counters["objects_forwarded"] += 1
        counters["bytes_forwarded"] += t.nbytes
        return ForwardedExport(export, self.hold(upstream, record))
