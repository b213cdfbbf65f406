"""Starting and closing an endpoint, and its periodic housekeeping.

``start()`` binds the control plane, starts the backends and the background
tasks, then connects to the configured peers; if anything fails, everything
started so far is released before the error propagates. ``aclose()`` says
Goodbye, NACKs what was not taken, fails what is in flight and releases every
buffer, segment, task and socket — shielded and bounded, so whatever cancels the
caller, nothing is left behind.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING

import anyio

from ..addresses import parse_address
from ..backends.base import BackendContext
from ..errors import ConfigurationError, OmniwireError
from ..registry import backend_status, backends, load_backend
from ..routing import StaticTablePolicy
from ._core import Core, State
from ._dispatch import Dispatcher
from ._peers import PeerTable
from ._receiver import Receiver
from ._sender import Sender

if TYPE_CHECKING:
    from ._facade import Endpoint

__all__ = ["Lifecycle"]

log = logging.getLogger("omniwire.endpoint")

_CLOSE_BUDGET = 5.0  # seconds aclose() may spend on backends and sockets


class Lifecycle:
    def __init__(
        self,
        endpoint: Endpoint,
        core: Core,
        peers: PeerTable,
        sender: Sender,
        receiver: Receiver,
        dispatch: Dispatcher,
    ) -> None:
        self._endpoint = endpoint
        self._core = core
        self._peers = peers
        self._sender = sender
        self._receiver = receiver
        self._dispatch = dispatch
        self._closed = anyio.Event()

    async def start(self) -> None:
        """See :meth:`Endpoint.start`."""
        core = self._core
        if core.state is not State.NEW:
            raise OmniwireError(f"endpoint {core.name!r} was already started")
        running = _running_asyncio_loop()
        core.state = State.OPEN
        core.loop = running
        core.loop_thread = threading.get_ident()
        try:
            await core.control.start()
            for name in self._choose_backends():
                ctx = BackendContext(
                    endpoint=core.name,
                    instance=core.instance,
                    options=core.config.backend_options.get(name, {}),
                    host=_host_of(core.control.address),
                )
                backend = load_backend(name)(ctx)
                core.backends[name] = backend
                await backend.start()
            await core.supervisor.start()
            for peer, peer_address in core.config.peers.items():
                self._peers.add(peer, peer_address)
            policy = core.config.policy
            if isinstance(policy, StaticTablePolicy) and core.config.peers:
                for problem in policy.unmatched(core.name, core.config.peers):
                    log.warning("%s: %s", core.name, problem)
        except BaseException:
            await self.release_everything()
            raise
        for loop in (self._dispatch.control_loop, self._dispatch.abort_loop, self.housekeeping):
            core.supervisor.spawn(loop)
        if core.observer is not None:
            core.observer.attach(self._endpoint)

    def _choose_backends(self) -> list[str]:
        cfg = self._core.config
        if cfg.backends is not None:
            return list(cfg.backends)
        tcp = cfg.address.startswith("tcp://")
        chosen = []
        for name in backends():
            entry = backend_status(name)
            if entry.status != "available" or entry.cls is None:
                continue
            auto = entry.cls.auto_start
            if auto == "always" or (auto == "tcp" and tcp):
                chosen.append(name)
        return chosen

    async def aclose(self, reason: str = "") -> None:
        """See :meth:`Endpoint.aclose`."""
        core = self._core
        if core.state is State.NEW:
            core.state = State.CLOSED
            self._closed.set()
            return
        if core.state is not State.OPEN:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2 * _CLOSE_BUDGET):
                await self._closed.wait()
            return
        core.state = State.CLOSING
        with anyio.CancelScope(shield=True):
            try:
                # NACKs of what we hold first: the Goodbye is the last frame (§10.5)
                self._receiver.close()
                self._sender.ledger.close()
                self._peers.goodbye(reason)
                await core.outbox.flush(0.5)
            finally:
                await self.release_everything()

    async def release_everything(self) -> None:
        """Stop tasks, close backends and sockets (shielded, bounded)."""
        core = self._core
        with anyio.CancelScope(shield=True):
            core.state = State.CLOSING
            self._peers.close()
            await core.supervisor.aclose(timeout=2.0)
            core.outbox.close()
            for backend in core.backends.values():
                with anyio.move_on_after(_CLOSE_BUDGET):
                    try:
                        await backend.aclose()
                    except Exception:
                        log.exception("closing backend %s of %s", backend.name, core.name)
            await core.control.aclose()
            self._receiver.reader.close()
            core.state = State.CLOSED
            self._closed.set()
            if core.observer is not None:
                core.observer.detach(self._endpoint)

    async def housekeeping(self) -> None:
        """ACK deadlines and liveness, a few times a second."""
        cfg = self._core.config
        tick = max(0.05, min(0.5, cfg.ack_timeout / 10, cfg.peer_timeout / 5))
        while True:
            await anyio.sleep(tick)
            now = time.monotonic()
            self._peers.tick(now)
            self._sender.ledger.check_deadlines(now)
            self._receiver.check_idle(now)
            self._receiver.flush_windows()
            self._receiver.deliveries.expire(now)
            self._core.noisy.flush()


def _host_of(address: str) -> str:
    """The host peers dial this endpoint at (ipc:// means this host: loopback)."""
    parsed = parse_address(address)
    return parsed.host.strip("[]") if parsed.scheme == "tcp" and parsed.host else "127.0.0.1"


def _running_asyncio_loop() -> asyncio.AbstractEventLoop:
    """The asyncio loop running this task (uvloop's included); a clear error under any
    other async library (trio: anyio.run(..., backend="trio"))."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")  # loaded if it runs this task; never imported here
    in_trio = trio is not None and getattr(trio.lowlevel, "in_trio_run", lambda: True)()
    library = "trio" if in_trio else "another library"
    raise ConfigurationError(
        f"omniwire runs on asyncio (pyzmq's asyncio sockets), not {library}: run it "
        "with asyncio.run(...), uvloop.run(...) or anyio.run(..., backend='asyncio')"
    )
