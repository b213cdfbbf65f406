"""The backend interface: a transport that exports buffers and imports references.

A backend knows nothing of messages, endpoints or routing. It hands out
*handles* that own their resources and release them exactly once:

Sender side, one :class:`Export` per object::

    exp = await backend.export(peer, nbytes, device)   # a writable buffer, reserved
    ...the endpoint packs bytes into exp.buffer...
    await exp.publish(lo, hi)                         # bytes [lo, hi) are written
    exp.ref                                           # -> BackendRef.info in the DataReady
    ...the peer's ACK (or its loss) arrives...
    exp.release()                                     # idempotent: the buffer may be reused

Receiver side, one :class:`Import` per announced object::

    imp = await backend.import_(peer, ref, nbytes)    # validate the reference, map/allocate
    await imp.fetch(lo, hi, dest)                     # bytes [lo, hi) into dest (or imp.buffer)
    imp.close()                                       # idempotent: before the ACK is sent

:class:`ByteBackend` moves packed bytes (shm, mooncake, nixl, nccl, cuda_ipc, …);
:class:`ObjectBackend` hands a Python object over inside one process (local).
The base class counts live handles, so :meth:`BackendBase.stats` is filled the
same way for every backend and no backend keeps its own "already freed?" set.

Every method lists what it raises; engine errors are translated once, at this
boundary, into :class:`~omniwire.errors.BackendError` (see :func:`map_errors`).
"""

from __future__ import annotations

import abc
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import anyio
import numpy as np
import torch

from ..capabilities import Capabilities, Locality
from ..errors import BackendError

__all__ = [
    "COPY_THREADS",
    "THREAD_COPY_THRESHOLD",
    "Availability",
    "BackendBase",
    "BackendContext",
    "BackendStats",
    "ByteBackend",
    "Capabilities",
    "Export",
    "Import",
    "Locality",
    "ObjectBackend",
    "PeerInfo",
    "copy_range",
    "in_parts",
    "map_errors",
    "one_line",
]

#: Copies at least this large run in a worker thread, off the event loop.
THREAD_COPY_THRESHOLD = 2 << 20  # ~120 µs of memcpy: a thread hop costs more below
#: A large copy is split into parts of at least this many bytes, each in a worker
#: thread of its own, so that it runs on several cores at once.
COPY_PART_BYTES = 8 << 20


def _copy_threads() -> int:
    """How many worker threads one large copy may use: ``OMNIWIRE_COPY_THREADS`` (1: never
    split), else the CPUs this process may run on, at most 4 (one core's memcpy does
    not saturate memory bandwidth; here 2 threads copy 64 MiB in 0.5–0.6 of the time)."""
    text = os.environ.get("OMNIWIRE_COPY_THREADS", "")
    if text:
        try:
            return max(1, int(text))
        except ValueError:
            raise ValueError(f"OMNIWIRE_COPY_THREADS must be an integer, not {text!r}") from None
    return max(1, min(4, len(os.sched_getaffinity(0))))


COPY_THREADS = _copy_threads()

