"""The backend interface: a few async methods that move bytes, and declared capabilities.

A backend knows nothing of messages, endpoints or routing. The endpoint packs a
payload into a buffer the backend hands out, asks the backend to publish it, and
sends the backend's opaque reference in a DataRef; the peer's backend opens that
reference and fetches the bytes. Two kinds of backend exist:

- :class:`ByteBackend` moves packed bytes (shm, mooncake, nixl, nccl, cuda_ipc, …).
- :class:`ObjectBackend` hands a Python object over inside one process (local).

Sender side of a ByteBackend, for one object::

    out = await allocate(peer, nbytes, device)    # a writable buffer, reserved
    ...packing writes bytes into out.buffer...
    await publish(out, lo, hi)                    # bytes [lo, hi) are written
    info = describe(out)                          # -> BackendRef.info
    ...DataReady sent; later the peer's ACK arrives...
    free(out)                                     # the buffer may be reused

Receiver side::

    inb = await open(peer, info, length)          # validate the reference, map/allocate
    await fetch(inb, lo, hi, dest)                # bytes [lo, hi) into dest (or inb.buffer)
    close(inb)                                    # before the ACK is sent

Every method documents what it raises; engine errors are translated at this
boundary into :class:`~omniwire.errors.BackendError` (see :func:`map_errors`).
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import anyio
import torch

from ..errors import BackendError

__all__ = [
    "Availability",
    "BackendBase",
    "BackendContext",
    "ByteBackend",
    "Capabilities",
    "InboundBuffer",
    "Locality",
    "ObjectBackend",
    "OutboundBuffer",
    "PeerInfo",
    "copy_range",
    "map_errors",
]

#: Copies at least this large run in a worker thread, off the event loop.
THREAD_COPY_THRESHOLD = 2 << 20  # ~120 µs of memcpy: a thread hop costs more below


class Locality(str, enum.Enum):
    """Where a peer is, relative to this endpoint."""

    SAME_PROCESS = "same_process"
    SAME_HOST = "same_host"
    CROSS_HOST = "cross_host"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can carry; routing reads these, never backend names.

    Attributes:
        devices: memory kinds the backend delivers natively (``"cpu"``, ``"cuda"``).
            Tensors on other devices are staged through host memory.
        localities: where a peer may be for this backend to reach it.
        streaming: carries stream chunks.
        payloads: carries whole payloads (inline carries stream chunks only).
        host_staging: accepts tensors on devices it does not carry natively by
            staging them through host memory (they arrive on the CPU).
        max_nbytes: the largest object it carries, or None for no limit.
        progressive: the receiver can fetch byte ranges while the sender still
            writes later ones (spec §5.2).
        zero_copy: the receiver can view the bytes in place.
        opt_in: routed only when configured for an edge or chosen by a policy
            (e.g. it needs a process group); the reason says what to configure.
        needs_gpu_peer_access: both ends must be GPUs that can access each other.
        preference: among backends that fit an edge, the highest wins.
    """

    devices: frozenset[str] = frozenset({"cpu"})
    localities: frozenset[Locality] = frozenset(Locality)
    streaming: bool = True
    payloads: bool = True
    host_staging: bool = True
    max_nbytes: int | None = None
    progressive: bool = False
    zero_copy: bool = False
    opt_in: str | None = None
    needs_gpu_peer_access: bool = False
    preference: int = 0

    def describe(self) -> str:
        parts = [
            "devices=" + ",".join(sorted(self.devices)),
            "localities=" + ",".join(sorted(loc.value for loc in self.localities)),
        ]
        if self.streaming:
            parts.append("streaming")
        if self.progressive:
            parts.append("progressive")
        if self.zero_copy:
            parts.append("zero-copy")
        if self.max_nbytes is not None:
            parts.append(f"max={self.max_nbytes}B")
        if self.needs_gpu_peer_access:
            parts.append("needs-gpu-peer-access")
        if self.opt_in:
            parts.append(f"opt-in ({self.opt_in})")
        parts.append(f"preference={self.preference}")
        return " ".join(parts)


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


@dataclass(eq=False)
class OutboundBuffer:
    """A sender-side buffer reserved for one object until :meth:`ByteBackend.free`.

    ``buffer`` is a 1-D uint8 tensor of at least ``nbytes`` that packing writes
    into; ``handle`` is the backend's own bookkeeping.
    """

    peer: PeerInfo
    nbytes: int
    buffer: torch.Tensor | None
    handle: Any = None
    #: "packed", or "per_tensor" when the backend shares tensors without packing.
    layout: str = "packed"


@dataclass(eq=False)
class InboundBuffer:
    """A receiver-side view of one object until :meth:`ByteBackend.close`.

    For the packed layout ``buffer`` holds the bytes fetched so far; for
    ``per_tensor`` the backend fills ``tensors`` instead.
    """

    peer: PeerInfo
    nbytes: int
    buffer: torch.Tensor | None = None
    tensors: list[torch.Tensor] | None = None
    handle: Any = None


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

    @classmethod
    def availability(cls) -> Availability:
        """Whether this backend can run in this process (cheap; no engine started)."""
        return Availability.ok()

    async def start(self) -> None:
        """Start engines, allocate pools. Raises BackendError on failure."""

    def local_info(self) -> bytes:
        """Connection info for this endpoint's Hello (``BackendInfo.info``)."""
        return b""

    async def connect(self, peer: PeerInfo) -> None:
        """A peer that runs this backend completed its Hello."""

    async def disconnect(self, peer: PeerInfo) -> None:
        """The peer is gone (closed, lost, or restarted): drop what belongs to it."""

    async def aclose(self) -> None:
        """Release every resource. Idempotent."""

    def stats(self) -> dict[str, int]:
        """Counters for tests and ``omniwire backends``; at least the in-flight counts."""
        return {}


