"""Endpoint options: each is declared once (``omniwire.endpoint._config.OPTIONS``:
name, type, default, check, one line of doc); the constructor's signature, its
docstring, the configuration's fields and the README's option table are checked
against that declaration here, and every option refuses every wrong value with an
error that names it (issue 47 item 13)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniwire import Endpoint
from omniwire.endpoint._config import OPTIONS, EndpointConfig, options_table
from omniwire.errors import ConfigurationError
from omniwire.observe import Observer
from omniwire.routing import DefaultPolicy, RoutingPolicy
from omniwire.wire._constants import MAX_TEXT_BYTES

README = Path(__file__).resolve().parents[1] / "README.md"
#: What a refusal may raise: the code's convention is ConfigurationError (a ValueError).
REFUSED = (ConfigurationError, TypeError, ValueError)

_I64 = (1 << 63) - 1


def _flag(v: Any) -> bool:
    return type(v) is bool


def _count(low: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v <= _I64


def _seconds(least: float | None = None, most: float = 1e9) -> Callable[[Any], bool]:
    def takes(v: Any) -> bool:
        if type(v) not in (int, float) or not math.isfinite(v) or v > most:
            return False
        return v > 0 if least is None else v >= least

    return takes


def _text(v: Any) -> bool:
    return v is None or (type(v) is str and 0 < len(v.encode()) <= MAX_TEXT_BYTES)


def _secret(v: Any) -> bool:
    return v is None or (type(v) in (str, bytes) and len(v) > 0)


#: The test's own idea of which values each simple option takes (an oracle kept apart
#: from the declaration it checks). Options whose content needs a registry or a parse
#: (address, peers, policy, routes, backends, backend_options, observer) are only
#: required to refuse a wrong *type*, and to name themselves whenever they refuse.
TAKES: dict[str, Callable[[Any], bool]] = {
    "max_inflight": _count(1),
    "max_inflight_bytes": _count(1),
    "ack_timeout": _seconds(),
    "handshake_timeout": _seconds(),
    "peer_timeout": _seconds(),
    "heartbeat_interval": _seconds(0.001, 2000.0),
    "zero_copy": _flag,
    "receive_buffer": _count(1),
    "receive_buffer_bytes": _count(1),
    "unclaimed_timeout": _seconds(),
    "receive_window": _count(4096),
    "max_open_streams": _count(1),
    "stream_idle_timeout": _seconds(),
    "max_ack_timeouts": _count(1),
    "allow_pickle": _flag,
    "auth_key": _secret,
    "host_id": _text,
    "progressive_chunk": _count(0),
    "max_peers": _count(1),
    "control_ring": _flag,
    "digest": _flag,
    "resume_window": _seconds(0),
}
WRONG_TYPE: dict[str, Callable[[Any], bool]] = {
    "address": lambda v: v is not None and type(v) is not str,
    "peers": lambda v: v is not None and not isinstance(v, Mapping),
    "policy": lambda v: v is not None and type(v) is not str and not isinstance(v, RoutingPolicy),
    "routes": lambda v: v is not None and not isinstance(v, Mapping),
    "backends": lambda v: v is not None and type(v) not in (list, tuple),
    "backend_options": lambda v: v is not None and not isinstance(v, Mapping),
    "observer": lambda v: (
        v is not None
        and not isinstance(v, Observer)
        and not (type(v) in (list, tuple) and all(isinstance(o, Observer) for o in v))
    ),
}

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([0, 1, 3, 4095, 4096, 1 << 63, (1 << 63) - 1, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0005, 1.5, 2500.0, 1e10, float("nan"), float("inf"), -0.0]),
    st.text(max_size=6),
    st.sampled_from(["", "no", "yes", "1M", "false", "x" * (MAX_TEXT_BYTES + 1)]),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.tuples(st.text(max_size=2)),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.just(object()),
    st.just(DefaultPolicy()),
)


def test_the_listed_wrong_values_are_refused_naming_the_option() -> None:
    """The values issue 47 found accepted (or refused with a bare TypeError)."""
    for option, value in [
        ("zero_copy", "no"),
        ("progressive_chunk", True),
        ("progressive_chunk", 1.5),
        ("progressive_chunk", "1M"),
        ("digest", "yes"),
        ("control_ring", 0),
        ("host_id", 5),
        ("heartbeat_interval", 0.0001),  # rounded to 0 ms: no heartbeat at all
        ("ack_timeout", float("nan")),
        ("auth_key", ""),  # an empty key would silently turn CURVE off
        ("backends", "shm"),  # a str is a sequence of one-letter names
        ("observer", 5),
    ]:
        with pytest.raises(ConfigurationError) as info:
            Endpoint("a", **{option: value})
        assert option in str(info.value), (option, value, str(info.value))


@pytest.mark.parametrize("option", [o.name for o in OPTIONS])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=ANY_VALUE)
def test_every_option_refuses_wrong_values_naming_itself(option: str, value: Any) -> None:
    try:
        Endpoint("a", **{option: value})
    except REFUSED as exc:
        assert option in str(exc), f"{option}={value!r} refused without naming it: {exc}"
        if option in TAKES:
            assert not TAKES[option](value), f"{option}={value!r} is valid, but refused: {exc}"
        return
    if option in TAKES:
        assert TAKES[option](value), f"{option}={value!r} was accepted"
    else:
        assert not WRONG_TYPE[option](value), f"{option}={value!r} was accepted"


def test_every_option_has_an_oracle_here() -> None:
    """A new option needs one (in TAKES or WRONG_TYPE) to be fuzzed."""
    assert {o.name for o in OPTIONS} == TAKES.keys() | WRONG_TYPE.keys()


def test_the_declared_defaults_are_the_signatures_and_pass_their_checks() -> None:
    params = inspect.signature(Endpoint.__init__).parameters
    declared = [o.name for o in OPTIONS]
    assert [p for p in params if p not in ("self", "name")] == declared
    for o in OPTIONS:
        p = params[o.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, o.name
        assert p.default == o.default, o.name
        assert p.annotation == o.annotation, o.name
        assert o.check(o.name, o.default) == o.default or o.default is None, o.name
        assert o.doc and "\n" not in o.doc, o.name


def test_the_configuration_keeps_every_option_it_uses() -> None:
    fields = {f.name for f in dataclasses.fields(EndpointConfig)}
    # routes are folded into the policy; the observer goes to the endpoint's core
    assert fields == {"name"} | {o.name for o in OPTIONS} - {"routes", "observer"}


def test_the_docstring_describes_every_option() -> None:
    doc = Endpoint.__doc__ or ""
    for o in OPTIONS:
        line = o.doc.replace("`", "``")[:30]
        assert re.search(rf"^\s+{o.name}: {re.escape(line)}", doc, re.M), o.name


def test_the_readme_option_table_is_the_declaration() -> None:
    text = README.read_text()
    start = text.index("<!-- options:begin -->")
    end = text.index("<!-- options:end -->")
    assert text[start:end].split("\n", 1)[1].strip() == options_table().strip(), (
        "README's option table differs from OPTIONS; paste the output of "
        "python -c 'from omniwire.endpoint._config import options_table; print(options_table())'"
    )
