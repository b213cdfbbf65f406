"""``nixl``: NVIDIA NIXL agents over UCX, pull model (one-sided READs).

Each backend instance runs one NIXL agent (``nixl_agent_config(enable_prog_thread=True,
enable_listen_thread=False, backends=["UCX"])``, thread-sync mode ``RW`` because the
agent is called from several worker threads) under a unique name, and registers one
**pool** of memory with it, once: pre-faulted host memory (``DRAM``), plus an optional
``VRAM`` pool on a CUDA device (``vram_pool_size``; nothing on a CPU-only host). A
buddy allocator carves the pools into reusable slots. An object that does not fit in
the free part of a pool gets a dedicated registration, released on ``free()``.
Receivers always land the bytes in host memory (the backend declares devices
``{"cpu"}``): a VRAM pool only spares a sender of CUDA tensors the staging copy.

Data flow (pull): the sender packs into its slot and announces it; the receiver's
agent **reads** each announced range ``[lo, hi)`` straight from the sender's slot
(``initialize_xfer("READ", ...)``, ``transfer``, then ``check_xfer_state`` polled
with a short, growing sleep in a worker thread; the transfer handle is released
afterwards, always). The sender's agent is passive: it learns that the object was
taken from omniwire's ACK, so reads carry no NIXL notification (a notification
would only pile up in the sender's agent unless drained by an extra engine call per
object). Where the receiver reads into:

- zero-copy (no ``dest``): a slot of its own registered pool (or a dedicated
  registration); the delivered tensors view it until ``close()``;
- copy mode (``dest`` given), objects of at least ``register_dest_min`` bytes: the
  destination itself is registered for the object and the bytes are read straight
  into it, then it is deregistered (UCX caches registrations of reused memory: a few
  microseconds). Measured here, reading in 8 MiB pieces: 64 MiB 17.5 ms against
  19.0 ms through an own slot plus a copy, 1 MiB 90 µs against 109 µs; below about
  256 KiB the two are even, so smaller objects are read into an own slot and copied.

Hello info (``BackendInfo.info``): msgpack ``{"agent": str, "metadata": bytes,
"pools": [[addr, length, dev, mem], ...]}`` — the agent name, its
``get_agent_metadata()`` blob (taken once the pools are registered) and the pools.
The metadata blob is NIXL's own serialization (``nixlSerDes``: tagged,
length-prefixed binary, parsed in C++ by ``nixlAgent::loadRemoteMD``; no pickle).
Before it is loaded, the agent name written in it must be the one announced.

Reference (``BackendRef.info``): msgpack ``{"pool": int, "offset": u64,
"length": u64, "region": [addr, length, dev, mem] | nil, "metadata": bytes}``.
``pool >= 0`` names bytes ``[offset, offset + length)`` of that pool of the
announcing peer, which must lie inside it; ``pool == -1`` names a dedicated
registration ``region``, described by ``metadata`` (``get_partial_agent_metadata``
of that one region, which must name the peer's agent). Descriptors always travel in
these structs: NIXL's ``get_serialized_descs``/``deserialize_descs`` use pickle and
are never called. Unknown fields are ignored.

A dedicated region stays known to the receiver's agent after it is released (NIXL
cannot forget one region of a peer). When a new region of the peer overlaps such a
stale one — the sender's allocator reuses addresses — and is not the very same
registration, or more than 64 stale regions pile up, the receiver reloads the
peer's metadata (``remove_remote_agent`` + ``add_remote_agent``) once no read from
that peer is in flight, so a read never resolves to a stale registration.

Options (``backend_options={"nixl": {...}}``): ``pool_size`` (bytes, default
128 MiB), ``vram_pool_size`` (bytes, default 0), ``cuda_device`` (index, default
the current device), ``register_dest_min`` (bytes, default 256 KiB),
``timeout`` (seconds one read may take, default 30 plus 1 s per 50 MB).

Environment: UCX reads ``UCX_*`` variables (tests pin ``UCX_NET_DEVICES=lo``);
``NIXL_LOG_LEVEL`` sets NIXL's Python log level (default here: WARNING — NIXL's
own handler prints to stdout, so it is removed and its records go to the normal
``logging`` tree).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import mmap
import os
import re
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, ClassVar, Literal

import anyio
import msgspec
import torch

from ..alloc import BuddyAllocator
from ..errors import BackendClosedError, BackendError
from .base import (
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    InboundBuffer,
    Locality,
    OutboundBuffer,
    PeerInfo,
)

__all__ = ["NixlBackend", "raw_bench"]

log = logging.getLogger("omniwire.nixl")

MODULE = "omniwire.backends.nixl"
INSTALL_HINT = 'pip install "omniwire[nixl]"'
#: Where the agent API is, in order: the ``nixl`` meta-package, then the CUDA builds.
_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")

_U64_MAX = 2**64 - 1
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_PAGE = 4096
_POLL_MIN_S = 10e-6
_POLL_MAX_S = 500e-6
_MAX_METADATA = 1 << 20
#: Stale dedicated regions of a peer kept loaded before its metadata is reloaded.
_MAX_STALE = 64

U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack integers stop at 2**64 - 1
Mem = Literal["DRAM", "VRAM"]


class _Region(msgspec.Struct, frozen=True, array_like=True):
    addr: U64
    length: U64
    dev: U64 = 0
    mem: Mem = "DRAM"

    @property
    def key(self) -> tuple[int, int, int, str]:
        return (self.addr, self.length, self.dev, self.mem)

    def overlaps(self, other: _Region) -> bool:
        return (
            self.mem == other.mem
            and self.dev == other.dev
            and self.addr < other.addr + other.length
            and other.addr < self.addr + self.length
        )


class _HelloInfo(msgspec.Struct, frozen=True):
    agent: str
    metadata: bytes
    pools: list[_Region]


class _Ref(msgspec.Struct, frozen=True):
    pool: Annotated[int, msgspec.Meta(ge=-1, le=255)]
    offset: U64
    length: U64
    region: _Region | None = None
    metadata: bytes = b""


_hello_decoder = msgspec.msgpack.Decoder(_HelloInfo)
_ref_decoder = msgspec.msgpack.Decoder(_Ref)
_encoder = msgspec.msgpack.Encoder()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- the library -------------------------------------------------------------------------

_api: Any = None
_api_error: str | None = None


def _tame_nixl_logging(raise_exceptions: bool) -> None:
    """NIXL's import configures a logger that prints to *stdout* and turns off
    ``logging.raiseExceptions``: undo both (stdout may be a protocol channel)."""
    logging.raiseExceptions = raise_exceptions
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is not sys.stderr:
            nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)


def _load_api() -> Any:
    """The ``_api`` module of the first NIXL build that imports (cached).

    Raises:
        ImportError: none does; the message lists why for each.
    """
    global _api, _api_error
    if _api is not None:
        return _api
    if _api_error is not None:
        raise ImportError(_api_error)
    errors = []
    raise_exceptions = logging.raiseExceptions
    try:
        for name in _API_MODULES:
            try:
                module = importlib.import_module(name)
            except (ImportError, OSError) as exc:  # OSError: a shared library is missing
                errors.append(f"{name}: {exc}")
                continue
            if hasattr(module, "nixl_agent") and hasattr(module, "nixl_agent_config"):
                _api = module
                return module
            errors.append(f"{name}: has no nixl_agent")
    finally:
        _tame_nixl_logging(raise_exceptions)
    _api_error = "cannot import the NIXL agent API (" + "; ".join(errors) + ")"
    raise ImportError(_api_error)


def _md_agent(metadata: bytes) -> str | None:
    """The agent name a NIXL metadata blob starts with (``nixlSerDes|Agent<len>name|``)."""
    head = b"nixlSerDes|Agent"
    start = len(head) + 8
    if not metadata.startswith(head) or len(metadata) < start:
        return None
    n = int.from_bytes(metadata[len(head) : start], sys.byteorder)
    if not 0 < n <= 1024 or metadata[start + n : start + n + 1] != b"|":
        return None
    try:
        return metadata[start : start + n].decode()
    except UnicodeDecodeError:
        return None


def _agent_name(endpoint: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", endpoint)[:48]
    return f"ow-{safe}-{os.getpid()}-{secrets.token_hex(6)}"


class _StuckRead(BackendError):
    """A READ failed or was abandoned and NIXL could not cancel it: it may still land."""


def _describe_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _map(size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Anonymous, pre-faulted memory and a uint8 tensor over it."""
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _unmap(mm: mmap.mmap | None) -> None:
    if mm is not None:
        # If views are still alive this fails; the GC unmaps when the last one goes.
        with contextlib.suppress(BufferError):
            mm.close()


