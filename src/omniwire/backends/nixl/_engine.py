"""nixl's raw engine calls, behind the :class:`Agent` seam.

:class:`Agent` is everything the backend asks of a NIXL agent. :class:`NixlAgent`
implements it with NIXL's Python API; a test passes another object with the same
methods as ``NixlBackend(ctx, agent_factory=...)`` or
``backend_options={"nixl": {"agent_factory": ...}}`` (a callable taking the agent
name). Every NIXL exception is mapped to :class:`~omniwire.errors.BackendError`
here, once (:func:`~omniwire.backends.base.map_errors`). The calls block: run
them in worker threads.

Logging: NIXL's import configures a logger that prints to *stdout* and turns off
``logging.raiseExceptions``; both are undone (``NIXL_LOG_LEVEL`` sets its level,
default WARNING).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import secrets
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import ModuleType, SimpleNamespace
from typing import Any, Protocol

from ...errors import BackendClosedError, BackendError
from ..base import map_errors, one_line
from ..support import Completions, poll_until
from ._blobs import Region, md_agent

__all__ = ["Agent", "NixlAgent", "StuckRead", "agent_name", "load_api", "read", "read_async"]

log = logging.getLogger("omniwire.nixl")

#: Where the agent API is, in order: the ``nixl`` meta-package, then the CUDA builds.
API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")

#: NIXL's registration list of one region (an untyped binding object).
Registration = object
#: A transfer handle of NIXL (an untyped binding object).
Transfer = object
#: ``(addr, length, dev)`` of one transfer descriptor.
Desc = tuple[int, int, int]


class StuckRead(BackendError):
    """A READ failed or was abandoned and NIXL could not cancel it: it may still land."""


class Agent(Protocol):
    """The raw calls of one NIXL agent (blocking; failures are BackendError)."""

    name: str

    def register(self, region: Region) -> Registration:
        """Register ``region`` of this process with the agent."""

    def deregister(self, registration: Registration) -> None:
        """Undo :meth:`register` (quiet: a failure is logged)."""

    def metadata(self) -> bytes:
        """The agent's metadata (every registration), for peers to load."""

    def partial_metadata(self, registration: Registration) -> bytes:
        """The metadata of one registration only."""

    def load(self, metadata: bytes) -> str:
        """Load a peer's (full or partial) metadata; returns the agent it names."""

    def unload(self, agent: str) -> None:
        """Forget a remote agent (quiet if unknown)."""

    def known(self, agent: str) -> bool:
        """Whether the agent's metadata is loaded."""

    def connect(self, agent: str) -> None:
        """Open the connection to ``agent`` ahead of the first read (best effort)."""

    def start_read(
        self, local: Sequence[Desc], local_mem: str, agent: str, remote: Sequence[Desc], mem: str
    ) -> tuple[Transfer, str]:
        """Start READs of ``remote`` (of ``agent``) into ``local``; returns the
        transfer and its first state."""

    def start_write(
        self, local: Sequence[Desc], local_mem: str, agent: str, remote: Sequence[Desc], mem: str
    ) -> tuple[Transfer, str]:
        """Start WRITEs of ``local`` into ``remote`` (of ``agent``), done when the bytes
        are there; returns the transfer and its first state. (An agent of a test may
        lack it: the backend then lands nothing.)"""

    def state(self, transfer: Transfer) -> str:
        """``"DONE"``, ``"PROC"`` or an error state."""

    def release(self, transfer: Transfer) -> None:
        """Release (cancel) a transfer; raises if NIXL could not."""

    def close(self) -> None:
        """Destroy the agent."""


_api: ModuleType | None = None
_api_error: str | None = None


def _tame_nixl_logging(raise_exceptions: bool) -> None:
    logging.raiseExceptions = raise_exceptions
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is not sys.stderr:
            nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)


