"""Exports (a slot of a segment, a forward) and imports (a mapped segment, a
``pread`` of a plain file) of the shm backend."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from .._peermem import Opened, pread_into, range_read_locked
from ..base import THREAD_COPY_THRESHOLD, Export, Import, PeerInfo, in_parts
from ..pool import Lease
from ..support import mib
from ._blobs import _encoder, _ForwardRef, _Ref
from ._segment import Segment

if TYPE_CHECKING:
    from ._backend import ShmBackend

log = logging.getLogger("omniwire.shm")


class _ShmExport(Export):
    """A slot of the arena, a kept segment, or a dedicated segment, until the peer's ACK."""

    def __init__(self, backend: ShmBackend, lease: Lease[Segment], segment: Segment) -> None:
        offset = max(lease.offset, 0)
        super().__init__(backend, lease.nbytes, segment.view(offset, lease.nbytes))
        self.lease = lease
        self.segment = segment
        self.offset = offset
        self.dedicated = lease.dedicated and not lease.kept  # the reader unmaps it after use

    @property
    def ref(self) -> bytes:
        return _encoder.encode(_Ref(self.segment.name, self.offset, self.nbytes, self.dedicated))

    def _release(self) -> None:
        fd = self.segment.fd
        if (
            not self.dedicated
            and self.segment.sealed
            and fd is not None
            and range_read_locked(fd, self.offset, self.nbytes)
        ):
            # A reader of a forward of it still reads it (its forwarder is gone: an
            # ACK would have waited for that reader). Reuse it once the lock is gone.
            log.info(
                "shm: a forward's reader still holds %s at %d of %s: kept out of use "
                "until it lets go",
                mib(self.nbytes),
                self.offset,
                self.segment.name,
            )
            self.lease.release_when(
                lambda: (
                    self.segment.fd is None
                    or not range_read_locked(self.segment.fd, self.offset, self.nbytes)
                )
            )
            return
        self.lease.release()


class _Link:
    """A name of ours for a memfd another omniwire process made and we hold (a
    forward): ``/dev/shm/<our prefix>-<n>`` → ``/proc/<our pid>/fd/<fd>``."""

    __slots__ = ("dedicated", "dropped", "fd", "key", "name", "origin", "users")

    def __init__(self, key: object, name: str, fd: int, origin: str, dedicated: bool) -> None:
        self.key = key
        self.name = name
        self.fd = fd
        self.origin = origin
        self.dedicated = dedicated
        self.users = 0
        self.dropped = dedicated  # a dedicated one goes with its last forward


class _ForwardExport(Export):
    """Bytes of a segment another process made, forwarded by reference through one
    of our links (no buffer: nothing is packed). Released at the downstream ACK."""

    def __init__(self, backend: ShmBackend, link: _Link, offset: int, nbytes: int) -> None:
        super().__init__(backend, nbytes, None)
        self._shm = backend
        self.link = link
        self.offset = offset
        link.users += 1

    @property
    def ref(self) -> bytes:
        link = self.link
        return _encoder.encode(
            _ForwardRef(link.name, self.offset, self.nbytes, link.dedicated, link.origin)
        )

    def _release(self) -> None:
        self.link.users -= 1
        self._shm._drop_link_if_done(self.link)


class _ShmImport(Import):
    """A view of the peer's sealed segment: of its mapping kept for the peer, or of a
    mapping of this object's range only (``own``), unmapped when the import closes.
    ``hold``: the read lock on its bytes held while it is open (a forward's)."""

    def __init__(
        self,
        backend: ShmBackend,
        peer: PeerInfo,
        nbytes: int,
        view: torch.Tensor,
        own: Segment | None = None,
        *,
        segment: Segment | None = None,
        offset: int = 0,
        hold: int = -1,
    ) -> None:
        super().__init__(backend, peer, nbytes, buffer=view)
        self._shm = backend
        self._own = own
        self.segment = segment if segment is not None else own
        self.offset = offset
        self._hold = hold

    def forward(self, peer: PeerInfo, lo: int, nbytes: int) -> Export | None:
        """Bytes ``[lo, lo + nbytes)`` of this object, by reference to ``peer`` (a
        forward, spec §9.2), or None: ``peer`` does not read forwards, or we cannot
        name the memory (closed, empty, not a mapped memfd)."""
        seg = self.segment
        if self.closed or seg is None or not seg.sealed or nbytes <= 0:
            return None
        return self._shm._forward(self, seg, peer, self.offset + lo, nbytes)

    def _close(self) -> None:
        if self._hold >= 0:
            os.close(self._hold)  # the unlock
            self._hold = -1
        if self._own is not None:  # views still alive keep it mapped until collected
            self._own.close()
            self._own = None


class _ReadImport(Import):
    """An object in a plain (unsealed) file: its owner may truncate it at any time, so
    it is never mapped; :meth:`fetch` reads it with ``pread`` (a truncation is a short
    read: :class:`BackendError`). A zero-copy receiver gets a copy of its own."""

    def __init__(
        self,
        backend: ShmBackend,
        peer: PeerInfo,
        nbytes: int,
        src: Opened,
        offset: int,
        *,
        own: bool,
    ) -> None:
        super().__init__(backend, peer, nbytes)
        self._src = src
        self._offset = offset
        self._own = own  # a descriptor for this object only: closed with the import

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        if hi <= lo:
            return
        if dest is None:
            if self.buffer is None:
                self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
            dest = self.buffer
        target = dest.numpy().data
        fd, offset = self._src.fd, self._offset
        what = f"shm segment {self._src.name} of {self.peer.name!r}"

        def read(a: int, b: int) -> None:
            pread_into(fd, target[a:b], offset + a, what)

        if hi - lo >= THREAD_COPY_THRESHOLD:
            await in_parts(read, lo, hi)
        else:
            read(lo, hi)

    def _close(self) -> None:
        if self._own:
            self._src.close()