class _Agent:
    """A NIXL agent with checked, blocking calls: run every method in a worker thread."""

    def __init__(self, name: str) -> None:
        api = _load_api()
        sync = getattr(api, "nixl_thread_sync_t", None)
        kwargs: dict[str, Any] = {}
        if sync is not None:
            kwargs["sync_mode"] = sync.NIXL_THREAD_SYNC_RW
        try:
            config = api.nixl_agent_config(
                enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"], **kwargs
            )
            agent = api.nixl_agent(name, config)
        except Exception as exc:
            raise BackendError(f"nixl: cannot create agent {name!r}: {_describe_exc(exc)}") from exc
        if "UCX" not in agent.backends:
            raise BackendError(
                f"nixl: agent {name!r} has no UCX backend (plugins found: "
                f"{', '.join(agent.get_plugin_list()) or 'none'}; set NIXL_PLUGIN_DIR?)"
            )
        self.name = name
        self._agent: Any = agent

    @property
    def nx(self) -> Any:
        if self._agent is None:
            raise BackendClosedError("nixl agent is closed")
        return self._agent

    def register(self, region: _Region) -> Any:
        try:
            descs = self.nx.register_memory(
                [(region.addr, region.length, region.dev, "")], region.mem
            )
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(
                f"nixl: cannot register {region.mem} [0x{region.addr:x}, +{region.length}) "
                f"on device {region.dev}: {_describe_exc(exc)}"
            ) from exc
        if descs is None:
            raise BackendError(f"nixl: cannot build a registration list for {region}")
        return descs

    def deregister(self, descs: Any) -> None:
        try:
            self.nx.deregister_memory(descs)
        except BackendClosedError:
            pass
        except Exception as exc:
            log.warning("nixl: deregistering memory failed: %s", _describe_exc(exc))

    def metadata(self) -> bytes:
        try:
            return bytes(self.nx.get_agent_metadata())
        except Exception as exc:
            raise BackendError(f"nixl: get_agent_metadata failed: {_describe_exc(exc)}") from exc

    def partial_metadata(self, descs: Any) -> bytes:
        try:
            return bytes(self.nx.get_partial_agent_metadata(descs, False, ["UCX"]))
        except Exception as exc:
            raise BackendError(
                f"nixl: get_partial_agent_metadata failed: {_describe_exc(exc)}"
            ) from exc

    def load(self, metadata: bytes, expected: str, peer: str) -> None:
        """Load a (full or partial) metadata blob of agent ``expected``.

        Raises:
            BackendError: it names another agent, or NIXL refused it.
        """
        named = _md_agent(metadata)
        if named != expected:
            raise BackendError(
                f"nixl metadata from {peer!r} names agent {named!r}, not its own {expected!r}"
            )
        try:
            loaded = self.nx.add_remote_agent(metadata)
        except Exception as exc:
            raise BackendError(
                f"nixl: cannot load the metadata of agent {expected!r} of {peer!r}: "
                f"{_describe_exc(exc)}"
            ) from exc
        # The binding returns bytes; every other call wants str.
        if isinstance(loaded, bytes):
            loaded = loaded.decode(errors="replace")
        if loaded != expected:  # pragma: no cover - checked above; defensive
            raise BackendError(f"nixl: loaded agent {loaded!r}, expected {expected!r}")

    def unload(self, agent: str) -> None:
        """Forget a remote agent (and disconnect from it). Quiet if it is unknown."""
        try:
            self.nx.agent.invalidateRemoteMD(agent)  # returns a status; NOT_FOUND is fine
        except BackendClosedError:
            pass
        except Exception as exc:
            log.debug("nixl: invalidating %s: %s", agent, _describe_exc(exc))

    def known(self, agent: str) -> bool:
        try:
            return bool(self.nx.check_remote_metadata(agent))
        except Exception:
            return False

    def connect(self, agent: str) -> None:
        """Open the connection to ``agent`` ahead of the first read (best effort)."""
        try:
            self.nx.make_connection(agent)
        except Exception as exc:
            log.debug("nixl: make_connection(%s): %s", agent, _describe_exc(exc))

    def read(
        self,
        local: tuple[int, int, str],
        remote_agent: str,
        remote: tuple[int, int, str],
        length: int,
        timeout: float,
        cancelled: Callable[[], bool],
        what: str,
        spin: bool = False,
    ) -> None:
        """READ ``length`` bytes at ``remote`` (addr, dev, mem) of ``remote_agent`` into
        ``local`` (addr, dev, mem); wait for it, polling with a short, growing sleep
        (``spin``: without sleeping). ``cancelled()`` is checked while waiting.

        Raises:
            BackendError: NIXL refused or failed the transfer, ``cancelled()`` turned
                true, or it took longer than ``timeout`` seconds (``_StuckRead`` when it
                could not be cancelled and may still land).
        """
        nx = self.nx
        ldescs = nx.get_xfer_descs([(local[0], length, local[1])], local[2])
        rdescs = nx.get_xfer_descs([(remote[0], length, remote[1])], remote[2])
        if ldescs is None or rdescs is None:
            raise BackendError(f"nixl: cannot build descriptors for {what}")
        try:
            handle = nx.initialize_xfer("READ", ldescs, rdescs, remote_agent)
        except Exception as exc:
            raise BackendError(
                f"nixl: cannot create a READ of {length} bytes at 0x{remote[0]:x} from agent "
                f"{remote_agent!r} for {what}: {_describe_exc(exc)}"
            ) from exc
        done = False
        try:
            state = nx.transfer(handle)
            started = time.monotonic()
            delay = _POLL_MIN_S
            while state == "PROC":
                elapsed = time.monotonic() - started
                if cancelled():
                    raise BackendError(f"nixl: READ for {what} was cancelled (peer lost or closed)")
                if elapsed > timeout:
                    raise BackendError(
                        f"nixl: READ of {length} bytes from agent {remote_agent!r} for {what} "
                        f"did not finish within {timeout:g} s"
                    )
                if not spin:
                    time.sleep(delay)
                    # Wake-ups add at most ~3 % to a long read and little to a short one.
                    delay = min(_POLL_MAX_S, max(delay * 2, elapsed / 32))
                state = nx.check_xfer_state(handle)
            if state != "DONE":
                raise BackendError(
                    f"nixl: READ of {length} bytes from agent {remote_agent!r} for {what} "
                    f"failed (state {state})"
                )
            done = True
        except BackendError:
            raise
        except Exception as exc:  # the bindings raise nixl*Error for error statuses
            raise BackendError(
                f"nixl: READ of {length} bytes from agent {remote_agent!r} for {what} "
                f"failed: {_describe_exc(exc)}"
            ) from exc
        finally:
            try:
                handle.release()
            except Exception as exc:  # NIXL could not cancel it: it may still land
                log.warning("nixl: releasing the READ for %s failed: %s", what, _describe_exc(exc))
                if not done:
                    raise _StuckRead(
                        f"nixl: READ for {what} could not be cancelled: {_describe_exc(exc)}"
                    ) from exc

    def close(self) -> None:
        """Destroy the agent (joins its progress thread)."""
        self._agent = None  # the last reference: the destructor runs here


