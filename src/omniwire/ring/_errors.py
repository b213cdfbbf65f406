"""The ring's exceptions."""

from __future__ import annotations

from ..errors import OmniwireError

__all__ = ["RingClosedError", "RingError"]


class RingError(OmniwireError):
    """A ring cannot be created or attached, or its shared state is inconsistent."""


class RingClosedError(RingError):
    """This side, or the peer, closed the ring."""
