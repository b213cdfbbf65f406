"""nccl's live links: every link whose threads may still run, stopped and joined at
exit (and by ``aclose()``)."""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...errors import BackendClosedError

if TYPE_CHECKING:
    from ._link import Link

__all__ = ["CLOSE_JOIN_SECONDS", "join_links", "live_links"]

#: Links whose threads may still run. Worker threads are daemons (a gloo wait cannot
#: be interrupted, and must not keep the process alive), but a daemon thread that
#: touches the engine while the interpreter finalizes aborts the process (pybind11
#: retakes the GIL, the thread is unwound through a noexcept destructor). So every
#: link is stopped and its threads joined at exit, and by ``aclose()``.
live_links: weakref.WeakSet[Link] = weakref.WeakSet()
_EXIT_JOIN_SECONDS = 10.0
CLOSE_JOIN_SECONDS = 1.0


def join_links(links: Sequence[Link], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for link in links:
        link.join(deadline)


@atexit.register
def _stop_links_at_exit() -> None:
    links = list(live_links)
    for link in links:
        link.fail(BackendClosedError("the interpreter is exiting"))
    join_links(links, _EXIT_JOIN_SECONDS)
