"""``Endpoint``: the async API of omniwire — one stage of a pipeline.

Data flows one way through the layers::

    send(target, payload)
      → codec.dumps          header + tensors          (codec.py)
      → policy.select        a Route with its reasons  (routing.py)
      → credits              wait instead of growing memory
      → backend.allocate     a buffer                  (backends/)
      → packing.pack_into    one copy per tensor       (packing.py)
      → wire.encode          DataReady                 (wire/)
      → control.send         ZeroMQ                    (control.py)
    … peer: control.recv → wire.decode → Session.check → backend.open/fetch
            → packing.unpack → codec.loads → Delivery → user; DataAck back.

Each peer has a :class:`~omniwire.wire.Session` (its protocol state), credits,
and one worker that takes its DataReady messages in order, so stream chunks are
delivered in order. The receive loop never blocks: it decodes, checks and
queues. Blocking engine calls and large copies run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import sys
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import anyio
import torch
from anyio.abc import TaskGroup

from . import codec, hostinfo, packing, wire
from .backends.base import (
    THREAD_COPY_THRESHOLD,
    BackendBase,
    BackendContext,
    ByteBackend,
    Export,
    Locality,
    ObjectBackend,
    PeerInfo,
)
from .control import ControlPlane, CurveKey, PeerEvent
from .delivery import Delivery, DeliveryKind, SendReceipt
from .errors import (
    AckTimeoutError,
    BackendError,
    EndpointClosedError,
    HandshakeError,
    OmniwireError,
    PeerLostError,
    ProtocolError,
    RemoteProtocolError,
    RequestAbortedError,
    UnsupportedVersionError,
    WireFormatError,
)
from .flow import Credits
from .recvpool import RecvPool
from .registry import backend_status, backends, load_backend, load_policy
from .routing import INLINE, Candidate, DefaultPolicy, Edge, PayloadInfo, Route, RoutingPolicy
from .routing import StaticTablePolicy as _StaticTable

__all__ = ["Endpoint", "RouteStats"]

log = logging.getLogger("omniwire.endpoint")
route_log = logging.getLogger("omniwire.route")

Kind = Literal["payload", "stream_chunk"]


@dataclass
class RouteStats:
    """What one (peer, kind, backend) route carried, for ``omniwire demo`` and tests."""

    peer: str
    kind: str
    backend: str
    reason: str
    count: int = 0
    nbytes: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    #: The latest decision on this route, with every candidate's rejection.
    route: Route | None = None

    def latency_ms(self, q: float = 0.5) -> float | None:
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(eq=False)
class _Out:
    """Sender-side bookkeeping of one object in flight (``OutboundObject.data``)."""

    backend: BackendBase
    buffer: Export | None
    info: bytes
    receipt: SendReceipt
    credit: int
    deadline: float
    stats: RouteStats


@dataclass(eq=False)
class _In:
    """Receiver-side bookkeeping of one announced object (``InboundObject.data``)."""

    msg: wire.DataReadyMessage
    progressed: anyio.Event = field(default_factory=anyio.Event)
    opened: bool = False


@dataclass(eq=False)
class _Peer:
    name: str
    address: str | None
    session: wire.Session[_OutObj, _InObj]
    credits: Credits
    ready: anyio.Event = field(default_factory=anyio.Event)
    inbox: deque[wire.DataReadyMessage] = field(default_factory=deque)
    inbox_event: anyio.Event = field(default_factory=anyio.Event)
    info: dict[str, PeerInfo] = field(default_factory=dict)
    edge: Edge | None = None
    candidates: tuple[Candidate, ...] = ()
    chunk_ids: dict[str, int] = field(default_factory=dict)
    send_lock: anyio.Lock = field(default_factory=anyio.Lock)
    current: tuple[str, anyio.CancelScope] | None = None
    #: A message of this peer is being taken (by its worker or the receive loop).
    busy: bool = False
    route_cache: dict[PayloadInfo, Route] = field(default_factory=dict)
    down_since: float | None = None
    lost_reason: str = ""
    last_refusal: str = ""
    workers: int = 0

    @property
    def hello(self) -> wire.HelloMessage | None:
        return self.session.hello


_ABORT_MEMORY = 65536  # remembered aborted request ids


@dataclass(eq=False)
class _OutObj(wire.OutboundObject):
    data: Any = None


@dataclass(eq=False)
class _InObj(wire.InboundObject):
    data: Any = None


@contextlib.asynccontextmanager
async def _locked(lock: anyio.Lock) -> AsyncIterator[None]:
    """``async with lock``, without anyio's scheduling checkpoint when it is free:
    an uncontended send must not cost a trip around the event loop."""
    try:
        lock.acquire_nowait()
    except anyio.WouldBlock:
        await lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _default_address(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:32]
    base = os.path.join(tempfile.gettempdir(), f"omniwire-{os.getuid()}")
    return f"ipc://{base}/{safe}-{os.getpid()}-{secrets.token_hex(3)}"


def _host_of(address: str) -> str:
    """The host of an advertised control address (ipc:// means this host: loopback)."""
    if address.startswith("tcp://"):
        return address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1"


class Endpoint:
    """One stage of a pipeline: sends payloads and streams to peers, receives theirs.

    Args:
        name: this stage's name; peers address it by this name.
        address: where this endpoint receives frames: ``ipc:///path`` on one host,
            ``tcp://host:port`` across hosts. Default: a fresh ipc path.
        peers: ``{stage name: address}`` of the peers this endpoint sends to.
            Peers that send to it are learned from their Hello.
        policy: a :class:`~omniwire.routing.RoutingPolicy`, or the name of one in
            the ``omniwire.policies`` entry-point group. Default: ``DefaultPolicy``.
        routes: per-edge overrides, ``{"far": "nixl", "far:stream_chunk": "shm"}``
            (see :class:`~omniwire.routing.StaticTablePolicy`).
        backends: names of the backends to run. Default: every available backend
            that starts automatically (local, shm, cuda_ipc; mooncake and nixl too
            when ``address`` is ``tcp://``).
        backend_options: ``{backend name: {option: value}}``.
        max_inflight, max_inflight_bytes: credits per peer: objects and bytes sent
            and not yet acknowledged. A send waits for a credit.
        ack_timeout: seconds a peer has to acknowledge an object (and to grant a
            credit) before the send fails with ``AckTimeoutError``.
        handshake_timeout: seconds to wait for a peer's Hello before a send fails.
        peer_timeout: seconds a disconnected peer has to come back before it is
            declared lost (at once if it is on this host and its process died).
        heartbeat_interval: ZMTP heartbeat period; a silent connection is dropped
            after three periods.
        zero_copy: deliver views of the sender's memory, acknowledged on
            ``Delivery.release()``, instead of owned copies.
        receive_buffer, receive_buffer_bytes: undelivered deliveries this endpoint
            holds before it stops taking data (and so stops acknowledging).
        allow_pickle: accept (and allow sending) pickled header values. Only for
            trusted peers.
        auth_key: a shared secret; when set, the control plane runs ZMQ CURVE and
            refuses peers without the same key. Default: ``$OMNIWIRE_AUTH_KEY``.
        host_id: override the host identity (tests simulate hosts with it).
        progressive_chunk: large objects are announced in pieces of this size so a
            copy-mode receiver copies while the sender packs (0 disables; objects to
            zero-copy receivers are never split).
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
        allow_pickle: bool = False,
        auth_key: str | bytes | None = None,
        host_id: str | None = None,
        progressive_chunk: int = 16 << 20,
    ) -> None:
        wire.HelloMessage(  # validates the name early, with the wire's own rules
            endpoint=name,
            wire_min=(1, 0),
            wire_max=(1, 0),
            host_id="-",
            pid=0,
            process_token="-",
            instance=0,
            address="-",
        )
        self.name = name
        self._address = address or _default_address(name)
        if isinstance(policy, str):
            policy = load_policy(policy)
        base_policy: RoutingPolicy = policy if policy is not None else DefaultPolicy()
        self.policy: RoutingPolicy = _StaticTable(routes, base_policy) if routes else base_policy
        self._wanted_backends = list(backends) if backends is not None else None
        self._backend_options = {k: dict(v) for k, v in (backend_options or {}).items()}
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self.ack_timeout = ack_timeout
        self.handshake_timeout = handshake_timeout
        self.peer_timeout = peer_timeout
        self.zero_copy = zero_copy
        self.allow_pickle = allow_pickle
        self.progressive_chunk = progressive_chunk
        self.instance = secrets.randbits(63)
        self.host_id = host_id or hostinfo.host_id()
        key = auth_key if auth_key is not None else os.environ.get("OMNIWIRE_AUTH_KEY") or None
        self._control = ControlPlane(
            self._address,
            key=CurveKey.from_shared_secret(key) if key else None,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=3 * heartbeat_interval,
        )
        self._devices = hostinfo.local_devices()
        self._backends: dict[str, BackendBase] = {}
        self._peers: dict[str, _Peer] = {}
        self._initial_peers = dict(peers or {})
        self._object_ids = itertools.count(1)
        self._queue: deque[Delivery] = deque()
        self._queue_event = anyio.Event()
        self._budget = Credits(receive_buffer, receive_buffer_bytes)
        self._pool = RecvPool()
        self._outbox: deque[tuple[str, bytes]] = deque()
        self._outbox_event = anyio.Event()
        self._acks: deque[tuple[str, bytes]] = deque()
        self._acks_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._aborted: OrderedDict[str, float] = OrderedDict()
        self._send_scopes: dict[str, set[anyio.CancelScope]] = {}
        self._tg: TaskGroup | None = None
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self.route_stats: dict[tuple[str, str, str], RouteStats] = {}
        self.counters: dict[str, int] = {}
        self._trace = os.environ.get("OMNIWIRE_TRACE", "") not in ("", "0")
        self._routes_seen: set[tuple[str, str, str]] = set()

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        """The bound control address (with the real port for ``tcp://host:0``)."""
        return self._control.address

    async def __aenter__(self) -> Endpoint:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            with contextlib.suppress(Exception):
                await self.drain(timeout=min(self.ack_timeout, 5.0))
        await self.aclose()

    def _choose_backends(self) -> list[str]:
        if self._wanted_backends is not None:
            return self._wanted_backends
        tcp = self._address.startswith("tcp://")
        chosen = []
        for name in backends():
            entry = backend_status(name)
            if entry.status != "available" or entry.cls is None:
                continue
            auto = getattr(entry.cls, "auto_start", "always")
            if auto == "always" or (auto == "tcp" and tcp):
                chosen.append(name)
        return chosen

    async def start(self) -> None:
        """Bind the control plane, start the backends, say Hello to the peers.

        Use ``async with Endpoint(...)`` (or call ``start`` and ``aclose`` from the
        same task).

        Raises:
            BackendUnavailableError: a backend named in ``backends`` cannot run here.
            OmniwireError: the address cannot be bound.
        """
        if self._state != "new":
            raise OmniwireError(f"endpoint {self.name!r} was already started")
        self._state = "open"
        self._loop = asyncio.get_running_loop()  # zmq.asyncio needs asyncio anyway
        self._loop_thread = threading.get_ident()
        try:
            await self._control.start()
            for name in self._choose_backends():
                cls = load_backend(name)
                ctx = BackendContext(
                    endpoint=self.name,
                    instance=self.instance,
                    options=self._backend_options.get(name, {}),
                    host=_host_of(self._control.address),  # as peers dial us
                )
                backend = cls(ctx)
                await backend.start()
                self._backends[name] = backend
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            await self._close_resources()
            self._state = "closed"
            raise
        for loop in (self._recv_loop, self._abort_loop, self._outbox_loop, self._housekeeping_loop):
            self._spawn(loop)
        for peer, address in self._initial_peers.items():
            self.add_peer(peer, address)

    async def aclose(self) -> None:
        """Close: NACK what was not taken, fail what is in flight, release every
        buffer and segment, close the sockets. Idempotent."""
        if self._state in ("closing", "closed", "new"):
            self._state = "closed"
            return
        self._state = "closing"
        for peer in self._peers.values():
            self._drop_inbound(peer, "receiver closed")
        for d in self._queue:
            d.release()
            self._give_back_budget(d)
        self._queue.clear()
        for peer in list(self._peers.values()):
            self._fail_outbound(peer, EndpointClosedError(f"endpoint {self.name!r} closed"))
        self._flush_acks()
        with anyio.move_on_after(1.0, shield=True):
            await self._flush_outbox()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
        await self._close_resources()
        self._state = "closed"
        self._queue_event.set()

    async def _close_resources(self) -> None:
        with anyio.CancelScope(shield=True):
            for backend in self._backends.values():
                try:
                    await backend.aclose()
                except Exception:
                    log.exception("closing backend %s of %s", backend.name, self.name)
            await anyio.to_thread.run_sync(self._control.close)
        self._pool.clear()

    def _spawn(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` in the endpoint's task group; a crash is logged, not fatal."""

        async def guarded() -> None:
            try:
                await fn(*args)
            except Exception:
                self._count("internal_errors")
                log.exception("%s: background task %s failed", self.name, fn.__name__)

        assert self._tg is not None
        self._tg.start_soon(guarded)

    def _check_open(self) -> None:
        if self._state != "open":
            raise EndpointClosedError(f"endpoint {self.name!r} is {self._state}")

    def _count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    # ------------------------------------------------------------------ peers

    def add_peer(self, name: str, address: str) -> None:
        """Connect to a peer; the Hello exchange follows in the background."""
        self._check_open()
        if name == self.name:
            raise ValueError(f"endpoint {name!r} cannot be its own peer")
        peer = self._peer(name)
        peer.address = address
        self._connect(peer, address)

    def _peer(self, name: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            peer = _Peer(
                name=name,
                address=None,
                session=wire.Session(local_name=self.name, peer_name=name),
                credits=Credits(self.max_inflight, self.max_inflight_bytes),
            )
            self._peers[name] = peer
            self._spawn(self._peer_worker, peer)
        return peer

    def _connect(self, peer: _Peer, address: str) -> None:
        if self._control.has_peer(peer.name):
            return
        self._control.connect(peer.name, address)
        self._spawn(self._watch_peer, peer)

    def _hello(self, *, reply: bool) -> wire.HelloMessage:
        return wire.HelloMessage(
            endpoint=self.name,
            wire_min=(wire.WIRE_VERSION[0], 0),
            wire_max=wire.WIRE_VERSION,
            features=tuple(
                f for f, on in (("pickle", self.allow_pickle), ("zero_copy", self.zero_copy)) if on
            ),
            host_id=self.host_id,
            hostname=hostinfo.hostname(),
            pid=os.getpid(),
            process_token=hostinfo.process_token(),
            instance=self.instance,
            address=self.address,
            abort_address=self._control.abort_address,
            devices=self._devices,
            backends=tuple(
                wire.BackendInfo(name=n, info=b.hello()) for n, b in self._backends.items()
            ),
            is_reply=reply,
        )

    async def _watch_peer(self, peer: _Peer) -> None:
        async for event in self._control.events(peer.name):
            if event is PeerEvent.UP:
                peer.down_since = None
                await self._send_frame(peer.name, wire.encode(self._hello(reply=False)))
            elif event is PeerEvent.DOWN:
                if peer.down_since is None:
                    peer.down_since = time.monotonic()
                self._lost_if_dead(peer)
            elif event is PeerEvent.AUTH_FAILED:
                peer.last_refusal = (
                    "the peer refused our credentials (authentication key mismatch?)"
                )
                self._count("auth_failed")
                log.warning(
                    "%s: %s refused the handshake: %s", self.name, peer.name, peer.last_refusal
                )

    def _lost_if_dead(self, peer: _Peer) -> bool:
        """Declare ``peer`` lost if it runs on this host and its process is gone."""
        hello = peer.hello
        if hello is None or hello.host_id != self.host_id or hostinfo.pid_alive(hello.pid):
            return False
        self._peer_lost(peer, f"its process (pid {hello.pid}) died")
        return True

    async def wait_peer(self, name: str, timeout: float | None = None) -> None:
        """Wait until ``name`` completed its Hello.

        Raises:
            HandshakeError: it did not within ``timeout`` (default: handshake_timeout).
        """
        await self._ready_peer(name, self.handshake_timeout if timeout is None else timeout)

    async def _ready_peer(self, name: str, timeout: float) -> _Peer:
        self._check_open()
        peer = self._peers.get(name)
        if peer is None:
            raise HandshakeError(
                f"{self.name!r} has no peer {name!r}: pass it in peers= or add_peer(), "
                "or wait for it to connect"
            )
        if not peer.ready.is_set():
            with anyio.move_on_after(timeout):
                await peer.ready.wait()
            if not peer.ready.is_set():
                if peer.lost_reason:
                    raise PeerLostError(
                        f"peer {name!r} was lost ({peer.lost_reason}) and did not come back "
                        f"within {timeout:g} s"
                    )
                detail = peer.last_refusal or "no HelloMessage received"
                raise HandshakeError(
                    f"peer {name!r} at {peer.address or '?'} did not complete the handshake "
                    f"with {self.name!r} within {timeout:g} s ({detail})"
                )
        return peer

    def _peer_info(self, peer: _Peer, backend: str) -> PeerInfo:
        info = peer.info.get(backend)
        if info is None:
            raise BackendError(f"peer {peer.name!r} does not run backend {backend!r}")
        return info

    async def _complete_hello(self, peer: _Peer, hello: wire.HelloMessage) -> None:
        if hello.host_id != self.host_id:
            locality = Locality.CROSS_HOST
        elif hello.process_token == hostinfo.process_token():
            locality = Locality.SAME_PROCESS
        else:
            locality = Locality.SAME_HOST
        peer_backends = {b.name: b.info for b in hello.backends}
        kinds = tuple(sorted({d.kind for d in hello.devices} or {"cpu"}))
        shared = [n for n in self._backends if n in peer_backends]
        peer.info = {
            n: PeerInfo(
                name=hello.endpoint,
                instance=hello.instance,
                pid=hello.pid,
                host_id=hello.host_id,
                process_token=hello.process_token,
                locality=locality,
                info=peer_backends[n],
                devices=kinds,
                host=_host_of(hello.address),
            )
            for n in shared
        }
        local_kinds = frozenset(d.kind for d in self._devices)
        peer.edge = Edge(
            src=self.name,
            dst=peer.name,
            locality=locality,
            src_devices=local_kinds,
            dst_devices=frozenset(kinds),
            gpu_peer_access=locality is not Locality.CROSS_HOST
            and hostinfo.gpu_peer_access(self._devices, hello.devices),
        )
        peer.candidates = (
            INLINE,
            *tuple(
                Candidate(n, type(self._backends[n]).capabilities, type(self._backends[n]).summary)
                for n in shared
            ),
        )
        for n in shared:
            try:
                await self._backends[n].connect(peer.info[n])
            except Exception as exc:
                log.warning("%s: backend %s cannot reach %s: %s", self.name, n, peer.name, exc)
                peer.info.pop(n, None)
                peer.candidates = tuple(c for c in peer.candidates if c.name != n)
        self._control.subscribe(peer.name, hello.abort_address)
        peer.route_cache = {}  # new edge, new candidates
        peer.lost_reason = ""
        peer.ready.set()
        peer.inbox_event.set()

    # ------------------------------------------------------------------ frames in

    async def _recv_loop(self) -> None:
        while True:
            try:
                frame = await self._control.recv()
            except EndpointClosedError:
                return
            self._count("frames_received")
            peer = self._on_frame(frame, channel="control")
            if peer is None:
                continue
            if self._can_take_here(peer):
                # The fast path: nothing of this object waits on I/O or on another
                # frame, so take it now instead of waking the peer's worker.
                msg = peer.inbox.popleft()
                peer.busy = True
                try:
                    await self._take(peer, msg)
                finally:
                    peer.busy = False
            else:
                peer.inbox_event.set()

    def _can_take_here(self, peer: _Peer) -> bool:
        """Whether the only queued message of ``peer`` can be taken without waiting."""
        if peer.busy or len(peer.inbox) != 1 or not peer.ready.is_set():
            return False
        ref = peer.inbox[0].data_ref
        if ref is None:
            return True  # inline chunk, stream end, error
        backend = self._backends.get(ref.backend)
        if isinstance(backend, ObjectBackend):
            return True
        obj = peer.session.inbound.get(ref.object_id)
        return (
            isinstance(backend, ByteBackend)
            and type(backend).capabilities.mapped
            and obj is not None
            and obj.ready == obj.length
            and ref.layout == "packed"
            and ref.ref.length < THREAD_COPY_THRESHOLD
            and self._budget.would_admit(0 if self.zero_copy else ref.ref.length)
        )

    async def _abort_loop(self) -> None:
        while True:
            try:
                frame = await self._control.recv_abort()
            except EndpointClosedError:
                return
            self._on_frame(frame, channel="abort")

    def _on_frame(self, frame: bytes, channel: str) -> _Peer | None:
        """Decode and apply one frame; returns the peer whose inbox got a DataReady."""
        try:
            msg = wire.decode(frame)
        except UnsupportedVersionError as exc:
            self._count("version_refused")
            for peer in self._peers.values():
                if not peer.ready.is_set():
                    peer.last_refusal = f"refused a frame: {exc}"
            log.warning("%s refused a frame: %s", self.name, exc)
            return None
        except WireFormatError as exc:
            self._count("decode_errors")
            log.warning("%s dropped a malformed frame (%d bytes): %s", self.name, len(frame), exc)
            return None
        if channel == "abort" and not isinstance(msg, wire.AbortMessage):
            self._count("protocol_errors")
            log.warning("%s: %s on the abort channel ignored", self.name, type(msg).__name__)
            return None
        try:
            return self._dispatch(msg)
        except ProtocolError as exc:
            self._count("protocol_errors")
            log.warning("%s: %s", self.name, exc)
            return None

    def _dispatch(self, msg: wire.Message) -> _Peer | None:
        if isinstance(msg, wire.HelloMessage):
            self._on_hello(msg)
            return None
        if isinstance(msg, wire.BatchMessage | wire.GoodbyeMessage | wire.RefusalMessage):
            return None  # 1.1 messages: handled by the endpoint package that replaces this module
        peer = self._peers.get(msg.from_stage)
        if peer is None:
            raise RemoteProtocolError(f"{type(msg).__name__} from unknown peer {msg.from_stage!r}")
        if isinstance(msg, wire.DataReadyMessage):
            return peer if self._on_data_ready(peer, msg) else None
        elif isinstance(msg, wire.DataProgressMessage):
            obj = peer.session.on_progress(msg)
            obj.data.progressed.set()
        elif isinstance(msg, wire.DataAckMessage):
            self._on_ack(peer, peer.session.on_ack(msg), msg)
        elif isinstance(msg, wire.AbortMessage):
            peer.session.check(msg)
            self._on_abort(msg.request_id, msg.from_stage, msg.reason)
        return None

    def _on_hello(self, hello: wire.HelloMessage) -> None:
        if hello.endpoint == self.name:
            if hello.instance != self.instance:
                raise RemoteProtocolError(f"another endpoint also calls itself {self.name!r}")
            return
        peer = self._peer(hello.endpoint)
        outcome, lost_out, lost_in = peer.session.on_hello(hello)
        if outcome is wire._state.HelloOutcome.RESTART:
            log.info("%s: peer %s restarted; releasing its old objects", self.name, peer.name)
            self._release_lost(
                peer, lost_out, lost_in, PeerLostError(f"peer {peer.name!r} restarted")
            )
        if peer.address is None:
            peer.address = hello.address
        self._connect(peer, hello.address)
        if not hello.is_reply:
            self._send_nowait(peer.name, wire.encode(self._hello(reply=True)))
        if outcome is wire._state.HelloOutcome.RESTART:
            peer.ready = anyio.Event()
        if outcome is not wire._state.HelloOutcome.DUPLICATE:
            self._spawn(self._complete_hello, peer, hello)

    def _on_data_ready(self, peer: _Peer, msg: wire.DataReadyMessage) -> bool:
        """Queue a DataReady for the peer's worker; False if it was refused."""
        if msg.data_ref is not None:
            ref = msg.data_ref
            ready = ref.ref.length if ref.ready is None else ref.ready
            peer.session.on_data_ready(
                msg, _InObj(ref.object_id, msg.request_id, ref.ref.length, ready, _In(msg))
            )
        else:
            peer.session.check(msg)
        limit = 4 * self.max_inflight + self._budget.max_count
        if len(peer.inbox) >= limit and msg.data_ref is not None:
            self._count("inbox_full")
            self._nack(peer, msg.data_ref.object_id, "receiver queue full")
            return False
        peer.inbox.append(msg)
        return True

    # ------------------------------------------------------------------ receiving

    async def _peer_worker(self, peer: _Peer) -> None:
        while True:
            if not peer.inbox or not peer.ready.is_set():
                peer.inbox_event = anyio.Event()
                await peer.inbox_event.wait()
                continue
            if peer.busy:  # the receive loop is taking one: keep the order
                peer.inbox_event = anyio.Event()
                await peer.inbox_event.wait()
                continue
            msg = peer.inbox.popleft()
            peer.busy = True
            try:
                await self._take(peer, msg)
            except Exception as exc:  # a bug must not kill the peer's worker
                log.exception("%s: failed to take data from %s", self.name, peer.name)
                self._count("internal_errors")
                if msg.data_ref is not None:
                    self._nack(peer, msg.data_ref.object_id, f"receiver error: {exc}")
            finally:
                peer.busy = False

    async def _take(self, peer: _Peer, msg: wire.DataReadyMessage) -> None:
        rid = msg.request_id
        ref = msg.data_ref
        if rid in self._aborted:
            if ref is not None:
                self._nack(peer, ref.object_id, "request aborted")
            return
        metadata = None
        if msg.metadata:
            try:
                metadata = codec.loads(msg.metadata, [])
            except WireFormatError as exc:
                if ref is not None:
                    self._nack(peer, ref.object_id, f"bad metadata: {exc}")
                await self._deliver(Delivery("error", rid, peer.name, msg.chunk_id, error=str(exc)))
                return
        if msg.error is not None:
            await self._deliver(
                Delivery("error", rid, peer.name, msg.chunk_id, metadata=metadata, error=msg.error)
            )
        elif msg.inline is not None:
            await self._take_inline(peer, msg, metadata)
        elif ref is not None:
            await self._take_ref(peer, msg, ref, metadata)
        if msg.is_done:
            await self._deliver(
                Delivery("stream_end", rid, peer.name, msg.chunk_id, metadata=metadata)
            )

    async def _take_inline(self, peer: _Peer, msg: wire.DataReadyMessage, metadata: Any) -> None:
        inline = msg.inline
        assert inline is not None
        try:
            tensors = packing.unpack(bytearray(inline.data), inline.tensors, copy=False)
            value = codec.loads(inline.header, tensors, allow_pickle=self.allow_pickle)
        except WireFormatError as exc:
            self._count("decode_errors")
            await self._deliver(
                Delivery("error", msg.request_id, peer.name, msg.chunk_id, error=str(exc))
            )
            return
        nbytes = sum(t.nbytes for t in inline.tensors)
        await self._deliver(
            Delivery(
                "stream_chunk",
                msg.request_id,
                peer.name,
                msg.chunk_id,
                value,
                metadata,
                backend="inline",
                nbytes=nbytes,
            )
        )

    async def _take_ref(
        self, peer: _Peer, msg: wire.DataReadyMessage, ref: wire.DataRef, metadata: Any
    ) -> None:
        kind: DeliveryKind = "payload" if ref.kind == "payload" else "stream_chunk"
        obj = peer.session.inbound.get(ref.object_id)
        if obj is None:  # dropped meanwhile (abort, peer lost)
            return
        backend = self._backends.get(ref.backend)
        budget = 0 if self.zero_copy else ref.ref.length
        taken: tuple[Any, Any] | None = None
        error: str | None = None
        with anyio.CancelScope() as scope:
            peer.current = (msg.request_id, scope)
            try:
                if backend is None:
                    raise BackendError(f"backend {ref.backend!r} is not running on {self.name!r}")
                await self._budget.acquire(budget)
                try:
                    taken = await self._fetch(peer, backend, ref, obj)
                except BaseException:
                    self._budget.release(budget)
                    raise
            except (OmniwireError, TypeError, ValueError, RuntimeError) as exc:
                self._count("backend_errors" if isinstance(exc, BackendError) else "receive_errors")
                error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "%s: cannot take object %d from %s: %s",
                    self.name,
                    ref.object_id,
                    peer.name,
                    error,
                )
            finally:
                peer.current = None
        if scope.cancelled_caught:
            reason = "request aborted" if msg.request_id in self._aborted else "receiver closing"
            self._nack(peer, ref.object_id, reason)
            return
        if taken is None:
            self._nack(peer, ref.object_id, error or "not taken")
            await self._deliver(
                Delivery(
                    "error",
                    msg.request_id,
                    peer.name,
                    msg.chunk_id,
                    metadata=metadata,
                    error=error,
                    backend=ref.backend,
                )
            )
            return
        value, release = taken
        await self._deliver(
            Delivery(
                kind,
                msg.request_id,
                peer.name,
                msg.chunk_id,
                payload=value,
                metadata=metadata,
                backend=ref.backend,
                nbytes=ref.ref.length,
                _on_release=release,
                _budget=budget,
            )
        )

    async def _wait_ready(self, obj: _InObj, done: int) -> int:
        """Wait until the sender announced bytes past ``done``; return the new ``ready``."""
        while obj.ready <= done:
            state: _In = obj.data
            state.progressed = anyio.Event()
            with anyio.move_on_after(self.ack_timeout):
                await state.progressed.wait()
            if obj.ready <= done and not state.progressed.is_set():
                raise BackendError(
                    f"sender made no progress on object {obj.object_id} for {self.ack_timeout:g} s"
                )
        return obj.ready

    async def _fetch(
        self, peer: _Peer, backend: BackendBase, ref: wire.DataRef, obj: _InObj
    ) -> tuple[Any, Any]:
        """Take an object's data. Returns the payload and, in zero-copy mode, the
        callback that releases it; otherwise the object is acknowledged here."""
        info = self._peer_info(peer, ref.backend)
        oid = ref.object_id
        if isinstance(backend, ObjectBackend):
            if ref.layout != "object":
                raise BackendError(
                    f"backend {ref.backend} expects layout 'object', got {ref.layout!r}"
                )
            imp = await backend.import_(info, ref.ref.info, 0)
            value = imp.value
            imp.close()
            self._ack(peer, oid)
            return value, None
        assert isinstance(backend, ByteBackend)
        length = ref.ref.length
        inb = await backend.import_(info, ref.ref.info, length)
        state: _In = obj.data
        state.opened = True
        try:
            if ref.layout == "per_tensor":
                await inb.fetch(0, length)
                tensors = list(inb.tensors or [])
                if not self.zero_copy:
                    tensors = [t.clone() for t in tensors]
            else:
                dest = None if self.zero_copy else self._receive_buffer(inb, length)
                done = 0
                while done < length:
                    ready = await self._wait_ready(obj, done)
                    await inb.fetch(done, ready, dest)
                    done = ready
                source = dest if dest is not None else inb.buffer
                if source is None:
                    if length:
                        raise BackendError(
                            f"backend {ref.backend} opened no buffer for object {oid}"
                        )
                    source = torch.empty(0, dtype=torch.uint8)  # a payload with no tensor bytes
                tensors = packing.unpack(source, ref.tensors, copy=False)
            value = codec.loads(ref.header, tensors, allow_pickle=self.allow_pickle)
        except BaseException:
            inb.close()
            raise
        if not self.zero_copy:
            inb.close()
            self._ack(peer, oid)
            return value, None
        instance = info.instance

        request_id = obj.request_id

        def release() -> None:
            inb.close()
            current = self._peers.get(peer.name)
            if (
                current is not None
                and current.hello is not None
                and current.hello.instance == instance
            ):
                aborted = request_id in self._aborted
                self._ack(current, oid, "request aborted" if aborted else None)

        return value, release

    def _receive_buffer(self, inb: Any, length: int) -> torch.Tensor:
        """Where a copy-mode delivery lands: the receiving GPU when the backend
        delivers to one, else a warm host buffer from the pool."""
        device = inb.buffer.device if inb.buffer is not None else None
        if device is not None and device.type != "cpu":
            return torch.empty(length, dtype=torch.uint8, device=device)
        return self._pool.take(length)

    async def _deliver(self, delivery: Delivery) -> None:
        self._queue.append(delivery)
        self._queue_event.set()

    def _ack(self, peer: _Peer, object_id: int, error: str | None = None) -> None:
        obj = peer.session.close_inbound(object_id)
        if obj is None:
            return  # already acknowledged or dropped
        state: _In = obj.data
        ref = state.msg.data_ref
        if not state.opened and ref is not None:  # refused unopened: a two-sided engine
            backend = self._backends.get(ref.backend)  # must still consume it
            info = peer.info.get(ref.backend)
            if backend is not None and info is not None and backend.capabilities.two_sided:
                self._spawn(self._consume, backend, info, ref)
        msg = wire.DataAckMessage(
            object_id=object_id,
            from_stage=self.name,
            to_stage=peer.name,
            success=error is None,
            error=error,
        )
        self._count("acks_sent" if error is None else "nacks_sent")
        self._send_soon(peer.name, wire.encode(msg))

    async def _consume(self, backend: BackendBase, info: PeerInfo, ref: wire.DataRef) -> None:
        with contextlib.suppress(OmniwireError):
            (await backend.import_(info, ref.ref.info, ref.ref.length)).close()

    def _nack(self, peer: _Peer, object_id: int, error: str) -> None:
        self._ack(peer, object_id, error[: wire.MAX_TEXT_BYTES // 4])

    async def receive(self) -> Delivery:
        """The next delivery (payloads, stream chunks, stream ends, errors, aborts).

        Raises:
            EndpointClosedError: the endpoint is closed.
        """
        while True:
            if self._queue:
                delivery = self._queue.popleft()
                self._give_back_budget(delivery)
                return delivery
            if self._state != "open":
                raise EndpointClosedError(f"endpoint {self.name!r} is closed")
            self._queue_event = anyio.Event()
            await self._queue_event.wait()

    def _give_back_budget(self, delivery: Delivery) -> None:
        if delivery._budget is not None:
            self._budget.release(delivery._budget)
            delivery._budget = None

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delivery]:
        while True:
            try:
                yield await self.receive()
            except EndpointClosedError:
                return

    # ------------------------------------------------------------------ sending

    async def send(
        self,
        target: str,
        payload: Any,
        *,
        request_id: str,
        metadata: Any = None,
        lend: bool = False,
    ) -> SendReceipt:
        """Send one payload to ``target``.

        Returns once the data is handed off (packed into the backend's buffer and
        announced); the sender's buffer stays reserved until the ACK, which the
        returned receipt reports. Waits for a credit when too much is in flight.

        Raises:
            TypeError: the payload holds a value the codec refuses (naming its path).
            HandshakeError: ``target`` did not complete its Hello in time.
            NoRouteError: the policy found no backend for this edge.
            AckTimeoutError: no credit was granted within ``ack_timeout``.
            PeerLostError, RequestAbortedError, EndpointClosedError, BackendError.
        """
        return await self._send(target, payload, request_id, "payload", metadata, lend)

    async def stream(
        self, target: str, chunk: Any, *, request_id: str, metadata: Any = None
    ) -> SendReceipt:
        """Send the next chunk of the stream ``request_id`` to ``target`` (in order).

        Raises: as :meth:`send`.
        """
        return await self._send(target, chunk, request_id, "stream_chunk", metadata)

    async def end_stream(
        self, target: str, *, request_id: str, error: str | None = None, metadata: Any = None
    ) -> None:
        """End the stream ``request_id`` to ``target`` (optionally with an error)."""
        self._check_open()
        peer = await self._ready_peer(target, self.handshake_timeout)
        chunk_id = peer.chunk_ids.pop(request_id, 0)
        msg = wire.DataReadyMessage(
            request_id=request_id,
            from_stage=self.name,
            to_stage=target,
            chunk_id=chunk_id,
            is_done=True,
            error=error,
            metadata=self._metadata(metadata),
        )
        async with _locked(peer.send_lock):
            await self._send_frame(target, wire.encode(msg))

    def _metadata(self, metadata: Any) -> bytes:
        if metadata is None:
            return b""
        enc = codec.dumps(metadata, allow_pickle=self.allow_pickle)
        if enc.tensors:
            raise TypeError(f"metadata cannot hold tensors (found {enc.paths[0]})")
        return enc.header

    def route(self, target: str, payload: Any, kind: Kind = "payload") -> Route:
        """The route ``payload`` would take to ``target`` now, with the reasons.

        Raises:
            HandshakeError: ``target`` has not completed its Hello.
            NoRouteError: the policy found no backend.
        """
        peer = self._peers.get(target)
        if peer is None or peer.edge is None:
            raise HandshakeError(f"no completed handshake with {target!r}")
        enc = codec.dumps(payload, allow_pickle=self.allow_pickle)
        layout = packing.plan(enc.tensors)
        return self._select(peer, self._payload_info(kind, enc.tensors, layout))

    @staticmethod
    def _payload_info(
        kind: Kind, tensors: list[torch.Tensor], layout: packing.PackPlan
    ) -> PayloadInfo:
        return PayloadInfo(
            kind, layout.nbytes, frozenset(t.device.type for t in tensors), len(tensors)
        )

    def _select(self, peer: _Peer, info: PayloadInfo) -> Route:
        assert peer.edge is not None
        # Policies are pure functions of their inputs, so a decision can be reused
        # for the same edge and payload shape (the cache is per peer instance).
        cache = peer.route_cache
        route = cache.get(info)
        if route is None:
            route = self.policy.select(peer.edge, info, peer.candidates)
            if len(cache) >= 256:
                cache.clear()
            cache[info] = route
        key = (peer.name, info.kind, route.backend)
        level = logging.DEBUG
        if key not in self._routes_seen:
            self._routes_seen.add(key)
            level = logging.INFO
        if route_log.isEnabledFor(level):
            route_log.log(level, "%s→%s %s: %s", self.name, peer.name, info.kind, route.explain())
        if self._trace:
            print(
                f"[omniwire] route {self.name}→{peer.name} {info.kind}: {route.explain()}",
                file=sys.stderr,
            )
        return route

    def _stats(self, peer: str, kind: str, route: Route) -> RouteStats:
        key = (peer, kind, route.backend)
        stats = self.route_stats.get(key)
        if stats is None:
            stats = self.route_stats[key] = RouteStats(peer, kind, route.backend, route.reason)
        stats.route = route
        return stats

    @contextlib.contextmanager
    def _interruptible(self, peer: _Peer, request_id: str) -> Any:
        """Cancel the enclosed wait if the request is aborted or the peer lost."""
        with anyio.CancelScope() as scope:
            for key in (request_id, "peer:" + peer.name):
                self._send_scopes.setdefault(key, set()).add(scope)
            try:
                yield scope
            finally:
                for key in (request_id, "peer:" + peer.name):
                    scopes = self._send_scopes.get(key)
                    if scopes is not None:
                        scopes.discard(scope)
                        if not scopes:
                            del self._send_scopes[key]
        if scope.cancelled_caught:
            if request_id in self._aborted:
                raise RequestAbortedError(f"request {request_id!r} was aborted")
            if self._state != "open":
                raise EndpointClosedError(f"endpoint {self.name!r} closed")
            raise PeerLostError(f"peer {peer.name!r} was lost: {peer.lost_reason}")

    async def _send(
        self,
        target: str,
        payload: Any,
        request_id: str,
        kind: Kind,
        metadata: Any,
        lend: bool = False,
    ) -> SendReceipt:
        self._check_open()
        if request_id in self._aborted:
            raise RequestAbortedError(f"request {request_id!r} was aborted")
        enc = codec.dumps(payload, allow_pickle=self.allow_pickle)
        meta = self._metadata(metadata)
        peer = await self._ready_peer(target, self.handshake_timeout)
        layout = packing.plan(enc.tensors, enc.paths)
        route = self._select(peer, self._payload_info(kind, enc.tensors, layout))
        stats = self._stats(target, kind, route)
        chunk_id = 0
        if kind == "stream_chunk":
            chunk_id = peer.chunk_ids.get(request_id, 0)
            peer.chunk_ids[request_id] = chunk_id + 1
        if route.backend == "inline":
            data = bytearray(layout.nbytes)
            packing.pack_into(data, enc.tensors, layout)
            msg = wire.DataReadyMessage(
                request_id=request_id,
                from_stage=self.name,
                to_stage=target,
                chunk_id=chunk_id,
                inline=wire.InlineStreamChunkRef(
                    header=enc.header, tensors=layout.metas, data=bytes(data)
                ),
                metadata=meta,
            )
            started = time.monotonic()
            async with _locked(peer.send_lock):
                await self._send_frame(target, wire.encode(msg))
            stats.count += 1
            stats.nbytes += layout.nbytes
            stats.latencies.append(time.monotonic() - started)
            return SendReceipt.completed(target, request_id, "inline", layout.nbytes)
        backend = self._backends[route.backend]
        receipt = SendReceipt(target, request_id, None, route.backend, layout.nbytes)
        with self._interruptible(peer, request_id):
            if not peer.credits.try_acquire(layout.nbytes):
                with anyio.move_on_after(self.ack_timeout) as credit_wait:
                    await peer.credits.acquire(layout.nbytes)
                if credit_wait.cancelled_caught:
                    raise AckTimeoutError(
                        f"no credit to send to {target!r} within {self.ack_timeout:g} s: "
                        f"{peer.credits.count} objects ({peer.credits.bytes} bytes) are "
                        "unacknowledged"
                    )
            try:
                await self._announce(
                    peer,
                    backend,
                    enc,
                    layout,
                    route,
                    request_id,
                    kind,
                    chunk_id,
                    meta,
                    payload,
                    receipt,
                    stats,
                    lend,
                )
            except BaseException:
                if receipt.object_id is None or receipt.object_id not in peer.session.outbound:
                    peer.credits.release(layout.nbytes)
                raise
        return receipt

    async def _pack(
        self,
        dest: torch.Tensor,
        tensors: list[torch.Tensor],
        layout: packing.PackPlan,
        lo: int,
        hi: int,
    ) -> None:
        if hi - lo < THREAD_COPY_THRESHOLD:
            packing.pack_into(dest, tensors, layout, lo, hi)
            return
        cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
        if cuda is None and dest.device.type != "cuda":
            await anyio.to_thread.run_sync(packing.pack_into, dest, tensors, layout, lo, hi)
            return
        # CUDA copies are ordered on a stream, and the current stream is per thread:
        # pack in the worker on the caller's stream, after the work that made the tensors.
        stream = torch.cuda.current_stream(cuda if cuda is not None else dest.device)

        def pack_on_stream() -> None:
            with torch.cuda.stream(stream):
                packing.pack_into(dest, tensors, layout, lo, hi)

        await anyio.to_thread.run_sync(pack_on_stream)

    async def _announce(
        self,
        peer: _Peer,
        backend: BackendBase,
        enc: codec.Encoded,
        layout: packing.PackPlan,
        route: Route,
        request_id: str,
        kind: Kind,
        chunk_id: int,
        meta: bytes,
        payload: Any,
        receipt: SendReceipt,
        stats: RouteStats,
        lend: bool = False,
    ) -> None:
        info = self._peer_info(peer, route.backend)
        object_id = next(self._object_ids)
        receipt.object_id = object_id
        record = _Out(
            backend, None, b"", receipt, layout.nbytes, time.monotonic() + self.ack_timeout, stats
        )
        points = [layout.nbytes]
        announced = False
        try:  # from here on, whatever goes wrong frees what was taken
            if isinstance(backend, ObjectBackend):
                exp = backend.export_object(info, payload)
                record.buffer = exp
                record.info = exp.ref
                ref = wire.DataRef(
                    object_id=object_id,
                    kind=kind,
                    backend=backend.name,
                    layout="object",
                    ref=wire.BackendRef(backend=backend.name, info=record.info, length=0),
                )
            else:
                assert isinstance(backend, ByteBackend)
                device = next((str(t.device) for t in enc.tensors if t.device.type != "cpu"), "cpu")
                out = await backend.export_tensors(info, enc.tensors, lent=lend)
                if out is None:
                    out = await backend.export(info, layout.nbytes, device)
                    record.buffer = out
                    if (
                        type(backend).capabilities.progressive
                        and self.progressive_chunk > 0
                        and "zero_copy" not in (peer.hello.features if peer.hello else ())
                    ):  # a zero-copy receiver copies nothing: announcing in pieces buys nothing
                        points = packing.split_points(enc.tensors, layout, self.progressive_chunk)
                    assert out.buffer is not None
                    await self._pack(out.buffer, enc.tensors, layout, 0, points[0])
                record.buffer = out
                record.info = out.ref
                first = points[0]
                ref = wire.DataRef(
                    object_id=object_id,
                    kind=kind,
                    backend=backend.name,
                    layout=out.layout,
                    ref=wire.BackendRef(
                        backend=backend.name, info=record.info, length=layout.nbytes
                    ),
                    header=enc.header,
                    tensors=layout.metas,
                    ready=first if first < layout.nbytes else None,
                )
            frame = wire.encode(
                wire.DataReadyMessage(
                    request_id=request_id,
                    from_stage=self.name,
                    to_stage=peer.name,
                    chunk_id=chunk_id,
                    data_ref=ref,
                    metadata=meta,
                )
            )
            # publish + announce under the peer's lock: a two-sided engine (nccl) pairs
            # sends and receives in order, so both must happen in DataReady order.
            async with _locked(peer.send_lock):
                peer.session.announce(
                    _OutObj(object_id, request_id, layout.nbytes, points[0], record)
                )
                announced = True
                if record.buffer is not None and record.buffer.layout == "packed":
                    assert isinstance(backend, ByteBackend)
                    await record.buffer.publish(0, points[0])
                await self._send_frame(peer.name, frame)
        except BaseException:
            if announced:
                peer.session.forget_outbound(object_id)
            self._free(record)
            raise
        out = record.buffer
        stats.count += 1
        stats.nbytes += layout.nbytes
        if len(points) > 1:
            assert out is not None and out.buffer is not None and isinstance(backend, ByteBackend)
            for lo, hi in itertools.pairwise(points):
                if object_id not in peer.session.outbound:
                    return  # lost or aborted meanwhile: the receiver drops it
                await self._pack(out.buffer, enc.tensors, layout, lo, hi)
                await out.publish(lo, hi)
                if object_id not in peer.session.outbound:
                    return
                peer.session.advance(object_id, hi)
                await self._send_frame(
                    peer.name,
                    wire.encode(
                        wire.DataProgressMessage(
                            object_id=object_id, from_stage=self.name, to_stage=peer.name, ready=hi
                        )
                    ),
                )

    def _free(self, record: _Out) -> None:
        if record.buffer is not None:
            record.buffer.release()
            record.buffer = None

    def _on_ack(self, peer: _Peer, obj: _OutObj, msg: wire.DataAckMessage) -> None:
        record: _Out = obj.data
        self._free(record)
        peer.credits.release(record.credit)
        if msg.success:
            record.receipt.resolve()
            if record.receipt.latency is not None:
                record.stats.latencies.append(record.receipt.latency)
        else:
            self._count("nacks_received")
            error: BaseException
            if msg.error == "request aborted":
                error = RequestAbortedError(f"request {obj.request_id!r} was aborted")
            else:
                error = BackendError(
                    f"{peer.name!r} could not take object {obj.object_id} of request "
                    f"{obj.request_id!r}: {msg.error}"
                )
            self._resolve(record.receipt, error)

    def _resolve(self, receipt: SendReceipt, error: BaseException) -> None:
        if receipt.done():
            return
        receipt.resolve(error)
        if not isinstance(error, RequestAbortedError | EndpointClosedError):
            log.warning("%s: %s", self.name, error)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every object sent so far was acknowledged (or failed).

        Raises:
            TimeoutError: some are still in flight after ``timeout`` seconds.
        """
        with anyio.fail_after(timeout):
            for peer in list(self._peers.values()):
                for obj in list(peer.session.outbound.values()):
                    record: _Out = obj.data
                    with contextlib.suppress(OmniwireError):
                        await record.receipt.wait()

    # ------------------------------------------------------------------ frames out

    async def _send_frame(self, peer: str, frame: bytes) -> None:
        await self._control.send(peer, frame)

    def _send_nowait(self, peer: str, frame: bytes) -> None:
        """Send a frame from synchronous code: at once when ZeroMQ can take it, else
        through the outbox task."""
        if not self._outbox and self._control.send_nowait(peer, frame):
            return
        self._outbox.append((peer, frame))
        self._outbox_event.set()

    def _send_soon(self, peer: str, frame: bytes) -> None:
        """Send an ACK once the tasks that are ready now have run: the delivery that
        the ACK follows reaches its consumer first, which keeps the ACK off the round
        trip. Safe from any thread (``Delivery.release`` may run anywhere)."""
        loop = self._loop
        if loop is None or self._state == "closed":
            return  # closed: the peer frees on its own when it sees us gone
        self._acks.append((peer, frame))
        if not self._acks_scheduled:
            self._acks_scheduled = True
            if threading.get_ident() == self._loop_thread:
                loop.call_soon(self._flush_acks)
            else:
                loop.call_soon_threadsafe(self._flush_acks)

    def _flush_acks(self) -> None:
        self._acks_scheduled = False
        while self._acks:
            peer, frame = self._acks.popleft()
            self._send_nowait(peer, frame)

    async def _outbox_loop(self) -> None:
        while True:
            await self._flush_outbox()
            self._outbox_event = anyio.Event()
            if not self._outbox:
                await self._outbox_event.wait()

    async def _flush_outbox(self) -> None:
        while self._outbox:
            peer, frame = self._outbox.popleft()
            with contextlib.suppress(KeyError, EndpointClosedError):
                await self._control.send(peer, frame)

    # ------------------------------------------------------------------ aborts

    async def abort(self, request_id: str, reason: str = "") -> None:
        """Abort ``request_id`` everywhere: pending sends fail, in-flight buffers are
        released on both sides, and data of it that arrives later is refused."""
        self._check_open()
        self._on_abort(request_id, self.name, reason)
        frame = wire.encode(
            wire.AbortMessage(request_id=request_id, from_stage=self.name, reason=reason)
        )
        await self._control.publish(frame)
        for peer in self._peers.values():  # direct, for peers that may not be subscribed yet
            if peer.ready.is_set() and any(True for _ in peer.session.outbound_of(request_id)):
                await self._send_frame(peer.name, frame)

    def _on_abort(self, request_id: str, origin: str, reason: str) -> None:
        first = request_id not in self._aborted
        self._aborted[request_id] = time.monotonic()
        self._aborted.move_to_end(request_id)
        while len(self._aborted) > _ABORT_MEMORY:
            self._aborted.popitem(last=False)
        self._count("aborts")
        for scope in list(self._send_scopes.get(request_id, ())):
            scope.cancel()
        error = RequestAbortedError(f"request {request_id!r} was aborted by {origin!r}: {reason}")
        for peer in self._peers.values():
            for obj in peer.session.outbound_of(request_id):
                self._resolve(obj.data.receipt, error)  # the buffer waits for the peer's NACK
            kept: deque[wire.DataReadyMessage] = deque()
            for msg in peer.inbox:
                if msg.request_id != request_id:
                    kept.append(msg)
                elif msg.data_ref is not None:
                    self._nack(peer, msg.data_ref.object_id, "request aborted")
            peer.inbox = kept
            if peer.current is not None and peer.current[0] == request_id:
                peer.current[1].cancel()
        kept_deliveries: deque[Delivery] = deque()
        for d in self._queue:
            if d.request_id == request_id and d.kind != "aborted":
                d.release()
                self._give_back_budget(d)
            else:
                kept_deliveries.append(d)
        self._queue = kept_deliveries
        if first and origin != self.name:
            self._queue.append(Delivery("aborted", request_id, origin, error=reason or None))
            self._queue_event.set()

    # ------------------------------------------------------------------ failures

    def _drop_inbound(self, peer: _Peer, reason: str) -> None:
        for msg in peer.inbox:
            if msg.data_ref is not None:
                self._nack(peer, msg.data_ref.object_id, reason)
        peer.inbox.clear()
        if peer.current is not None:
            peer.current[1].cancel()

    def _fail_outbound(self, peer: _Peer, error: BaseException) -> None:
        for obj in list(peer.session.outbound.values()):
            peer.session.forget_outbound(obj.object_id)
            self._release_out(peer, obj, error)
        for scope in list(self._send_scopes.get("peer:" + peer.name, ())):
            scope.cancel()

    def _release_out(self, peer: _Peer, obj: _OutObj, error: BaseException) -> None:
        record: _Out = obj.data
        self._free(record)
        peer.credits.release(record.credit)
        self._resolve(record.receipt, error)

    def _release_lost(
        self,
        peer: _Peer,
        lost_out: list[_OutObj],
        lost_in: list[_InObj],
        error: BaseException,
    ) -> None:
        for obj in lost_out:
            self._release_out(peer, obj, error)
        peer.inbox.clear()
        if peer.current is not None:
            peer.current[1].cancel()
        old = dict(peer.info)
        for name, info in old.items():
            backend = self._backends.get(name)
            if backend is not None and self._tg is not None:
                self._spawn(backend.disconnect, info)
        peer.chunk_ids.clear()

    def _peer_lost(self, peer: _Peer, reason: str) -> None:
        if not peer.ready.is_set() and peer.hello is None:
            return
        log.warning("%s: peer %s lost: %s", self.name, peer.name, reason)
        self._count("peers_lost")
        peer.lost_reason = reason
        error = PeerLostError(f"peer {peer.name!r} was lost: {reason}")
        lost_out = list(peer.session.outbound.values())
        lost_in = list(peer.session.inbound.values())
        peer.session = wire.Session(local_name=self.name, peer_name=peer.name)
        peer.ready = anyio.Event()
        self._release_lost(peer, lost_out, lost_in, error)
        for scope in list(self._send_scopes.get("peer:" + peer.name, ())):
            scope.cancel()
        peer.down_since = None

    async def _housekeeping_loop(self) -> None:
        """ACK deadlines and disconnected peers, checked a few times a second."""
        tick = max(0.05, min(0.5, self.ack_timeout / 10, self.peer_timeout / 5))
        while True:
            await anyio.sleep(tick)
            now = time.monotonic()
            for peer in list(self._peers.values()):
                if peer.down_since is not None and now - peer.down_since > self.peer_timeout:
                    self._peer_lost(peer, f"disconnected for more than {self.peer_timeout:g} s")
                    continue
                for obj in list(peer.session.outbound.values()):
                    record: _Out = obj.data
                    if now > record.deadline and not record.receipt.done():
                        if self._lost_if_dead(peer):
                            break
                        self._resolve(
                            record.receipt,
                            AckTimeoutError(
                                f"peer {peer.name!r} did not acknowledge object {obj.object_id} "
                                f"(request {obj.request_id!r}, {record.credit} bytes via "
                                f"{record.backend.name}) within {self.ack_timeout:g} s"
                            ),
                        )

    # ------------------------------------------------------------------ introspection

    def backend(self, name: str) -> BackendBase:
        """The running backend instance ``name`` (for stats and tests)."""
        return self._backends[name]

    @property
    def running_backends(self) -> list[str]:
        return list(self._backends)

    def peer_names(self) -> list[str]:
        return [p.name for p in self._peers.values() if p.ready.is_set()]

    def in_flight(self) -> dict[str, tuple[int, int]]:
        """Per peer: (objects sent and not acknowledged, objects received and not acknowledged)."""
        return {
            n: (len(p.session.outbound), len(p.session.inbound)) for n, p in self._peers.items()
        }
