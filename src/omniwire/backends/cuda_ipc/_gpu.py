"""cuda_ipc's raw calls — torch's CUDA IPC internals, CUDA events and streams, the
host's GPUs and processes — behind the :class:`CudaApi` seam.

:class:`TorchCuda` is the only code that calls into torch's CUDA IPC machinery
(``UntypedStorage._share_cuda_`` / ``_new_shared_cuda`` /
``_release_ipc_counter_cuda``, as ``torch.multiprocessing.reductions`` does). A
test passes another object with the same methods as ``CudaIpcBackend(ctx,
api=...)`` or ``backend_options={"cuda_ipc": {"api": ...}}`` (the CPU tests
simulate a GPU that way). Unless noted, the calls block: the backend runs them in
worker threads (or its clean-up thread), never on the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, cast

import torch

from ... import hostinfo
from ...wire import DeviceInfo
from ..base import Availability
from ._blobs import IPC_EVENT_HANDLE_SIZE, Share

__all__ = ["CudaApi", "Event", "TorchCuda"]

log = logging.getLogger("omniwire.cuda_ipc")

# torch's CUDA IPC entry points are untyped; they are called through these.
_cuda: Any = torch.cuda
_Storage: Any = torch.UntypedStorage

INSTALL_HINT = "needs an NVIDIA GPU and a CUDA build of torch"


class Event(Protocol):
    """A CUDA event (interprocess ones have an IPC handle)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CudaApi(Protocol):
    """Everything the backend asks of CUDA, torch's IPC machinery and the host."""

    def availability(self) -> Availability:
        """Whether CUDA IPC can run in this process (cheap; loop-safe)."""

    def init(self) -> None:
        """Initialise CUDA."""

    def current_device(self) -> int:
        """The calling thread's current GPU (loop-safe)."""

    def devices(self) -> Sequence[DeviceInfo]:
        """This process's devices, with the GPUs' UUIDs."""

    def process_alive(self, pid: int) -> bool:
        """Whether process ``pid`` of this host is alive (loop-safe)."""

    def on_device(self, index: int) -> AbstractContextManager[object]:
        """Make GPU ``index`` current in this thread for the block."""

    def empty(self, nbytes: int, index: int) -> torch.Tensor:
        """A fresh uint8 buffer on GPU ``index``, from torch's caching allocator (so
        that it can be shared). Raises torch.cuda.OutOfMemoryError."""

    def gpu_index(self, t: torch.Tensor) -> int | None:
        """The GPU a tensor is on, or None (loop-safe)."""

    def sync_streams(self, indices: Iterable[int]) -> None:
        """Wait for this thread's current stream on each GPU."""

    def share(self, storage: torch.UntypedStorage, uuid_of: Callable[[int], str]) -> Share:
        """``storage._share_cuda_()`` as a typed share (cheap: an event record;
        loop-safe). Raises RuntimeError when torch cannot share it."""

    def open_share(self, share: Share, index: int) -> torch.UntypedStorage:
        """Map a share on GPU ``index``; the storage gives torch's counter back when
        it dies."""

    def release_share(self, share: Share) -> None:
        """Give back torch's counter of a share that will never be mapped."""

    def new_event(self, index: int) -> tuple[Event, bytes]:
        """An interprocess event on GPU ``index`` and its IPC handle."""

    def open_event(self, index: int, handle: bytes) -> Event:
        """A peer's interprocess event, opened on GPU ``index``."""

    def record_after(self, event: Event, index: int, others: Iterable[int] = ()) -> None:
        """Record ``event`` on this thread's current stream of GPU ``index``, after the
        work queued on the default stream there and on the current streams of
        ``others`` (loop-safe)."""

    def local_events(self, devices: Iterable[int]) -> list[Event]:
        """Events recorded now on the current streams of ``devices`` (loop-safe)."""

    def peer_access(self, a: int, b: int) -> bool:
        """Whether GPUs ``a`` and ``b`` can access each other's memory."""

    def mem_get_info(self, index: int) -> tuple[int, int]:
        """Free and total bytes of GPU ``index``."""

    def ipc_collect(self) -> None:
        """Let torch free blocks whose consumers are all gone."""


