"""The shm backend: the arena, large and dedicated segments, the peers' segments
mapped here, forwards."""

from __future__ import annotations

import itertools
import logging
import os
import secrets
from collections.abc import Callable
from typing import ClassVar

import anyio
import msgspec
import torch

from ...errors import BackendClosedError, BackendError, BadReferenceError, ShmFullError
from ...hostinfo import pid_alive
from .._peermem import SEALING, Opened, OwnerGoneError, open_shared, read_lock
from ..base import (
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    Export,
    Import,
    Locality,
    PeerInfo,
)
from ..pool import SlotPool
from ..support import decode_blob
from ..threads import make_in_thread
from ._blobs import _encoder, _forward_ref_decoder, _ForwardRef, _forwards_hello_decoder, _Hello
from ._segment import (
    _NAME,
    PREFIX,
    PREFIX_RE,
    SHM_DIR,
    Segment,
    _unlink_quietly,
    sweep_stale_segments,
)
from ._transfers import _ForwardExport, _Link, _ReadImport, _ShmExport, _ShmImport

log = logging.getLogger("omniwire.shm")

#: Long-lived segments of one peer kept open here (omniwire senders use 1 + large_segments);
#: beyond it, an object's segment is opened for that object alone.
MAX_KEPT_SEGMENTS = 16
#: The Hello feature of a peer that reads sealed segments (spec §11.2, §9.2).
SEALED_FEATURE = "sealed"


class _Arena:
    """One form's arena and its pool: sealed memfds, or plain files for a peer that
    has not said it reads sealed segments (spec §9.2, "Which form")."""

    def __init__(self, backend: ShmBackend, main: bool, keep: int) -> None:
        self.sealed = backend.sealed and main
        self.segment: Segment | None = None
        self.lock = anyio.Lock()
        self.error = ""
        self.create: Callable[[int], Segment] = (
            (lambda size: backend._new_segment(size))
            if main
            else (lambda size: backend._new_segment(size, sealed=False))
        )
        self.pool: SlotPool[Segment] = SlotPool(
            "shm arena" if main else "shm arena (plain files)",
            create=self.create,
            destroy=backend._drop_segment,
            option="backend_options['shm']['arena_size']",
            keep=keep,
        )


