"""What the parts of an endpoint share: its identity, configuration, sockets and counters."""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
from dataclasses import dataclass, field

from .. import hostinfo, wire
from .._ratelimit import RateLimitedLog
from ..backends.base import BackendBase
from ..control import ControlPlane, CurveKey
from ..errors import EndpointClosedError, EndpointNotStartedError
from ..observe import Observer
from ._aborts import Aborts
from ._config import EndpointConfig
from ._outbox import Outbox
from ._stats import Counters
from ._supervisor import Supervisor

__all__ = ["Core", "State"]

log = logging.getLogger("omniwire.endpoint")


class State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


_OPEN = State.OPEN  # (a module global: reading it through the enum costs 70 ns)


@dataclass(eq=False)
class Core:
    """One endpoint's shared state; each part (peers, sender, receiver) holds it."""

    config: EndpointConfig
    instance: int
    host_id: str
    devices: tuple[wire.DeviceInfo, ...]
    control: ControlPlane
    supervisor: Supervisor
    outbox: Outbox
    counters: Counters
    aborts: Aborts = field(default_factory=Aborts)
    backends: dict[str, BackendBase] = field(default_factory=dict)
    state: State = State.NEW
    loop: asyncio.AbstractEventLoop | None = None
    loop_thread: int = 0
    #: Log records a peer can cause go through here: a few per cause, then a count.
    noisy: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log, interval=10.0))
    #: Told of sends, credit waits and deliveries; None (the default) costs nothing.
    observer: Observer | None = None

    @classmethod
    def assemble(
        cls, config: EndpointConfig, key: str | bytes | None, observer: Observer | None
    ) -> Core:
        """The state of a new endpoint: its control plane (CURVE when ``key`` is set),
        supervisor, outbox and counters."""
        counters = Counters()
        supervisor = Supervisor(config.name, counters)
        control = ControlPlane(
            config.address,
            key=CurveKey.from_shared_secret(key) if key else None,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=3 * config.heartbeat_interval,
        )
        return cls(
            config=config,
            instance=secrets.randbits(63),
            host_id=config.host_id or hostinfo.host_id(),
            devices=hostinfo.local_devices(),
            control=control,
            supervisor=supervisor,
            outbox=Outbox(control, supervisor),
            counters=counters,
            observer=observer,
        )

    @property
    def name(self) -> str:
        return self.config.name

    def check_open(self) -> None:
        """Raises EndpointNotStartedError / EndpointClosedError unless the endpoint is open."""
        if self.state is _OPEN:  # (runs for every send)
            return
        if self.state is State.NEW:
            raise EndpointNotStartedError(
                f"endpoint {self.name!r} is not started: use `async with Endpoint(...)` "
                "or `await endpoint.start()` first"
            )
        raise EndpointClosedError(f"endpoint {self.name!r} is closed")