class ByteBackend(BackendBase):
    """A backend that moves packed bytes. See the module docstring for the flow."""

    layout: ClassVar[str] = "packed"
    #: ``open`` + ``fetch`` of a small, fully announced object complete without
    #: waiting on I/O (they only touch mapped memory), so the endpoint may take such
    #: objects directly in its receive loop instead of a worker task.
    takes_small_objects_inline: ClassVar[bool] = False

    @abc.abstractmethod
    async def allocate(self, peer: PeerInfo, nbytes: int, device: str) -> OutboundBuffer:
        """Reserve a buffer of ``nbytes`` for an object to ``peer``.

        ``device`` is where the payload's tensors are (``"cpu"``, ``"cuda:0"``).

        Raises:
            BackendError: no memory could be reserved (``ShmFullError`` for /dev/shm).
            BackendClosedError: the backend is closed.
        """

    async def export_tensors(
        self, peer: PeerInfo, tensors: list[torch.Tensor]
    ) -> OutboundBuffer | None:
        """Share ``tensors`` without packing (layout ``per_tensor``), or return None.

        The default returns None: the endpoint then packs into :meth:`allocate`.
        """
        return None

    async def publish(self, out: OutboundBuffer, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of ``out`` are written; make them available to the peer."""

    @abc.abstractmethod
    def describe(self, out: OutboundBuffer) -> bytes:
        """The opaque reference the peer's backend will ``open`` (BackendRef.info)."""

    @abc.abstractmethod
    def free(self, out: OutboundBuffer) -> None:
        """The peer acknowledged (or is gone): the buffer may be reused. Idempotent."""

    @abc.abstractmethod
    async def open(self, peer: PeerInfo, info: bytes, nbytes: int) -> InboundBuffer:
        """Validate and open a reference from ``peer``.

        ``inb.buffer`` must be set for the packed layout, also for a 0-byte object.

        Raises:
            BackendError: the reference is malformed, names memory the peer does not
                own, or lies outside it.
        """

    async def fetch(
        self, inb: InboundBuffer, lo: int, hi: int, dest: torch.Tensor | None = None
    ) -> None:
        """Make bytes ``[lo, hi)`` available: in ``dest[lo:hi]`` if given, else in
        ``inb.buffer``. The default copies from ``inb.buffer`` (mapped memory).

        Raises:
            BackendError: the engine failed to move the bytes.
        """
        if dest is not None:
            assert inb.buffer is not None
            await copy_range(dest, inb.buffer, lo, hi)

    @abc.abstractmethod
    def close(self, inb: InboundBuffer) -> None:
        """The receiver is done with ``inb`` (the ACK follows). Idempotent.

        It may be called before every byte was fetched (abort, error): a
        two-sided engine must then still consume the rest of the object.
        """

    def drop(self, peer: PeerInfo, info: bytes, nbytes: int) -> None:
        """The receiver refuses an announced object without opening it (abort,
        error, full queue); a NACK follows. One-sided engines need nothing; a
        two-sided engine must still consume the object so later ones stay paired.
        """


class ObjectBackend(BackendBase):
    """A backend that hands Python objects over inside one process (layout ``object``)."""

    layout: ClassVar[str] = "object"

    @abc.abstractmethod
    def put_object(self, peer: PeerInfo, value: Any) -> bytes:
        """Keep ``value`` for ``peer``; return the reference (BackendRef.info)."""

    @abc.abstractmethod
    def take_object(self, peer: PeerInfo, info: bytes) -> Any:
        """Take the value a reference names. Raises BackendError if there is none."""

    @abc.abstractmethod
    def discard(self, info: bytes) -> None:
        """Drop a value that will not be taken (abort, peer lost). Idempotent."""


async def copy_range(dest: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """``dest[lo:hi] = src[lo:hi]``, in a worker thread when it is large."""
    if hi <= lo:
        return
    if hi - lo >= THREAD_COPY_THRESHOLD:
        await anyio.to_thread.run_sync(dest[lo:hi].copy_, src[lo:hi])
    else:
        dest[lo:hi].copy_(src[lo:hi])


@contextlib.contextmanager
def map_errors(
    mapping: Mapping[type[BaseException], type[BackendError]], context: str
) -> Iterator[None]:
    """Translate engine exceptions into omniwire errors at the backend boundary."""
    try:
        yield
    except BackendError:
        raise
    except tuple(mapping) as exc:
        for source, target in mapping.items():
            if isinstance(exc, source):
                raise target(f"{context}: {exc}") from exc
        raise  # pragma: no cover - the tuple matched one of the keys