class ShmBackend(ByteBackend):
    """Options (``backend_options={"shm": {...}}``): ``arena_size`` (bytes, default
    64 MiB), ``directory`` (default /dev/shm), ``arena_wait`` (seconds an object of at
    most half the arena waits for a free slot before it gets a dedicated segment,
    default 1), ``large_segments`` (how many kept segments of the arena's size carry
    objects over half the arena, default 2; 0: a dedicated segment each), ``sealed``
    (default True where the platform has sealed memfds: sealed memfds behind links; False: plain files, for peers in
    another PID namespace that share /dev/shm — a receiver then copies with
    ``pread``, even in zero-copy mode).

    An object larger than the arena always gets a dedicated segment. One that fits
    but finds the arena full waits for ACKs to free a slot (warm memory beats a
    fresh segment, which page-faults at a fraction of memcpy speed).
    """

    name: ClassVar[str] = "shm"
    summary: ClassVar[str] = "POSIX shared memory, one pre-faulted arena per sender"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu"}),
        localities=frozenset({Locality.SAME_PROCESS, Locality.SAME_HOST}),
        progressive=True,
        zero_copy=True,
        mapped=True,
        shared_refs=True,
        preference=80,
    )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        opts = ctx.options
        try:
            self.arena_size = int(opts.get("arena_size", 64 << 20))
            self.directory = str(opts.get("directory", SHM_DIR))
            self.arena_wait = float(opts.get("arena_wait", 1.0))
            large = int(opts.get("large_segments", 2))
            self.sealed = bool(opts.get("sealed", SEALING))
        except (TypeError, ValueError) as exc:
            raise BackendError(f"shm: bad options {dict(opts)!r}: {exc}") from None
        self.prefix = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._seq = itertools.count()
        self._keep = max(large, 0)
        self._main = _Arena(self, True, self._keep)
        self.pool = self._main.pool
        # plain files for peers that did not say they read sealed segments: made on
        # the first object to such a peer (only when this endpoint writes sealed ones)
        self._plain: _Arena | None = None
        # receiver side: peer key -> the segments of it mapped here
        self._mapped: dict[tuple[str, int], dict[str, Segment | Opened]] = {}
        self._prefixes: dict[tuple[str, int], str] = {}
        # peers that read forwarded references (their Hello says ``forwards``)
        self._forwards: set[tuple[str, int]] = set()
        # forwarding: our links to memfds of other processes, by (peer key, segment)
        # for a kept segment (until it is unmapped here) or by import for a dedicated one
        self._links: dict[object, _Link] = {}
        self._closed = False

    @classmethod
    def availability(cls) -> Availability:
        if not os.path.isdir(SHM_DIR):
            return Availability.missing(f"{SHM_DIR} does not exist on this system")
        return Availability.ok()

    async def start(self) -> None:
        sweep_stale_segments(self.directory)

    def hello(self) -> bytes:
        return _encoder.encode(_Hello(self.prefix, forwards=SEALING))

    def accepts(self, peer: PeerInfo) -> str | None:
        try:
            prefix = _forwards_hello_decoder.decode(peer.info).prefix
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return f"malformed shm hello info: {exc}"
        # A peer may only claim segments of its own process (spec §9.2): the prefix
        # carries its pid, and no other live peer holds the same prefix.
        m = PREFIX_RE.match(prefix)
        if m is None or int(m.group(1)) != peer.pid:
            return f"shm prefix {prefix[:80]!r} is not 'omniwire-{peer.pid}-<hex>' (its own pid)"
        if prefix == self.prefix or any(
            p == prefix and key[0] != peer.name for key, p in self._prefixes.items()
        ):
            return f"shm prefix {prefix!r} is already held by another endpoint"
        return None

    async def connect(self, peer: PeerInfo) -> None:
        why = self.accepts(peer)
        if why is not None:
            raise BackendError(f"{peer.name!r}: {why}")
        hello = _forwards_hello_decoder.decode(peer.info)
        self._prefixes[peer.key] = hello.prefix
        if hello.forwards:
            self._forwards.add(peer.key)

    def _new_segment(self, size: int, sealed: bool | None = None) -> Segment:
        name = f"{self.prefix}-{next(self._seq)}"
        form = self.sealed if sealed is None else sealed
        return Segment.create(name, size, self.directory, sealed=form)

    @property
    def _arena(self) -> Segment | None:
        """The (main) arena's segment, once made."""
        return self._main.segment

    def reads_sealed(self, peer: PeerInfo) -> bool:
        """Whether ``peer`` said (Hello feature "sealed") that it reads sealed segments;
        a peer that did not is sent plain files, as the earlier 1.1 text made them."""
        return SEALED_FEATURE in peer.features

    def shares(self, export: Export, peer: PeerInfo) -> bool:
        if isinstance(export, _ShmExport) and export.segment.sealed:
            return self.reads_sealed(peer)
        return True

    def _arena_for(self, peer: PeerInfo) -> _Arena:
        if not self.sealed or self.reads_sealed(peer):
            return self._main
        if self._plain is None:
            self._plain = _Arena(self, False, self._keep)  # plain files
        return self._plain

    def _drop_segment(self, seg: Segment) -> None:
        seg.unlink(self.directory)
        seg.close()

    async def _ensure_arena(self, arena: _Arena) -> None:
        """Create the arena on the first send. If /dev/shm has no room for it, say so
        once and carry on with dedicated segments (each of which fails with
        ShmFullError if it, too, does not fit)."""
        if arena.segment is not None or self.arena_size <= 0 or arena.error:
            return
        async with arena.lock:
            if arena.segment is None and not arena.error and not self._closed:
                try:
                    segment = await make_in_thread(
                        lambda: arena.create(self.arena_size), self._drop_segment
                    )
                except ShmFullError as exc:
                    arena.error = str(exc)
                    log.warning("shm arena not created: %s; using per-object segments", exc)
                    return
                if arena.pool.closed:  # closed meanwhile
                    self._drop_segment(segment)
                    return
                arena.pool.attach(segment.size)
                arena.segment = segment

    # -- sender --------------------------------------------------------------------

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        if self._closed:
            raise BackendClosedError("shm backend is closed")
        arena = self._arena_for(peer)
        await self._ensure_arena(arena)
        lease = await arena.pool.take(
            nbytes, wait=self.arena_wait, purpose=f"to {peer.name!r}", key=peer.name
        )
        segment = lease.buffer if lease.buffer is not None else arena.segment
        if segment is None:  # closed meanwhile
            lease.release()
            raise BackendClosedError("shm backend is closed")
        return _ShmExport(self, lease, segment)

    # -- receiver ----------------------------------------------------------------------

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        if self._closed:
            raise BackendClosedError("shm backend is closed")
        prefix = self._prefixes.get(peer.key)
        if prefix is None:
            raise BadReferenceError(f"{peer.name!r} did not announce shm in its Hello")
        r = decode_blob(_forward_ref_decoder, ref, f"shm reference from {peer.name!r}")
        if not _NAME.match(r.segment) or not r.segment.startswith(prefix + "-"):
            raise BadReferenceError(
                f"shm reference from {peer.name!r} names segment {r.segment[:80]!r}, "
                "which is not one of its own"
            )
        if r.origin and (not SEALING or not _NAME.match(r.origin)):
            raise BadReferenceError(
                f"shm reference from {peer.name!r} forwards {r.origin[:80]!r}, "
                "which is not an omniwire segment name"
            )
        if r.size != nbytes or r.offset < 0:
            raise BadReferenceError(
                f"shm reference from {peer.name!r} has size {r.size} != {nbytes}"
            )
        held = self._mapped.setdefault(peer.key, {}).get(r.segment)
        if held is None and r.size == 0:
            return _ShmImport(self, peer, 0, torch.empty(0, dtype=torch.uint8))
        if held is None:
            # Checked before anything is mapped, off the loop (_peermem: a link must
            # lead to a sealed memfd of the peer's; a plain file is read, never mapped).
            # Read-write, as before: zero-copy views are writable tensors, and a write
            # into a read-only mapping would fault. We never write to it ourselves.
            opened = await make_in_thread(
                lambda: open_shared(self.directory, r.segment, peer.pid, True, r.origin),
                Opened.close,
            )
            segments = self._mapped.get(peer.key)  # None: the peer went meanwhile
            held = segments.get(r.segment) if segments is not None else None
            if held is not None:  # another import opened it meanwhile
                opened.close()
            else:
                keep = segments is not None and not r.dedicated
                try:
                    self._check_bounds(peer, r, opened.size)
                    if self._closed:
                        raise BackendClosedError("shm backend is closed")
                    if segments is None or not keep or len(segments) >= MAX_KEPT_SEGMENTS:
                        return self._import_once(peer, r, opened)
                    held = opened if not opened.sealed else Segment.map(opened)
                except BaseException:
                    opened.close()
                    raise
                if held is not opened:
                    opened.close()  # the mapping stays
                segments[r.segment] = held
        self._check_bounds(peer, r, held.size)
        if isinstance(held, Segment):
            if held.origin != (r.origin or r.segment):
                raise BadReferenceError(
                    f"shm reference from {peer.name!r} says {r.segment} is "
                    f"{r.origin or r.segment!r}; it is the memfd {held.origin!r}"
                )
            hold = self._hold(peer, r, held)
            return _ShmImport(
                self,
                peer,
                r.size,
                held.view(r.offset, r.size),
                segment=held,
                offset=r.offset,
                hold=hold,
            )
        if r.origin:
            raise BadReferenceError(f"{r.segment} of {peer.name!r} is not a forwarded memfd")
        return _ReadImport(self, peer, r.size, held, r.offset, own=False)

    def _import_once(self, peer: PeerInfo, r: _ForwardRef, opened: Opened) -> Import:
        """An object whose segment is not kept here: this import owns the descriptor
        (a plain file) or a mapping of the object's pages only (a sealed one)."""
        if not opened.sealed:
            return _ReadImport(self, peer, r.size, opened, r.offset, own=True)
        try:
            seg = Segment.map(opened, r.offset, r.size)
        finally:
            opened.close()
        try:
            hold = self._hold(peer, r, seg)
        except BaseException:
            seg.close()
            raise
        return _ShmImport(
            self, peer, r.size, seg.view(r.offset, r.size), seg, offset=r.offset, hold=hold
        )

    def _hold(self, peer: PeerInfo, r: _ForwardRef, seg: Segment) -> int:
        """For a forward: a read lock on the object's bytes (spec §9.2 "Forwarding"),
        taken while the forwarder lives — so if it dies later, the creator sees the
        lock before it reuses the slot. -1 for anything else."""
        if not r.origin or seg.fd is None:
            return -1
        hold = read_lock(seg.fd, r.offset, r.size)
        if not pid_alive(peer.pid):
            os.close(hold)
            raise OwnerGoneError(f"{peer.name!r} forwarded {r.origin} and is gone")
        return hold

    # -- forwarding ----------------------------------------------------------------------

    def _forward(
        self, imp: _ShmImport, seg: Segment, peer: PeerInfo, offset: int, nbytes: int
    ) -> Export | None:
        if self._closed or not self.sealed or peer.key not in self._forwards or seg.fd is None:
            return None
        dedicated = imp._own is seg
        key: object = ("own", id(seg)) if dedicated else (imp.peer.key, seg.name)
        link = self._links.get(key)
        if link is None:
            name = f"{self.prefix}-{next(self._seq)}"
            fd = os.dup(seg.fd)
            try:
                os.symlink(f"/proc/{os.getpid()}/fd/{fd}", os.path.join(self.directory, name))
            except OSError as exc:
                os.close(fd)
                log.warning("shm: cannot name %s to forward it (%s); packing it", seg.name, exc)
                return None
            link = self._links[key] = _Link(key, name, fd, seg.origin, dedicated)
        # the object's place in the segment (a range mapping starts at seg.start)
        return _ForwardExport(self, link, offset, nbytes)

    def _drop_link_if_done(self, link: _Link) -> None:
        if link.users > 0 or not link.dropped:
            return
        if self._links.get(link.key) is link:
            del self._links[link.key]
        _unlink_quietly(os.path.join(self.directory, link.name))  # the name first (§9.2)
        if link.fd >= 0:
            os.close(link.fd)
            link.fd = -1

    def _drop_links(self, peer_key: tuple[str, int] | None) -> None:
        """Our links to the kept segments of ``peer_key`` (None: all) go once unused."""
        for key, link in list(self._links.items()):
            if peer_key is None or (isinstance(key, tuple) and key[0] == peer_key):
                link.dropped = True
                if peer_key is None:
                    link.users = 0  # closing: nothing is sent any more
                self._drop_link_if_done(link)

    def _check_bounds(self, peer: PeerInfo, r: _ForwardRef, size: int) -> None:
        if r.offset + r.size > size:
            raise BadReferenceError(
                f"shm reference from {peer.name!r} spans [{r.offset}, {r.offset + r.size}) "
                f"outside segment {r.segment} of {size} bytes"
            )

    async def disconnect(self, peer: PeerInfo) -> None:
        self._forwards.discard(peer.key)
        self._drop_links(peer.key)
        for held in self._mapped.pop(peer.key, {}).values():
            held.close()
        prefix = self._prefixes.pop(peer.key, None)
        if prefix is not None:  # if the peer died, nobody else will unlink its segments
            self._sweep_prefix(prefix)

    def _sweep_prefix(self, prefix: str) -> None:
        try:
            names = {n for n in os.listdir(self.directory) if n.startswith(prefix + "-")}
        except OSError:
            return
        if names:
            sweep_stale_segments(self.directory, names)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_links(None)
        for segments in self._mapped.values():
            for held in segments.values():
                held.close()
        self._mapped.clear()
        for prefix in self._prefixes.values():
            self._sweep_prefix(prefix)
        self._prefixes.clear()
        for arena in (self._main, self._plain):
            if arena is None:
                continue
            await arena.pool.aclose()
            async with arena.lock:
                if arena.segment is not None:
                    self._drop_segment(arena.segment)
                    arena.segment = None

    def detail(self) -> dict[str, int]:
        return {
            **self.pool.detail("arena_"),
            **(self._plain.pool.detail("plain_arena_") if self._plain is not None else {}),
            "mapped_segments": sum(len(m) for m in self._mapped.values()),
            "forward_links": len(self._links),
        }
