"""The peer table: handshake, liveness, loss and close (spec §4.1, §7).

Theory of operation
-------------------
A peer enters the table in two ways: ``peers=``/``add_peer`` (we connect a PUSH
to its address and keep connecting to it), or its own Hello (we validate the
Hello, then connect to the address it carries). Each time our PUSH to a peer
completes a ZeroMQ handshake we send it a Hello; each Hello that is not a
reply gets a reply. A peer is READY once its Hello was accepted (the rules are
in :mod:`._handshake`), every backend we share with it is connected and our
PUSH is up.

A peer ends as LOST (its process died, its connection stayed down for
``peer_timeout``, it took no frame for ``peer_timeout``) or CLOSED (it said
Goodbye). Either way every object in flight with it is handed to the sender
and receiver to release, and its sockets, monitor and tasks are released. A
peer we were configured with is connected again, so that its next instance
finds us; one we only learned from its Hello is forgotten.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import anyio

from .. import hostinfo, wire
from ..addresses import parse_address
from ..backends.base import PeerInfo
from ..capabilities import Locality
from ..control import PeerEvent
from ..errors import (
    AddressError,
    BackendError,
    HandshakeError,
    OmniwireError,
    PeerClosedError,
    PeerLostError,
    PeerUnresponsiveError,
    RemoteProtocolError,
)
from ..flow import Credits, ReceiveWindow, Window
from ..ring import RingReader
from ..routing import INLINE, INLINE_ANY, Candidate, Edge, RouteCache
from ._core import Core
from ._handshake import check_hello, hello_of, locality_of, peer_infos, refusal_error, refuse
from ._records import InRecord, OutRecord, Peer, PeerStatus
from ._rings import attach_ring, offer_ring

__all__ = ["PeerTable"]

log = logging.getLogger("omniwire.endpoint")

#: Called when a peer is gone: the peer, its objects in flight both ways, the
#: delivery cause ("peer_lost" / "peer_closed") and the error for the sender side.
GoneHook = Callable[[Peer, list[OutRecord], list[InRecord], str, PeerLostError], None]

_TOMBSTONES = 256  # lost/closed peers remembered (for their error messages)
#: Seconds between two restarts of one peer's session, at least: a Hello that would
#: restart it sooner is held back until then. A real restart or epoch bump follows a
#: crash or a declared loss, seconds apart; a peer re-sending Hellos with ever higher
#: epochs made each one tear the session down and build it again (0.3–1.3 ms of the
#: event loop per 400-byte frame).
RESTART_INTERVAL = 1.0
#: The most of a peer's window (spec §7.6) this endpoint uses, whatever the peer
#: grants: what is charged to it is ours to hold until the peer reads it (a peer
#: granting 2**64-1 bytes that never read its socket pinned gigabytes here).
SEND_WINDOW_MAX = 64 << 20
#: How long after its connection dropped a peer is declared lost (a Goodbye sent
#: just before its process closed the connection has this long to land).
LINK_DROP_GRACE = 0.25
#: Bytes of numbered frames kept for a peer until it acknowledges them (spec §10.7),
#: at most: its window bounds what it may have outstanding, and it acks at every tick.
RETAIN_MAX = 4 * SEND_WINDOW_MAX
#: Frames ZeroMQ may hold for a peer that grants no window (``window = 0``: a
#: writer predating spec §7.6, or one pretending to be): nothing else tells this
#: endpoint that such a peer reads. With the outbox's backlog bound, a peer that
#: never reads pins a few tens of MiB here until it is declared unresponsive
#: (``peer_timeout``); a granted window bounds the others.
NO_WINDOW_FRAMES = 8


class PeerTable:
    def __init__(
        self,
        core: Core,
        on_ready: Callable[[Peer], None],
        on_gone: GoneHook,
        on_ring: Callable[[Peer, RingReader], None],
        on_forgotten: Callable[[str], None],
    ) -> None:
        self.core = core
        self._on_ready = on_ready
        self._on_gone = on_gone
        self._on_ring = on_ring
        self._on_forgotten = on_forgotten  # a gone peer's record was dropped
        self._peers: dict[str, Peer] = {}
        self._changed = anyio.Event()  # a peer appeared

    # -- lookups -------------------------------------------------------------------

    def get(self, name: str) -> Peer | None:
        return self._peers.get(name)

    def all(self) -> list[Peer]:
        return list(self._peers.values())

    def ready(self) -> list[Peer]:
        return [p for p in self._peers.values() if p.status is PeerStatus.READY]

    def _new(self, name: str) -> Peer:
        cfg = self.core.config
        peer = Peer(
            name=name,
            session=wire.Session(
                local_name=cfg.name, peer_name=name, resumes=cfg.resume_window > 0
            ),
            credits=Credits(cfg.max_inflight, cfg.max_inflight_bytes),
            rwindow=ReceiveWindow(cfg.receive_window),
        )
        self._peers[name] = peer
        self._changed.set()
        self._changed = anyio.Event()
        return peer

    # -- connecting ------------------------------------------------------------------

    def add(self, name: str, address: str) -> Peer:
        """Connect to a configured peer (its Hello exchange follows in the background).

        Raises:
            AddressError: ``address`` is not usable.
        """
        address = str(parse_address(address, what=f"peers[{name!r}]"))
        peer = self._peers.get(name) or self._new(name)
        peer.configured = peer.address = address
        self._connect(peer)
        return peer

    def _connect(self, peer: Peer) -> None:
        """Open our PUSH (and its monitor) to ``peer.address`` once."""
        if peer.push_open or peer.address is None:
            return
        self.core.control.connect(peer.name, peer.address)  # AddressError: nothing opened
        peer.push_open = True
        peer.connected = False
        self.core.supervisor.spawn(self._watch, peer)

    def _disconnect(self, peer: Peer) -> None:
        self.core.control.disconnect(peer.name)
        self.core.control.unsubscribe(peer.name)
        peer.push_open = peer.connected = False

    async def _watch(self, peer: Peer) -> None:
        """Connection events of our PUSH to ``peer``, until it is closed."""
        async for event in self.core.control.events(peer.name):
            if event is PeerEvent.UP:
                self._link_up(peer)
            elif event is PeerEvent.DOWN:
                if peer.down_since is None:
                    peer.down_since = time.monotonic()
                if (
                    peer.status is PeerStatus.READY
                    and peer.ring_writer is None
                    and peer.session.resumption is None
                ):
                    # ZeroMQ reconnects, but what the closed connection's buffers
                    # held is gone: sends that returned may never arrive (spec §10.6)
                    peer.dropped_at = peer.dropped_at or time.monotonic()
                self._lost_if_dead(peer)
            elif event is PeerEvent.AUTH_FAILED:
                self._auth_failed(peer, "it refused our credentials (authentication key mismatch?)")
            elif event is PeerEvent.MECHANISM_MISMATCH:
                self._auth_failed(
                    peer,
                    "it runs without CURVE (no auth_key) and this endpoint has a key"
                    if self.core.control.key is not None
                    else "it requires CURVE authentication and this endpoint has no auth_key",
                )
            elif event is PeerEvent.HANDSHAKE_FAILED:
                # A peer closing mid-handshake cuts one short; a wrong CURVE key cuts
                # every one (the server cannot decrypt us and hangs up).
                peer.failed_handshakes += 1
                self.core.counters["handshakes_failed"] += 1
                if self.core.control.key is not None and peer.failed_handshakes >= 2:
                    self._auth_failed(
                        peer,
                        "it refused our credentials (every CURVE handshake fails: a "
                        "different auth_key?)",
                    )

    def _link_up(self, peer: Peer) -> None:
        """Our PUSH to ``peer`` completed a ZeroMQ handshake: say Hello. After a drop, a
        resuming session goes on (spec §10.7): its ACK deadlines waited with it, and what
        the dropped connection held is sent again."""
        down_since, peer.down_since = peer.down_since, None
        resumption = peer.session.resumption
        if down_since is not None:
            peer.relinked = True
            if resumption is not None:
                downtime = time.monotonic() - down_since
                for record in peer.session.outbound.values():
                    record.deadline += downtime
        peer.connected = True
        peer.auth_failure = ""
        peer.failed_handshakes = 0
        self.core.outbox.post(peer, hello_of(self.core, peer, reply=False))
        if resumption is not None and peer.ring_writer is None:
            self.core.counters["frames_resent"] += self.core.outbox.resend(peer)
            if down_since is not None:
                self.core.counters["sessions_resumed"] += 1
        self._maybe_ready(peer)

    def _auth_failed(self, peer: Peer, why: str) -> None:
        """A handshake failed for a reason of keys: tell the waiters, count, log (bounded)."""
        peer.auth_failure = why
        self.core.counters["auth_failed"] += 1
        self.core.noisy.warning("auth", "%s: %s %s", self.core.name, peer.name, why)
        peer.notify()

    # -- Hello, Refusal, Goodbye in ----------------------------------------------------

    def on_hello(self, hello: wire.HelloMessage) -> None:
        """Accept or refuse a Hello. Never raises for what a peer sent: a refusal is
        sent back (best effort) and counted."""
        refusal = check_hello(self.core, hello, self._peers.get(hello.endpoint), self.all())
        if refusal is not None:
            refuse(self.core, hello, *refusal)
            return
        peer = self._peers.get(hello.endpoint) or self._new(hello.endpoint)
        if peer.session.restarts(hello):
            if time.monotonic() - peer.accepted_at < RESTART_INTERVAL:
                if peer.held_hello is None:
                    self.core.counters["restarts_held"] += 1
                peer.held_hello = hello  # applied by tick() once the interval is over
                return
            peer.held_hello = None
        peer.heard_at = time.monotonic()  # a Hello is word from it too (``QUIET``)
        before = peer.hello
        resumption = peer.session.resumption
        old_token = resumption.peer_token if resumption is not None else 0
        outcome, lost_out, lost_in = peer.session.on_hello(hello)  # checked: cannot raise
        if outcome is wire.HelloOutcome.RESTART:
            restarted = before is None or before.instance != hello.instance
            reason = "it restarted" if restarted else "it had declared us lost (a partition)"
            self._end(peer, lost_out, lost_in, PeerStatus.LOST, reason, PeerLostError)
        if outcome is not wire.HelloOutcome.DUPLICATE:
            peer.window = Window(min(hello.window, SEND_WINDOW_MAX))
            peer.rwindow = ReceiveWindow(self.core.config.receive_window)
            peer.ack_timeouts = 0
            peer.relinked = False
            peer.generation += 1
            peer.status = PeerStatus.CONNECTING
            peer.hello_done = False
            peer.refusal = None
            peer.reason = ""
            peer.accepted_at = time.monotonic()
        if peer.address is None or not peer.configured:
            peer.address = str(parse_address(hello.address))
        self._connect(peer)
        if outcome is not wire.HelloOutcome.DUPLICATE and peer.push_open:
            self.core.control.limit_frames(peer.name, 0 if hello.window else NO_WINDOW_FRAMES)
        offered = offer_ring(self.core, peer, hello)
        if (
            outcome is wire.HelloOutcome.DUPLICATE
            and resumption is not None
            and hello.session not in (0, old_token)
        ):
            # the peer ended its side and numbers from 1 again: what it dropped comes
            # again, addressed to its new session (§10.7)
            self.core.counters["frames_resent"] += self.core.outbox.resend(peer, rekey=True)
        # after a restart our token is new: the peer must learn it, even from a reply
        restarted = outcome is wire.HelloOutcome.RESTART
        if not hello.is_reply or offered or restarted:
            self.core.outbox.post(peer, hello_of(self.core, peer, reply=True))
        attach_ring(self.core, peer, hello, self._on_ring)
        if outcome is not wire.HelloOutcome.DUPLICATE:
            self.core.supervisor.spawn(self._complete, peer, hello, peer.generation)

    def on_refusal(self, msg: wire.RefusalMessage) -> None:
        """A peer refused us: fail the waiters of the peer it concerns, at once."""
        core = self.core
        if msg.to_stage not in ("", core.name):
            raise RemoteProtocolError(f"Refusal from {msg.from_stage!r} for {msg.to_stage!r}")
        peer = self._peers.get(msg.addressed or msg.from_stage)
        if peer is None or peer.status is PeerStatus.READY:
            raise RemoteProtocolError(f"unexpected Refusal from {msg.from_stage!r} ({msg.code})")
        core.counters["refusals_received"] += 1
        peer.refusal = refusal_error(core, peer, msg)
        core.noisy.warning("refused", "%s: %s", core.name, peer.refusal)
        peer.notify()

    def on_goodbye(self, peer: Peer, msg: wire.GoodbyeMessage) -> None:
        out, inn = peer.session.on_goodbye(msg)
        reason = f"it closed ({msg.reason})" if msg.reason else "it closed"
        self._end(peer, out, inn, PeerStatus.CLOSED, reason, PeerClosedError)

    async def _complete(self, peer: Peer, hello: wire.HelloMessage, generation: int) -> None:
        """Connect the backends both ends run; then the peer may become READY."""
        core = self.core
        info: dict[str, PeerInfo] = {}
        for name, pinfo in peer_infos(core, hello).items():
            backend = core.backends[name]
            try:
                await backend.connect(pinfo)
            except (OmniwireError, OSError, ValueError) as exc:
                core.counters["backend_refused"] += 1
                core.noisy.warning(
                    "connect",
                    "%s: backend %s cannot serve %s: %s",
                    core.name,
                    name,
                    peer.name,
                    exc,
                )
                continue
            info[name] = pinfo
        if peer.generation != generation:  # lost or restarted meanwhile
            for name, pinfo in info.items():
                await core.backends[name].disconnect(pinfo)
            return
        peer.info = info
        locality = locality_of(core, hello)
        peer.edge = Edge(
            src=core.name,
            dst=peer.name,
            locality=locality,
            src_devices=frozenset(d.kind for d in core.devices),
            dst_devices=frozenset(d.kind for d in hello.devices) or frozenset({"cpu"}),
            gpu_peer_access=locality is not Locality.CROSS_HOST
            and hostinfo.gpu_peer_access(core.devices, hello.devices),
        )
        peer.candidates = (
            INLINE_ANY if peer.session.version >= (1, 1) else INLINE,
            *(
                Candidate(n, type(core.backends[n]).capabilities, type(core.backends[n]).summary)
                for n in info
            ),
        )
        peer.routes = RouteCache()
        if hello.abort_address:
            core.control.subscribe(peer.name, hello.abort_address)
        peer.hello_done = True
        self._maybe_ready(peer)

    def _maybe_ready(self, peer: Peer) -> None:
        if peer.status is PeerStatus.CONNECTING and peer.hello_done and peer.connected:
            peer.status = PeerStatus.READY
            peer.reason = ""
            peer.notify()
            self._on_ready(peer)

    # -- waiting for a peer ------------------------------------------------------------

    async def wait_ready(self, name: str, timeout: float, *, unknown_ok: bool = False) -> Peer:
        """The peer ``name`` once READY.

        Raises:
            HandshakeError: it is unknown (unless ``unknown_ok``), or not ready in time.
            PeerRefusedError: it refused this endpoint (NameClashError, PeerNameMismatchError).
            PeerLostError: it was lost (or closed) and did not come back in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            self.core.check_open()
            peer = self._peers.get(name)
            if peer is not None:
                if peer.status is PeerStatus.READY:
                    return peer
                if peer.refusal is not None:
                    raise peer.refusal
                if peer.status in (PeerStatus.LOST, PeerStatus.CLOSED) and not peer.configured:
                    raise self.gone_error(peer)
            elif not unknown_ok:
                raise HandshakeError(
                    f"{self.core.name!r} has no peer {name!r}: pass it in peers= or "
                    "add_peer(), or wait for it to connect (wait_peer)"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._not_ready_error(name, peer, timeout)
            event = peer.changed if peer is not None else self._changed
            with anyio.move_on_after(left):
                await event.wait()

    def gone_error(self, peer: Peer) -> PeerLostError:
        """The error of a send whose session with ``peer`` ended (its reason: never
        empty, also when the peer is back in a new session)."""
        if peer.status is PeerStatus.CLOSED:
            return PeerClosedError.of(peer.name, peer.reason, closed=True)
        if peer.status is PeerStatus.LOST:
            return PeerLostError.of(peer.name, peer.reason)
        return PeerLostError.of(peer.name, "the session the send began in ended")

    def _not_ready_error(self, name: str, peer: Peer | None, timeout: float) -> OmniwireError:
        if peer is None:
            return HandshakeError(f"no endpoint named {name!r} said Hello within {timeout:g} s")
        if peer.status in (PeerStatus.LOST, PeerStatus.CLOSED):
            error = self.gone_error(peer)
            return type(error)(f"{error} and did not come back within {timeout:g} s")
        if peer.auth_failure:
            detail = peer.auth_failure
        elif not peer.connected:
            detail = "no connection to its address"
        elif peer.hello is None:
            detail = "connected, but no HelloMessage received"
        else:
            detail = "its backends are still connecting"
        return HandshakeError(
            f"peer {name!r} at {peer.address or '?'} did not complete the handshake with "
            f"{self.core.name!r} within {timeout:g} s ({detail})"
        )

    # -- loss and close ------------------------------------------------------------------

    def lose(self, peer: Peer, reason: str, cls: type[PeerLostError] = PeerLostError) -> None:
        """Declare ``peer`` lost: release everything in flight with it."""
        if peer.status in (PeerStatus.LOST, PeerStatus.CLOSED):
            return
        peer.epoch += 1  # our next Hello tells the peer, should it not have noticed
        out, inn = peer.session.reset()
        self._end(peer, out, inn, PeerStatus.LOST, reason, cls)

    def remind(self, peer: Peer) -> None:
        """``peer`` still sends numbered frames of a session we ended (a loss it did not
        notice; its connection to us stayed up): reach it again, so that our Hello —
        its epoch higher — ends its side too (spec §10.6, §10.7), at most once per
        ``RESTART_INTERVAL``."""
        now = time.monotonic()
        if peer.status is not PeerStatus.LOST or peer.address is None:
            return
        if now - peer.reminded_at < RESTART_INTERVAL:
            return
        peer.reminded_at = now
        self.core.counters["peers_reminded"] += 1
        if peer.push_open and peer.connected:
            self.core.outbox.post(peer, hello_of(self.core, peer, reply=False))
        else:
            with contextlib.suppress(AddressError):
                self._connect(peer)  # its Hello goes when the link is up

    def _lost_if_dead(self, peer: Peer) -> bool:
        hello = peer.hello
        if hello is None or hello.host_id != self.core.host_id or hostinfo.pid_alive(hello.pid):
            return False
        self.lose(peer, f"its process (pid {hello.pid}) died")
        return True

    def _end(
        self,
        peer: Peer,
        out: list[OutRecord],
        inn: list[InRecord],
        status: PeerStatus,
        reason: str,
        cls: type[PeerLostError],
    ) -> None:
        core = self.core
        was_ready = peer.status is PeerStatus.READY
        peer.status = status
        peer.reason = reason
        cause = "peer_closed" if status is PeerStatus.CLOSED else "peer_lost"
        if status is PeerStatus.CLOSED:
            core.counters["peers_closed"] += 1
            log.info("%s: peer %s %s", core.name, peer.name, reason)
        elif was_ready or out or inn:
            core.counters["peers_lost"] += 1
            core.noisy.warning("lost", "%s: peer %s lost: %s", core.name, peer.name, reason)
        error = cls.of(peer.name, reason, closed=status is PeerStatus.CLOSED)
        self._on_gone(peer, out, inn, cause, error)
        for each in core.backends.values():
            each.peer_gone(peer.name)  # what it lent that peer comes back (landings)
        for name, pinfo in peer.info.items():
            backend = core.backends.get(name)
            if backend is not None:
                core.supervisor.spawn(backend.disconnect, pinfo)
        peer.info = {}
        peer.edge = None
        peer.routes = RouteCache()
        peer.chunk_ids.clear()
        peer.hello_done = False
        peer.down_since = None
        peer.dropped_at = None
        peer.generation += 1
        core.outbox.drop(peer.name, error)
        peer.close_rings()
        peer.ring_reading = False
        self._disconnect(peer)
        peer.notify()
        if peer.configured and core.state.value == "open":
            with contextlib.suppress(AddressError):  # checked when it was configured
                self._connect(peer)  # its next instance will find us

    def _forget(self, peer: Peer, reason: str) -> None:
        """Drop a peer learned from a Hello that never became reachable."""
        self.core.counters["peers_dropped"] += 1
        self.core.noisy.warning("drop", "%s: forgetting %s: %s", self.core.name, peer.name, reason)
        out, inn = peer.session.reset()
        self._end(peer, out, inn, PeerStatus.LOST, reason, PeerLostError)
        if self._peers.pop(peer.name, None) is not None:
            self._on_forgotten(peer.name)

    def _prune(self) -> None:
        gone = [
            p
            for p in self._peers.values()
            if p.status in (PeerStatus.LOST, PeerStatus.CLOSED) and not p.configured
        ]
        for peer in gone[: max(0, len(gone) - _TOMBSTONES)]:
            del self._peers[peer.name]
            self._on_forgotten(peer.name)

    def tick(self, now: float) -> None:
        """Liveness: a few times a second."""
        cfg = self.core.config
        self._prune()
        for peer in self.all():
            held = peer.held_hello
            if held is not None and now - peer.accepted_at >= RESTART_INTERVAL:
                peer.held_hello = None
                if peer.status not in (PeerStatus.LOST, PeerStatus.CLOSED):
                    self.on_hello(held)  # checked again, as if it came now
            if peer.status in (PeerStatus.LOST, PeerStatus.CLOSED):
                continue
            if peer.hello is not None and self._lost_if_dead(peer):
                continue
            ring = peer.ring_writer
            if ring is not None and ring.closed and peer.down_since is None:
                peer.down_since = now  # its reader closed: like a broken connection
            resumption = peer.session.resumption
            if resumption is not None:
                if resumption.received > resumption.ack_sent:
                    self.core.outbox.ack(peer)
                if resumption.retained_bytes > RETAIN_MAX:
                    self.lose(
                        peer,
                        f"it acknowledged none of {resumption.retained_bytes} bytes of frames "
                        f"sent to it (the limit is {RETAIN_MAX})",
                        PeerUnresponsiveError,
                    )
                    continue
                if peer.down_since is not None:
                    if now - peer.down_since > cfg.resume_window:
                        self.lose(
                            peer,
                            f"disconnected for more than resume_window ({cfg.resume_window:g} s)",
                        )
                    continue  # a blip: the session resumes when the link is back
            if peer.dropped_at is not None and now - peer.dropped_at >= LINK_DROP_GRACE:
                self.lose(
                    peer,
                    "its connection dropped (frames on their way may be lost; a new "
                    "session starts when it is back)",
                )
            elif peer.down_since is not None and now - peer.down_since > cfg.peer_timeout:
                self.lose(peer, f"disconnected for more than {cfg.peer_timeout:g} s")
            elif self.core.outbox.waiting_for(peer.name, now) > cfg.peer_timeout:
                detail = ""
                if peer.hello is not None and peer.hello.host_id == self.core.host_id:
                    state = hostinfo.process_state(peer.hello.pid)
                    detail = f"; its process (pid {peer.hello.pid}) is {state}"
                self.lose(
                    peer,
                    f"it took no frame for more than {cfg.peer_timeout:g} s{detail}",
                    PeerUnresponsiveError,
                )
            elif (
                not peer.configured
                and peer.status is PeerStatus.CONNECTING
                and now - peer.accepted_at > cfg.handshake_timeout
            ):
                self._forget(
                    peer, f"no connection to {peer.address} within {cfg.handshake_timeout:g} s"
                )

    def goodbye(self, reason: str) -> None:
        """Say Goodbye to every peer whose Hello we accepted and that can read it."""
        msg = wire.GoodbyeMessage(
            from_stage=self.core.name, instance=self.core.instance, reason=reason
        )
        for peer in self.all():
            live = peer.status not in (PeerStatus.LOST, PeerStatus.CLOSED)
            if (
                live
                and peer.hello is not None
                and peer.push_open
                and peer.session.version >= (1, 1)
            ):
                self.core.outbox.post(peer, msg)

    def close(self) -> None:
        """Wake every waiter and close the rings (the endpoint is closing; the control
        plane closes the sockets, giving queued frames — the Goodbyes — their linger)."""
        for peer in self.all():
            peer.close_rings()
            peer.notify()

    def connected_backend(self, peer: Peer, name: str) -> PeerInfo:
        info = peer.info.get(name)
        if info is None:
            raise BackendError(f"backend {name!r} is not connected to peer {peer.name!r}")
        return info
