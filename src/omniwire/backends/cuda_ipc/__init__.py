"""``cuda_ipc``: CUDA tensors between processes of one host, through CUDA IPC.

Files: ``_blobs`` (Hello info and references, validated; tensors to shares and
back), ``_gpu`` (every CUDA and torch IPC call, behind the :class:`CudaApi` seam),
``_devices`` (this process's GPUs by index and UUID), ``_slots`` (the sender's slot
pool, from the shared slot pool :mod:`omniwire.backends.pool`, and its event ring),
``_peers`` (what is kept per peer, given back when the peer goes), ``_handles`` (the
export and import handles and the mapping work they do), ``_backend`` (the backend:
its lifecycle and the export and import entry points).

Two paths, chosen per object by the sender:

- **Same GPU** (the receiver's GPU holds every tensor): ``export_tensors``
  shares each tensor's storage with torch's own CUDA IPC machinery
  (``UntypedStorage._share_cuda_``, as ``torch.multiprocessing.reductions.reduce_tensor``
  does) and the receiver maps it (``UntypedStorage._new_shared_cuda``, as
  ``rebuild_cuda_tensor`` does): layout ``per_tensor``, no copy. The sender keeps
  the tensors alive until the ACK.
- **Another GPU** (or a storage torch cannot share, such as one received from
  another process): a **slot pool** on the sender's GPU, reserved by ``start``
  (``backend_options={"cuda_ipc": {"pool_size": ...}}``, so an out-of-memory shows
  when the endpoint starts) and carved by a buddy allocator. Packing copies the
  payload into a slot; ``publish`` records an interprocess CUDA event; the
  receiver maps the pool once (its IPC handle is exported once per receiver), waits
  for the event, and copies out (or the endpoint views the slot, in zero-copy
  mode). An object larger than the free pool gets a dedicated buffer, shared the
  same way and dropped after its ACK.

Lifetime (spec §7) and torch's own reference counting
-----------------------------------------------------
torch counts, per ``_share_cuda_`` call, the consumers of a shared block in a
shared-memory file (``/torch_<pid>_…``): the producer's block is not returned to
its caching allocator ("limbo") until every consumer storage built by
``_new_shared_cuda`` is gone — each decrements its counter when it dies, after a
stream sync — or ``_release_ipc_counter_cuda`` is called for it. omniwire's ACK is
the primary rule (the sender holds its tensors / slot until the ACK), and torch's
counters are kept exact so that they cooperate:

- every share the sender makes is either mapped exactly once by the receiver (its
  storage then releases the counter) or released explicitly: by the receiver when it
  closes an object unfetched or fails half-way, by the sender when a
  share fails half-way, or by the sender for a peer whose process died. An object
  the receiver refuses is still imported and closed unfetched (the backend
  declares ``two_sided``), which gives its counters back;
- so a zero-copy view the user keeps after releasing it stays valid memory (torch
  keeps the block in limbo), and nothing stays in limbo once everybody is done.

Receivers drop mapped storages in a helper thread (torch's deleter synchronizes a
stream), after an event recorded where the endpoint copied from them. Pool slots
are reused only after the receiver is done: a receiver that handed out zero-copy
views of a slot records its *release event* (an interprocess event announced in its
Hello) when they are released, and a freed slot is quarantined until that event has
completed (the sender queries it; it never blocks the event loop). In-place writes
by the user into a tensor sent on the same-GPU path, after its ACK, race with the
receiver's pending copy just as with ``torch.multiprocessing``: do not mutate a sent
tensor; send a fresh one.

Each end announces the GPU it receives on; ``connect`` refuses a peer whose GPU
cannot access this one's (``torch.cuda.can_device_access_peer``), so the endpoint
routes that peer elsewhere.

Blocking CUDA calls (opening handles, event waits, copies, syncs) run in worker
threads (``anyio.to_thread.run_sync``) bounded by ``timeout``; a failed or timed-out
transfer frees its slot and fails only itself.

Blob formats: see :mod:`omniwire.backends.cuda_ipc._blobs`.

Options (``backend_options={"cuda_ipc": {...}}``): ``pool_size`` (bytes, default
256 MiB; 0 disables the pool), ``device`` (the local GPU index this endpoint
receives on and keeps its pool on; default: the current device), ``min_block``
(slot granularity, default 64 KiB), ``timeout`` (seconds for one GPU wait or copy,
default 60), ``api`` (a :class:`CudaApi` to use instead of torch's CUDA).
"""

from ._backend import CudaIpcBackend
from ._gpu import CudaApi, Event, TorchCuda
from ._slots import EventRing

__all__ = ["CudaApi", "CudaIpcBackend", "Event", "EventRing", "TorchCuda"]
