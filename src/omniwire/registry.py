"""The backend and policy registries, fed by entry points and loaded lazily.

Backends come from the entry-point group ``omniwire.backends`` — omniwire's own
built-ins are declared there too, in its pyproject — and from
:func:`register_backend`. Nothing is imported until a backend is asked for; a
plugin that fails to import or breaks the interface is logged and listed as
broken, and never breaks ``import omniwire``. A backend whose engine is missing
is *unavailable*, with the reason and an install hint.

Routing policies come from the group ``omniwire.policies`` (see :func:`load_policy`).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Literal

from .backends.base import Availability, BackendBase, ByteBackend, Capabilities, ObjectBackend
from .errors import BackendUnavailableError, OmniwireError, UnknownNameError
from .routing import RoutingPolicy

__all__ = [
    "BACKEND_GROUP",
    "POLICY_GROUP",
    "BackendEntry",
    "PluginError",
    "backend_status",
    "backends",
    "load_backend",
    "load_policy",
    "register_backend",
]

log = logging.getLogger("omniwire.registry")

BACKEND_GROUP = "omniwire.backends"
POLICY_GROUP = "omniwire.policies"


class PluginError(OmniwireError):
    """A plugin cannot be used: it fails to import or does not implement the interface."""


Status = Literal["available", "unavailable", "broken"]


@dataclass
class BackendEntry:
    """One registered backend. ``cls`` is None until it is loaded."""

    name: str
    #: "built-in", "plugin <distribution> <version>", or "registered in code".
    source: str
    target: str
    entry_point: metadata.EntryPoint | None = None
    cls: type[BackendBase] | None = None
    error: str = ""
    status: Status | None = None
    availability: Availability | None = field(default=None)


_lock = threading.RLock()
_entries: dict[str, BackendEntry] = {}
_shadowed: dict[str, BackendEntry] = {}  # entries a code registration replaced
_discovered = False


def _source(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "plugin (unknown distribution)"
    if dist.metadata["Name"] == "omniwire":
        return "built-in"
    return f"plugin {dist.metadata['Name']} {dist.version}"


def _discover() -> None:
    global _discovered
    with _lock:
        if _discovered:
            return
        _discovered = True
        for ep in metadata.entry_points(group=BACKEND_GROUP):
            if ep.name in _entries:
                log.warning(
                    "backend %r from %s ignored: the name is already registered by %s",
                    ep.name,
                    _source(ep),
                    _entries[ep.name].source,
                )
                continue
            _entries[ep.name] = BackendEntry(ep.name, _source(ep), ep.value, ep)


def check_interface(name: str, cls: object, source: str) -> type[BackendBase]:
    """Check that ``cls`` implements the backend interface.

    Raises:
        PluginError: naming the plugin and what is missing.
    """
    where = f"backend {name!r} ({source})"
    if not isinstance(cls, type) or not issubclass(cls, ByteBackend | ObjectBackend):
        raise PluginError(f"{where}: {cls!r} is not a ByteBackend or ObjectBackend subclass")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise PluginError(f"{where}: {cls.__qualname__} does not implement {missing}")
    if getattr(cls, "name", None) != name:
        raise PluginError(
            f"{where}: {cls.__qualname__}.name is {getattr(cls, 'name', None)!r}, not {name!r}"
        )
    if not isinstance(getattr(cls, "capabilities", None), Capabilities):
        raise PluginError(f"{where}: {cls.__qualname__}.capabilities is not a Capabilities")
    return cls


def _load(entry: BackendEntry) -> None:
    if entry.status is not None:
        return
    if entry.cls is None and entry.entry_point is not None:
        try:
            obj = entry.entry_point.load()
        except ImportError as exc:
            entry.status = "unavailable"
            entry.error = f"cannot import {entry.target}: {exc}"
            entry.availability = Availability.missing(entry.error)
            return
        except Exception as exc:
            entry.status = "broken"
            entry.error = f"{entry.target} failed to load: {type(exc).__name__}: {exc}"
            log.error("backend plugin %r (%s) is broken: %s", entry.name, entry.source, entry.error)
            return
        try:
            entry.cls = check_interface(entry.name, obj, entry.source)
        except PluginError as exc:
            entry.status = "broken"
            entry.error = str(exc)
            log.error("%s", exc)
            return
    assert entry.cls is not None
    try:
        entry.availability = entry.cls.availability()
    except Exception as exc:
        entry.status = "broken"
        entry.error = f"availability() raised {type(exc).__name__}: {exc}"
        log.error("backend %r (%s): %s", entry.name, entry.source, entry.error)
        return
    entry.status = "available" if entry.availability.available else "unavailable"
    entry.error = entry.availability.reason


def backends() -> Mapping[str, BackendEntry]:
    """A read-only view of every registered backend (loaded on first access of each)."""
    _discover()
    with _lock:
        return MappingProxyType(dict(_entries))


def backend_status(name: str) -> BackendEntry:
    """The entry for ``name``, loaded and with its status filled in.

    Raises:
        UnknownNameError: no backend of that name is registered (a ``KeyError``).
    """
    _discover()
    with _lock:
        entry = _entries.get(name)
        if entry is None:
            raise UnknownNameError(
                f"no backend named {name!r} is registered; registered: "
                f"{', '.join(sorted(_entries))}"
            )
        _load(entry)
        return entry


def load_backend(name: str) -> type[BackendBase]:
    """The backend class registered as ``name``, if it can run here.

    Raises:
        UnknownNameError: no such backend (a ``KeyError``).
        BackendUnavailableError: its engine is missing here (with an install hint).
        PluginError: the plugin is broken.
    """
    entry = backend_status(name)
    if entry.status == "broken":
        raise PluginError(entry.error)
    if entry.status == "unavailable":
        hint = entry.cls.install_hint if entry.cls is not None else ""
        av = entry.availability
        raise BackendUnavailableError(name, entry.error, (av.hint if av else "") or hint)
    assert entry.cls is not None
    return entry.cls


def register_backend(name: str, cls: type[BackendBase], *, replace: bool = False) -> None:
    """Register a backend class in code (for tests, or apps that ship their own).

    With ``replace=True`` it shadows the entry of that name (a built-in, say) until
    :func:`unregister_backend` restores it.

    Raises:
        ValueError: ``name`` is taken and ``replace`` is False.
        PluginError: ``cls`` does not implement the interface.
    """
    _discover()
    check_interface(name, cls, "registered in code")
    with _lock:
        old = _entries.get(name)
        if old is not None and not replace:
            raise ValueError(
                f"backend {name!r} is already registered ({old.source}); "
                "pass replace=True to override it"
            )
        if old is not None and name not in _shadowed:
            _shadowed[name] = old
        _entries[name] = BackendEntry(name, "registered in code", cls.__qualname__, cls=cls)


def unregister_backend(name: str) -> None:
    """Remove a backend registered in code; the entry it shadowed comes back."""
    with _lock:
        entry = _entries.get(name)
        if entry is None or entry.entry_point is not None:
            return
        shadowed = _shadowed.pop(name, None)
        if shadowed is not None:
            _entries[name] = shadowed
        else:
            del _entries[name]


def _policy_from(obj: object, name: str) -> RoutingPolicy:
    policy = obj() if isinstance(obj, type) else obj
    if not isinstance(policy, RoutingPolicy):
        raise PluginError(f"policy {name!r}: {obj!r} does not implement RoutingPolicy")
    return policy


def load_policy(name: str) -> RoutingPolicy:
    """Instantiate the routing policy registered under ``name`` in ``omniwire.policies``.

    Raises:
        UnknownNameError: no such policy (a ``KeyError``; the message lists the known ones).
        PluginError: it fails to load or is not a policy.
    """
    eps = {ep.name: ep for ep in metadata.entry_points(group=POLICY_GROUP)}
    ep = eps.get(name)
    if ep is None:
        raise UnknownNameError(
            f"no routing policy named {name!r}; registered: {', '.join(sorted(eps))}"
        )
    try:
        obj = ep.load()
    except Exception as exc:
        raise PluginError(f"policy {name!r} ({ep.value}) failed to load: {exc}") from exc
    return _policy_from(obj, name)
