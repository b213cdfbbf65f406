"""An endpoint's options, each declared once, and its configuration, checked whole
at construction.

:data:`OPTIONS` is the one declaration of every ``Endpoint`` option (h2's
``H2Configuration`` shape): its name, type, default, check and one line of doc.
The constructor's signature, its docstring's ``Args``, the fields of
:class:`EndpointConfig` and the README's option table are derived from it or
tested against it (``tests/test_options.py``); adding an option means adding one
:class:`Option` here, its parameter in ``Endpoint.__init__`` and its field below
(the tests name whichever is missing).

Every option a user can get wrong is refused here with a
:class:`~omniwire.errors.ConfigurationError` that names the option and the value,
before any socket, segment or task exists — so a refused endpoint leaves
nothing behind. No value is coerced: ``zero_copy="no"`` is refused, not truthy.
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import registry, wire
from ..addresses import parse_address
from ..errors import ConfigurationError, UnknownNameError, WireFormatError
from ..observe import Observer
from ..routing import INLINE, DefaultPolicy, RoutingPolicy, StaticTablePolicy
from ..wire._constants import MAX_TEXT_BYTES

__all__ = [
    "OPTIONS",
    "EndpointConfig",
    "Option",
    "default_address",
    "options_doc",
    "options_table",
]

#: Counts fit a signed 64-bit integer (some travel in the Hello).
_MAX_COUNT = (1 << 63) - 1
#: Seconds: positive, finite, at most this (about 31 years).
_MAX_SECONDS = 1e9


def default_address(name: str) -> str:
    """A fresh ipc address in the temp directory, unique to this process and call."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:32]
    base = os.path.join(tempfile.gettempdir(), f"omniwire-{os.getuid()}")
    return f"ipc://{base}/{safe}-{os.getpid()}-{secrets.token_hex(3)}"


# -- checks: each takes (option name, value), returns the value or raises ------------


def _refuse(what: str, wants: str, value: object) -> ConfigurationError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigurationError(f"{what} must be {wants}, not {shown} ({type(value).__name__})")


def _flag(what: str, value: Any) -> Any:
    if type(value) is not bool:
        raise _refuse(what, "True or False", value)
    return value


def _count(low: int) -> Callable[[str, Any], Any]:
    wants = "a positive integer" if low == 1 else f"an integer >= {low}"

    def check(what: str, value: Any) -> Any:
        if type(value) is not int or not low <= value <= _MAX_COUNT:
            raise _refuse(what, wants, value)
        return value

    return check


def _seconds(least: float | None = None, most: float = _MAX_SECONDS) -> Callable[[str, Any], Any]:
    """Seconds: more than 0 (or at least ``least``), finite, at most ``most``."""
    wants = f"a number of seconds {'> 0' if least is None else f'>= {least:g}'} and <= {most:g}"

    def check(what: str, value: Any) -> Any:
        if type(value) not in (int, float) or not math.isfinite(value) or value > most:
            raise _refuse(what, wants, value)
        if value <= 0 if least is None else value < least:
            raise _refuse(what, wants, value)
        return value

    return check


def _optional(kinds: tuple[type, ...], wants: str) -> Callable[[str, Any], Any]:
    def check(what: str, value: Any) -> Any:
        if value is not None and not isinstance(value, kinds):
            raise _refuse(what, wants, value)
        return value

    return check


def _host_id(what: str, value: Any) -> Any:
    if value is None:
        return value
    if type(value) is not str or not 0 < len(value.encode("utf-8", "replace")) <= MAX_TEXT_BYTES:
        raise _refuse(what, f"None or a non-empty str of at most {MAX_TEXT_BYTES} bytes", value)
    return value


def _secret(what: str, value: Any) -> Any:
    if value is not None and (type(value) not in (str, bytes) or not value):
        raise _refuse(what, "None or a non-empty str or bytes", value)
    return value


def _names(what: str, value: Any) -> Any:
    if value is None:
        return value
    if type(value) not in (list, tuple) or not all(type(v) is str for v in value):
        raise _refuse(what, "None or a list of backend names", value)
    return value


