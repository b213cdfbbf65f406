"""``local``: hand the payload object to an endpoint in the same process.

No serialization and no copy of tensors. Each delivery gets its own copy of the
payload's *containers* (dict, list, tuple, set), so that when one payload fans
out to several local targets, one target mutating a dict or list cannot change
what another sees. Tensors, numpy arrays and every other object inside are
shared by reference: treat received tensors as read-only, or clone them.

``BackendRef.info`` is the UTF-8 key of the object in a process-wide table.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, ClassVar

from ..errors import BackendClosedError, BackendError
from ..wire import MAX_HEADER_DEPTH
from .base import Capabilities, Locality, ObjectBackend, PeerInfo

__all__ = ["LocalBackend", "copy_containers"]

_table: dict[bytes, Any] = {}
_lock = threading.Lock()
_ids = itertools.count(1)


def copy_containers(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` with new dicts, lists, tuples and sets; leaves shared."""
    kind = type(value)
    if kind not in (dict, list, tuple, set):
        return value
    if depth >= MAX_HEADER_DEPTH:
        raise ValueError(f"payload nests deeper than {MAX_HEADER_DEPTH} levels")
    d = depth + 1
    if kind is dict:
        return {k: copy_containers(v, d) for k, v in value.items()}
    if kind is list:
        return [copy_containers(v, d) for v in value]
    if kind is tuple:
        return tuple(copy_containers(v, d) for v in value)
    return {copy_containers(v, d) for v in value}


class LocalBackend(ObjectBackend):
    name: ClassVar[str] = "local"
    summary: ClassVar[str] = "the object is handed over in-process, without serialization"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        localities=frozenset({Locality.SAME_PROCESS}),
        zero_copy=True,
        preference=100,
    )

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self._mine: set[bytes] = set()
        self._closed = False

    def put_object(self, peer: PeerInfo, value: Any) -> bytes:
        if self._closed:
            raise BackendClosedError("local backend is closed")
        key = f"{self.ctx.instance:x}:{next(_ids)}".encode()
        copied = copy_containers(value)
        with _lock:
            _table[key] = copied
        self._mine.add(key)
        return key

    def take_object(self, peer: PeerInfo, info: bytes) -> Any:
        with _lock:
            try:
                return _table.pop(info)
            except KeyError:
                raise BackendError(
                    f"local object {info[:64]!r} from {peer.name!r} does not exist in this "
                    "process (already taken, released, or the sender is elsewhere)"
                ) from None

    def discard(self, info: bytes) -> None:
        with _lock:
            _table.pop(info, None)
        self._mine.discard(info)

    async def aclose(self) -> None:
        self._closed = True
        with _lock:
            for key in self._mine:
                _table.pop(key, None)
        self._mine.clear()

    def stats(self) -> dict[str, int]:
        with _lock:
            held = sum(1 for k in self._mine if k in _table)
        return {"objects_held": held}
