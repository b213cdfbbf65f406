"""The nixl receiver side: a peer's agent as this endpoint knows it, its registrations
loaded here, and imports that READ the peer's spans into a registered destination or
a landing slot."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import torch

from ... import hops
from ...errors import BackendError
from ..base import Import, PeerInfo, copy_range
from ..pool import Lease
from ..support import check_range
from ..threads import run_to_end
from . import _blobs as blobs
from ._blobs import Mem, Region, Span
from ._engine import Registration, StuckRead, read, read_async
from ._memory import Memory

if TYPE_CHECKING:
    from ._backend import NixlBackend

__all__ = ["Loaded", "Remote", "SpanImport"]

#: At most this many spans (remote descriptors) for a READ started on the event loop.
LOOP_SPANS = 16


class Loaded:
    """A registration of a peer (dedicated or lent) made known to our agent."""

    __slots__ = ("metadata", "region", "users")

    def __init__(self, region: Region, metadata: bytes) -> None:
        self.region = region
        self.metadata = metadata
        self.users = 0


class Remote:
    """What the receiver knows of a peer's agent."""

    def __init__(self, peer: PeerInfo, hello: blobs.PiecesHello) -> None:
        self.peer = peer.name
        self.key = peer.key
        self.agent = hello.agent
        self.metadata = hello.metadata
        self.pools = list(hello.pools)
        self.pieces = hello.pieces
        self.alive = True
        #: A READ from it completed: its connection is up, later READs start on the loop.
        self.opened = False
        self.active = 0  # reads in flight
        self.idle: anyio.Event | None = None
        self.refreshing: anyio.Event | None = None
        self.lock = anyio.Lock()  # loads of registrations and reloads
        self.loaded: dict[tuple[int, int, int, str], Loaded] = {}