def _string_map(values: str) -> Callable[[str, Any], Any]:
    def check(what: str, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, Mapping):
            raise _refuse(what, f"None or a mapping of str to {values}", value)
        for key, item in value.items():
            if type(key) is not str:
                raise _refuse(f"{what} key", "a str", key)
            if values == "str" and type(item) is not str:
                raise _refuse(f"{what}[{key[:80]!r}]", "a str", item)
            if values == "mapping" and not isinstance(item, Mapping):
                raise _refuse(f"{what}[{key[:80]!r}]", "a mapping of options", item)
        return value

    return check


def _observer(what: str, value: Any) -> Any:
    if value is None or isinstance(value, Observer):
        return value
    if type(value) not in (list, tuple) or not all(isinstance(v, Observer) for v in value):
        raise _refuse(what, "None, an Observer or a list of Observers", value)
    return value


@dataclass(frozen=True)
class Option:
    """One ``Endpoint`` option, declared once."""

    name: str
    #: Its annotation in ``Endpoint.__init__``, as written there.
    annotation: str
    default: Any
    #: ``check(name, value)`` returns the value, or raises ConfigurationError naming it.
    check: Callable[[str, Any], Any]
    #: One line: what it does (the README's table and the docstring's first line).
    doc: str
    #: More for the docstring (optional).
    more: str = ""
    #: The default as the README writes it (``1 GiB``); default: ``repr(default)``.
    shown: str = ""


