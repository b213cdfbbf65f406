"""Memory barriers for the shared words: CPython has none of its own.

``ordered()`` keeps loads with loads, stores with stores and a load before a later
store: a no-op on x86-64 (TSO), a full barrier elsewhere. ``fence()`` is the full
barrier, store→load included, everywhere: it takes and releases an uncontended
``threading.Lock`` (twice on AArch64). Why that is enough is under "What we rely on"
in the package docstring.
"""

from __future__ import annotations

import platform
import threading

__all__ = ["fence", "ordered"]

_fence_lock = threading.Lock()
_acquire, _release = _fence_lock.acquire, _fence_lock.release

if platform.machine().lower() in ("x86_64", "amd64"):

    def fence() -> None:
        _acquire()
        _release()

    def ordered() -> None:
        pass

else:

    def fence() -> None:
        _acquire()
        _release()
        _acquire()
        _release()

    ordered = fence
