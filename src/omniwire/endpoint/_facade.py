"""``Endpoint``: the public face of one pipeline stage.

The facade holds the configuration and the lifecycle and delegates each call
to the part that does the work::

    send/stream/end_stream ─► Sender (FanOut for several targets) ─► Outbox ─► ControlPlane (PUSH)
    ControlPlane (PULL/SUB) ─► Dispatcher ─► PeerTable / Receiver / Sender(ACKs)
    Receiver ─► Deliveries ─► receive() / deliveries() / requests() / async for

``aclose()`` is cancel-safe: whatever cancels its caller, it says Goodbye,
releases every object, stops the background tasks and closes backends and
sockets (unlinking segments and socket files) before it returns or the
cancellation goes on.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, overload

import torch

from ..addresses import parse_address
from ..backends.base import BackendBase
from ..delivery import SendReceipt
from ..errors import (
    ConfigurationError,
    OmniwireError,
)
from ..observe import Observer, as_observer
from ..ring import RingReader
from ..routing import Route, RoutingPolicy
from ._buffers import TransportBuffer
from ._config import OPTIONS, EndpointConfig, options_doc
from ._core import Core, State
from ._dispatch import Dispatcher
from ._lifecycle import Lifecycle
from ._peers import PeerTable
from ._receiver import Receiver
from ._receiving import Receiving
from ._records import InRecord, OutRecord, Peer
from ._sender import Kind, Sender
from ._stats import RouteStats
from ._targets import Targets

__all__ = ["Endpoint"]


class Endpoint(Receiving):
    """One stage of a pipeline: sends payloads and streams to peers, receives theirs.

    Args:
        name: this stage's name; peers address it by this name.
        {options}

    Every option is declared once, with its check, in
    :data:`omniwire.endpoint._config.OPTIONS` (this list is made from it).

    Raises:
        ConfigurationError: an option is unusable (``AddressError`` for an address,
            ``UnknownNameError`` for a backend, policy or route name), naming it.
    """

    def __init__(
        self,
        name: str,
        *,
        address: str | None = None,
        peers: Mapping[str, str] | None = None,
        policy: RoutingPolicy | str | None = None,
        routes: Mapping[str, str] | None = None,
        backends: Sequence[str] | None = None,
        backend_options: Mapping[str, Mapping[str, Any]] | None = None,
        max_inflight: int = 16,
        max_inflight_bytes: int = 1 << 30,
        ack_timeout: float = 30.0,
        handshake_timeout: float = 10.0,
        peer_timeout: float = 5.0,
        heartbeat_interval: float = 1.0,
        zero_copy: bool = False,
        receive_buffer: int = 64,
        receive_buffer_bytes: int = 1 << 30,
        unclaimed_timeout: float = 30.0,
        receive_window: int = 4 << 20,
        max_open_streams: int = 4096,
        stream_idle_timeout: float = 300.0,
        max_ack_timeouts: int = 3,
        allow_pickle: bool = False,
        auth_key: str | bytes | None = None,
        host_id: str | None = None,
        progressive_chunk: int = 16 << 20,
        max_peers: int = 256,
        control_ring: bool = True,
        digest: bool = False,
        resume_window: float = 30.0,
        observer: Observer | Sequence[Observer] | None = None,
    ) -> None:
        given = locals()
        cfg = EndpointConfig.build(name, {o.name: given[o.name] for o in OPTIONS})
        key = auth_key if auth_key is not None else os.environ.get("OMNIWIRE_AUTH_KEY") or None
        self._core = core = Core.assemble(cfg, key, as_observer(observer))
        self._peers = PeerTable(
            core, self._on_ready, self._on_gone, self._on_ring, self._on_forgotten
        )
        core.outbox.on_broken = self._on_broken
        trace = os.environ.get("OMNIWIRE_TRACE", "") not in ("", "0")
        self._sender = Sender(core, self._peers, trace)
        self._receiver = Receiver(core, self._peers)
        self._sender.holds = self._receiver.holds
        self._receiver.deliveries.replier = self
        self._targets = Targets(self._sender)
        self._dispatch = Dispatcher(core, self._peers, self._sender, self._receiver)
        self._life = Lifecycle(
            self, core, self._peers, self._sender, self._receiver, self._dispatch
        )
        #: Named event counts: every name of ``omniwire.endpoint.COUNTERS``, from 0 (another
        #: name raises ``UnknownNameError``).
        self.counters = core.counters

    # -- properties -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def address(self) -> str:
        """The bound control address (with the real port for ``tcp://host:0``)."""
        return self._core.control.address

    @property
    def instance(self) -> int:
        return self._core.instance

    @property
    def policy(self) -> RoutingPolicy:
        return self._core.config.policy

    @property
    def observer(self) -> Observer | None:
        """The observer given as ``observer=`` (several are combined into one)."""
        return self._core.observer

    @property
    def route_stats(self) -> dict[tuple[str, str, str], RouteStats]:
        """What each (peer, kind, backend) route carried."""
        return self._sender.route_stats

    # -- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> Endpoint:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None and self._core.state is State.OPEN:
                with contextlib.suppress(OmniwireError):
                    await self.drain(timeout=min(self._core.config.ack_timeout, 5.0))
        finally:
            await self.aclose()

    async def start(self) -> None:
        """Bind the control plane, start the backends, say Hello to the peers.

        Raises:
            ConfigurationError: run outside asyncio (omniwire needs pyzmq's asyncio).
            AddressInUseError: the address is served by a live process.
            BackendUnavailableError: a backend named in ``backends`` cannot run here.
            BackendError: a backend failed to start.
            OmniwireError: started twice.
        """
        await self._life.start()

    async def aclose(self, reason: str = "") -> None:
        """Close: say Goodbye to the peers, NACK what was not taken, fail what is in
        flight, release every buffer and segment, close the sockets. Idempotent and
        cancel-safe (everything is released even if the caller is cancelled)."""
        await self._life.aclose(reason)

    # -- peers ------------------------------------------------------------------------

    def add_peer(self, name: str, address: str) -> None:
        """Connect to a peer; the Hello exchange follows in the background.

        Raises:
            AddressError: ``address`` is not usable. ConfigurationError: ``name`` is ours.
            EndpointNotStartedError, EndpointClosedError.
        """
        self._core.check_open()
        if name == self.name:
            raise ConfigurationError(f"endpoint {name!r} cannot be its own peer")
        parse_address(address, what=f"add_peer({name!r})")
        self._peers.add(name, address)

    async def wait_peer(self, name: str, timeout: float | None = None) -> None:
        """Wait until ``name`` completed its handshake (also a peer not known yet).

        Raises:
            HandshakeError: it did not within ``timeout`` (default: handshake_timeout).
            PeerRefusedError: it refused this endpoint (e.g. ``NameClashError``).
            PeerLostError: it was lost and did not come back in time.
        """
        wait = self._core.config.handshake_timeout if timeout is None else timeout
        await self._peers.wait_ready(name, wait, unknown_ok=True)

    def peer_names(self) -> list[str]:
        """Peers that completed their handshake and are not lost or closed."""
        return [p.name for p in self._peers.ready()]

    # -- sending ----------------------------------------------------------------------

    async def empty(
        self,
        target: str,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        *,
        device: str = "cpu",
    ) -> TransportBuffer:
        """A tensor born in transport memory: sending it to ``target`` copies nothing.

        On one host it is a slot of this endpoint's shm arena (the receiver's
        zero-copy delivery is a view of it, a copy-mode delivery one copy); through
        mooncake or nixl a slot of the engine's registered pool (written from there
        into the peer's landing, or read in place; nothing registered per send);
        through another engine that reads lent memory
        in place it is ordinary memory, lent on every send. Send the tensor itself
        (``ep.send(target, buf.tensor, ...)``, or ``{"name": buf.tensor}``); write to it
        only when no send of it is in flight (``await buf.settled()``); give it back
        with ``buf.release()`` or use ``async with await ep.empty(...) as tensor:``.
        Another target on the same backend may be sent it too; any other route packs
        it (one copy) as usual.

        Raises:
            HandshakeError: ``target`` did not complete its Hello in time.
            NoRouteError, ShmFullError, BackendError, EndpointClosedError.
        """
        return await self._sender.buffers.empty(target, tuple(shape), dtype, device)

    @overload
    async def send(
        self,
        target: str,
        payload: Any,
        *,
        request_id: str,
        metadata: Any = None,
        lend: bool = False,
    ) -> SendReceipt: ...

    @overload
    async def send(
        self,
        target: Sequence[str],
        payload: Any,
        *,
        request_id: str,
        metadata: Any = None,
        lend: bool = False,
    ) -> list[SendReceipt]: ...

    async def send(
        self,
        target: str | Sequence[str],
        payload: Any,
        *,
        request_id: str,
        metadata: Any = None,
        lend: bool = False,
    ) -> SendReceipt | list[SendReceipt]:
        """Send one payload to ``target``, or to each of several targets (a fan-out).

        Returns once the data is handed off (packed into the backend's buffer and
        announced); the sender's buffer stays reserved until the ACK, which the
        returned receipt reports. Waits for a credit when too much is in flight.
        With ``lend=True`` an engine may read the payload's tensors in place (no
        pack copy): do not modify them until the receipt completes. A payload whose
        only tensor (however nested, beside any plain values) is a non-empty,
        contiguous CPU tensor lying in a zero-copy delivery not yet released is
        forwarded by reference (README "Forwarding by reference"). A large object
        announced in pieces (``progressive_chunk``) is finished even if the call is
        cancelled meanwhile: the call ends at once, and the rest of its pieces are
        still packed from the tensors — leave them alone until then too.

        A fan-out (``target`` a list of names) encodes the payload once and routes
        each target on its own: each gets its own route, credit and receipt
        (returned in target order). Targets on a backend that shares references
        (``Capabilities.shared_refs``: shm, mooncake, nixl) read one buffer, packed once and
        released when the last of them acknowledges; other backends get one export
        per target.

        Raises:
            TypeError: the payload holds a value the codec refuses (naming its path).
            ValueError: an empty fan-out, or a target named twice.
            HandshakeError: ``target`` did not complete its Hello in time
                (``PeerRefusedError`` if it refused this endpoint).
            NoRouteError: the policy found no backend for this edge.
            AckTimeoutError: no credit was granted within ``ack_timeout``.
            PeerLostError: the peer died, closed or hung (whenever it happened).
            RequestAbortedError, EndpointClosedError, BackendError.
            A fan-out raises on the first target that fails; the targets announced
            before it keep their data until their ACK.
        """
        if self._core.observer is None and isinstance(target, str):
            return await self._sender.send(target, payload, request_id, "payload", metadata, lend)
        return await self._targets.send("payload", target, payload, request_id, metadata, lend)

    @overload
    async def stream(
        self, target: str, chunk: Any, *, request_id: str, metadata: Any = None
    ) -> SendReceipt: ...

    @overload
    async def stream(
        self, target: Sequence[str], chunk: Any, *, request_id: str, metadata: Any = None
    ) -> list[SendReceipt]: ...

    async def stream(
        self, target: str | Sequence[str], chunk: Any, *, request_id: str, metadata: Any = None
    ) -> SendReceipt | list[SendReceipt]:
        """Send the next chunk of the stream ``request_id`` to ``target`` (in order),
        or to each of several targets (a fan-out, as in :meth:`send`).

        Raises: as :meth:`send`; ``PeerUnresponsiveError`` when an inline chunk is
        not taken within ``ack_timeout``.
        """
        if self._core.observer is None and isinstance(target, str):
            return await self._sender.send(
                target, chunk, request_id, "stream_chunk", metadata, False
            )
        return await self._targets.send("stream_chunk", target, chunk, request_id, metadata, False)

    async def end_stream(
        self,
        target: str | Sequence[str],
        *,
        request_id: str,
        error: str | None = None,
        metadata: Any = None,
    ) -> None:
        """End the stream ``request_id`` to ``target`` (or to each of several),
        optionally with an error.

        Raises: HandshakeError, PeerLostError (``PeerUnresponsiveError`` when the frame
        is not taken within ``ack_timeout``), RequestAbortedError, EndpointClosedError.
        Of several targets, every one is ended that can be, then the first target's
        error is raised.
        """
        await self._targets.end_stream(target, request_id, error, metadata)

    def route(self, target: str, payload: Any, kind: Kind = "payload") -> Route:
        """The route ``payload`` would take to ``target`` now, with the reasons.

        Raises:
            HandshakeError: ``target`` has not completed its Hello.
            NoRouteError: the policy found no backend.
        """
        return self._sender.route(target, payload, kind)

    async def abort(self, request_id: str, reason: str = "") -> None:
        """Abort ``request_id`` everywhere: pending sends fail wherever they wait,
        in-flight buffers are released on both sides, data of it that arrives later
        is refused, and every peer that has seen it here — sent data of it, or sent us
        some — hears of it directly and passes it on through the pipeline. Here, as
        there, every consumer of the request (``deliveries(request_id=…)``,
        ``receive(request_id=…)``, now or later) gets an ``aborted`` delivery and ends."""
        self._core.check_open()
        self._dispatch.abort(request_id, self.name, reason, via=None)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every object sent so far was acknowledged (or failed).

        Raises:
            DrainTimeoutError: some are still unacknowledged after ``timeout`` seconds.
        """
        await self._sender.ledger.drain(timeout)

    # -- introspection ----------------------------------------------------------------

    def backend(self, name: str) -> BackendBase:
        """The running backend instance ``name`` (for stats and tests)."""
        return self._core.backends[name]

    @property
    def running_backends(self) -> list[str]:
        return list(self._core.backends)

    def control_channel(self, peer: str) -> str:
        """How frames to ``peer`` travel now: ``"ring"`` (the same-host shared-memory
        ring, spec §3.6) or ``"zmq"`` (its socket); ``""`` for no such peer."""
        record = self._peers.get(peer)
        if record is None:
            return ""
        return "ring" if record.ring_writer is not None else "zmq"

    def in_flight(self) -> dict[str, tuple[int, int]]:
        """Per peer: (objects sent and not acknowledged, objects received and not acknowledged)."""
        out, inn = self._sender.ledger.in_flight(), self._receiver.in_flight()
        return {name: (out.get(name, 0), inn.get(name, 0)) for name in out.keys() | inn.keys()}

    # -- wiring -------------------------------------------------------------------------

    def _on_ready(self, peer: Peer) -> None:
        self._receiver.on_ready(peer)

    def _on_gone(
        self, peer: Peer, out: list[OutRecord], inn: list[InRecord], cause: str, error: Any
    ) -> None:
        self._sender.ledger.on_peer_gone(peer, out, error)
        self._receiver.on_peer_gone(peer, inn, cause, error)

    def _on_forgotten(self, name: str) -> None:
        self._sender.forget(name)
        if self._core.observer is not None:
            self._core.observer.peer_forgotten(self._core.name, name)

    def _on_broken(self, name: str, error: OmniwireError) -> None:
        """What was queued to ``name`` could not be sent: it is lost (nothing is
        dropped with the peer still reported alive)."""
        peer = self._peers.get(name)
        if peer is not None:
            self._peers.lose(peer, f"its control channel broke ({error})")

    def _on_ring(self, peer: Peer, reader: RingReader) -> None:
        self._dispatch.start_ring(peer, reader, peer.generation)


if Endpoint.__doc__:  # (None under python -OO)
    Endpoint.__doc__ = re.sub(
        r"^( *)\{options\}$",
        lambda m: options_doc(m.group(1)),
        Endpoint.__doc__,
        count=1,
        flags=re.M,
    )