OPTIONS: tuple[Option, ...] = (
    Option(
        "address",
        "str | None",
        None,
        _optional((str,), "None or an address str"),
        "where this endpoint receives frames: `ipc:///path` on one host, `tcp://host:port` "
        "across hosts",
        shown="a fresh ipc path",
    ),
    Option(
        "peers",
        "Mapping[str, str] | None",
        None,
        _string_map("str"),
        "`{stage name: address}` of the peers this endpoint sends to (peers that send to "
        "it are learned from their Hello)",
    ),
    Option(
        "policy",
        "RoutingPolicy | str | None",
        None,
        _optional((RoutingPolicy, str), "None, a RoutingPolicy or a policy name"),
        "a `RoutingPolicy`, or the name of one in the `omniwire.policies` entry-point group",
        shown="`DefaultPolicy()`",
    ),
    Option(
        "routes",
        "Mapping[str, str] | None",
        None,
        _string_map("str"),
        'per-edge overrides, `{"far": "nixl", "far:stream_chunk": "shm"}` (see '
        "`StaticTablePolicy`)",
    ),
    Option(
        "backends",
        "Sequence[str] | None",
        None,
        _names,
        "names of the backends to run",
        shown="every available one that starts by itself: local, shm, cuda_ipc; "
        "mooncake and nixl too on `tcp://`",
    ),
    Option(
        "backend_options",
        "Mapping[str, Mapping[str, Any]] | None",
        None,
        _string_map("mapping"),
        "`{backend name: {option: value}}`",
    ),
    Option(
        "max_inflight",
        "int",
        16,
        _count(1),
        "credits per peer: objects sent and not yet acknowledged; a send waits for one",
    ),
    Option(
        "max_inflight_bytes",
        "int",
        1 << 30,
        _count(1),
        "credits per peer: bytes sent and not yet acknowledged",
        shown="1 GiB",
    ),
    Option(
        "ack_timeout",
        "float",
        30.0,
        _seconds(),
        "seconds a peer has to acknowledge an object (or grant a credit, or take a "
        "frame) before the send fails",
        shown="30",
    ),
    Option(
        "handshake_timeout",
        "float",
        10.0,
        _seconds(),
        "seconds to wait for a peer's Hello before a send fails",
        shown="10",
    ),
    Option(
        "peer_timeout",
        "float",
        5.0,
        _seconds(),
        "seconds a peer may stay unreachable, or take no frame, before it is declared lost",
        more="At once if it is on this host and its process died.",
        shown="5",
    ),
    Option(
        "heartbeat_interval",
        "float",
        1.0,
        _seconds(0.001, 2000.0),
        "ZMTP heartbeat period of the sockets we read, 1 ms to 2000 s; a silent "
        "connection is dropped after three",
        more=(
            "Our PUSH sockets use TCP keepalive and user timeout on the same clock, spec "
            "§3.4; a peer whose connection dropped while ready is declared lost then "
            "(frames on their way may be gone; a new session starts when it is back)."
        ),
        shown="1",
    ),
    Option(
        "zero_copy",
        "bool",
        False,
        _flag,
        "deliver views of the sender's memory, acknowledged on `Delivery.release()`, "
        "instead of owned copies",
    ),
    Option(
        "receive_buffer",
        "int",
        64,
        _count(1),
        "undelivered deliveries this endpoint holds before it stops taking data",
    ),
    Option(
        "receive_buffer_bytes",
        "int",
        1 << 30,
        _count(1),
        "undelivered bytes this endpoint holds before it stops taking data (and so "
        "stops acknowledging)",
        shown="1 GiB",
    ),
    Option(
        "unclaimed_timeout",
        "float",
        30.0,
        _seconds(),
        "seconds a delivery of a request nobody holds may keep its share of the receive "
        'buffer while others wait; then it is dropped (`cause="unclaimed"`)',
        shown="30",
    ),
    Option(
        "receive_window",
        "int",
        4 << 20,
        _count(4096),
        "bytes of DataReady charge (spec §7.6) each peer may have outstanding here; at least 4096",
        more=(
            "Every header, metadata and inline byte, plus a fixed charge per message; "
            "reopened as the application takes deliveries. A peer that overruns it "
            "ends its own session."
        ),
        shown="4 MiB",
    ),
    Option(
        "max_open_streams",
        "int",
        4096,
        _count(1),
        "streams one peer may hold open here; the first chunk of one more is aborted "
        "back (`too_many_streams`)",
    ),
    Option(
        "stream_idle_timeout",
        "float",
        300.0,
        _seconds(),
        "seconds an open stream may go without a chunk before it ends with an `error` "
        '(`cause="stream_idle"`) and is aborted back',
        shown="300",
    ),
    Option(
        "max_ack_timeouts",
        "int",
        3,
        _count(1),
        "consecutive ACK timeouts after which a peer is declared unresponsive and its "
        "objects released",
    ),
    Option(
        "allow_pickle",
        "bool",
        False,
        _flag,
        "accept (and allow sending) pickled header values; only for trusted peers",
    ),
    Option(
        "auth_key",
        "str | bytes | None",
        None,
        _secret,
        "a shared secret: the control plane runs ZMQ CURVE and refuses peers without it",
        shown="`$OMNIWIRE_AUTH_KEY`, else none",
    ),
    Option(
        "host_id",
        "str | None",
        None,
        _host_id,
        "override the host identity (tests simulate hosts with it; `$OMNIWIRE_HOST_ID` "
        "does the same)",
    ),
    Option(
        "progressive_chunk",
        "int",
        16 << 20,
        _count(0),
        "large objects are announced in pieces of this size so a copy-mode receiver "
        "copies while the sender packs; 0 disables",
        more="Objects to zero-copy receivers are never split.",
        shown="16 MiB",
    ),
    Option(
        "max_peers",
        "int",
        256,
        _count(1),
        "the most peers served at once; more are refused (`peer_limit`)",
    ),
    Option(
        "control_ring",
        "bool",
        True,
        _flag,
        "peers on this host exchange control frames through a shared-memory ring per "
        "direction (spec §3.6) when both allow it",
        more="ZeroMQ stays for the handshake and for other hosts.",
    ),
    Option(
        "digest",
        "bool",
        False,
        _flag,
        "send an XXH3-64 digest of each object's CPU tensor bytes; a receiver that "
        "reads other bytes NACKs it (`digest_mismatch`)",
        more=(
            'Sent to peers with feature ``"digest"`` (every omniwire endpoint), '
            "computed from the tensors sent; the receiver delivers an ``error`` in the "
            "object's place. A receiver checks every digest it is sent, whatever its "
            "own option. About 12 ms per 64 MiB on each side."
        ),
    ),
    Option(
        "resume_window",
        "float",
        30.0,
        _seconds(0),
        "seconds a session outlives a broken connection: a peer back within it resumes "
        "it (unacknowledged frames are sent again); 0 turns resumption off",
        shown="30",
    ),
    Option(
        "observer",
        "Observer | Sequence[Observer] | None",
        None,
        _observer,
        "an `Observer` (or a list of them) told of sends, credit and window waits and "
        "deliveries (`omniwire.observe`); None makes no observer call",
    ),
)