def load_api(modules: Sequence[str] = API_MODULES) -> ModuleType:
    """The ``_api`` module of the first NIXL build that imports (cached).

    Raises:
        ImportError: none does; the message lists why for each.
    """
    global _api, _api_error
    default = tuple(modules) == API_MODULES
    if default and _api is not None:
        return _api
    if default and _api_error is not None:
        raise ImportError(_api_error)
    errors = []
    raise_exceptions = logging.raiseExceptions
    try:
        for name in modules:
            try:
                module = importlib.import_module(name)
            except (ImportError, OSError) as exc:  # OSError: a shared library is missing
                errors.append(f"{name}: {exc}")
                continue
            if hasattr(module, "nixl_agent") and hasattr(module, "nixl_agent_config"):
                if default:
                    _api = module
                return module
            errors.append(f"{name}: has no nixl_agent")
    finally:
        _tame_nixl_logging(raise_exceptions)
    error = "cannot import the NIXL agent API (" + "; ".join(errors) + ")"
    if default:
        _api_error = error
    raise ImportError(error)


def agent_name(endpoint: str) -> str:
    """A unique agent name for an endpoint of this process."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", endpoint)[:48]
    return f"ow-{safe}-{os.getpid()}-{secrets.token_hex(6)}"


def _nixl(what: str) -> AbstractContextManager[None]:
    return map_errors({Exception: BackendError}, f"nixl: {what}")


#: How long (µs; NIXL rounds it up to whole ms) the UCX progress thread waits in
#: ``poll()`` for an event before it looks at its workers anyway (events wake it
#: sooner). NIXL's Python wrapper hard-codes 0, which makes that thread a busy
#: loop: one whole core per agent, idle or not. Measured here, per connected agent
#: idle: 100 % of a core with 0, 4.1–4.6 % with 1 ms, 0.7–0.85 % with 10 ms,
#: 0.34 % with 100 ms; a 1 MiB lent READ on loopback, send to ACK: 1.65–2.39 ms
#: with 1 ms, 1.48–1.81 ms with 10 ms (the 1 ms wake-ups take CPU from the
#: transfer on a small machine), 1.99–2.78 ms with 100 ms.
PROGRESS_POLL_US = 10_000

_create_lock = threading.Lock()


def _new_agent(api: ModuleType, name: str, config: Any, progress_poll_us: int) -> Any:
    """``api.nixl_agent(name, config)`` whose progress thread sleeps in ``poll()``
    between events (``pthrDelay = progress_poll_us``) instead of spinning.

    The wrapper builds its native config itself and sets ``pthrDelay = 0``; for the
    duration of the call its ``nixlBind`` module global is replaced by a copy whose
    config class keeps our delay (under a lock: one agent is created at a time).
    Without a ``nixlBind`` whose config can be subclassed, the agent is created as
    the wrapper makes it (spinning).
    """
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if bind is None or not isinstance(base, type) or progress_poll_us <= 0:
        return api.nixl_agent(name, config)
    try:

        class _Config(base):  # type: ignore[misc, valid-type]
            def __setattr__(self, key: str, value: Any) -> None:
                super().__setattr__(key, progress_poll_us if key == "pthrDelay" else value)

    except TypeError:  # a final native class
        log.debug("nixl: cannot set the progress thread's delay; it spins")
        return api.nixl_agent(name, config)
    names = {k: getattr(bind, k) for k in dir(bind) if not k.startswith("__")}
    patched = SimpleNamespace(**{**names, "nixlAgentConfig": _Config})
    with _create_lock:
        api.nixlBind = patched  # type: ignore[attr-defined]
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind = bind  # type: ignore[attr-defined]


class NixlAgent:
    """A NIXL agent with the UCX backend (a progress thread that waits for events,
    see :data:`PROGRESS_POLL_US`; thread-sync mode ``RW``: it is called from several
    worker threads).

    Raises:
        BackendError: it cannot be created, or has no UCX backend.
    """

    def __init__(self, name: str, *, progress_poll_us: int = PROGRESS_POLL_US) -> None:
        try:
            api = load_api()
        except ImportError as exc:
            raise BackendError(str(exc)) from exc
        sync = getattr(api, "nixl_thread_sync_t", None)
        kwargs: dict[str, Any] = {}
        if sync is not None:
            kwargs["sync_mode"] = sync.NIXL_THREAD_SYNC_RW
        with _nixl(f"cannot create agent {name!r}"):
            config = api.nixl_agent_config(
                enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"], **kwargs
            )
            agent = _new_agent(api, name, config, progress_poll_us)
        if "UCX" not in agent.backends:
            raise BackendError(
                f"nixl: agent {name!r} has no UCX backend (plugins found: "
                f"{', '.join(agent.get_plugin_list()) or 'none'}; set NIXL_PLUGIN_DIR?)"
            )
        self.name = name
        self._agent: Any = agent

    @property
    def _nx(self) -> Any:
        if self._agent is None:
            raise BackendClosedError("nixl agent is closed")
        return self._agent

    def register(self, region: Region) -> Registration:
        where = f"[0x{region.addr:x}, +{region.length}) on device {region.dev}"
        with _nixl(f"cannot register {region.mem} {where}"):
            descs = self._nx.register_memory(
                [(region.addr, region.length, region.dev, "")], region.mem
            )
        if descs is None:
            raise BackendError(f"nixl: cannot build a registration list for {region}")
        return descs

    def deregister(self, registration: Registration) -> None:
        try:
            with _nixl("deregistering memory"):
                self._nx.deregister_memory(registration)
        except BackendClosedError:
            pass
        except BackendError as exc:
            log.warning("%s", exc)

    def metadata(self) -> bytes:
        with _nixl("get_agent_metadata"):
            return bytes(self._nx.get_agent_metadata())

    def partial_metadata(self, registration: Registration) -> bytes:
        with _nixl("get_partial_agent_metadata"):
            return bytes(self._nx.get_partial_agent_metadata(registration, False, ["UCX"]))

    def load(self, metadata: bytes) -> str:
        with _nixl("cannot load a peer's metadata"):
            loaded = self._nx.add_remote_agent(metadata)
        # The binding returns bytes; every other call wants str.
        return loaded.decode(errors="replace") if isinstance(loaded, bytes) else str(loaded)

    def unload(self, agent: str) -> None:
        try:
            self._nx.agent.invalidateRemoteMD(agent)  # returns a status; NOT_FOUND is fine
        except BackendClosedError:
            pass
        except Exception as exc:
            log.debug("nixl: invalidating %s: %s", agent, one_line(exc))

    def known(self, agent: str) -> bool:
        try:
            return bool(self._nx.check_remote_metadata(agent))
        except Exception:
            return False

    def connect(self, agent: str) -> None:
        try:
            self._nx.make_connection(agent)
        except Exception as exc:
            log.debug("nixl: make_connection(%s): %s", agent, one_line(exc))

    def start_read(
        self, local: Sequence[Desc], local_mem: str, agent: str, remote: Sequence[Desc], mem: str
    ) -> tuple[Transfer, str]:
        return self._start("READ", local, local_mem, agent, remote, mem)

    def start_write(
        self, local: Sequence[Desc], local_mem: str, agent: str, remote: Sequence[Desc], mem: str
    ) -> tuple[Transfer, str]:
        """A WRITE: NIXL's UCX backend flushes the endpoint after the puts, so ``DONE``
        means the bytes are in the peer's memory."""
        return self._start("WRITE", local, local_mem, agent, remote, mem)

    def _start(
        self,
        op: str,
        local: Sequence[Desc],
        local_mem: str,
        agent: str,
        remote: Sequence[Desc],
        mem: str,
    ) -> tuple[Transfer, str]:
        nx = self._nx
        where = "from" if op == "READ" else "to"
        nbytes = sum(d[1] for d in remote)
        with _nixl(f"cannot create a {op} of {nbytes} bytes {where} {agent!r}"):
            ldescs = nx.get_xfer_descs(list(local), local_mem)
            rdescs = nx.get_xfer_descs(list(remote), mem)
            if ldescs is None or rdescs is None:
                raise BackendError("nixl: cannot build transfer descriptors")
            handle = nx.initialize_xfer(op, ldescs, rdescs, agent)
        try:
            with _nixl(f"{op} {where} {agent!r} failed"):
                return handle, str(nx.transfer(handle))
        except BackendError:
            self.release(handle)
            raise

    def state(self, transfer: Transfer) -> str:
        with _nixl("checking a READ"):
            return str(self._nx.check_xfer_state(transfer))

    def release(self, transfer: Transfer) -> None:
        with _nixl("releasing a READ"):
            transfer.release()  # type: ignore[attr-defined]

    def close(self) -> None:
        self._agent = None  # the last reference: the destructor runs here