# -- memory ------------------------------------------------------------------------------


class _Memory:
    """Registered memory this backend owns: a pool or a dedicated buffer."""

    def __init__(
        self, region: _Region, descs: Any, tensor: torch.Tensor, mm: mmap.mmap | None
    ) -> None:
        self.region = region
        self.descs = descs
        self.tensor = tensor
        self.mm = mm
        self.metadata = b""  # partial metadata, for dedicated sender buffers

    @classmethod
    def create(cls, agent: _Agent, size: int, mem: Mem, dev: int) -> _Memory:
        """Allocate (pre-faulted) and register ``size`` bytes. Blocking."""
        size = max(_PAGE, -(-size // _PAGE) * _PAGE)
        mm: mmap.mmap | None = None
        if mem == "VRAM":
            tensor = torch.empty(size, dtype=torch.uint8, device=f"cuda:{dev}")
        else:
            try:
                mm, tensor = _map(size)
            except OSError as exc:
                raise BackendError(f"nixl: cannot map {_mib(size)} of host memory: {exc}") from exc
        region = _Region(tensor.data_ptr(), size, dev, mem)
        try:
            descs = agent.register(region)
        except BaseException:
            del tensor
            _unmap(mm)
            raise
        return cls(region, descs, tensor, mm)

    def release(self, agent: _Agent | None) -> None:
        """Deregister and unmap. Blocking."""
        if agent is not None and self.descs is not None:
            agent.deregister(self.descs)
        self.descs = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        _unmap(self.mm)
        self.mm = None


class _Pool:
    def __init__(self, index: int, memory: _Memory) -> None:
        self.index = index
        self.memory = memory
        self.alloc = BuddyAllocator(memory.region.length, min_block=_PAGE)


class _Lease:
    """A sender buffer: a pool slot (``pool`` set) or a dedicated registration."""

    __slots__ = ("dedicated", "length", "offset", "pool")

    def __init__(
        self, pool: _Pool | None, offset: int, length: int, dedicated: _Memory | None
    ) -> None:
        self.pool = pool
        self.offset = offset
        self.length = length
        self.dedicated = dedicated


class _Loaded:
    __slots__ = ("metadata", "region", "users")

    def __init__(self, region: _Region, metadata: bytes) -> None:
        self.region = region
        self.metadata = metadata
        self.users = 0


class _Remote:
    """What the receiver knows of a peer's agent."""

    def __init__(self, peer: PeerInfo, hello: _HelloInfo) -> None:
        self.peer = peer.name
        self.key = peer.key
        self.agent = hello.agent
        self.metadata = hello.metadata
        self.pools = list(hello.pools)
        self.alive = True
        self.active = 0  # reads in flight
        self.idle: anyio.Event | None = None
        self.refreshing: anyio.Event | None = None
        self.lock = anyio.Lock()  # loads of dedicated regions and reloads
        self.loaded: dict[tuple[int, int, int, str], _Loaded] = {}


class _Inbound:
    __slots__ = (
        "addr",
        "dest",
        "dest_descs",
        "dev",
        "landing",
        "landing_pool",
        "loaded",
        "mem",
        "nbytes",
        "oid",
        "remote",
    )

    def __init__(
        self, remote: _Remote, addr: int, dev: int, mem: str, nbytes: int, loaded: _Loaded | None
    ) -> None:
        self.remote = remote
        self.addr = addr
        self.dev = dev
        self.mem = mem
        self.nbytes = nbytes
        self.loaded = loaded
        self.oid = f"0x{addr:x}+{nbytes}"
        # where the bytes land: an own pool slot / dedicated buffer, or the caller's dest
        self.landing: _Memory | None = None
        self.landing_pool: tuple[_Pool, int] | None = None
        self.dest: torch.Tensor | None = None
        self.dest_descs: Any = None


# -- the backend -------------------------------------------------------------------------


class NixlBackend(ByteBackend):
    """NIXL over UCX. Options: see the module docstring."""

    name: ClassVar[str] = "nixl"
    summary: ClassVar[str] = "NVIDIA NIXL agent over UCX, one-sided READs from a registered pool"
    install_hint: ClassVar[str] = INSTALL_HINT
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "tcp"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu"}),
        localities=frozenset({Locality.SAME_HOST, Locality.CROSS_HOST}),
        progressive=True,
        zero_copy=True,
        preference=50,
    )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        opts = ctx.options
        self.pool_size = int(opts.get("pool_size", 128 << 20))
        self.vram_pool_size = int(opts.get("vram_pool_size", 0))
        cuda_device = opts.get("cuda_device")
        self.cuda_device = int(cuda_device) if cuda_device is not None else None
        self.register_dest_min = int(opts.get("register_dest_min", 256 << 10))
        timeout = opts.get("timeout")
        self._timeout = float(timeout) if timeout is not None else None
        self.agent_name = _agent_name(ctx.endpoint)
        self._agent: _Agent | None = None
        self._pools: list[_Pool] = []
        self._info = b""
        self._leases: set[_Lease] = set()
        self._dedicated: set[_Memory] = set()  # sender buffers and receiver landings
        self._remotes: dict[tuple[str, int], _Remote] = {}
        self._inbounds: set[_Inbound] = set()
        self._quarantine: list[Any] = []  # memory a read that could not be cancelled may hit
        self._releaser: ThreadPoolExecutor | None = None
        self._active = 0
        self._idle: anyio.Event | None = None
        self._closed = False
        self._warned_dedicated = False
        self._counters = {"reads": 0, "reloads": 0, "dest_registrations": 0}

    @classmethod
    def availability(cls) -> Availability:
        try:
            _load_api()
        except ImportError as exc:
            return Availability.missing(str(exc), INSTALL_HINT)
        return Availability.ok()

    def timeout_for(self, nbytes: int) -> float:
        if self._timeout is not None:
            return self._timeout
        return 30.0 + nbytes / 50e6

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._closed:
            raise BackendClosedError("nixl backend is closed")
        if self._agent is not None:
            return
        if self.vram_pool_size > 0 and not torch.cuda.is_available():
            raise BackendError("nixl: vram_pool_size is set but CUDA is not available here")
        await anyio.to_thread.run_sync(self._start_blocking)

    def _start_blocking(self) -> None:
        agent = _Agent(self.agent_name)
        pools: list[_Pool] = []
        try:
            if self.pool_size > 0:
                pools.append(_Pool(0, _Memory.create(agent, self.pool_size, "DRAM", 0)))
            if self.vram_pool_size > 0:
                dev = (
                    self.cuda_device
                    if self.cuda_device is not None
                    else torch.cuda.current_device()
                )
                memory = _Memory.create(agent, self.vram_pool_size, "VRAM", dev)
                pools.append(_Pool(len(pools), memory))
            metadata = agent.metadata()
        except BaseException:
            for pool in pools:
                pool.memory.release(agent)
            agent.close()
            raise
        self._pools = pools
        self._info = _encoder.encode(
            _HelloInfo(self.agent_name, metadata, [p.memory.region for p in pools])
        )
        self._agent = agent

    def local_info(self) -> bytes:
        return self._info

    def _live_agent(self) -> _Agent:
        if self._closed:
            raise BackendClosedError("nixl backend is closed")
        if self._agent is None:
            raise BackendError("nixl backend is not started")
        return self._agent

    async def connect(self, peer: PeerInfo) -> None:
        agent = self._live_agent()
        if len(peer.info) > _MAX_METADATA:
            raise BackendError(f"nixl hello info from {peer.name!r} is too large")
        try:
            hello = _hello_decoder.decode(peer.info)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError(f"malformed nixl hello info from {peer.name!r}: {exc}") from None
        if hello.agent == agent.name:
            raise BackendError(f"nixl peer {peer.name!r} claims this endpoint's own agent name")
        for other in self._remotes.values():
            if other.agent == hello.agent and other.key != peer.key:
                raise BackendError(
                    f"nixl peer {peer.name!r} claims agent {hello.agent!r}, "
                    f"which belongs to {other.peer!r}"
                )
        old = self._remotes.get(peer.key)
        if old is not None:
            if old.agent == hello.agent and old.metadata == hello.metadata:
                return
            await self.disconnect(peer)
        remote = _Remote(peer, hello)

        def load() -> None:
            agent.unload(hello.agent)  # a stale copy (the same agent seen before)
            agent.load(hello.metadata, hello.agent, peer.name)
            agent.connect(hello.agent)

        await anyio.to_thread.run_sync(load)
        self._remotes[peer.key] = remote

    async def disconnect(self, peer: PeerInfo) -> None:
        remote = self._remotes.pop(peer.key, None)
        if remote is None:
            return
        remote.alive = False  # reads in flight from it stop waiting
        with anyio.move_on_after(10):
            await self._wait_idle(remote)
        if self._agent is not None and not self._closed:
            await anyio.to_thread.run_sync(self._agent.unload, remote.agent)
        remote.loaded.clear()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for remote in self._remotes.values():
            remote.alive = False
        with anyio.move_on_after(10):
            while self._active:
                self._idle = anyio.Event()
                await self._idle.wait()
        releaser, self._releaser = self._releaser, None
        agent, self._agent = self._agent, None
        remotes = list(self._remotes.values())
        self._remotes.clear()
        memories = list(self._dedicated)
        self._dedicated.clear()
        dest_descs = [h.dest_descs for h in self._inbounds if h.dest_descs is not None]
        for h in self._inbounds:
            h.dest_descs = h.dest = None
        self._inbounds.clear()
        pools, self._pools = self._pools, []
        self._leases.clear()

        def teardown() -> None:
            if releaser is not None:
                releaser.shutdown(wait=True)
            if agent is None:
                return
            for remote in remotes:
                agent.unload(remote.agent)
            for descs in dest_descs:
                agent.deregister(descs)
            for memory in memories:
                memory.release(agent)
            for pool in pools:
                pool.memory.release(agent)
            agent.close()

        await anyio.to_thread.run_sync(teardown)
        self._quarantine.clear()

    def stats(self) -> dict[str, int]:
        return {
            "leases": len(self._leases),
            "open": len(self._inbounds),
            "dedicated": len(self._dedicated),
            "pool_bytes_in_use": sum(p.alloc.bytes_in_use for p in self._pools),
            "remotes": len(self._remotes),
            "reads_in_flight": self._active,
            "quarantined": len(self._quarantine),
            **self._counters,
        }

    # -- helpers ---------------------------------------------------------------------------

    async def _wait_idle(self, remote: _Remote) -> None:
        while remote.active:
            if remote.idle is None or remote.idle.is_set():
                remote.idle = anyio.Event()
            await remote.idle.wait()

    def _later(self, fn: Any, *args: Any) -> None:
        """Run a blocking cleanup call off the event loop, without waiting for it."""
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(1, thread_name_prefix="omniwire-nixl")
        self._releaser.submit(fn, *args)

    def _release_memory(self, memory: _Memory) -> None:
        self._dedicated.discard(memory)
        self._later(memory.release, self._agent)

    def _pool_for(self, device: str) -> _Pool | None:
        if device.startswith("cuda"):
            dev = torch.device(device).index
            for pool in self._pools:
                region = pool.memory.region
                if region.mem == "VRAM" and (dev is None or region.dev == dev):
                    return pool
        for pool in self._pools:
            if pool.memory.region.mem == "DRAM":
                return pool
        return None

    async def _dedicated_memory(self, nbytes: int, mem: Mem, dev: int, purpose: str) -> _Memory:
        agent = self._live_agent()
        if not self._warned_dedicated:
            self._warned_dedicated = True
            log.info(
                "nixl pool (%s) has no free slot for %s (%s): using a dedicated registration; "
                "raise backend_options['nixl']['pool_size'] if this is common",
                _mib(self.pool_size),
                _mib(nbytes),
                purpose,
            )

        def make() -> _Memory:
            memory = _Memory.create(agent, nbytes, mem, dev)
            if purpose == "send":
                try:
                    memory.metadata = agent.partial_metadata(memory.descs)
                except BaseException:
                    memory.release(agent)
                    raise
            return memory

        memory = await anyio.to_thread.run_sync(make)
        if self._closed:
            await anyio.to_thread.run_sync(memory.release, agent)
            raise BackendClosedError("nixl backend is closed")
        self._dedicated.add(memory)
        return memory

    # -- sender ----------------------------------------------------------------------------

    async def allocate(self, peer: PeerInfo, nbytes: int, device: str) -> OutboundBuffer:
        self._live_agent()
        pool = self._pool_for(device)
        offset = pool.alloc.allocate(max(nbytes, 1)) if pool is not None else None
        if pool is not None and offset is not None:
            lease = _Lease(pool, offset, nbytes, None)
            view = pool.memory.tensor[offset : offset + nbytes]
        else:
            mem: Mem = "DRAM"
            dev = 0
            if pool is not None:
                mem, dev = pool.memory.region.mem, pool.memory.region.dev
            memory = await self._dedicated_memory(nbytes, mem, dev, "send")
            lease = _Lease(None, 0, nbytes, memory)
            view = memory.tensor[:nbytes]
        self._leases.add(lease)
        return OutboundBuffer(peer, nbytes, view, lease)

    async def publish(self, out: OutboundBuffer, lo: int, hi: int) -> None:
        if out.buffer is not None and out.buffer.is_cuda:  # packing may still be queued
            await anyio.to_thread.run_sync(torch.cuda.synchronize, out.buffer.device)

    def describe(self, out: OutboundBuffer) -> bytes:
        lease: _Lease = out.handle
        if lease.pool is not None:
            return _encoder.encode(_Ref(lease.pool.index, lease.offset, lease.length))
        assert lease.dedicated is not None
        memory = lease.dedicated
        return _encoder.encode(_Ref(-1, 0, lease.length, memory.region, memory.metadata))

    def free(self, out: OutboundBuffer) -> None:
        lease: _Lease = out.handle
        if lease not in self._leases:
            return
        self._leases.discard(lease)
        out.buffer = None
        if lease.dedicated is not None:
            if lease.dedicated in self._dedicated:
                self._release_memory(lease.dedicated)
        elif lease.pool is not None and not self._closed:
            lease.pool.alloc.free(lease.offset)

    # -- receiver --------------------------------------------------------------------------

    async def open(self, peer: PeerInfo, info: bytes, nbytes: int) -> InboundBuffer:
        self._live_agent()
        remote = self._remotes.get(peer.key)
        if remote is None or not remote.alive:
            raise BackendError(f"{peer.name!r} did not announce nixl in its Hello")
        try:
            ref = _ref_decoder.decode(info)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError(f"malformed nixl reference from {peer.name!r}: {exc}") from None
        if ref.length != nbytes:
            raise BackendError(
                f"nixl reference from {peer.name!r} has length {ref.length} != {nbytes}"
            )
        loaded: _Loaded | None = None
        if ref.pool >= 0:
            if ref.region is not None or ref.metadata:
                raise BackendError(f"nixl reference from {peer.name!r} mixes pool and region")
            if ref.pool >= len(remote.pools):
                raise BackendError(
                    f"nixl reference from {peer.name!r} names pool {ref.pool}; it announced "
                    f"{len(remote.pools)}"
                )
            region = remote.pools[ref.pool]
        else:
            if ref.region is None:
                raise BackendError(f"nixl reference from {peer.name!r} names no region")
            region = ref.region
        if ref.offset + ref.length > region.length or region.addr + region.length > _U64_MAX:
            raise BackendError(
                f"nixl reference from {peer.name!r} spans [{ref.offset}, "
                f"{ref.offset + ref.length}) outside its {region.mem} region of "
                f"{region.length} bytes"
            )
        if ref.pool < 0:
            loaded = await self._load_region(remote, region, ref.metadata)
        inb = _Inbound(remote, region.addr + ref.offset, region.dev, region.mem, nbytes, loaded)
        self._inbounds.add(inb)
        buffer = torch.empty(0, dtype=torch.uint8) if nbytes == 0 else None
        return InboundBuffer(peer, nbytes, buffer, handle=inb)

    async def _load_region(self, remote: _Remote, region: _Region, metadata: bytes) -> _Loaded:
        """Make a dedicated region of the peer known to our agent; count one user."""
        agent = self._live_agent()
        if len(metadata) > _MAX_METADATA:
            raise BackendError(f"nixl metadata from {remote.peer!r} is too large")
        if any(region.overlaps(p) for p in remote.pools):
            raise BackendError(
                f"nixl reference from {remote.peer!r} names a region inside its own pool"
            )
        async with remote.lock:
            entry = remote.loaded.get(region.key)
            busy = [e for e in remote.loaded.values() if e.users and e.region.overlaps(region)]
            if busy:
                raise BackendError(
                    f"nixl reference from {remote.peer!r} names a region that overlaps one "
                    "still in use"
                )
            if entry is not None and entry.metadata == metadata:
                entry.users += 1  # the same registration again: nothing to load
                return entry
            stale = [e for e in remote.loaded.values() if e.region.overlaps(region)]
            if stale or len(remote.loaded) > _MAX_STALE:
                await self._reload(remote)
            try:
                await anyio.to_thread.run_sync(agent.load, metadata, remote.agent, remote.peer)
            except BackendError:
                if _md_agent(metadata) != remote.agent:
                    raise
                await self._reload(remote)  # NIXL refused it against a stale entry
                await anyio.to_thread.run_sync(agent.load, metadata, remote.agent, remote.peer)
            entry = remote.loaded[region.key] = _Loaded(region, metadata)
            entry.users += 1
            return entry

    async def _reload(self, remote: _Remote) -> None:
        """Forget everything the agent knows of the peer and load its metadata again
        (with the regions still in use), once no read from it is in flight. The
        caller holds ``remote.lock``."""
        agent = self._live_agent()
        event = remote.refreshing = anyio.Event()
        try:
            with anyio.fail_after(self.timeout_for(0)):
                await self._wait_idle(remote)
            keep = {k: e for k, e in remote.loaded.items() if e.users}

            def reload() -> None:
                agent.unload(remote.agent)
                agent.load(remote.metadata, remote.agent, remote.peer)
                for e in keep.values():
                    agent.load(e.metadata, remote.agent, remote.peer)

            await anyio.to_thread.run_sync(reload)
            remote.loaded = keep
            self._counters["reloads"] += 1
        except TimeoutError:
            raise BackendError(
                f"nixl: reads from {remote.peer!r} did not drain; cannot reload its metadata"
            ) from None
        finally:
            remote.refreshing = None
            event.set()

    async def fetch(
        self, inb: InboundBuffer, lo: int, hi: int, dest: torch.Tensor | None = None
    ) -> None:
        h = inb.handle
        if not isinstance(h, _Inbound) or h not in self._inbounds:
            raise BackendError("nixl: fetch on a closed reference")
        if not 0 <= lo <= hi <= h.nbytes:
            raise BackendError(f"nixl: range [{lo}, {hi}) outside the object of {h.nbytes} B")
        if hi == lo:
            return
        agent = self._live_agent()
        remote = h.remote
        while remote.refreshing is not None:
            await remote.refreshing.wait()
        if not remote.alive:
            raise BackendError(f"nixl: peer {remote.peer!r} is gone")
        direct = (
            dest is not None
            and h.nbytes >= self.register_dest_min
            and dest.dtype == torch.uint8
            and dest.dim() == 1
            and dest.is_contiguous()
            and dest.numel() >= hi
            and dest.device.type in ("cpu", "cuda")
        )
        if not direct and h.landing is None and h.landing_pool is None:
            await self._take_landing(h)
            if dest is None:
                inb.buffer = self._landing_view(h)
        if (
            direct
            and dest is not None
            and h.dest is not None
            and (h.dest.data_ptr(), h.dest.numel()) != (dest.data_ptr(), dest.numel())
        ):  # another destination than the last fetch's: register that one instead
            old = h.dest_descs
            h.dest = h.dest_descs = None
            if old is not None:
                await anyio.to_thread.run_sync(agent.deregister, old)
        what = f"object {h.oid} of {remote.peer!r}"
        timeout = self.timeout_for(hi - lo)
        register = direct and h.dest_descs is None

        def run() -> None:
            local: tuple[int, int, str]
            if direct:
                assert dest is not None
                mem: Mem = "VRAM" if dest.is_cuda else "DRAM"
                dev = dest.device.index or 0
                if h.dest_descs is None:
                    h.dest_descs = agent.register(_Region(dest.data_ptr(), dest.numel(), dev, mem))
                    h.dest = dest
                local = (dest.data_ptr() + lo, dev, mem)
            else:
                base, ldev, lmem = self._landing_addr(h)
                local = (base + lo, ldev, lmem)
            agent.read(
                local,
                remote.agent,
                (h.addr + lo, h.dev, h.mem),
                hi - lo,
                timeout,
                lambda: not remote.alive or self._closed,
                what,
            )
            if direct and hi == h.nbytes and h.dest_descs is not None:
                descs, h.dest_descs, h.dest = h.dest_descs, None, None
                agent.deregister(descs)
            elif not direct and dest is not None:
                dest[lo:hi].copy_(self._landing_view(h)[lo:hi])

        error: BackendError | None = None
        self._active += 1
        remote.active += 1
        try:
            await anyio.to_thread.run_sync(run)
        except BackendError as exc:
            error = exc
        finally:
            self._active -= 1
            remote.active -= 1
            if remote.active == 0 and remote.idle is not None:
                remote.idle.set()
            if self._active == 0 and self._idle is not None:
                self._idle.set()
        if error is None:
            self._counters["reads"] += 1
            self._counters["dest_registrations"] += register
            return
        if isinstance(error, _StuckRead):
            self._quarantine_inbound(h, dest)
        if remote.alive and not self._closed:
            # NIXL forgets a peer's metadata after a connection error: load it again,
            # so that later objects can be read.
            async with remote.lock:
                if not await anyio.to_thread.run_sync(agent.known, remote.agent):
                    with contextlib.suppress(BackendError):
                        await self._reload(remote)
        raise error

    async def _take_landing(self, h: _Inbound) -> None:
        pool = self._pool_for("cpu")
        offset = pool.alloc.allocate(h.nbytes) if pool is not None else None
        if pool is not None and offset is not None:
            h.landing_pool = (pool, offset)
        else:
            h.landing = await self._dedicated_memory(h.nbytes, "DRAM", 0, "receive")

    @staticmethod
    def _landing_addr(h: _Inbound) -> tuple[int, int, str]:
        if h.landing_pool is not None:
            pool, offset = h.landing_pool
            region = pool.memory.region
            return region.addr + offset, region.dev, region.mem
        assert h.landing is not None
        region = h.landing.region
        return region.addr, region.dev, region.mem

    @staticmethod
    def _landing_view(h: _Inbound) -> torch.Tensor:
        if h.landing_pool is not None:
            pool, offset = h.landing_pool
            return pool.memory.tensor[offset : offset + h.nbytes]
        assert h.landing is not None
        return h.landing.tensor[: h.nbytes]

    def _quarantine_inbound(self, h: _Inbound, dest: torch.Tensor | None) -> None:
        """A read could not be cancelled: keep the memory it targets out of reuse."""
        if h.landing_pool is not None:
            self._quarantine.append(h.landing_pool)
            h.landing_pool = None
        if h.landing is not None:
            self._quarantine.append(h.landing)
            self._dedicated.discard(h.landing)
            h.landing = None
        if dest is not None:
            self._quarantine.append(dest)  # the caller's pool block stays referenced
        if h.dest_descs is not None:
            self._quarantine.append(h.dest_descs)  # stays registered
            h.dest_descs = h.dest = None

    def close(self, inb: InboundBuffer) -> None:
        h = inb.handle
        if not isinstance(h, _Inbound):
            return
        inb.handle = None
        inb.buffer = None
        if h not in self._inbounds:
            return
        self._inbounds.discard(h)
        if h.loaded is not None:
            h.loaded.users -= 1
        if h.landing_pool is not None:
            pool, offset = h.landing_pool
            h.landing_pool = None
            if not self._closed and pool in self._pools:
                pool.alloc.free(offset)
        if h.landing is not None:
            memory, h.landing = h.landing, None
            if memory in self._dedicated:
                self._release_memory(memory)
        if h.dest_descs is not None and self._agent is not None:  # closed before the end
            descs, h.dest_descs, h.dest = h.dest_descs, None, None
            self._later(self._agent.deregister, descs)


# -- raw engine benchmark ------------------------------------------------------------------


def _bench_agent(name: str, size: int) -> tuple[_Agent, _Memory]:
    agent = _Agent(name)
    return agent, _Memory.create(agent, size, "DRAM", 0)


def _pattern(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int32) % 251).to(torch.uint8)


