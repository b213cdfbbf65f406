"""``nccl``: torch.distributed point-to-point between two endpoints — NCCL for CUDA
objects, gloo for CPU objects.

Files: ``_blobs`` (Hello info and references), ``_engine`` (torch.distributed
behind the :class:`Dist` seam), ``_objects`` (the sender's and receiver's state of
one object, the ordered channel's headers), ``_link`` (a pair, and one generation
of its process groups: their state, the posts, failure), ``_groups`` (the
rendezvous, building the groups and tearing them down), ``_threads`` (the worker
threads' loops: reapers, tagged receives, the ordered channel's FIFO threads),
``_registry`` (the live links, joined at exit), ``_backend`` (the backend and its
handles).

Process groups
    Every backend instance hosts a ``TCPStore`` (bound to ``ctx.host``, port chosen by
    the OS) and announces ``host:port`` in its Hello. For each peer the side whose
    ``(endpoint name, instance)`` sorts first is rank 0; both sides rendezvous in rank
    0's store under a prefix unique to the pair, both instances and a *generation*,
    and build their **own** 2-rank ``ProcessGroupGloo`` (plus two 2-rank
    ``ProcessGroupNCCL``, one per direction, when both ends have CUDA) in a worker
    thread. The global default process group is never touched. ``connect()`` starts
    the build and returns; transfers queued meanwhile are posted once it is ready.

Pairing
    The endpoint publishes objects in DataReady order and imports them in that order,
    but it may *refuse* an object early (it imports and closes it unfetched — the
    backend declares ``two_sided``) — an abort NACKs queued ones at once — so the
    receiver's calls do not arrive in the sender's order. Two channels cope with
    that:

    - **tagged** (CPU objects, gloo): every object carries its own gloo tag in its
      reference. Sends and receives are posted without blocking (gloo matches them
      by tag) and their completion is awaited in per-link worker threads, so the
      order in which the receiver posts never matters.
    - **ordered** (CUDA objects, NCCL — NCCL ignores tags and pairs operations in
      issue order): before each payload the sender's FIFO thread sends a 24-byte
      header (tag, size, device) on a gloo control tag; the receiver posts one header
      receive per object it imports and its FIFO thread receives payloads in
      header order, i.e. in the sender's order. The ``ordered`` option routes CPU
      objects through this channel too (with gloo payloads), which is how the NCCL
      ordering logic is tested on machines without GPUs.

    Every announced object is received exactly once: one closed before its bytes
    were fetched is received into a scratch buffer. An object whose header arrives
    but which the endpoint never imports within ``timeout`` (its DataReady was lost)
    is consumed the same way.

Lent tensors (``send(..., lend=True)``, CPU tensors, the tagged channel)
    No packing: each tensor is sent as it is, one gloo message per tensor under
    consecutive tags, and the receiver posts one receive per tensor into its place
    in the packed image. The caller must not modify the tensors until the send's
    receipt completes.

Lifetime and failures
    Gloo cannot cancel a posted operation, and a gloo wait that times out closes the
    pair for good. Waits are therefore bounded by the group's ``timeout`` and only
    begin when completion is due: a receive right away (its send was posted before
    the DataReady), a send once its buffer is freed (after the ACK it has completed;
    reaper threads wait, more of them when one is stuck, so one send whose receiver
    never came does not hold back the buffers of the others). Any engine error
    breaks the link: awaited fetches fail at once, and the next object builds a new
    generation (a receiver follows the generation named in references).
    ``disconnect()`` and ``aclose()`` fail pending work immediately and never wait for
    the engine beyond a second; NCCL communicators are aborted; a gloo wait still in
    progress ends when the peer closes its sockets or the timeout passes. Worker
    threads are daemons, and an exit hook stops and joins them before the
    interpreter finalizes (a thread that touches the engine during finalization
    would abort the process).

Blob formats: see :mod:`omniwire.backends.nccl._blobs`.

Options (``backend_options={"nccl": {...}}``): ``timeout`` (s, default 300: every
engine wait, and how long an unclaimed ordered object is kept), ``connect_timeout``
(s, default 30: rendezvous), ``ordered`` (bool: CPU objects use the ordered channel),
``device`` (CUDA device that receives CUDA objects; default the current one),
``pool_bytes`` (idle CPU buffers kept for reuse, default 256 MiB), ``dist`` (a
:class:`Dist` to use instead of torch.distributed).
"""

from ._backend import NcclBackend
from ._engine import Dist, TorchDistributed

__all__ = ["Dist", "NcclBackend", "TorchDistributed"]