def options_doc(indent: str) -> str:
    """The docstring's ``Args`` lines of every option (after ``name``)."""
    lines = []
    for o in OPTIONS:
        text = o.doc.replace("`", "``") + "."
        if o.more:
            text += " " + o.more
        default = o.shown or repr(o.default)
        text += f" Default: {default}."
        words = text.split()
        line = f"{indent}{o.name}:"
        for word in words:
            if len(line) + 1 + len(word) > 88:
                lines.append(line)
                line = indent + "    " + word
            else:
                line += " " + word
        lines.append(line)
    return "\n".join(lines)


def options_table() -> str:
    """The README's option table (between ``<!-- options:begin/end -->``)."""
    rows = ["| option | default | what it does |", "|---|---|---|"]
    for o in OPTIONS:
        default = o.shown or repr(o.default)
        rows.append(f"| `{o.name}` | {default} | {o.doc} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class EndpointConfig:
    """The validated options of one :class:`~omniwire.Endpoint` (see :data:`OPTIONS`)."""

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
    peer_timeout: float
    heartbeat_interval: float
    zero_copy: bool
    receive_buffer: int
    receive_buffer_bytes: int
    unclaimed_timeout: float
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
    digest: bool
    resume_window: float

    @classmethod
    def build(cls, name: str, options: Mapping[str, Any]) -> EndpointConfig:
        """Check every option (each by its declared check, then what needs several or a
        registry); return the configuration. ``options`` has every name of
        :data:`OPTIONS`.

        Raises:
            ConfigurationError: a bad name, number or option (naming it).
            AddressError: ``address`` or a ``peers=`` address is not usable.
            UnknownNameError: a backend, policy or route names nothing registered.
        """
        _check_name("name", name)
        given = {o.name: o.check(o.name, options[o.name]) for o in OPTIONS}
        address = given.pop("address")
        address = str(parse_address(address or default_address(name), what="address", bind=True))
        checked_peers: dict[str, str] = {}
        for peer, peer_address in (given.pop("peers") or {}).items():
            _check_name(f"peers key {peer!r}", peer)
            if peer == name:
                raise ConfigurationError(f"peers= names {name!r}, this endpoint's own name")
            checked_peers[peer] = str(parse_address(peer_address, what=f"peers[{peer!r}]"))
        registered = set(registry.backends())
        backends = given.pop("backends")
        for backend in backends or ():
            if backend not in registered:
                raise UnknownNameError(
                    f"backends= names {backend!r}, which is not registered; registered: "
                    f"{', '.join(sorted(registered))}"
                )
        backend_options = given.pop("backend_options") or {}
        for backend in backend_options:
            if backend not in registered:
                raise UnknownNameError(
                    f"backend_options= names {backend!r}, which is not registered; "
                    f"registered: {', '.join(sorted(registered))}"
                )
        policy = given.pop("policy")
        base: RoutingPolicy
        if isinstance(policy, str):
            base = registry.load_policy(policy)
        elif policy is None:
            base = DefaultPolicy()
        else:
            base = policy
        routes = given.pop("routes")
        for edge, backend in (routes or {}).items():
            if backend not in registered and backend != INLINE.name:
                raise UnknownNameError(
                    f"routes[{edge!r}] names backend {backend!r}, which is not registered; "
                    f"registered: {', '.join(sorted(registered | {INLINE.name}))}"
                )
        given.pop("observer")  # (checked; the endpoint's core keeps it)
        return cls(
            name=name,
            address=address,
            peers=checked_peers,
            policy=StaticTablePolicy(routes, base) if routes else base,
            backends=tuple(backends) if backends is not None else None,
            backend_options={k: dict(v) for k, v in backend_options.items()},
            **given,
        )


def _check_name(what: str, name: object) -> None:
    if not isinstance(name, str):
        raise ConfigurationError(f"{what} must be a str, not {type(name).__name__}")
    try:  # the wire's own rule for stage names
        wire.GoodbyeMessage(from_stage=name, instance=0)
    except (ValueError, WireFormatError) as exc:
        raise ConfigurationError(f"{what} {name[:80]!r} is not a valid stage name: {exc}") from None