def _serve(size: int) -> int:
    """The passive side of :func:`raw_bench`: register a buffer, print how to reach it,
    wait for EOF on stdin."""
    agent, memory = _bench_agent(_agent_name("raw-target"), size)
    n = min(memory.region.length, 1 << 20)
    memory.tensor[:n].copy_(_pattern(n))
    line = {
        "agent": agent.name,
        "metadata": agent.metadata().hex(),
        "addr": memory.region.addr,
        "length": memory.region.length,
    }
    print(json.dumps(line), flush=True)
    sys.stdin.read()
    memory.release(agent)
    agent.close()
    return 0


def raw_bench(sizes: Sequence[int], iters: int) -> dict[int, float]:
    """GB/s of bare NIXL: READs of ``size`` bytes from a pre-registered buffer of another
    process (``python -m omniwire.backends.nixl serve``) into a pre-registered local
    buffer, the operation the backend uses; median of ``iters`` after one warm-up.

    Raises:
        BackendError: the engine or the other process failed.
    """
    if not sizes:
        return {}
    size_max = max(sizes)
    proc = subprocess.Popen(
        [sys.executable, "-m", MODULE, "serve", "--size", str(size_max)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    agent: _Agent | None = None
    memory: _Memory | None = None
    results: dict[int, float] = {}
    try:
        line = proc.stdout.readline()
        try:
            target = json.loads(line)
        except ValueError:
            raise BackendError(
                f"nixl raw_bench: target did not start (said {line[:200]!r})"
            ) from None
        agent, memory = _bench_agent(_agent_name("raw-initiator"), size_max)
        peer = str(target["agent"])
        agent.load(bytes.fromhex(target["metadata"]), peer, "raw-bench target")
        local = memory.region
        for size in sizes:
            times = []
            for i in range(iters + 1):
                started = time.perf_counter()
                agent.read(
                    (local.addr, 0, "DRAM"),
                    peer,
                    (int(target["addr"]), 0, "DRAM"),
                    size,
                    60.0,
                    lambda: False,
                    f"raw read {i}",
                    spin=True,
                )
                if i:
                    times.append(time.perf_counter() - started)
            results[size] = size / statistics.median(times) / 1e9
        expected = _pattern(min(size_max, 1 << 20))
        if not torch.equal(memory.tensor[: expected.numel()], expected):
            raise BackendError("nixl raw_bench: the bytes read differ from the target's")
        agent.unload(peer)
    finally:
        proc.stdin.close()
        code = proc.wait(30)
        proc.stdout.close()
        if memory is not None and agent is not None:
            memory.release(agent)
        if agent is not None:
            agent.close()
    if code != 0:
        raise BackendError(f"nixl raw_bench: the target process exited with {code}")
    return results


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="the passive side of raw_bench")
    serve.add_argument("--size", type=_parse_size, required=True)
    bench = sub.add_parser("bench", help="GB/s of bare NIXL READs between two processes")
    bench.add_argument("--sizes", default="1M,64M", help="comma-separated, e.g. 1M,64M")
    bench.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args.size)
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s]
    for size, gbps in raw_bench(sizes, args.iters).items():
        print(f"{size:>12} B  {gbps:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
