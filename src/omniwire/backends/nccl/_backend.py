"""The nccl backend: per-pair process groups, objects sent when whole (or the caller's
lent tensors sent as they are), received exactly once. See the package docstring."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, ClassVar, Literal

import anyio
import torch

from ...errors import BackendClosedError, BackendError
from ...recvpool import RecvPool
from ..base import (
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    Export,
    Import,
    Locality,
    PeerInfo,
    copy_range,
)
from ..support import check_range, lent_pieces
from . import _blobs as blobs
from ._engine import Dist, Store, TorchDistributed, engine_error
from ._link import Link, Pair
from ._objects import Inbound, Outbound
from ._registry import CLOSE_JOIN_SECONDS, join_links, live_links

__all__ = ["NcclBackend"]

log = logging.getLogger("omniwire.nccl")

#: Peer names whose last link generation is kept (a name evicted and then healed
#: from a partition under the same instance would start again at generation 0).
_GENS_KEPT = 4096

_dist: Any = torch.distributed
_cuda: Any = torch.cuda  # Event constructors are untyped


def _consume_exception(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception was never retrieved" noise


class _Export(Export):
    """One object to one peer: sent once it is whole, released when its sends end."""

    def __init__(
        self,
        backend: NcclBackend,
        o: Outbound,
        buffer: torch.Tensor | None,
        pieces: list[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__(backend, o.nbytes, buffer)
        self.nccl = backend
        self.o = o
        ref = blobs.Ref(o.link.gen, o.tag, o.nbytes, o.device, o.ordered)
        if pieces:
            ref = blobs.PiecesRef(o.link.gen, o.tag, o.nbytes, o.device, o.ordered, pieces)
        self._ref = blobs.encode(ref)

    @property
    def ref(self) -> bytes:
        return self._ref

    async def publish(self, lo: int, hi: int) -> None:
        """Post the send(s) once every byte is written (one message per object or
        piece; nothing for 0 bytes).

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: the link failed.
        """
        o = self.o
        if self.nccl._closed:
            raise BackendClosedError("nccl backend is closed")
        if o.published or hi < o.nbytes or o.nbytes == 0:
            return
        o.published = True
        if o.device == "cuda":
            o.event = _cuda.Event()
            o.event.record(torch.cuda.current_stream(o.tensors[0].device))
        link = o.link
        try:
            if o.ordered:
                link.send_ordered(o)
            else:
                link.submit(lambda: link.post_send(o))
        except BackendError:
            raise
        except Exception as exc:
            link.fail(engine_error(f"send to {link.pair.name!r} failed", exc))
            raise link.error or BackendError(str(exc)) from exc
        self.nccl.counters["objects_sent"] += 1
        self.nccl.counters["bytes_sent"] += o.nbytes

    def _release(self) -> None:
        o = self.o
        with o.link.lock:
            o.freed = True
            if o.works and o.link.error is None:
                o.link.reap(o)


class _Import(Import):
    """One announced object: received once, into ``dest`` or a buffer of its own."""

    def __init__(self, backend: NcclBackend, peer: PeerInfo, h: Inbound) -> None:
        super().__init__(backend, peer, h.nbytes)
        self.nccl = backend
        self.h = h

    async def fetch(self, lo: int, hi: int, dest: torch.Tensor | None = None) -> None:
        h = self.h
        if self.closed:
            raise BackendError("nccl: fetch on a closed import")
        if hi <= lo:
            return
        check_range(lo, hi, h.nbytes, "nccl")
        if not h.posted and not h.done:
            whole = (
                dest is not None
                and lo == 0
                and hi == h.nbytes
                and dest.dtype == torch.uint8
                and dest.numel() >= h.nbytes
                and dest.is_contiguous()
                and (dest.device.type == "cpu" or (h.ordered and h.device == "cuda"))
            )
            target = dest[: h.nbytes] if whole and dest is not None else self._own_buffer()
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            fut.add_done_callback(_consume_exception)
            link = h.link
            with link.lock:
                link.check()
                h.loop, h.future = loop, fut
                link.pending.add(h)
            try:
                link.receive(h, target)
            except BackendError as exc:
                link.complete(h, exc)
            except Exception as exc:
                link.fail(engine_error(f"receive from {link.pair.name!r} failed", exc))
        if not h.done:
            await _received(h)
        if h.error is not None:
            raise h.error
        if h.data is None:
            raise BackendError("nccl: the object's bytes are gone")
        if dest is not None and h.data.data_ptr() != dest.data_ptr():
            await copy_range(dest, h.data, lo, hi)
        self.nccl.counters["objects_received"] += 1

    def _own_buffer(self) -> torch.Tensor:
        if self.buffer is None:
            h = self.h
            if h.device == "cuda":
                self.buffer = torch.empty(h.nbytes, dtype=torch.uint8, device=self.nccl.cuda_device)
            else:
                self.buffer = self.nccl.scratch(h.nbytes)
        return self.buffer

    def _close(self) -> None:
        h = self.h
        if not h.posted and h.nbytes:  # never fetched: the send must still meet a receive
            self.nccl._consume(h)


async def _received(h: Inbound) -> None:
    """Wait for ``h``'s receive to complete. Not through ``asyncio.shield`` (its
    callback costs a turn of the event loop per object): a cancellation that cancels
    the future leaves a new one for a later fetch (the receive goes on)."""
    fut = h.future
    assert fut is not None
    try:
        await fut
    except asyncio.CancelledError:
        if fut.cancelled():
            with h.link.lock:
                if not h.done and h.future is fut:  # (complete() reads it under the lock)
                    h.future = fut.get_loop().create_future()
                    h.future.add_done_callback(_consume_exception)
        raise


class NcclBackend(ByteBackend):
    """torch.distributed point-to-point: NCCL for CUDA objects, gloo for CPU objects.

    See the package docstring for the design and the options.
    """

    name: ClassVar[str] = "nccl"
    summary: ClassVar[str] = (
        "torch.distributed point-to-point: NCCL for CUDA tensors, gloo for CPU tensors"
    )
    install_hint: ClassVar[str] = (
        "install a torch build with torch.distributed (gloo; NCCL for GPUs)"
    )
    auto_start: ClassVar[Literal["always", "tcp", "never"]] = "never"
    capabilities: ClassVar[Capabilities] = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        localities=frozenset({Locality.SAME_HOST, Locality.CROSS_HOST}),
        progressive=False,
        zero_copy=True,
        two_sided=True,
        opt_in=(
            "needs a process group: enable it for an edge, e.g. "
            "Endpoint(backends=[..., 'nccl'], routes={'peer': 'nccl'})"
        ),
        preference=40,
    )

    def __init__(self, ctx: BackendContext, *, dist: Dist | None = None) -> None:
        super().__init__(ctx)
        opts = ctx.options
        try:
            self.timeout = float(opts.get("timeout", 300.0))
            self.connect_timeout = float(opts.get("connect_timeout", 30.0))
            self.ordered = bool(opts.get("ordered", False))
            pool_bytes = int(opts.get("pool_bytes", 256 << 20))
        except (TypeError, ValueError) as exc:
            raise BackendError(f"nccl: bad options {dict(opts)!r}: {exc}") from None
        self.dist: Dist = dist or opts.get("dist") or TorchDistributed()
        self.cuda = self.dist.nccl_available()
        self._device_option = opts.get("device")
        self._cuda_device: torch.device | None = None
        self.store: Store | None = None
        self.port = 0
        self._pool = RecvPool(max_idle_bytes=pool_bytes)
        self._pairs: dict[tuple[str, int], Pair] = {}
        #: name -> (its latest instance, the last link generation built with it): a
        #: partitioned instance that comes back needs a newer generation; a restarted
        #: one (a new instance) starts again. The least recently connected go first.
        self._gens: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._closed = False
        self.counters: dict[str, int] = {
            "links_built": 0,
            "links_failed": 0,
            "objects_sent": 0,
            "sends_completed": 0,
            "objects_received": 0,
            "objects_consumed": 0,
            "bytes_sent": 0,
            "bytes_received": 0,
            "lent": 0,
        }

    @classmethod
    def availability(cls) -> Availability:
        if not _dist.is_available():
            return Availability.missing(
                "this torch build has no torch.distributed", cls.install_hint
            )
        if not _dist.is_gloo_available():
            return Availability.missing("this torch build has no gloo", cls.install_hint)
        return Availability.ok()

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Host this endpoint's rendezvous store.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: it cannot listen on the endpoint's host.
        """
        if self._closed:
            raise BackendClosedError("nccl backend is closed")
        if self.store is not None:
            return
        try:
            self.store, self.port = await anyio.to_thread.run_sync(
                self.dist.host_store, self.ctx.host, self.connect_timeout
            )
        except OSError as exc:
            raise BackendError(f"nccl: cannot listen on {self.ctx.host}: {exc}") from exc
        except RuntimeError as exc:
            raise engine_error("nccl: cannot start the rendezvous store", exc) from exc

    def hello(self) -> bytes:
        return blobs.encode(
            blobs.PiecesHello(host=self.ctx.host, port=self.port, cuda=self.cuda, pieces=True)
        )

    async def connect(self, peer: PeerInfo) -> None:
        if self._closed:
            raise BackendClosedError("nccl backend is closed")
        hello = blobs.decode_hello(peer)
        old = self._pairs.pop(peer.key, None)
        if old is not None and old.link is not None:
            old.link.fail(BackendError(f"{peer.name!r} connected again"))
        pair = Pair(self, peer, hello)
        instance, gen = self._gens.get(peer.name, (peer.instance, -1))
        pair.max_gen = gen if instance == peer.instance else -1
        self._pairs[peer.key] = pair
        self._new_link(pair, pair.max_gen + 1)

    def _new_link(self, pair: Pair, gen: int) -> Link:
        if pair.link is not None:
            pair.link.fail(BackendError(f"superseded by generation {gen}"))
        pair.max_gen = max(pair.max_gen, gen)
        name, instance = pair.key
        self._gens[name] = (instance, pair.max_gen)
        self._gens.move_to_end(name)
        if len(self._gens) > _GENS_KEPT:
            self._gens.popitem(last=False)
        pair.link = Link(self, pair, gen)
        return pair.link

    async def disconnect(self, peer: PeerInfo) -> None:
        pair = self._pairs.pop(peer.key, None)
        if pair is not None and pair.link is not None:
            pair.link.fail(BackendError(f"peer {peer.name!r} is gone"))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Every link of ours still alive: current ones and those failed or superseded.
        links = [link for link in list(live_links) if link.backend is self]
        for link in links:
            link.fail(BackendClosedError("nccl backend is closed"))
        self._pairs.clear()
        # Idle threads end at once; one blocked in the engine (a gloo wait, a store
        # connect) ends with that call — the exit hook waits for it longer.
        await anyio.to_thread.run_sync(join_links, links, CLOSE_JOIN_SECONDS)
        self.store = None  # shuts the rendezvous server down once no link holds it
        self._pool.clear()

    def detail(self) -> dict[str, int]:
        return {"pairs": len(self._pairs), **self.counters}

    @property
    def cuda_device(self) -> torch.device:
        """The device that receives CUDA objects (resolved on first use: no CUDA
        context is created before a CUDA object arrives)."""
        if self._cuda_device is None:
            option = self._device_option
            self._cuda_device = (
                torch.device(option)
                if option is not None
                else torch.device("cuda", torch.cuda.current_device())
            )
        return self._cuda_device

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A CPU buffer for bytes nobody wants (released when collected)."""
        return self._pool.take(nbytes)

    # -- sender --------------------------------------------------------------------

    def _pair(self, peer: PeerInfo) -> Pair:
        if self._closed:
            raise BackendClosedError("nccl backend is closed")
        pair = self._pairs.get(peer.key)
        if pair is None:
            raise BackendError(f"{peer.name!r} did not announce nccl in its Hello")
        return pair

    def _link(self, pair: Pair) -> Link:
        link = pair.link
        if link is None or link.error is not None:  # broken: the next generation
            link = self._new_link(pair, pair.max_gen + 1)
        return link

    async def export(self, peer: PeerInfo, nbytes: int, device: str) -> Export:
        pair = self._pair(peer)
        link = self._link(pair)
        on_cuda = device.startswith("cuda") and link.nccl
        if on_cuda:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:  # CPU (CUDA tensors are staged here when the peer has no NCCL)
            tensor = self._pool.take(nbytes)
        o = Outbound(
            link,
            pair.next_tags(),
            nbytes,
            "cuda" if on_cuda else "cpu",
            on_cuda or self.ordered,
            [tensor],
        )
        return _Export(self, o, tensor)

    async def export_tensors(
        self, peer: PeerInfo, tensors: list[torch.Tensor], *, lent: bool
    ) -> Export | None:
        """Lent CPU tensors (tagged channel) are sent as they are, one message each;
        else None (the endpoint packs into :meth:`export`)."""
        pair = self._pair(peer)
        if not lent or self.ordered or not pair.peer_pieces:
            return None
        image = lent_pieces(tensors)
        if image is None:
            return None
        pieces, nbytes = image
        link = self._link(pair)
        o = Outbound(
            link, pair.next_tags(len(pieces)), nbytes, "cpu", False, [p.data for p in pieces]
        )
        self.counters["lent"] += 1
        return _Export(self, o, None, [(p.at, p.nbytes) for p in pieces])

    # -- receiver ------------------------------------------------------------------------

    def _decode_ref(self, peer: PeerInfo, info: bytes, nbytes: int) -> tuple[Pair, blobs.PiecesRef]:
        pair = self._pair(peer)
        ref = blobs.decode_ref(info, nbytes, peer.name, self.cuda and pair.peer_cuda)
        return pair, ref

    def _link_for(self, pair: Pair, ref: blobs.PiecesRef) -> Link:
        link = pair.link
        if link is None or ref.gen > link.gen:  # the sender rebuilt: follow it
            link = self._new_link(pair, ref.gen)
        elif ref.gen < link.gen:
            raise BackendError(
                f"nccl reference from {pair.name!r} names generation {ref.gen} of the "
                f"process group; generation {link.gen} replaced it"
            )
        link.check()
        return link

    async def import_(self, peer: PeerInfo, ref: bytes, nbytes: int) -> Import:
        """Open an announced object. It must be imported even when refused (the send
        must meet a receive): closing it unfetched receives it into scratch.

        Raises:
            BackendClosedError: the backend is closed.
            BackendError: the reference is malformed, or names a replaced generation.
        """
        pair, r = self._decode_ref(peer, ref, nbytes)
        link = self._link_for(pair, r)
        h = Inbound(link, r)
        if r.ordered and r.nbytes:
            link.register_ordered(h)
        return _Import(self, peer, h)

    def _consume(self, h: Inbound) -> None:
        """Receive ``h`` into scratch: the sender's send must complete."""
        link = h.link
        try:
            link.receive(h, None)
        except BackendError as exc:
            log.info("nccl: cannot consume object from %s: %s", link.pair.name, exc)
        except Exception as exc:
            link.fail(engine_error(f"receive from {link.pair.name!r} failed", exc))