Layout = Literal["packed", "per_tensor", "object"]


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and if not, why and how to fix it."""

    available: bool
    reason: str = ""
    hint: str = ""

    @classmethod
    def ok(cls) -> Availability:
        return cls(True)

    @classmethod
    def missing(cls, reason: str, hint: str = "") -> Availability:
        return cls(False, reason, hint)


@dataclass(frozen=True)
class PeerInfo:
    """What a backend learns about a peer from its HelloMessage."""

    name: str
    instance: int
    pid: int
    host_id: str
    process_token: str
    locality: Locality
    #: This backend's connection info from the peer's Hello (BackendInfo.info).
    info: bytes = b""
    devices: tuple[str, ...] = ("cpu",)
    #: The peer's control-plane host (for engines that need an address).
    host: str = "127.0.0.1"
    #: The features of the peer's Hello (spec §11.2), e.g. "sealed".
    features: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.instance)


@dataclass
class BackendContext:
    """What a backend instance is told about the endpoint that runs it."""

    endpoint: str
    instance: int
    #: Backend-specific options from ``Endpoint(backend_options={name: {...}})``.
    options: Mapping[str, Any] = field(default_factory=dict)
    #: The host this endpoint's control plane binds (engines bind data ports there).
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class BackendStats:
    """What a backend holds and what it carried. ``exports`` and ``imports`` are the
    live handles, counted by the base class: after every object was acknowledged both
    are 0. The totals count since the backend started, as the endpoint announces and
    imports objects (:meth:`BackendBase.note_sent`, :meth:`BackendBase.note_received`)."""

    exports: int
    imports: int
    #: Backend-specific counters (bytes in use, segments, registrations, …).
    detail: Mapping[str, int] = field(default_factory=dict)
    #: Objects this endpoint announced through the backend, and their bytes: each
    #: target of a fan-out, each send of an ``Endpoint.empty`` buffer, each forward.
    objects_sent: int = 0
    bytes_sent: int = 0
    #: Objects the endpoint imported through it (received from peers), and their bytes.
    objects_received: int = 0
    bytes_received: int = 0

    @property
    def idle(self) -> bool:
        """Nothing in flight: no export and no import is alive."""
        return self.exports == 0 and self.imports == 0


class Export(abc.ABC):
    """The sender side of one object, reserved until :meth:`release`.

    ``buffer`` is where the endpoint packs the bytes (a 1-D uint8 tensor of at
    least ``nbytes``) for the ``packed`` layout, None otherwise. Subclasses
    implement :attr:`ref` and, if they hold anything, :meth:`_release`.
    """

    def __init__(
        self,
        backend: BackendBase,
        nbytes: int,
        buffer: torch.Tensor | None = None,
        *,
        layout: Layout = "packed",
    ) -> None:
        self.backend = backend
        self.nbytes = nbytes
        self.buffer = buffer
        self.layout: Layout = layout
        self._released = False
        backend._live_exports += 1

    @property
    @abc.abstractmethod
    def ref(self) -> bytes:
        """The opaque reference the peer's backend imports (``BackendRef.info``)."""

    async def publish(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of the buffer are written: make them available to the peer.

        Raises:
            BackendError: the engine failed.
        """

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """The peer acknowledged (or is gone): free or reuse the buffer. Idempotent."""
        if self._released:
            return
        self._released = True
        self.buffer = None
        self.backend._live_exports -= 1
        self._release()

    def _release(self) -> None:
        """Free what this export holds (called once)."""


class Import:
    """The receiver side of one announced object, open until :meth:`close`.

    For the packed layout ``buffer`` holds the bytes fetched so far (or views the
    sender's memory); for ``per_tensor`` the backend fills ``tensors``; for
    ``object`` (in-process hand-off) ``value`` is the object itself.
    """

    def __init__(
        self,
        backend: BackendBase,
        peer: PeerInfo,
        nbytes: int,
        *,
        buffer: torch.Tensor | None = None,
        tensors: list[torch.Tensor] | None = None,
        value: Any = None,
    ) -> None:
        self.backend = backend
        self.peer = peer
        self.nbytes = nbytes
        self.buffer = buffer
        self.tensors = tensors
        self.value = value
        self._closed = False
        backend._live_imports += 1

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        """Make bytes ``[lo, hi)`` available: in ``dest[lo:hi]`` if given, else in
        ``buffer``. The default copies from ``buffer`` (mapped memory).

        Raises:
            BackendError: the engine failed to move the bytes.
        """
        if dest is not None:
            if self.buffer is None:
                raise BackendError(f"{self.backend.name}: import has no buffer to copy from")
            await copy_range(dest, self.buffer, lo, hi)

    def forward(self, peer: PeerInfo, lo: int, nbytes: int) -> Export | None:
        """An export that carries bytes ``[lo, lo + nbytes)`` of this object to
        ``peer`` by reference (the object was delivered zero-copy and is sent on with
        ``lend=True``), or None (the default): the endpoint packs them as usual. The
        endpoint keeps this import open, and its object unacknowledged, until the
        export is released.

        Raises:
            BackendError: the engine failed.
        """
        return None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """The receiver is done (the ACK follows). Idempotent.

        It may come before every byte was fetched (abort, error): a two-sided
        engine must then still consume the rest of the object.
        """
        if self._closed:
            return
        self._closed = True
        self.backend._live_imports -= 1
        self._close()
        self.buffer = None
        self.tensors = None
        self.value = None

    def _close(self) -> None:
        """Release what this import holds (called once)."""


class BackendBase(abc.ABC):
    """What every backend has: a name, capabilities, availability and a lifecycle."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    #: One line for humans: what the backend is (shown in routing reasons).
    summary: ClassVar[str] = ""
    #: Shown when the backend is unavailable, e.g. ``pip install "omniwire[mooncake]"``.
    install_hint: ClassVar[str] = ""
    #: When an Endpoint runs it without being told to: ``"always"``; ``"tcp"`` — only
    #: when the endpoint binds a tcp:// address (cross-host engines); ``"never"`` —
    #: only when listed in ``Endpoint(backends=[...])``.
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "always"
    #: Needs a CUDA device to run at all (its tests skip, rather than fail, without one).
    needs_gpu: ClassVar[bool] = False

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self._live_exports = 0
        self._live_imports = 0
        self._sent = [0, 0]  # objects, bytes (note_sent)
        self._received = [0, 0]  # objects, bytes (note_received)

    @classmethod
    def availability(cls) -> Availability:
        """Whether this backend can run in this process (cheap; no engine started)."""
        return Availability.ok()

    async def start(self) -> None:
        """Start engines, allocate pools.

        Raises:
            BackendError: the engine cannot start.
        """

    def hello(self) -> bytes:
        """Connection info for this endpoint's Hello (``BackendInfo.info``)."""
        return b""

    def hello_to(self, peer: str) -> bytes:
        """The connection info for a Hello addressed to the endpoint ``peer``: what
        :meth:`hello` says, plus what this backend lends that peer alone (a landing
        for its objects, say). The default: :meth:`hello`."""
        return self.hello()

    def shares(self, export: Export, peer: PeerInfo) -> bool:
        """Whether ``export``, made for one peer, may be announced to ``peer`` too (a
        fan-out's one export, a buffer born in transport memory). The default: yes.
        shm says no for a sealed segment and a peer that does not read sealed ones
        (spec §9.2 "Which form")."""
        return True

    def accepts(self, peer: PeerInfo) -> str | None:
        """Why a peer's Hello must be refused (``bad_hello``) because of what it says
        about this backend — e.g. it claims memory it cannot own — or None. Cheap and
        synchronous: it runs for every Hello before anything is kept."""
        return None

    async def connect(self, peer: PeerInfo) -> None:
        """A peer that runs this backend completed its Hello.

        Raises:
            BackendError: its connection info is unusable, or the engine cannot reach
                it; the endpoint then routes around this backend for that peer.
        """

    async def disconnect(self, peer: PeerInfo) -> None:
        """The peer is gone (closed, lost, or restarted): drop what belongs to it."""

    def peer_gone(self, peer: str) -> None:
        """The session with the endpoint ``peer`` ended (Goodbye, lost, a new
        instance), whether or not it connected this backend: take back what was lent
        to it alone (:meth:`hello_to`). Synchronous, before the next Hello addressed
        to that name is written (which then lends afresh). The default: nothing."""

    async def aclose(self) -> None:
        """Release every resource. Idempotent. Handles still alive become inert."""

    def stats(self) -> BackendStats:
        """Live handles and totals (counted here), and the backend's own :meth:`detail`
        counters."""
        return BackendStats(
            self._live_exports,
            self._live_imports,
            self.detail(),
            *self._sent,
            *self._received,
        )

    def note_sent(self, nbytes: int) -> None:
        """The endpoint announced an object of ``nbytes`` through this backend (for
        :meth:`stats`; whatever export, share or landing carried it)."""
        self._sent[0] += 1
        self._sent[1] += nbytes

    def note_received(self, nbytes: int) -> None:
        """The endpoint imported an announced object of ``nbytes`` through this backend
        (for :meth:`stats`)."""
        self._received[0] += 1
        self._received[1] += nbytes

    def detail(self) -> dict[str, int]:
        """Backend-specific counters for ``stats()`` (override; default none)."""
        return {}

    @abc.abstractmethod
    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        """Validate and open a reference from ``peer`` (``BackendRef.info``).

        For the packed layout ``Import.buffer`` must be set, also for a 0-byte
        object; an object backend sets ``Import.value``.

        Raises:
            BackendError: the reference is malformed, names memory (or an object)
                the peer does not own, or lies outside it.
            BackendClosedError: the backend is closed.
        """


class ByteBackend(BackendBase):
    """A backend that moves packed bytes. See the module docstring for the flow."""

    @abc.abstractmethod
    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        """Reserve a buffer of ``nbytes`` for an object to ``peer`` (layout ``packed``).

        ``device`` is where the payload's tensors are (``"cpu"``, ``"cuda:0"``).

        Raises:
            BackendError: no memory could be reserved (``ShmFullError`` for /dev/shm).
            BackendClosedError: the backend is closed.
        """

    async def export_tensors(
        self, peer: PeerInfo, tensors: list[torch.Tensor], *, lent: bool
    ) -> Export | None:
        """Carry ``tensors`` without packing them, or return None and let the endpoint
        pack into :meth:`export` (the default).

        ``lent`` is True when the caller lent its tensors (``send(..., lend=True)``):
        it does not modify them until the object is acknowledged, so the engine may
        read them in place (register them, say) — the export then has
        ``buffer=None`` and layout ``packed`` (the peer's ``fetch`` still yields the
        packed image), or layout ``per_tensor`` (the peer's import fills
        ``Import.tensors``). Without ``lent`` a backend may only share memory whose
        reuse it controls.

        Raises:
            BackendError, BackendClosedError: as :meth:`export`.
        """
        return None

    def can_land(self, peer: PeerInfo, nbytes: int) -> bool:
        """Whether :meth:`land` would find room now for an object of ``nbytes`` to
        ``peer`` (cheap, synchronous). The endpoint then packs an object larger than
        its ``progressive_chunk`` whole, to land it, instead of announcing it in pieces
        for the peer to read. The default: False."""
        return False

    async def land(self, peer: PeerInfo, export: Export) -> Export | None:
        """Move a complete export's bytes into memory ``peer`` lent this endpoint for
        that (a *landing*), before its announcement; return the export that replaces
        ``export`` (its reference names the landed bytes; the caller then releases
        ``export``, whose memory the peer no longer needs), or None: announce
        ``export`` as it is (the default; also when the landing is full or the write
        failed).

        An object that landed is in the receiver's memory when this returns: its
        receipt completes then, without waiting for the ACK (which frees the landing).

        Raises:
            BackendClosedError: the backend is closed.
        """
        return None

    async def delivery_buffer(self, nbytes: int) -> torch.Tensor | None:
        """Where a copy-mode delivery of ``nbytes`` may land: a host buffer that the
        engine reads into without a registration per object (from a pool of memory
        registered once), owned by the caller from then on; or None (the default) and
        the endpoint takes one of its own.

        Raises:
            BackendError: the engine refused to register new memory.
        """
        return None


class ObjectBackend(BackendBase):
    """A backend that hands Python objects over inside one process (layout ``object``)."""

    @abc.abstractmethod
    def export_object(self, peer: PeerInfo, value: Any) -> Export:
        """Keep ``value`` for ``peer`` until it is imported or the export released.

        Raises:
            BackendClosedError: the backend is closed.
        """


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest[:] = src`` (equal shapes). Host bytes to host bytes go through numpy,
    which calls libc's ``memcpy`` (non-temporal stores for large copies): 5–10 %
    faster here than torch's vectorised byte loop; either releases the GIL."""
    if (
        dest.device.type == "cpu"
        and src.device.type == "cpu"
        and dest.dtype == src.dtype == torch.uint8
        and dest.is_contiguous()
        and src.is_contiguous()
    ):
        np.copyto(dest.numpy(), src.numpy())
    else:
        dest.copy_(src)


async def copy_range(dest: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """``dest[lo:hi] = src[lo:hi]``, off the event loop (see :func:`in_parts`) when it
    is large."""
    if hi <= lo:
        return
    if hi - lo < THREAD_COPY_THRESHOLD:
        _copy(dest[lo:hi], src[lo:hi])
    elif dest.device.type == src.device.type == "cpu":
        await in_parts(lambda a, b: _copy(dest[a:b], src[a:b]), lo, hi)
    else:  # a device copy: one thread (its parts would only queue on one engine)
        await anyio.to_thread.run_sync(_copy, dest[lo:hi], src[lo:hi])


async def in_parts(copy: Callable[[int, int], None], lo: int, hi: int) -> None:
    """Run ``copy(a, b)`` over ``[lo, hi)`` in worker threads: in one, or split into
    parts of at least ``COPY_PART_BYTES`` (page-aligned) over up to ``COPY_THREADS``
    threads at once. ``copy`` must release the GIL (memcpy, pread) and be safe on
    disjoint ranges. Every part has finished when this returns or raises (a
    cancelled copy never writes on behind its caller); the first error is raised.
    """
    parts = min(COPY_THREADS, (hi - lo) // COPY_PART_BYTES)
    if parts <= 1:
        await anyio.to_thread.run_sync(copy, lo, hi)
        return
    step = -(-(hi - lo) // parts)
    step += -step % 4096
    errors: list[BaseException] = []

    async def part(a: int, b: int) -> None:
        try:
            await anyio.to_thread.run_sync(copy, a, b)
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for a in range(lo, hi, step):
            tg.start_soon(part, a, min(a + step, hi))
    if errors:
        raise errors[0]


@contextlib.contextmanager
def map_errors(
    mapping: Mapping[type[BaseException], type[BackendError]], context: str
) -> Iterator[None]:
    """Translate engine exceptions into omniwire errors at the backend boundary::

        with map_errors({OSError: BackendError}, f"shm: cannot map {name}"):
            ...

    ``BackendError`` passes through unchanged; the first matching key wins. The
    message is ``context`` and the first line of the engine's (its type when empty).
    Works as a decorator too.
    """
    try:
        yield
    except BackendError:
        raise
    except tuple(mapping) as exc:
        for source, target in mapping.items():
            if isinstance(exc, source):
                raise target(f"{context}: {one_line(exc)}") from exc
        raise  # pragma: no cover - the tuple matched one of the keys


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
