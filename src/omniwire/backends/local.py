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
from .base import BackendBase, Capabilities, Export, Import, Locality, ObjectBackend, PeerInfo

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


class _ObjectExport(Export):
    """A value waiting in the process-wide table under ``key``."""

    def __init__(self, backend: BackendBase, key: bytes) -> None:
        super().__init__(backend, 0, layout="object")
        self.key = key

    @property
    def ref(self) -> bytes:
        return self.key

    def _release(self) -> None:
        with _lock:
            _table.pop(self.key, None)


class LocalBackend(ObjectBackend):
    name: ClassVar[str] = "local"
    summary: ClassVar[str] = "the object is handed over in-process, without serialization"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        localities=frozenset({Locality.SAME_PROCESS}),
        zero_copy=True,
        preference=100,
        layouts=frozenset({"object"}),
    )

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self._closed = False

    def export_object(self, peer: PeerInfo, value: Any) -> Export:
        if self._closed:
            raise BackendClosedError("local backend is closed")
        key = f"{self.ctx.instance:x}:{next(_ids)}".encode()
        copied = copy_containers(value)
        with _lock:
            _table[key] = copied
        return _ObjectExport(self, key)

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        if self._closed:
            raise BackendClosedError("local backend is closed")
        with _lock:
            try:
                value = _table.pop(ref)
            except KeyError:
                raise BackendError(
                    f"local object {ref[:64]!r} from {peer.name!r} does not exist in this "
                    "process (already taken, released, or the sender is elsewhere)"
                ) from None
        return Import(self, peer, 0, value=value)

    async def aclose(self) -> None:
        self._closed = True
        prefix = f"{self.ctx.instance:x}:".encode()
        with _lock:  # values never taken: nobody will import them now
            for key in [k for k in _table if k.startswith(prefix)]:
                del _table[key]

    def detail(self) -> dict[str, int]:
        with _lock:
            prefix = f"{self.ctx.instance:x}:".encode()
            return {"objects_waiting": sum(1 for k in _table if k.startswith(prefix))}
