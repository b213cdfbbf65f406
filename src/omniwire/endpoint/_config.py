"""An endpoint's configuration, checked whole at construction.

Every option a user can get wrong is refused here with a
:class:`~omniwire.errors.ConfigurationError` that names the option and the value,
before any socket, segment or task exists — so a refused endpoint leaves
nothing behind.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import registry, wire
from ..addresses import parse_address
from ..errors import ConfigurationError, UnknownNameError, WireFormatError
from ..routing import INLINE, DefaultPolicy, RoutingPolicy, StaticTablePolicy

__all__ = ["EndpointConfig", "default_address"]


def default_address(name: str) -> str:
    """A fresh ipc address in the temp directory, unique to this process and call."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:32]
    base = os.path.join(tempfile.gettempdir(), f"omniwire-{os.getuid()}")
    return f"ipc://{base}/{safe}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class EndpointConfig:
    """The validated options of one :class:`~omniwire.Endpoint` (see its docstring)."""

    name: str
    address: str
    peers: Mapping[str, str]
    policy: RoutingPolicy
    backends: tuple[str, ...] | None
    backend_options: Mapping[str, Mapping[str, Any]]
    max_inflight: int
    max_inflight_bytes: int
    ack_timeout: float
    handshake_timeout: float
    unclaimed_timeout: float
    peer_timeout: float
    heartbeat_interval: float
    zero_copy: bool
    receive_buffer: int
    receive_buffer_bytes: int
    receive_window: int
    max_open_streams: int
    stream_idle_timeout: float
    max_ack_timeouts: int
    allow_pickle: bool
    auth_key: str | bytes | None
    host_id: str | None
    progressive_chunk: int
    max_peers: int
    control_ring: bool
    digest: bool = False

    @classmethod
    def build(
        cls,
        name: str,
        *,
        address: str | None,
        peers: Mapping[str, str] | None,
        policy: RoutingPolicy | str | None,
        routes: Mapping[str, str] | None,
        backends: Sequence[str] | None,
        backend_options: Mapping[str, Mapping[str, Any]] | None,
        **numbers: Any,
    ) -> EndpointConfig:
        """Check every option; return the configuration.

        Raises:
            ConfigurationError: a bad name, number or option (naming it).
            AddressError: ``address`` or a ``peers=`` address is not usable.
            UnknownNameError: a backend, policy or route names nothing registered.
        """
        _check_name("name", name)
        address = str(parse_address(address or default_address(name), what="address", bind=True))
        checked_peers: dict[str, str] = {}
        for peer, peer_address in (peers or {}).items():
            _check_name(f"peers key {peer!r}", peer)
            if peer == name:
                raise ConfigurationError(f"peers= names {name!r}, this endpoint's own name")
            checked_peers[peer] = str(parse_address(peer_address, what=f"peers[{peer!r}]"))
        registered = set(registry.backends())
        for backend in backends or ():
            if backend not in registered:
                raise UnknownNameError(
                    f"backends= names {backend!r}, which is not registered; registered: "
                    f"{', '.join(sorted(registered))}"
                )
        for backend in backend_options or {}:
            if backend not in registered:
                raise UnknownNameError(
                    f"backend_options= names {backend!r}, which is not registered; "
                    f"registered: {', '.join(sorted(registered))}"
                )
        base: RoutingPolicy
        if isinstance(policy, str):
            base = registry.load_policy(policy)
        elif policy is None:
            base = DefaultPolicy()
        elif isinstance(policy, RoutingPolicy):
            base = policy
        else:
            raise ConfigurationError(f"policy= must be a RoutingPolicy or a name, not {policy!r}")
        for edge, backend in (routes or {}).items():
            if backend not in registered and backend != INLINE.name:
                raise UnknownNameError(
                    f"routes[{edge!r}] names backend {backend!r}, which is not registered; "
                    f"registered: {', '.join(sorted(registered | {INLINE.name}))}"
                )
        for key in ("max_inflight", "receive_buffer", "max_peers", "max_open_streams"):
            _positive(key, numbers[key], integer=True)
        for key in ("max_inflight_bytes", "receive_buffer_bytes", "max_ack_timeouts"):
            _positive(key, numbers[key], integer=True)
        for key in (
            "ack_timeout",
            "handshake_timeout",
            "unclaimed_timeout",
            "peer_timeout",
            "heartbeat_interval",
            "stream_idle_timeout",
        ):
            _positive(key, numbers[key])
        if (
            isinstance(numbers["receive_window"], bool)
            or not isinstance(numbers["receive_window"], int)
            or numbers["receive_window"] < 4096
        ):
            raise ConfigurationError(
                f"receive_window must be an integer of at least 4096 bytes, not "
                f"{numbers['receive_window']!r}"
            )
        if numbers["progressive_chunk"] < 0:
            raise ConfigurationError(
                f"progressive_chunk must be >= 0 (0 disables), not {numbers['progressive_chunk']!r}"
            )
        return cls(
            name=name,
            address=address,
            peers=checked_peers,
            policy=StaticTablePolicy(routes, base) if routes else base,
            backends=tuple(backends) if backends is not None else None,
            backend_options={k: dict(v) for k, v in (backend_options or {}).items()},
            **numbers,
        )


def _check_name(what: str, name: object) -> None:
    if not isinstance(name, str):
        raise ConfigurationError(f"{what} must be a str, not {type(name).__name__}")
    try:  # the wire's own rule for stage names
        wire.GoodbyeMessage(from_stage=name, instance=0)
    except (ValueError, WireFormatError) as exc:
        raise ConfigurationError(f"{what} {name[:80]!r} is not a valid stage name: {exc}") from None


def _positive(what: str, value: object, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ConfigurationError(f"{what} must be {kind}, not {value!r}")