class _Read:
    """One READ (or, with ``write``, WRITE) of ``(local addr, remote addr, length)``
    spans, started at once: its state, and its release (always, once), shared by
    :func:`read` and :func:`read_async`."""

    def __init__(
        self,
        agent: Agent,
        reads: Sequence[tuple[int, int, int]],
        local: tuple[int, str],
        remote_agent: str,
        remote: tuple[int, str],
        what: str,
        write: bool = False,
    ) -> None:
        ldescs = [(lo, n, local[0]) for lo, _, n in reads]
        rdescs = [(ro, n, remote[0]) for _, ro, n in reads]
        self.agent = agent
        self.what = f"nixl: {'WRITE' if write else 'READ'} for {what}"
        start = agent.start_write if write else agent.start_read
        self.transfer, self.state = start(ldescs, local[1], remote_agent, rdescs, remote[1])

    def finished(self) -> bool:
        if self.state == "PROC":
            self.state = self.agent.state(self.transfer)
        return self.state != "PROC"

    def check(self) -> None:
        if self.state != "DONE":
            raise BackendError(f"{self.what} failed (state {self.state})")

    def release(self, done: bool) -> None:
        """Release the transfer; StuckRead if it did not finish and NIXL could not
        cancel it, or if it was abandoned still in progress: over UCX's TCP transport
        a READ released in progress still wrote its bytes once the link came back
        (into a receive block given to the next object meanwhile), so it may land."""
        try:
            self.agent.release(self.transfer)
        except BackendError as exc:
            log.warning("%s: releasing it failed: %s", self.what, exc)
            if not done:
                raise StuckRead(f"{self.what} could not be cancelled: {exc}") from exc
        if not done and self.state == "PROC":
            raise StuckRead(f"{self.what} was abandoned in progress: it may still land")