class TorchCuda:
    """:class:`CudaApi` with torch."""

    def availability(self) -> Availability:
        if not hasattr(torch.UntypedStorage, "_share_cuda_"):
            return Availability.missing(
                f"torch {torch.__version__} has no CUDA IPC storage sharing", INSTALL_HINT
            )
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return Availability.missing(
                f"no CUDA device: torch {torch.__version__} is a build without CUDA",
                INSTALL_HINT,
            )
        try:
            ok = torch.cuda.is_available()
        except Exception as exc:
            return Availability.missing(f"no CUDA device: CUDA failed to initialise ({exc})")
        if not ok:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            extra = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return Availability.missing(f"no CUDA device: torch sees no GPU{extra}")
        return Availability.ok()

    def init(self) -> None:
        _cuda.init()

    def current_device(self) -> int:
        return int(torch.cuda.current_device())

    def devices(self) -> Sequence[DeviceInfo]:
        return hostinfo.local_devices()

    def process_alive(self, pid: int) -> bool:
        return hostinfo.pid_alive(pid)

    def on_device(self, index: int) -> AbstractContextManager[object]:
        return cast(AbstractContextManager[object], torch.cuda.device(index))

    def empty(self, nbytes: int, index: int) -> torch.Tensor:
        with self.on_device(index):
            return torch.empty(
                max(nbytes, 1), dtype=torch.uint8, device=torch.device("cuda", index)
            )

    def gpu_index(self, t: torch.Tensor) -> int | None:
        return t.device.index if t.device.type == "cuda" else None

    def sync_streams(self, indices: Iterable[int]) -> None:
        for index in sorted(set(indices)):
            torch.cuda.current_stream(index).synchronize()

    def share(self, storage: torch.UntypedStorage, uuid_of: Callable[[int], str]) -> Share:
        dev, handle, nbytes, offset, counter, counter_offset, event, sync = cast(
            Any, storage
        )._share_cuda_()
        if not handle:
            return Share(device=uuid_of(int(dev)), handle=b"", nbytes=0, offset=0)
        return Share(
            device=uuid_of(int(dev)),
            handle=bytes(handle),
            nbytes=int(nbytes),
            offset=int(offset),
            counter=bytes(counter).decode("ascii"),
            counter_offset=int(counter_offset),
            event=bytes(event) if sync else b"",
            event_sync=bool(sync),
        )

    def open_share(self, share: Share, index: int) -> torch.UntypedStorage:
        if not share.handle or not share.nbytes:
            return cast(torch.UntypedStorage, _Storage(0, device=torch.device("cuda", index)))
        return cast(
            torch.UntypedStorage,
            _Storage._new_shared_cuda(
                index,
                share.handle,
                share.nbytes,
                share.offset,
                share.counter.encode("ascii"),
                share.counter_offset,
                share.event or bytes(IPC_EVENT_HANDLE_SIZE),
                share.event_sync,
            ),
        )

    def release_share(self, share: Share) -> None:
        if share.counter:
            _Storage._release_ipc_counter_cuda(share.counter.encode("ascii"), share.counter_offset)

    def new_event(self, index: int) -> tuple[Event, bytes]:
        with self.on_device(index):
            event = _cuda.Event(interprocess=True)
            handle = bytes(event.ipc_handle())
        return event, handle

    def open_event(self, index: int, handle: bytes) -> Event:
        with self.on_device(index):
            return cast(Event, _cuda.Event.from_ipc_handle(torch.device("cuda", index), handle))

    def record_after(self, event: Event, index: int, others: Iterable[int] = ()) -> None:
        current = torch.cuda.current_stream(index)
        default = torch.cuda.default_stream(index)
        if current != default:
            current.wait_stream(default)
        for other in others:
            if other != index:
                current.wait_stream(torch.cuda.current_stream(other))
        event.record(current)

    def local_events(self, devices: Iterable[int]) -> list[Event]:
        events = []
        for index in sorted(set(devices)):
            with self.on_device(index):
                event = _cuda.Event()
                event.record(torch.cuda.current_stream(index))
                events.append(event)
        return events

    def peer_access(self, a: int, b: int) -> bool:
        return bool(torch.cuda.can_device_access_peer(a, b)) and bool(
            torch.cuda.can_device_access_peer(b, a)
        )

    def mem_get_info(self, index: int) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(index)
        return int(free), int(total)

    def ipc_collect(self) -> None:
        with contextlib.suppress(Exception):
            _cuda.ipc_collect()


def release_shares(api: CudaApi, shares: Iterable[Share]) -> None:
    """Give back torch's counters of shares never mapped (best effort: the producer may
    be gone, as torch itself assumes)."""
    for share in shares:
        try:
            api.release_share(share)
        except Exception as exc:
            log.debug("cuda_ipc: releasing ref counter %s failed: %s", share.counter, exc)
