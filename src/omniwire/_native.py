"""Native engines' own log lines, kept off the user's terminal unless asked for.

Engines such as Mooncake log through glog straight to file descriptor 2, past
Python's logging: a harmless ``E… transfer_metadata.cpp … Local segment descriptor
not found`` at every engine start looks like a failure to a user. Wrap the call
that makes such noise in :func:`engine_stderr`: what the engine writes to fd 2
meanwhile is captured, and each of its log lines goes to the ``omniwire.native``
logger at INFO (``omniwire -v …`` shows them) instead of the terminal. Lines that
are not engine log lines (another thread's Python warning, say) are written back
to stderr afterwards, so nothing else is lost. ``OMNIWIRE_NATIVE_LOGS=1`` turns the
capture off.

The capture redirects fd 2 for the whole process, so keep the block short (an
engine's initialisation, not its lifetime).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["NativeOutput", "engine_stderr"]

log = logging.getLogger("omniwire.native")

# glog ("E1130 23:53:36.004117 20695 transfer_metadata.cpp:1098] …" and its
# "WARNING: Logging before InitGoogleLogging() …" preamble) and UCX
# ("[1700000000.123456] [host:123:0]  ucp_context.c:… UCX  WARN …").
_ENGINE_LINE = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"
    r"|WARNING: Logging before InitGoogleLogging\(\)"
    r"|\[\d+\.\d+\] +\[[^\]]*\])"
)
_lock = threading.Lock()  # one redirection at a time: they would restore each other's fd


@dataclass
class NativeOutput:
    """The engine log lines captured by :func:`engine_stderr` (for error messages)."""

    lines: list[str] = field(default_factory=list)

    def text(self, limit: int = 5) -> str:
        """The last ``limit`` lines, joined with "; " ("" if none)."""
        return "; ".join(self.lines[-limit:])


def _enabled() -> bool:
    return os.environ.get("OMNIWIRE_NATIVE_LOGS", "") in ("", "0")


@contextlib.contextmanager
def engine_stderr(engine: str) -> Iterator[NativeOutput]:
    """Capture what native code writes to fd 2 in the block (see the module docstring).

    Yields a :class:`NativeOutput` filled with the engine's lines when the block ends.
    """
    out = NativeOutput()
    if not _enabled():
        yield out
        return
    with _lock, tempfile.TemporaryFile() as sink:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            _sort(engine, sink.read().decode(errors="replace"), out)


def _sort(engine: str, captured: str, out: NativeOutput) -> None:
    """Engine lines to the log (and ``out``); anything else back to stderr."""
    other = []
    for line in captured.splitlines():
        if _ENGINE_LINE.match(line):
            out.lines.append(line)
            log.info("%s: %s", engine, line)
        elif line:
            other.append(line)
    if other:
        os.write(2, ("\n".join(other) + "\n").encode())
