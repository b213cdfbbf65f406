"""``mooncake``: the Mooncake Transfer Engine, peer to peer (``P2PHANDSHAKE``): the
receiver reads, or the sender writes into the receiver's landing.

Files: ``_blobs`` (Hello info and references, validated), ``_engine`` (the raw
engine calls behind the :class:`Engine` seam, one engine per process),
``_memory`` (registered memory: the pool's region and dedicated buffers, the
lent tensors' registration cache), ``_reading`` (the receiver's import: reads of the
peer's spans), ``_backend`` (the backend, its exports, landings and writes).

Each backend registers one **pool** of host memory with the engine, once, and
carves it into slots with the shared slot pool (:mod:`omniwire.backends.pool`);
an object that finds no free slot gets a dedicated buffer, registered for that
object and unregistered when it is released.

Data flow (pull): the sender packs into its slot and announces it; the receiver
**reads** the announced byte ranges ``[lo, hi)`` with
``batch_transfer_async_read``, submitted in one of the backend's threads
(:class:`~omniwire.backends.support.Threads`: the TCP transport may connect inside
the submit call), and the backend's one
:class:`~omniwire.backends.support.Completions` thread polls the status of every
read in flight (not the engine's synchronous calls: they spin a core while they
wait, which costs a third to a half of the throughput on a 2-core machine; not a
polling thread per read: while 1 MiB objects stream between two namespace hosts,
dozens of them took the cores from the engine, and one poller streams 1.7 times
as fast). Each read has its own batch id. The ACK frees the slot.

**Landings** (push, spec §9.4): each backend lends every peer it writes a Hello to
(:meth:`MooncakeBackend.hello_to`) a *landing* of ``landing_size`` bytes of its
memory (128 MiB on tcp by default, room for two 64 MiB objects; not pre-faulted:
tcp registers it without pinning, in microseconds, on the loop; 0 on rdma, where
it would pin; none past ``landing_peers`` peers, 16 by default), registered when
the first Hello of a session is written and kept while the session lasts; it comes
back when the session ends (:class:`~omniwire.backends.landing.Lender`: deregistered
— the engine's server then refuses a peer's write there — and quarantined for
``landing_quarantine`` seconds before it is unmapped). A sender
whose peer lent one writes a complete object there (:meth:`MooncakeBackend.land`:
one ``batch_transfer_async_write`` per span — the pool slot, or each lent piece —
submitted and watched as reads are) before it announces it, in a range it allots
with a buddy allocator and frees at the ACK. Its own slot (or the caller's lent
tensors) is free as soon as the write ends, and the send's receipt completes then
(outcome ``"landed"``): the bytes are in the receiver's memory, and the ACK round
trip is no longer on the sender's path (1 MiB lent between two namespace hosts,
one-way: 0.48–0.75 GB/s read by the receiver, 1.14–1.19 GB/s landed; the bare
engine writes 1 MiB at 1.7–2.0 GB/s there). The write's submit runs on the event loop
while the session is warm (``WARM_S``), else in a worker thread. The receiver reads
nothing: it copies out of the landing (copy mode) or delivers views of it
(zero-copy) and ACKs as always. A fan-out's objects, and a tensor born in the pool
(``Endpoint.empty()``), land one by one from the one slot. An object the landing
cannot hold now, or a progressive one, is read as below; a write that fails leaves the object for a read, and one that is abandoned
(timeout, peer lost) keeps its range out of use for as long as the peer's landing
is the same (a peer that reconnects after a partition keeps it). A write that
stalls (not done after ``LAND_STALL_S``, 10 s, plus 1 s per 50 MB) leaves
the object for a read at once and keeps its range until the engine says it ended.

**Shared references** (``Capabilities.shared_refs``): a reference names the session,
an offset and a length, and any peer may read it, so a fan-out to several mooncake
peers packs one slot that all of them read (freed with the last ACK), and
``Endpoint.empty()`` hands out a slot of the pool: a tensor born there is sent in
place, with no pack copy and no registration of its own.

**Lent tensors** (``send(..., lend=True)``, CPU tensors, contiguous): no packing.
The sender registers each tensor's storage with the engine (a bounded cache keeps
registrations for the next send of the same memory, see
:class:`~omniwire.backends.support.RegistrationCache`) and announces where each
tensor's bytes are (a reference with *pieces*); the receiver reads each piece to
its place in the packed image. The caller must not modify the tensors until the
send's receipt completes.

Where the receiver reads into:

- zero-copy (no ``dest``): a slot of its own registered pool (or a dedicated
  registered buffer); the delivered tensors view it until the import is closed;
- copy mode, the endpoint's receive buffer: a block of the backend's **registered
  receive pool** (:meth:`MooncakeBackend.delivery_buffer`,
  :class:`~omniwire.backends.support.RegisteredRecvPool`): each block is registered
  once, when it is made, and reused for later objects (it comes back when the last
  delivered tensor viewing it is collected), so a read needs no registration of its
  own (register + unregister cost about 40 µs on tcp, more on rdma, where it pins
  pages). Up to ``recv_pool_idle`` bytes of idle blocks are kept; beyond, a block
  coming back is unregistered and unmapped.
- copy mode, any other ``dest``: by default (``register_dest``, on for ``tcp``) the
  destination range itself is registered for the read and unregistered after it,
  about 10 µs on tcp against 5–9 ms for an extra copy of 64 MiB. With
  ``register_dest=False`` (the default for ``rdma``) the bytes are read into an own
  registered slot and copied into ``dest``.

Reads are submitted in the backend's threads, not on the event loop: the engine's
tcp transport may connect to the peer inside its submit call, which blocks while a
link is down.

**TCP slices.** The tcp transport writes a transfer in slices (``MC_TCP_SLICE_SIZE``,
64 KiB by default). At an MTU of 1500 a 64 KiB slice ends in a short segment, which
the kernel holds back (Nagle) until the reader's delayed ACK: between two namespace
hosts one 1 MiB read in ten took about 60 ms. Unless ``MC_TCP_SLICE_SIZE`` is set,
the engine is started with slices of whole segments of the MSS of the interface that
holds ``host`` (45 × 1448 bytes at MTU 1500; Ethernet MTUs only, loopback keeps
64 KiB): 1 MiB one-way 100–170 → 500–590 MB/s there, the bare engine's
0.7 → 1.7 GB/s. The variable is process-wide and read when an engine starts.

Blob formats: see :mod:`omniwire.backends.mooncake._blobs`.

Options (``backend_options={"mooncake": {...}}``): ``protocol`` (``"tcp"``, the
default, or ``"rdma"``); ``device_name`` (RDMA device filter, e.g. ``"mlx5_0"``;
empty: the engine discovers); ``host`` (the address peers reach this engine at;
default: the host of the endpoint's address, 127.0.0.1 for ``ipc://`` and
``tcp://*``); ``pool_size`` (bytes, default 64 MiB); ``register_dest`` (above);
``recv_pool_idle`` (bytes of idle registered receive buffers kept, default 256 MiB;
0: no registered receive pool); ``register_inline`` (bytes: a lent tensor's storage
up to this size is registered on the event loop rather than in a worker thread;
default 64 MiB on tcp, where that takes 4–76 µs against 0.4–0.6 ms for the thread
hop on 2 loaded cores, and 0 on rdma, where registering pins pages);
``landing_size`` (bytes lent to each peer for landed objects; default 128 MiB on
tcp, 0 on rdma; 0: none), ``landing_peers`` (how many peers get one at once, default
16), ``landing_quarantine`` (seconds a landing that came back is lent to nobody
before it is unmapped, default 60);
``timeout`` (seconds a single read may take before it is abandoned; default 60,
plus 1 s per 100 MB); ``engine`` (an :class:`Engine` object to use instead).

Engine caveats (0.3.13): its handshake and data listeners bind every interface,
whatever ``host`` is; a read that is abandoned (timeout, or the peer lost while
it ran: a link that goes down and comes back) may still land later, so its local
buffer is quarantined until ``aclose()``, and a registered ``dest`` is kept
referenced (a receive-pool block is not reused while a tensor holds it) and
registered until ``aclose()``.
"""

from ._backend import MooncakeBackend
from ._engine import Engine, TransferEngine

__all__ = ["Engine", "MooncakeBackend", "TransferEngine"]
