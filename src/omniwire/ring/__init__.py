"""``omniwire.ring``: shared-memory frame rings, a same-host control channel that skips
the socket.

One :class:`RingReader` and one :class:`RingWriter` form a single-producer,
single-consumer channel of byte frames from one process to another process of
the same host (same kernel, same /dev/shm). A peer pair uses two, one per
direction. Frames are variable-length records in a byte ring in a POSIX
shared-memory segment; a frame larger than the free space (or than the whole
ring) travels as fragments that the reader joins, so one channel carries every
frame, in order. Each side sleeps in its event loop on a doorbell (a FIFO read
with ``loop.add_reader``): nothing polls, and an idle channel costs no CPU.

Roles. The **reader creates** the ring (:meth:`RingReader.create`) and gives its
:attr:`~RingReader.name` to the one peer that will write; that peer attaches
(:meth:`RingWriter.attach`). The reader owns every name in /dev/shm and unlinks
them as soon as it sees the writer attached (or at close), so once a channel is
up nothing of it is left to leak whatever process dies; until then the names
are ``omniwire-<reader pid>-<hex>-<n>`` files that the reader keeps ``flock``-ed,
exactly like the shm backend's segments, so ``sweep_stale_segments`` removes
them if the reader dies first:

- ``<name>-0`` the segment (header + data), created by ``Segment.create``: a memfd
  (0600, ``posix_fallocate``, pre-faulted) sealed at its size, which this name, a
  link to ``/proc/<pid>/fd/<n>``, points at. Sealed, it cannot shrink: neither
  side can pull pages from under the other's mapping (a SIGBUS that would kill
  the whole process, not just the session). The writer opens it only through
  ``backends._peermem.open_shared``, checks its seals, size and header (``pread``)
  before mapping it, and does that in a worker thread (:meth:`RingWriter.open`);
- ``<name>-1`` the reader's doorbell, a FIFO the writer rings when there are frames;
- ``<name>-2`` the writer's doorbell, a FIFO the reader rings when there is room.

Usage (reader in one process, writer in the other)::

    reader = RingReader.create()                  # name goes to the peer (Hello)
    reader.start(on_frames=handle_batch)          # on the event loop
    ...
    writer = RingWriter.attach(name, owner_pid=peer_pid)   # in the loop
    if not writer.send_nowait(frame):             # False: full; keep order yourself
        queue.append(frame)                       # ... and, in a drain task:
        await writer.wait_writable()              # then send_nowait(queue[0]) again

Modules
-------

============  ===================================================================
module        what it does
============  ===================================================================
_reader       :class:`RingReader`: creates the ring, takes frames, sleeps between
_writer       :class:`RingWriter`: attaches, puts frames (in fragments), waits for room
_files        the three files: names, creating and attaching them, unlinking them
_layout       header words, record format, sizes; checking a peer-made header
_doorbell     a FIFO doorbell: ring (once per sleep), drain, the owner's ``flock``
_fences       ``ordered()`` and ``fence()``, the memory barriers (below)
_errors       :class:`RingError`, :class:`RingClosedError`
============  ===================================================================

Theory of operation
-------------------

Shared state (all fields are 8-byte words, each written by one side only)::

    block 0  magic, version, capacity, reader pid        (set once, before the name is given)
    block 1  tail  want  writer_pid  writer_closed        (written by the writer only)
    block 2  head  sleeping  reader_closed                (written by the reader only)
    4096…    data: ``capacity`` bytes (a power of two)

``tail`` and ``head`` count bytes ever written / consumed (they never wrap; the
position is ``index & (capacity - 1)``), so ``tail - head`` is the bytes in use.
A record is an 8-byte header ``<u32 length, u32 flags>`` (flag 1: more fragments
of this frame follow) and the payload, padded to 8 bytes; a payload may wrap
around the end of the data area, a header never does (every record starts at a
multiple of 8 and the capacity is one).

What we rely on. Python has no atomics, so:

1. *Single-copy atomicity.* Index and flag words are read and written through a
   ``memoryview`` cast to native ``'Q'``. CPython implements those as a
   ``memcpy`` of ``sizeof(unsigned long long)`` bytes, which C compilers emit as
   one 8-byte load or store; aligned 8-byte accesses are single-copy atomic on
   x86-64 and AArch64. So a word is never seen torn. (64-bit platforms only.)
2. *Ordering.* x86-64 is TSO: loads are not reordered with loads, stores not with
   stores, and a load not with a later store; only a store followed by a load of
   another address may be reordered (the store buffer). AArch64 may reorder all
   four. ``ordered()`` is the barrier for the first three cases: a no-op on
   x86-64, a full barrier elsewhere. ``fence()`` is the full (store→load) barrier
   everywhere: CPython has none, so it takes and releases a ``threading.Lock``.
   Taking and releasing an uncontended lock are atomic read-modify-writes (any
   lock needs them; on CPython 3.11 with glibc, the compare-and-swap of
   ``sem_trywait`` and of ``sem_post``), with acquire and release semantics. On
   x86-64 each is a ``lock``-prefixed instruction, which is a full barrier. On
   AArch64 we take and release it twice, so that a release (unlock 1) is followed
   by an acquire (lock 2), which ARMv8 keeps in order (RCsc): every access before
   the fence is then ordered before every access after it. The interpreter adds
   no reordering of its own: every access is a separate call through the eval
   loop. Cost here: 0.1 µs per ``fence()``.
3. *Doorbells synchronise.* A byte written to a FIFO and read by the other side
   goes through the kernel's pipe lock, so everything the ringer stored before
   the write is visible to the woken side after its read.

Data. Writer: write header and payload, ``ordered()``, store ``tail``.
Reader: load ``tail``, ``ordered()``, read the records up to it, ``ordered()``,
store ``head``. Writer, before reusing space: load ``head``, ``ordered()``, then
overwrite. So the reader never sees a record before its bytes, and the writer
never overwrites bytes the reader has not copied out.

No lost wakeup (the reader). The writer rings the reader's doorbell only when the
reader has said it is going to sleep, and once per sleep, so a stream of frames
costs no syscall per frame. ``sleeping`` is 0 while the reader is awake and a new
number (its sleep count, ``E``) each time it goes to sleep::

    writer W                          reader R (about to wait in epoll)
    w1  store tail                    r1  store sleeping = E
    w2  fence()                       r2  fence()
    w3  s = load sleeping             r3  if load tail != head: sleeping = 0, go on
        if s and s != rung:               else: return to the event loop
            rung = s; ring

This is the store-buffering litmus test with a full fence on both sides, which
forbids both loads from missing the other side's store: either w3 sees ``E`` or
r3 sees the new tail. If r3 sees it, R does not sleep. If w3 sees ``E`` it rings,
unless it rang for ``E`` already; either way a byte for sleep ``E`` is in the FIFO
(it stays there until R reads it, so a ring that comes before R reaches epoll
still wakes it), and R, woken by it, takes frames and then runs r1–r3 again with
``E + 1`` — which w3 did not see, so, by the same litmus test, that r3 sees our
tail. Spurious wakeups are possible and cost one empty pass. While R is awake it
keeps ``sleeping == 0``; when it stays awake to let other tasks run it reschedules
itself with ``call_soon``.

No lost wakeup (the writer, when the ring is full). Same pattern with roles
swapped: the writer stores ``want = (seq << 32) | bytes_needed``, fences, and loads
``head``; if the room is there after all it does not wait. The reader, after
every batch, stores ``head``, fences, loads ``want``, and rings the writer's
doorbell once per ``want`` value when the room it asks for is free. ``bytes_needed``
never exceeds the capacity and a waiting writer does not advance ``tail``, so the
reader, which consumes everything it finds, frees enough room eventually.

Close and death. ``close()`` on either side sets its ``*_closed`` word and rings the
other side unconditionally; the reader hands out what was written before the
writer closed, then reports the end. Neither side ever waits on the other except
in its event loop, so a dead peer wedges nothing: frames to a dead reader pile up
until the ring is full (then ``send_nowait`` returns False), and a dead writer just
stops. A reader that dies before it read the writer's fence never unlinks the
ring's names: the writer, closing, sweeps them (pid dead, locks free).
:meth:`~RingReader.peer_alive` tells a dead peer (its ``flock`` on its
doorbell FIFO is gone), and the endpoint's own process-liveness check applies.
A reader that finds the shared state inconsistent (a buggy or hostile writer)
stops and reports a :class:`RingError`; it never reads outside its mapping.

Doorbell choice, measured on the team's shared 2-core VM (asyncio ping-pong of a
bare doorbell between two processes, ``scripts/ring_bench.py --doorbells``, seven
interleaved rounds in two runs): p50 FIFO 30–56 µs, eventfd 29–51 µs, unix
datagram (abstract name) 38–121 µs; ring + drain with nobody waiting: eventfd
0.7–1.0 µs, FIFO 1.1–1.6 µs, datagram 3.5–3.8 µs. A FIFO is
as fast as an eventfd within noise, is opened by path (an eventfd cannot be: it
would need a unix-socket rendezvous to pass it with ``SCM_RIGHTS``), lives in
/dev/shm beside the segment — so it reaches exactly the processes the segment
reaches (our ``host_id`` is the boot id plus the /dev/shm device), where an
abstract socket needs a shared network namespace — and has file permissions
(0600), where any process may connect to an abstract socket.
"""

from ._errors import RingClosedError, RingError
from ._layout import DEFAULT_CAPACITY
from ._reader import RingReader
from ._writer import RingWriter

__all__ = [
    "DEFAULT_CAPACITY",
    "RingClosedError",
    "RingError",
    "RingReader",
    "RingWriter",
]
