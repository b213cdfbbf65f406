"""``nixl``: NVIDIA NIXL agents over UCX: one-sided READs by the receiver, or WRITEs by
the sender into the receiver's landing.

Files: ``_blobs`` (Hello info and references, validated), ``_engine`` (the raw
NIXL calls behind the :class:`Agent` seam, errors mapped once), ``_memory``
(registrations: the pools' regions and dedicated buffers, the lent tensors'
registration cache), ``_reading`` (the receiver side: each peer's agent as known
here, and the imports that READ its spans), ``_backend`` (the backend: its pools,
exports, connections and recovery).

Each backend instance runs one NIXL agent under a unique name and registers one
**pool** of memory with it, once: pre-faulted host memory (``DRAM``), plus an
optional ``VRAM`` pool on a CUDA device (``vram_pool_size``). The shared slot
pool (:mod:`omniwire.backends.pool`) carves them into slots; an object that finds
no free slot gets a dedicated registration, released with its export. Receivers
always land the bytes in host memory (the backend declares devices ``{"cpu"}``):
a VRAM pool only spares a sender of CUDA tensors the staging copy.

Data flow (pull): the sender packs into its slot and announces it; the receiver's
agent **reads** each announced range ``[lo, hi)`` straight from the sender's slot
(``initialize_xfer("READ", ...)``, ``transfer``, then ``check_xfer_state`` polled;
the transfer is released afterwards, always). The first READ from a peer runs in a
worker thread (:func:`~omniwire.backends.support.poll_until`); once one completed
(the UCX connection is up), READs of at most 16 spans into memory registered
already (a landing slot, a block of the registered receive pool) are created and
posted on the event loop
(posting only queues them for UCX's progress thread) and waited for by the
backend's :class:`~omniwire.backends.support.Completions` thread, which wakes the
loop when each ends: no worker thread has to be scheduled before the READ starts. The sender's agent is passive: it learns that
the object was taken from omniwire's ACK, so reads carry no NIXL notification.

**Landings** (push, spec §9.5; shared with mooncake, :mod:`omniwire.backends.landing`):
each backend lends every peer it writes a Hello to a *landing* of ``landing_size``
bytes of host memory (128 MiB by default, not pre-faulted, registered on the loop in
tens of microseconds; none past ``landing_peers`` peers, 16 by default), announced with its
partial metadata. The peer loads that metadata once (it stays loaded through a
reload) and WRITEs a complete object there before announcing it, in one transfer
from its pool slot or its lent tensors: NIXL's UCX backend flushes the endpoint
after the puts, so ``DONE`` means the bytes are in the receiver's memory, and the
send's receipt completes then (outcome ``"landed"``). The receiver READs nothing.
A WRITE that fails leaves the object for a READ, and its range out of use (whether
it reached the memory is not known). A landing comes back when its peer's session
ends, quarantined for ``landing_quarantine`` seconds (UCX writes memory that is no
longer registered: the quarantine is the fence, see
:class:`~omniwire.backends.landing.Lender`).

**Shared references** (``Capabilities.shared_refs``): a reference names a pool and
an offset (or a dedicated region with its metadata), which any peer may read: a
fan-out to several nixl peers packs one slot they all read (freed with the last ACK),
and ``Endpoint.empty()`` hands out a pool slot, sent in place with no registration.

**Lent tensors** (``send(..., lend=True)``, CPU tensors, contiguous): no packing.
The sender registers each tensor's storage with its agent (cached for the next
send of the same memory) and announces each registration's partial metadata and
where each tensor's bytes are; the receiver loads the registrations (once per
registration) and reads every piece to its place in one READ. The caller must not
modify the tensors until the send's receipt completes.

Where the receiver reads into:

- zero-copy (no ``dest``): a slot of its own registered pool (or a dedicated
  registration); the delivered tensors view it until the import is closed;
- copy mode, the endpoint's receive buffer (objects of at least
  ``register_dest_min`` bytes): a block of the backend's **registered receive pool**
  (:meth:`NixlBackend.delivery_buffer`), registered once when the block is made and
  reused for later objects, so a READ lands in it with no registration of its own
  (measured here: about 60 µs to register 1 MiB and 15 µs to deregister it);
- copy mode, any other ``dest`` of at least ``register_dest_min`` bytes: the
  destination itself is registered for the object and the bytes are read straight
  into it, then it is deregistered. Below about 256 KiB reading into an own slot
  and copying is as fast.

Blob formats: see :mod:`omniwire.backends.nixl._blobs`.

Options (``backend_options={"nixl": {...}}``): ``pool_size`` (bytes, default
128 MiB), ``vram_pool_size`` (bytes, default 0), ``cuda_device`` (index, default
the current device), ``register_dest_min`` (bytes, default 256 KiB),
``recv_pool_idle`` (bytes of idle registered receive buffers kept, default 256 MiB;
0: none), ``register_inline`` (bytes: a lent host tensor's storage up to this size is
registered on the event loop rather than in a worker thread, default 4 MiB; measured
with UCX over tcp: ~50 µs for 1 MiB, ~200 µs for 16 MiB), ``timeout``
(seconds one read may take, default 30 plus 1 s per 50 MB), ``landing_size`` (bytes
lent to each peer for landed objects, default 128 MiB; 0: none), ``landing_peers``
(how many peers get one at once, default 16), ``landing_quarantine`` (seconds a
landing that came back is lent to nobody before it is unmapped, default 60),
``agent_factory`` (a
callable returning an :class:`Agent` for a name, instead of a NIXL agent).

Environment: UCX reads ``UCX_*`` variables (tests pin ``UCX_NET_DEVICES=lo``);
``NIXL_LOG_LEVEL`` sets NIXL's Python log level.
"""

from ._backend import NixlBackend
from ._engine import Agent, NixlAgent

__all__ = ["Agent", "NixlAgent", "NixlBackend"]
