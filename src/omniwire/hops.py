"""Hop marks: where the time of one backend object goes, across processes (off by default).

With ``OMNIWIRE_HOPS=<directory>`` in its environment, a process notes the
``time.monotonic()`` of each hop of every object sent through a backend — the send
call reached the object path, the export is ready, the announcement is posted,
frames came in, the receiver's take began, the engine's transfer was submitted and
ended, the object was unpacked, the ACK was posted and came back — and writes them
to ``<directory>/hops-<pid>.json`` when it exits (``{"pid": …, "marks": [[name,
seconds], …]}``, at most ``MAX_MARKS``). CLOCK_MONOTONIC is one clock for every
process and network namespace of a kernel, so the marks of a sender and a receiver
line up; ``scripts/timeline.py --hops`` prints them per hop.

Inline data (small payloads, stream chunks) is not marked: its path is one message.
Without the variable :func:`mark` does nothing (one call of an empty function per
hop of a backend object).
"""

from __future__ import annotations

import atexit
import json
import os
import time

__all__ = ["MAX_MARKS", "enabled", "mark"]

#: Marks a process keeps (later ones are not recorded): memory stays bounded.
MAX_MARKS = 200_000

_DIRECTORY = os.environ.get("OMNIWIRE_HOPS", "")
_marks: list[tuple[str, float]] = []


def enabled() -> bool:
    """Whether this process records hop marks."""
    return bool(_DIRECTORY)


def _off(name: str) -> None:
    """``mark`` when ``OMNIWIRE_HOPS`` is not set."""


def _record(name: str) -> None:
    """Note that the current object reached hop ``name`` now (any thread: a list's
    append is atomic)."""
    if len(_marks) < MAX_MARKS:
        _marks.append((name, time.monotonic()))


def _dump() -> None:
    if not _marks:
        return
    os.makedirs(_DIRECTORY, exist_ok=True)
    path = os.path.join(_DIRECTORY, f"hops-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), "marks": _marks}, f)


mark = _record if _DIRECTORY else _off
if _DIRECTORY:
    atexit.register(_dump)
