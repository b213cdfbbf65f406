"""omniwire under sglang-omni 0.1.x: stage data through omniwire, turned on with one line.

In a stage factory module (any module sglang-omni imports in every stage process)::

    import omniwire.integrations.sglang_omni
    omniwire.integrations.sglang_omni.enable()

or, without editing code, ``OMNIWIRE_SGLANG_OMNI=1`` in the stages' environment
once ``python -m omniwire.integrations.sglang_omni install-pth`` has put a
``.pth`` hook into site-packages (it calls ``enable()`` when sglang-omni's router
is imported). What ``enable()`` changes, all reversible with ``disable()``:

- sglang-omni's relay registry names ``shm`` and ``mooncake`` (and ``cuda_ipc``
  where CUDA is available) create :class:`OmniwireRelay`;
- ``Stage.start`` also starts the stage's omniwire endpoint and introduces its
  peers (every other stage, at an address derived from its sglang-omni one), and
  creates its relays, so the first transfer pays no start-up; ``Stage.stop``
  closes it;
- ``CommRouter.outbound_stream`` routes a stream chunk for a non-GPU target
  through ``shm`` instead of raising ``ValueError`` (see docs/sglang-omni.md for
  the one-line upstream patch that would make this unnecessary);
- ``CommEngine.cleanup`` (sglang-omni's abort and failure paths) also aborts the
  request in omniwire.

sglang-omni's control plane, its pickled headers, ``DataReady``/``DataAck``,
local (same-process) hand-offs and inline stream chunks stay sglang-omni's.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

from ._compat import SUPPORTED_SERIES, SglangOmniCompatibilityError, SglangOmniNames, check

__all__ = [
    "SUPPORTED_SERIES",
    "SglangOmniCompatibilityError",
    "disable",
    "enable",
    "enabled",
]

log = logging.getLogger("omniwire.integrations.sglang_omni")

_lock = threading.Lock()
_saved: dict[str, Any] = {}
_names: SglangOmniNames | None = None


def enabled() -> bool:
    """Whether ``enable()`` is in effect in this process."""
    return _names is not None


def enable() -> None:
    """Make this process's sglang-omni stages move their data through omniwire.

    Idempotent; call it before the stages start (at import of a stage factory
    module). Checks sglang-omni first and changes nothing if a check fails.

    Raises:
        SglangOmniCompatibilityError: sglang-omni is missing, outside the supported
            series (``OMNIWIRE_SGLANG_OMNI_ANY_VERSION=1`` lifts this one), or an
            internal name the adapter uses changed; the message names it.
    """
    global _names
    with _lock:
        if _names is not None:
            return
        names = check(strict_version=os.environ.get("OMNIWIRE_SGLANG_OMNI_ANY_VERSION") != "1")
        from . import _patches

        _saved.update(_patches.apply(names))
        _names = names
    log.info("omniwire carries sglang-omni %s stage data in pid %d", names.version, os.getpid())


def disable() -> None:
    """Undo ``enable()`` (stages started since keep their endpoints until they stop)."""
    global _names
    with _lock:
        if _names is None:
            return
        from . import _patches

        _patches.revert(_names, _saved)
        _saved.clear()
        _names = None


def _enable_on_import(_module: object = None) -> None:
    """The ``.pth`` hook's call: enable, or log why not (never break the import)."""
    try:
        enable()
    except Exception:
        log.exception("OMNIWIRE_SGLANG_OMNI=1 but omniwire could not be enabled")


@functools.cache
def _relay_class(kind: str) -> Any:
    from ._relay import OmniwireRelay

    return type(f"Omniwire{kind.title().replace('_', '')}Relay", (OmniwireRelay,), {"kind": kind})
