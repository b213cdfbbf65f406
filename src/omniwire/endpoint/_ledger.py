"""The outbound ledger: what this endpoint has in flight to each peer, and what
ends it — the peer's ACK or NACK, an abort, the peer's loss, an ACK deadline, the
endpoint's close or drain (spec §7.1–§7.4). Each object's one record
(:class:`~._records.OutRecord`) is released here once its send posted it; the
sender (:mod:`._sender`) only adds to the ledger."""

from __future__ import annotations

import contextlib

import anyio

from .. import hops, hostinfo, wire
from ..errors import (
    AckTimeoutError,
    BackendError,
    DrainTimeoutError,
    EndpointClosedError,
    OmniwireError,
    PeerClosedError,
    PeerLostError,
    PeerUnresponsiveError,
    RequestAbortedError,
    reason_text,
)
from ._core import Core
from ._peers import PeerTable
from ._records import OutRecord, Peer, PeerStatus

__all__ = ["Ledger"]


class Ledger:
    def __init__(self, core: Core, peers: PeerTable) -> None:
        self.core = core
        self.peers = peers

    def missed(self, peer: Peer, what: str) -> None:
        """``peer`` missed a deadline (an ACK, a window): one more in a row. A peer on
        this host whose process is stopped, or one that missed ``max_ack_timeouts`` in a
        row, is declared unresponsive (its buffers come back); raises its error then."""
        cfg = self.core.config
        if peer.status is not PeerStatus.READY:
            return
        peer.ack_timeouts += 1
        hello = peer.hello
        detail = ""
        if hello is not None and hello.host_id == self.core.host_id:
            state = hostinfo.process_state(hello.pid)
            if state != "alive":
                detail = f"; its process (pid {hello.pid}) is {state}"
        if detail or peer.ack_timeouts >= cfg.max_ack_timeouts:
            self.core.counters["peers_unresponsive"] += 1
            self.peers.lose(
                peer,
                f"it missed {peer.ack_timeouts} {what} deadline(s) of {cfg.ack_timeout:g} s "
                f"in a row{detail}",
                PeerUnresponsiveError,
            )
            if what == "window":
                raise PeerUnresponsiveError.of(peer.name, peer.reason)

    def on_ack(self, peer: Peer, msg: wire.DataAckMessage) -> None:
        hops.mark("send: ACK in")
        record = peer.session.on_ack(msg)  # RemoteProtocolError if not in flight to it
        peer.ack_timeouts = 0
        if msg.success:
            record.release(None)
            return
        self.core.counters["nacks_received"] += 1
        error: OmniwireError
        if msg.reason == "aborted":
            error = RequestAbortedError(
                f"request {record.request_id!r} was aborted ({peer.name!r} refused object "
                f"{record.object_id})"
            )
        elif msg.reason == "receiver_closed":  # its NACKs come just before its Goodbye
            error = PeerClosedError(
                f"{peer.name!r} closed before it took object {record.object_id} of request "
                f"{record.request_id!r}"
            )
        else:
            error = BackendError(
                f"{peer.name!r} could not take object {record.object_id} of request "
                f"{record.request_id!r} ({msg.reason or 'internal'}): "
                f"{reason_text(msg.error, 'it gave no detail')}"
            )
            self.core.noisy.warning("nack", "%s: %s", self.core.name, error)
        record.release(error, "refused")

    def on_abort(self, request_id: str, error: RequestAbortedError) -> None:
        """Fail the receipts of the request (the buffers wait for the peers' NACKs) and
        forget its streams: no chunk of it goes anywhere again. Only the peers we sent
        data of it to can hold any (an abort of a request never seen costs nothing)."""
        for name in self.core.aborts.involved(request_id):
            peer = self.peers.get(name)
            if peer is None:
                continue
            peer.chunk_ids.pop(request_id, None)
            for record in peer.session.outbound_of(request_id):
                record.fail(error)

    def on_peer_gone(self, peer: Peer, records: list[OutRecord], error: PeerLostError) -> None:
        for record in records:
            record.release(error)
        self.core.aborts.cancel_peer(peer.name, error)

    def on_window(self, peer: Peer, msg: wire.WindowMessage) -> None:
        peer.session.check(msg)
        peer.window.reopen(msg.increment)

    def check_deadlines(self, now: float) -> None:
        """Fail the receipts of objects past their ACK deadline; a peer that missed
        ``max_ack_timeouts`` in a row is declared unresponsive (its buffers come back)."""
        cfg = self.core.config
        timeout = cfg.ack_timeout
        for peer in self.peers.all():
            if peer.down_since is not None and peer.session.resumption is not None:
                continue  # its session waits for the link (spec §10.7): so do deadlines
            for record in list(peer.session.outbound.values()):
                if now > record.deadline and not record.receipt.done():
                    record.fail(
                        AckTimeoutError(
                            f"peer {peer.name!r} did not acknowledge object {record.object_id} "
                            f"(request {record.request_id!r}, {record.length} bytes via "
                            f"{record.receipt.backend}) within {timeout:g} s; it may still be "
                            "delivered: receipt.settled() tells once its ACK or NACK comes"
                        )
                    )
                    self.missed(peer, "ACK")

    def close(self) -> None:
        error = EndpointClosedError(f"endpoint {self.core.name!r} closed")
        self.core.aborts.cancel_all(error)
        for peer in self.peers.all():
            for record in list(peer.session.outbound.values()):
                record.release(error)

    async def drain(self, timeout: float | None) -> None:
        pending = [
            (peer.name, record)
            for peer in self.peers.all()
            for record in list(peer.session.outbound.values())
        ]
        with anyio.move_on_after(timeout):
            for _, record in pending:
                with contextlib.suppress(OmniwireError):
                    await record.receipt.wait()
            return
        left = [f"{name}:{r.object_id}" for name, r in pending if not r.receipt.done()]
        raise DrainTimeoutError(
            f"{len(left)} object(s) still unacknowledged after {timeout:g} s: {', '.join(left[:8])}"
        )

    def in_flight(self) -> dict[str, int]:
        return {p.name: len(p.session.outbound) for p in self.peers.all()}
