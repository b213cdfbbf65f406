"""nccl's raw engine calls (``torch.distributed``), behind the :class:`Dist` seam.

:class:`Dist` makes the stores and the 2-rank process groups the backend pairs
endpoints with; :class:`TorchDistributed` implements it with torch. A test passes
another object with the same methods as ``NcclBackend(ctx, dist=...)`` or
``backend_options={"nccl": {"dist": ...}}``. The calls block: the backend makes
them in its link threads, never on the event loop. The global default process
group is never touched.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Protocol

import torch

from ...errors import BackendError
from ..base import one_line

__all__ = ["Dist", "Group", "Store", "TorchDistributed", "Work", "engine_error", "header"]

#: torch.distributed, untyped: its stubs and its runtime disagree (``_Options``).
_dist: Any = torch.distributed

HEADER_BYTES = 24  # int64 tag, nbytes, device (0 cpu, 1 cuda)


class Work(Protocol):
    def wait(self) -> Any: ...


class Group(Protocol):
    """A 2-rank process group (gloo or NCCL)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> Work: ...


class Store(Protocol):
    def set(self, key: str, value: str, /) -> None: ...

    def get(self, key: str, /) -> bytes: ...

    def wait(self, keys: list[str], timeout: datetime.timedelta, /) -> None: ...


class Dist(Protocol):
    """What the backend asks of torch.distributed (blocking calls)."""

    def nccl_available(self) -> bool:
        """NCCL can run in this process (a CUDA device and a build with NCCL)."""

    def host_store(self, host: str, timeout: float) -> tuple[Store, int]:
        """A rendezvous store listening on ``host`` (port chosen by the OS), and its port.

        Raises:
            OSError: it cannot listen.
        """

    def client_store(self, host: str, port: int, timeout: float) -> Store:
        """A client of the store at ``host:port`` (raises OSError/RuntimeError if it
        cannot connect within ``timeout``)."""

    def prefix_store(self, prefix: str, store: Store) -> Store:
        """``store`` with every key under ``prefix``."""

    def gloo_group(self, store: Store, rank: int, timeout: float, host: str) -> Group:
        """A 2-rank gloo group on ``host``'s interface."""

    def nccl_group(self, store: Store, rank: int, timeout: float) -> Group:
        """A 2-rank NCCL group."""

    def abort(self, group: Group) -> None:
        """Abort a group's communicators (NCCL), best effort."""


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


class TorchDistributed:
    """:class:`Dist` with torch.distributed (``TCPStore``, ``ProcessGroupGloo``,
    ``ProcessGroupNCCL``), outside the default process group."""

    def nccl_available(self) -> bool:
        return bool(
            torch.cuda.is_available()
            and _dist.is_nccl_available()
            and hasattr(_dist, "ProcessGroupNCCL")
        )

    def host_store(self, host: str, timeout: float) -> tuple[Store, int]:
        sock = socket.create_server((host, 0))
        port = int(sock.getsockname()[1])
        fd = sock.detach()  # the store owns the listening socket from here on
        try:
            store = _dist.TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=_seconds(timeout),
                master_listen_fd=fd,
            )
        except BaseException:
            os.close(fd)
            raise
        return store, port

    def client_store(self, host: str, port: int, timeout: float) -> Store:
        # TCPStore's own connect retries until its timeout and cannot be interrupted:
        # check that the store accepts connections first, with a short timeout.
        with socket.create_connection((host, port), timeout=1.0):
            pass
        store = _dist.TCPStore(host, port, is_master=False, timeout=_seconds(2.0))
        store.set_timeout(_seconds(timeout))
        return store  # type: ignore[no-any-return]

    def prefix_store(self, prefix: str, store: Store) -> Store:
        return _dist.PrefixStore(prefix, store)  # type: ignore[no-any-return]

    def gloo_group(self, store: Store, rank: int, timeout: float, host: str) -> Group:
        opts = _dist.ProcessGroupGloo._Options()
        opts._timeout = _seconds(timeout)
        opts._threads = 1
        opts._devices = [_dist.ProcessGroupGloo.create_device(hostname=host)]
        return _dist.ProcessGroupGloo(store, rank, 2, opts)  # type: ignore[no-any-return]

    def nccl_group(self, store: Store, rank: int, timeout: float) -> Group:
        opts = _dist.ProcessGroupNCCL.Options()
        opts._timeout = _seconds(timeout)
        return _dist.ProcessGroupNCCL(store, rank, 2, opts)  # type: ignore[no-any-return]

    def abort(self, group: Group) -> None:
        abort = getattr(group, "abort", None)
        if abort is not None:
            abort()


def engine_error(what: str, exc: BaseException) -> BackendError:
    """An engine exception as a BackendError (the one mapping of nccl's errors)."""
    return BackendError(f"{what}: {one_line(exc)}" if what else one_line(exc))


def header(tag: int, nbytes: int, device: str) -> torch.Tensor:
    """The ordered channel's header of one object."""
    return torch.tensor([tag, nbytes, int(device == "cuda")], dtype=torch.int64).view(torch.uint8)


def seconds(value: float) -> datetime.timedelta:
    return _seconds(value)