def read(
    agent: Agent,
    reads: Sequence[tuple[int, int, int]],
    local: tuple[int, str],
    remote_agent: str,
    remote: tuple[int, str],
    timeout: float,
    what: str,
    cancelled: Callable[[], bool] | None = None,
    *,
    spin: bool = False,
    write: bool = False,
) -> None:
    """READ (or, with ``write``, WRITE) each ``(local addr, remote addr, length)`` in
    one transfer, the local side on ``local = (dev, mem)``, the remote on ``remote``;
    wait for it (blocking) and release the transfer, always.

    Raises:
        StuckRead: it failed or was abandoned and could not be released (it may still
            land: never reuse its memory).
        TransferTimeoutError: not done within ``timeout`` (released).
        BackendError: NIXL refused or failed it, or ``cancelled()`` turned true.
    """
    op = _Read(agent, reads, local, remote_agent, remote, what, write)
    done = False
    try:
        poll_until(op.finished, timeout=timeout, what=op.what, cancelled=cancelled, spin=spin)
        op.check()
        done = True
    finally:
        op.release(done)


async def read_async(
    agent: Agent,
    completions: Completions,
    reads: Sequence[tuple[int, int, int]],
    local: tuple[int, str],
    remote_agent: str,
    remote: tuple[int, str],
    timeout: float,
    what: str,
    cancelled: Callable[[], bool] | None = None,
    *,
    write: bool = False,
) -> None:
    """:func:`read` started on the event loop (creating and posting a READ only queues
    it for UCX's progress thread) and waited for by ``completions``, which wakes the
    loop when it ends: no worker thread to schedule before the READ starts.

    Raises: as :func:`read`.
    """
    op = _Read(agent, reads, local, remote_agent, remote, what, write)
    done = False
    try:
        await completions.wait(
            op.finished,
            timeout=timeout,
            what=op.what,
            cancelled=cancelled,
            nbytes=sum(n for _, _, n in reads),
        )
        op.check()
        done = True
    finally:
        op.release(done)


def check_agent(metadata: bytes, expected: str, peer: str) -> None:
    """Raises BackendError unless the metadata blob names agent ``expected``."""
    named = md_agent(metadata)
    if named != expected:
        raise BackendError(
            f"nixl metadata from {peer!r} names agent {named!r}, not its own {expected!r}"
        )


def load_checked(agent: Agent, metadata: bytes, expected: str, peer: str) -> None:
    """Load a peer's metadata after checking the agent name it carries.

    Raises:
        BackendError: it names another agent, or NIXL refused it.
    """
    check_agent(metadata, expected, peer)
    loaded = agent.load(metadata)
    if loaded != expected:  # pragma: no cover - checked above; defensive
        raise BackendError(f"nixl: loaded agent {loaded!r}, expected {expected!r}")


AgentFactory = Callable[[str], Agent]
