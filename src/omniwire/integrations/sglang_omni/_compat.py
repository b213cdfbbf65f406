"""The sglang-omni versions and internal names the adapter relies on, checked once."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from ...errors import OmniwireError

__all__ = ["SUPPORTED_SERIES", "SglangOmniCompatibilityError", "SglangOmniNames", "check"]

#: The sglang-omni release series this adapter was written against and tested on.
SUPPORTED_SERIES = "0.1"


class SglangOmniCompatibilityError(OmniwireError):
    """The installed sglang-omni is not one the adapter knows: a version outside
    the supported series, or an internal name it relies on moved or changed shape.
    The message names what changed; nothing was patched."""


@dataclass(frozen=True)
class SglangOmniNames:
    """The sglang-omni objects the adapter touches, resolved and checked."""

    version: str
    relay_base: Any  # sglang_omni.relay.base (RELAY_REGISTRY, Relay, RelayOperation)
    router_cls: Any  # sglang_omni.comm.router.CommRouter
    engine_cls: Any  # sglang_omni.comm.engine.CommEngine
    stage_cls: Any  # sglang_omni.pipeline.stage.runtime.Stage
    transport_kind: Any  # sglang_omni.comm.data_ref.TransportKind
    platform: Any  # sglang_omni.platforms.current_platform


# (module, attribute, what it must be): every internal name the adapter uses.
_NAMES: tuple[tuple[str, str, str], ...] = (
    ("sglang_omni.relay.base", "RELAY_REGISTRY", "dict"),
    ("sglang_omni.relay.base", "Relay", "class"),
    ("sglang_omni.relay.base", "RelayOperation", "class"),
    ("sglang_omni.relay.base", "create_relay", "callable"),
    ("sglang_omni.comm.data_ref", "TransportKind", "class"),
    ("sglang_omni.comm.router", "CommRouter", "class"),
    ("sglang_omni.comm.engine", "CommEngine", "class"),
    ("sglang_omni.comm.stage_io", "read_transfer_buffer", "callable"),
    ("sglang_omni.pipeline.stage.runtime", "Stage", "class"),
    ("sglang_omni.platforms", "current_platform", "object"),
)

# (class path, method, parameters it must accept, in order)
_METHODS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "sglang_omni.relay.base",
        "Relay",
        "put_async",
        ("self", "tensor", "request_id", "dst_rank", "receiver_id"),
    ),
    (
        "sglang_omni.relay.base",
        "Relay",
        "get_async",
        ("self", "metadata", "dest_tensor", "request_id"),
    ),
    ("sglang_omni.relay.base", "Relay", "cleanup", ("self", "request_id")),
    ("sglang_omni.relay.base", "Relay", "close", ("self",)),
    ("sglang_omni.relay.base", "RelayOperation", "wait_for_completion", ("self", "timeout")),
    ("sglang_omni.relay.base", "RelayOperation", "mark_receiver_done", ("self",)),
    ("sglang_omni.relay.base", "RelayOperation", "mark_receiver_failed", ("self", "exc")),
    ("sglang_omni.comm.router", "CommRouter", "outbound_stream", ("self", "target", "data")),
    (
        "sglang_omni.comm.router",
        "CommRouter",
        "note_transport",
        ("self", "direction", "target", "kind"),
    ),
    ("sglang_omni.comm.router", "CommRouter", "relay", ("self", "kind")),
    ("sglang_omni.comm.router", "CommRouter", "build_relay", ("self", "kind")),
    ("sglang_omni.comm.engine", "CommEngine", "cleanup", ("self", "request_id")),
    ("sglang_omni.pipeline.stage.runtime", "Stage", "start", ("self",)),
    ("sglang_omni.pipeline.stage.runtime", "Stage", "stop", ("self",)),
)

# Attributes set in __init__ that the adapter reads (checked on the constructor's source).
_ATTRIBUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "sglang_omni.comm.router",
        "CommRouter",
        (
            "stage_name",
            "gpu_stage_names",
            "remote_stage_names",
            "same_process_targets",
            "comm_config",
            "relays",
            "gpu_id",
        ),
    ),
    (
        "sglang_omni.pipeline.stage.runtime",
        "Stage",
        ("name", "endpoints", "comm", "same_process_targets"),
    ),
)

_TRANSPORTS = ("SHM", "MOONCAKE", "CUDA_IPC", "LOCAL_OBJECT")


def installed_version() -> str:
    try:
        return metadata.version("sglang-omni")
    except metadata.PackageNotFoundError as exc:
        raise SglangOmniCompatibilityError(
            "sglang-omni is not installed; install it with: pip install 'omniwire[sglang-omni]'"
        ) from exc


def check(*, strict_version: bool = True) -> SglangOmniNames:
    """Import and check every sglang-omni name the adapter relies on.

    Raises:
        SglangOmniCompatibilityError: sglang-omni is missing, its version is outside
            ``SUPPORTED_SERIES`` (unless ``strict_version`` is false), a module does
            not import, or a name is missing or changed shape; the message says which.
    """
    version = installed_version()
    series = ".".join(version.split(".")[:2])
    if strict_version and series != SUPPORTED_SERIES:
        raise SglangOmniCompatibilityError(
            f"sglang-omni {version} is installed; omniwire.integrations.sglang_omni supports "
            f"{SUPPORTED_SERIES}.x (set OMNIWIRE_SGLANG_OMNI_ANY_VERSION=1 to try it anyway: "
            "every internal name is still checked)"
        )
    modules: dict[str, Any] = {}
    for mod, _, _ in _NAMES:
        if mod in modules:
            continue
        try:
            modules[mod] = importlib.import_module(mod)
        except ImportError as exc:
            raise SglangOmniCompatibilityError(
                f"sglang-omni {version}: cannot import {mod} ({exc}); the adapter needs it"
            ) from exc
    for mod, name, kind in _NAMES:
        if not hasattr(modules[mod], name):
            raise SglangOmniCompatibilityError(
                f"sglang-omni {version}: {mod}.{name} is gone; the adapter relies on it"
            )
        value = getattr(modules[mod], name)
        ok = {
            "dict": isinstance(value, dict),
            "class": inspect.isclass(value),
            "callable": callable(value),
            "object": True,
        }[kind]
        if not ok:
            raise SglangOmniCompatibilityError(
                f"sglang-omni {version}: {mod}.{name} is no longer a {kind} "
                f"(it is {type(value).__name__})"
            )
    for mod, cls_name, meth, params in _METHODS:
        cls = getattr(modules[mod], cls_name)
        fn = getattr(cls, meth, None)
        if fn is None:
            raise SglangOmniCompatibilityError(
                f"sglang-omni {version}: {mod}.{cls_name}.{meth} is gone; the adapter relies on it"
            )
        got = tuple(inspect.signature(fn).parameters)
        if got[: len(params)] != params:
            raise SglangOmniCompatibilityError(
                f"sglang-omni {version}: {mod}.{cls_name}.{meth} changed its parameters "
                f"to {got}; the adapter expects {params}"
            )
    for mod, cls_name, attrs in _ATTRIBUTES:
        src = inspect.getsource(getattr(modules[mod], cls_name).__init__)
        for attr in attrs:
            if f"self.{attr} =" not in src and f"self.{attr}: " not in src:
                raise SglangOmniCompatibilityError(
                    f"sglang-omni {version}: {mod}.{cls_name} no longer sets .{attr}; "
                    "the adapter reads it"
                )
    kinds = modules["sglang_omni.comm.data_ref"].TransportKind
    for member in _TRANSPORTS:
        if not hasattr(kinds, member):
            raise SglangOmniCompatibilityError(
                f"sglang-omni {version}: TransportKind.{member} is gone; the adapter relies on it"
            )
    return SglangOmniNames(
        version=version,
        relay_base=modules["sglang_omni.relay.base"],
        router_cls=modules["sglang_omni.comm.router"].CommRouter,
        engine_cls=modules["sglang_omni.comm.engine"].CommEngine,
        stage_cls=modules["sglang_omni.pipeline.stage.runtime"].Stage,
        transport_kind=kinds,
        platform=modules["sglang_omni.platforms"].current_platform,
    )
