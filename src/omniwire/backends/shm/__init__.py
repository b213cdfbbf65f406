"""``shm``: POSIX shared memory between processes of one host.

Each sending endpoint owns one **arena**: a segment created on its first send
(space reserved with ``posix_fallocate`` so that no memory is a clear
``ShmFullError``, never a SIGBUS), pre-faulted (``MAP_POPULATE``: our own memory),
and carved into reusable slots by the shared slot pool
(:mod:`omniwire.backends.pool`). Packing writes straight into a slot; the receiver
maps the arena once and reads views of the slot. An endpoint that only receives
creates no arena.

Objects over half the arena never wait behind others (a 1 KiB slot anywhere in
the arena would keep them waiting): up to ``large_segments`` extra segments of the
arena's size are made for them on first need, pre-faulted and kept, and the
receiver keeps them mapped like the arena. An object that finds no room either
way — or is larger than the arena — gets a dedicated segment, unlinked when it is
acknowledged.

Sealed segments (spec §9.2; ``sealed=False`` makes 1.1's plain files instead). A
segment is a memfd sealed at its size (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL``), named in /dev/shm by a symlink to ``/proc/<pid>/fd/<n>``. Nobody,
its owner included, can then shrink it, so a receiver's mapping of it can never
fault, whatever the sender does: a peer that truncates what it shares could
otherwise kill the receiving process (SIGBUS), not just its own session. The
receiver opens names only through :func:`._peermem.open_shared`, which follows
that one kind of link to a sealed memfd of the announcing pid and its name, or
opens a plain file with ``O_NOFOLLOW`` — and a plain file (a 1.1 sender's) is
read with ``pread``, never mapped (a truncation is then a short read: a NACK). It
never pre-faults a peer's memory (a sparse segment costs it only what it reads):
a dedicated segment is mapped for the object's range, a long-lived one whole,
once, untouched but for what objects use. Older readers open the link like a file
and map the memfd, so nothing on the wire changes.

Ownership (as in ``multiprocessing.shared_memory``, but without its resource
tracker): the creator owns a segment, holds an exclusive ``flock`` on it for its
lifetime, and unlinks its name exactly once (then closes it). Readers only map
and unmap.

Segments are named ``omniwire-<pid>-<token>-<n>``. A segment whose owner died
(its pid is gone and, for a plain file, its ``flock`` can be taken) is swept by
the next endpoint that starts, and by the peer that mapped it when that peer
closes or sees the owner die — so nothing is left in /dev/shm after a SIGKILL.

Forwarding (spec §9.2 "Forwarding"). A tensor this endpoint received zero-copy —
a view of another process's sealed segment — and sends on with ``lend=True`` goes
by reference: :meth:`_ShmImport.forward` names the memfd this endpoint holds (a
descriptor kept with its mapping) by a link of its own, ``<our prefix>-<n>`` →
``/proc/<our pid>/fd/<dup>``, and the reference says whose memfd it is
(``origin``, the creator's segment name). The endpoint keeps its upstream delivery
unacknowledged until the downstream ACK, so the creator does not reuse the slot
meanwhile. A reader of a forward holds a read lock (an OFD lock, its own open file
description) on the object's bytes while it reads them, and a creator reuses a
slot only once no lock covers it (:func:`~._peermem.range_read_locked`): if the
forwarder dies, the creator's ACK-less release does not hand the slot to a new
object while a reader downstream still reads it. Forward links of a kept segment
live as long as its mapping here; of a dedicated one, as long as its forwards.

Hello info (``BackendInfo.info``): msgpack ``{"prefix": "omniwire-<pid>-<token>",
"forwards": bool}`` (``forwards``: this endpoint reads forwarded references).
Reference (``BackendRef.info``): msgpack ``{"segment": str, "offset": u64, "size": u64,
"dedicated": bool}``, and ``"origin": str`` last for a forward; a dedicated segment
is unmapped by the reader right after use, any other (the arena, a kept segment for
large objects) stays mapped until the peer is gone.

Modules
-------

=============  =================================================================
module         what it does
=============  =================================================================
_blobs         the Hello info and references as msgspec structs, their codecs
_segment       :class:`Segment` (create, own, unlink) and :func:`sweep_stale_segments`
_transfers     exports (a slot, a forward) and imports (mapped, or read with pread)
_backend       :class:`ShmBackend`: the arena, large and dedicated segments, peers
=============  =================================================================
"""

from ._backend import MAX_KEPT_SEGMENTS, ShmBackend
from ._segment import PREFIX, PREFIX_RE, SHM_DIR, Segment, sweep_stale_segments

__all__ = [
    "MAX_KEPT_SEGMENTS",
    "PREFIX",
    "PREFIX_RE",
    "SHM_DIR",
    "Segment",
    "ShmBackend",
    "sweep_stale_segments",
]