class SpanImport(Import):
    """READs of the peer's spans, into ``dest`` (registered) or a landing slot."""

    def __init__(
        self,
        backend: NixlBackend,
        peer: PeerInfo,
        nbytes: int,
        remote: Remote,
        spans: list[Span],
        loaded: list[Loaded],
    ) -> None:
        super().__init__(backend, peer, nbytes)
        self.nx = backend
        self.remote = remote
        self.spans = spans
        self.loaded = loaded
        self.landing: Lease[Memory] | None = None
        self.dest: torch.Tensor | None = None
        self.dest_registration: Registration | None = None
        self.what = f"an object of {nbytes} B from {remote.peer!r}"
        if nbytes == 0:
            self.buffer = torch.empty(0, dtype=torch.uint8)

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        nx = self.nx
        agent = nx._live_agent()
        if self.closed:
            raise BackendError("nixl: fetch on a closed import")
        check_range(lo, hi, self.nbytes, "nixl")
        if hi == lo:
            return
        remote = self.remote
        while remote.refreshing is not None:
            await remote.refreshing.wait()
        if not remote.alive:
            raise BackendError(f"nixl: peer {remote.peer!r} is gone")
        direct = (
            dest is not None
            and self.nbytes >= nx.register_dest_min
            and dest.dtype == torch.uint8
            and dest.dim() == 1
            and dest.is_contiguous()
            and dest.numel() >= hi
            and dest.device.type in ("cpu", "cuda")
        )
        if not direct and self.landing is None:
            self.landing = await nx.landing_pool().slots.take(self.nbytes, purpose="receive")
            if dest is None:
                self.buffer = self._landing_view()
        if (
            direct
            and dest is not None
            and self.dest is not None
            and (self.dest.data_ptr(), self.dest.numel()) != (dest.data_ptr(), dest.numel())
        ):
            self._drop_dest()  # another destination than the last fetch's
        # a block of the registered receive pool needs no registration of its own
        held = direct and dest is not None and nx.holds(dest)
        register = direct and not held and self.dest_registration is None
        timeout = nx.timeout_for(hi - lo)
        # on the loop: memory registered already, a connection up, and few descriptors
        # (building and posting a READ is CPU work in NIXL and UCX, about 0.1–0.4 ms here
        # for one descriptor, growing with their number)
        on_loop = remote.opened and (held or not direct) and len(self.spans) <= LOOP_SPANS

        def cancelled() -> bool:
            return not remote.alive or nx._closed

        async def run_now() -> None:
            if direct:
                assert dest is not None
                base, local = dest.data_ptr(), (0, "DRAM")
            else:
                base, local = self._landing_addr()
            for (dev, mem), group in self._groups(lo, hi):
                await read_async(
                    agent,
                    nx._completions,
                    [(base + at, addr, n) for at, addr, n in group],
                    local,
                    remote.agent,
                    (dev, mem),
                    timeout,
                    self.what,
                    cancelled,
                )
            if not direct and dest is not None:
                await copy_range(dest, self._landing_view(), lo, hi)

        def run() -> None:
            if held:
                assert dest is not None
                base, local = dest.data_ptr(), (0, "DRAM")
            elif direct:
                assert dest is not None
                kind: Mem = "VRAM" if dest.is_cuda else "DRAM"
                dev = dest.device.index or 0
                if self.dest_registration is None:
                    region = Region(dest.data_ptr(), dest.numel(), dev, kind)
                    self.dest_registration = agent.register(region)
                    self.dest = dest
                base, local = dest.data_ptr(), (dev, str(kind))
            else:
                base, local = self._landing_addr()
            for (dev, mem), group in self._groups(lo, hi):
                read(
                    agent,
                    [(base + at, addr, n) for at, addr, n in group],
                    local,
                    remote.agent,
                    (dev, mem),
                    timeout,
                    self.what,
                    cancelled,
                )
            if direct and not held and hi == self.nbytes and self.dest_registration is not None:
                registration, self.dest_registration, self.dest = self.dest_registration, None, None
                agent.deregister(registration)
            elif not direct and dest is not None:
                dest[lo:hi].copy_(self._landing_view()[lo:hi])

        error: BackendError | None = None
        with nx.transferring(remote):
            try:
                if on_loop:
                    hops.mark("engine: submit (event loop)")
                    await run_now()
                else:
                    hops.mark("engine: submit and wait (worker thread)")
                    await run_to_end(run)  # cancelled, still waits: the READ writes dest
                    remote.opened = True
                hops.mark("engine: back on the loop")
            except BackendError as exc:
                error = exc
        if error is None:
            nx.counters["reads"] += 1
            nx.counters["dest_registrations"] += register
            return
        if isinstance(error, StuckRead):
            self._quarantine(dest)
        remote.opened = False  # the next READ reconnects, if need be, in a worker thread
        await nx._recover(remote)
        raise error

    def _groups(self, lo: int, hi: int) -> list[tuple[tuple[int, str], list[tuple[int, int, int]]]]:
        """The reads of bytes ``[lo, hi)``: ``(at, remote addr, length)``, grouped by the
        remote memory kind (one READ transfer per group)."""
        groups: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
        for s in self.spans:
            a, b = max(lo, s.at), min(hi, s.at + s.length)
            if a < b:
                groups.setdefault((s.dev, s.mem), []).append((a, s.addr + (a - s.at), b - a))
        return list(groups.items())

    def _landing_addr(self) -> tuple[int, tuple[int, str]]:
        lease = self.landing
        assert lease is not None
        if lease.buffer is not None:
            r = lease.buffer.region
            return r.addr, (r.dev, r.mem)
        r = self.nx.landing_pool().memory.region
        return r.addr + lease.offset, (r.dev, r.mem)

    def _landing_view(self) -> torch.Tensor:
        lease = self.landing
        assert lease is not None
        if lease.buffer is not None:
            return lease.buffer.tensor[: self.nbytes]
        return self.nx.landing_pool().memory.tensor[lease.offset : lease.offset + self.nbytes]

    def _quarantine(self, dest: torch.Tensor | None) -> None:
        """A READ could not be cancelled: keep the memory it targets out of reuse."""
        if self.landing is not None:
            self.landing.quarantine()
            self.landing = None
        if dest is not None:
            self.nx._quarantined.append(dest)  # the caller's block stays referenced
        if self.dest_registration is not None:
            self.nx._quarantined.append(self.dest_registration)  # stays registered
            self.dest_registration = self.dest = None

    def _drop_dest(self) -> None:
        registration, self.dest_registration, self.dest = self.dest_registration, None, None
        agent = self.nx._agent
        if registration is not None and agent is not None:
            self.nx._releaser.submit(agent.deregister, registration)

    def _close(self) -> None:
        for entry in self.loaded:
            entry.users -= 1
        self.loaded = []
        if self.landing is not None:
            self.landing.release()
            self.landing = None
        self._drop_dest()  # closed before the last range arrived
