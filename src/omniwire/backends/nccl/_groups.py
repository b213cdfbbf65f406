"""nccl's process groups: a link's rendezvous in the rank-0 ``TCPStore``, the groups
its builder thread builds, and their teardown when the link fails."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from ...errors import BackendError
from ._engine import Group, Store, engine_error, seconds

if TYPE_CHECKING:
    from ._link import Link

__all__ = ["abort_engine", "build"]


def _store_address(link: Link) -> tuple[str, int]:
    if link.rank == 0:
        return link.backend.ctx.host, link.backend.port
    return link.pair.store_host, link.pair.store_port


def _connect_store(link: Link, deadline: float, cancellable: bool = True) -> Store:
    """A client of the rank-0 store, retried (cancellably) until ``deadline``."""
    host, port = _store_address(link)
    while True:
        if cancellable and link.error is not None:
            raise BackendError("the rendezvous was cancelled")
        try:
            return link.backend.dist.client_store(host, port, max(1.0, deadline - time.monotonic()))
        except (OSError, RuntimeError) as exc:
            if time.monotonic() >= deadline:
                raise BackendError(f"cannot reach its store at {host}:{port}: {exc}") from exc
            time.sleep(0.05)


def _open_store(link: Link) -> Store | None:
    b = link.backend
    if link.rank == 0:
        return b.store
    return _connect_store(link, time.monotonic() + b.connect_timeout)


def build(link: Link) -> None:
    """(builder thread) Rendezvous with the peer and build the link's groups; hand
    them to the link, or fail it."""
    b = link.backend
    try:
        store = _open_store(link)
        if store is None:
            raise BackendError("the backend is closed")
        dist = b.dist
        base = dist.prefix_store(link.prefix, store)
        with link.lock:
            if link.error is not None:
                return
            link.store = base
        # Our own handshake first: its wait is bounded by connect_timeout and can
        # be cancelled (``fail`` writes "cancel"); gloo's rendezvous cannot.
        base.set(f"join{link.rank}", "ok")
        base.wait([f"join{link.peer}"], seconds(b.connect_timeout))
        if base.get(f"join{link.peer}") != b"ok" or link.error is not None:
            raise BackendError("the rendezvous was cancelled")
        pg = dist.gloo_group(dist.prefix_store("gloo", base), link.rank, b.timeout, b.ctx.host)
        nccl_out = nccl_in = None
        if link.nccl:
            groups = [
                dist.nccl_group(dist.prefix_store(f"nccl{r}", base), link.rank, b.timeout)
                for r in (0, 1)
            ]
            nccl_out, nccl_in = groups[link.rank], groups[link.peer]
    except Exception as exc:
        err = exc if isinstance(exc, BackendError) else engine_error("", exc)
        link.fail(
            BackendError(
                f"cannot build the nccl backend's process group with {link.pair.name!r} "
                f"(generation {link.gen}): {str(err).lstrip(': ')}"
            )
        )
        return
    link.install(pg, nccl_out, nccl_in)


def abort_engine(link: Link, building: bool, groups: list[Group]) -> None:
    """(teardown thread) Undo what a failed link's build got to."""
    dist = link.backend.dist
    if building:  # wake both builders blocked in the handshake (a connection of our own:
        # the builder's may be busy waiting)
        with contextlib.suppress(Exception):
            client = _connect_store(link, time.monotonic() + 2.0, cancellable=False)
            store = dist.prefix_store(link.prefix, client)
            for rank in (link.peer, link.rank):
                store.set(f"join{rank}", "cancel")
    for g in groups:
        with contextlib.suppress(Exception):
            dist.abort(g)
