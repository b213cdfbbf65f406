"""nccl's links: one generation of a pair's process groups and the threads that
drive them (the engine is blocking and cannot be cancelled; the event loop never
waits on it). See the package docstring for the pairing rules; the groups are built
in :mod:`._groups`, the threads' loops are in :mod:`._threads`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ... import hops
from ...errors import BackendError
from ..base import Locality, PeerInfo
from ._blobs import MAX_TAG, PiecesHello
from ._engine import HEADER_BYTES, Group, Store, engine_error
from ._groups import abort_engine, build
from ._objects import CTL_TAG, Header, Inbound, Outbound
from ._registry import live_links
from ._threads import ordered_recv_loop, ordered_send_loop, reap_loop, recv_loop

if TYPE_CHECKING:
    from ._backend import NcclBackend

__all__ = ["Link", "Pair"]

_MAX_REAPERS = 4
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _call_soon(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., None], *args: Any) -> None:
    if loop is None:
        return
    with contextlib.suppress(RuntimeError):  # the loop is closed
        loop.call_soon_threadsafe(fn, *args)


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class Pair:
    """This endpoint and one peer instance: the rendezvous facts and the current link."""

    def __init__(self, backend: NcclBackend, peer: PeerInfo, hello: PiecesHello) -> None:
        me = (backend.ctx.endpoint, backend.ctx.instance)
        them = (peer.name, peer.instance)
        self.name = peer.name
        self.key = peer.key
        self.rank = 0 if me < them else 1
        first, second = (me, them) if self.rank == 0 else (them, me)
        ident = repr((first, second)).encode()
        self.pair_id = hashlib.sha256(ident).hexdigest()[:24]
        host = hello.host
        if peer.locality is Locality.CROSS_HOST and host in _LOOPBACK:
            host = peer.host  # it bound loopback, but it is elsewhere: use its address
        self.store_host = host
        self.store_port = hello.port
        self.peer_cuda = hello.cuda
        self.peer_pieces = hello.pieces
        self.link: Link | None = None
        self.max_gen = -1
        self._tags = 0

    def next_tags(self, count: int = 1) -> int:
        """The first of ``count`` consecutive fresh tags in 1 .. MAX_TAG - 1 (0 is the
        ordered channel's)."""
        if self._tags + count >= MAX_TAG:
            self._tags = 0
        first = self._tags + 1
        self._tags += count
        return first


class Link:
    """One generation of a pair's process groups and the threads that drive them.

    Theory of operation: every engine call that may block runs in this link's
    threads; the event loop only posts gloo operations (which never block) and
    puts work on queues. ``lock`` guards the state below; ``submit`` runs a post
    now if the group is ready, or keeps it until the builder thread has built it.
    ``fail`` is the one way out: it marks the link broken, fails every awaited
    object and stops the threads (a thread blocked in a gloo wait stops when the
    wait returns).
    """

    def __init__(self, backend: NcclBackend, pair: Pair, gen: int) -> None:
        self.backend = backend
        self.pair = pair
        self.gen = gen
        self.rank = pair.rank
        self.peer = 1 - pair.rank
        self.nccl = backend.cuda and pair.peer_cuda
        self.prefix = f"omniwire.nccl/{pair.pair_id}/{gen}"
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.ready = threading.Event()  # set once built, failed or closed
        self.usable = False
        self.error: BackendError | None = None
        self.pg: Group | None = None
        self.nccl_out: Group | None = None
        self.nccl_in: Group | None = None
        self.store: Store | None = None
        self._deferred: list[Callable[[], None]] = []
        self._queues: dict[str, queue.SimpleQueue[Any]] = {}
        self._threads: dict[str, int] = {}
        self.idle_reapers = 0
        self.graveyard: list[Any] = []  # engine objects of a failed link, kept until it dies
        self.pending: set[Inbound] = set()  # receiver objects someone may await
        self.regs: dict[int, Inbound] = {}  # ordered channel: tag -> receiver object
        self.expired: set[int] = set()
        self._expired_order: deque[int] = deque()
        self._thread_objs: list[threading.Thread] = []
        live_links.add(self)
        self._spawn("build", build, self)

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(
            target=target, args=args, name=f"omniwire-nccl-{name}-{self.pair.name}", daemon=True
        )
        self._thread_objs.append(thread)
        thread.start()

    def join(self, deadline: float) -> None:
        """Wait (until ``deadline``, a monotonic time) for this link's threads to end."""
        for thread in list(self._thread_objs):
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    # -- building --------------------------------------------------------------------

    def install(self, pg: Group, nccl_out: Group | None, nccl_in: Group | None) -> None:
        """(builder thread) The groups are built: the link is usable, and the posts
        kept meanwhile run."""
        errors: list[BaseException] = []
        with self.lock:
            if self.failed():
                self.graveyard.append((pg, nccl_out, nccl_in))
                return
            self.pg, self.nccl_out, self.nccl_in = pg, nccl_out, nccl_in
            self.usable = True
            deferred, self._deferred = self._deferred, []
            for post in deferred:
                try:
                    post()
                except Exception as exc:
                    errors.append(exc)
        self.ready.set()
        self.backend.counters["links_built"] += 1
        if errors:
            self.fail(engine_error("posting a deferred transfer failed", errors[0]))

    # -- state ---------------------------------------------------------------------

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def failed(self) -> bool:
        """Whether the link is broken (a method: the state changes under other threads)."""
        return self.error is not None

    def submit(self, post: Callable[[], None]) -> None:
        """Run ``post`` (under the lock) now if the group is ready, else once it is."""
        with self.lock:
            self.check()
            if self.usable:
                post()
            else:
                self._deferred.append(post)

    def _queue(self, name: str, loop: Callable[[Link, queue.SimpleQueue[Any]], None]) -> Any:
        """The queue of worker ``name``, starting the worker if needed (lock held)."""
        q = self._queues.get(name)
        if q is None:
            self.check()
            q = self._queues[name] = queue.SimpleQueue()
            self._threads[name] = 0
            self._start(name, loop, q)
        return q

    def _start(
        self, name: str, loop: Callable[[Link, queue.SimpleQueue[Any]], None], q: Any
    ) -> None:
        self._threads[name] += 1
        if name == "reap":
            self.idle_reapers += 1
        self._spawn(name, loop, self, q)

    def fail(self, error: BackendError) -> None:
        """Break the link: fail awaited objects, stop the threads. Idempotent."""
        with self.lock:
            if self.error is not None:
                return
            self.error = error
            self.usable = False
            self._deferred.clear()
            pending = list(self.pending)
            self.pending.clear()
            regs = list(self.regs.values())
            self.regs.clear()
            queues = [(q, self._threads.get(n, 1)) for n, q in self._queues.items()]
            building = not self.ready.is_set() and self.store is not None
            groups = [g for g in (self.nccl_out, self.nccl_in) if g is not None]
            # Let the groups go: once no posted operation holds them either, gloo
            # closes the pair's sockets and the peer's pending operations fail at once.
            self.pg = self.nccl_out = self.nccl_in = None
            self.cond.notify_all()
        self.ready.set()
        self.backend.counters["links_failed"] += 1
        for h in pending + regs:
            self.complete(h, error)
        for q, count in queues:
            for _ in range(count):
                q.put(None)
        if building or groups:
            self._spawn("teardown", abort_engine, self, building, groups)

    def gloo(self) -> Group:
        """(lock held) The gloo group of a usable link."""
        if self.pg is None:
            raise self.error or BackendError("the process group is not built")
        return self.pg

    def complete(self, h: Inbound, error: BackendError | None) -> None:
        """``h`` is received (or failed): wake whoever awaits it."""
        with self.lock:
            if h.done:
                return
            h.done = True
            h.error = error
            if error is not None and h.works:
                self.graveyard.append(h.works)  # may still be posted: never drop them early
            h.works = []
            if error is None and not h.consume:
                h.data = h.target
            elif error is None:
                self.backend.counters["objects_consumed"] += 1
            h.target = None
            self.pending.discard(h)
            fut, loop = h.future, h.loop
        if fut is not None:
            _call_soon(loop, _resolve, fut, error)

    def expire(self, tag: int) -> None:
        """Remember (lock held) that the object ``tag`` was consumed unclaimed."""
        self.expired.add(tag)
        self._expired_order.append(tag)
        if len(self._expired_order) > 4096:
            self.expired.discard(self._expired_order.popleft())

    # -- sender: tagged channel --------------------------------------------------------

    def post_send(self, o: Outbound) -> None:
        """(lock held) Post the gloo sends of ``o``; never blocks."""
        pg = self.gloo()
        for i, t in enumerate(o.tensors):
            o.works.append((pg.send([t], self.peer, o.tag + i), t))
        hops.mark("engine: send posted")
        o.posted = True
        if o.freed:
            self.reap(o)

    def reap(self, o: Outbound) -> None:
        """(lock held) ``o`` was freed: wait for its sends in a reaper thread."""
        if not o.works:
            return
        works, o.works = o.works, []
        if self.error is not None:
            self.graveyard.append(works)
            return
        q = self._queue("reap", reap_loop)
        q.put(works)
        if self.idle_reapers == 0 and self._threads["reap"] < _MAX_REAPERS:
            # Every reaper is waiting (on a send whose receiver has not come yet): add
            # one, so that completed sends still release their buffers.
            self._start("reap", reap_loop, q)

    # -- receiver: tagged channel ------------------------------------------------------

    def post_recv(self, h: Inbound) -> None:
        """(lock held) Post the gloo receives of ``h`` into ``h.target``; never blocks."""
        assert h.target is not None
        pg = self.gloo()
        h.works = [pg.recv([buf], self.peer, tag) for buf, tag in h.messages(h.target)]
        hops.mark("engine: receive posted")
        self._queue("recv", recv_loop).put(h)

    def receive(self, h: Inbound, target: torch.Tensor | None) -> None:
        """Receive ``h`` into ``target``, or into scratch (consumed) when None: post its
        gloo receives (tagged channel) or claim it for the FIFO thread (ordered)."""
        if h.ordered:
            self.claim(h, target)
            return
        if target is None:
            h.consume = True
            target = self.backend.scratch(h.nbytes)
        h.target = target
        h.posted = True
        self.submit(lambda: self.post_recv(h))

    # -- ordered channel -----------------------------------------------------------------

    def send_ordered(self, o: Outbound) -> None:
        with self.lock:
            self.check()
            self._queue("ordered-out", ordered_send_loop).put(o)

    def register_ordered(self, h: Inbound) -> None:
        """The endpoint announced ``h``: expect one more header, remember the object."""
        with self.lock:
            self.check()
            if h.tag in self.expired:
                raise BackendError(
                    f"object (tag {h.tag}) from {self.pair.name!r} was not claimed within "
                    f"{self.backend.timeout:g} s and was discarded"
                )
            self.regs[h.tag] = h
            self.cond.notify_all()
        self.submit(self.post_header)

    def post_header(self) -> None:
        """(lock held) Post the gloo receive of the next header; never blocks."""
        tensor = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        work = self.gloo().recv([tensor], self.peer, CTL_TAG)
        self._queue("ordered-in", ordered_recv_loop).put(Header(work, tensor))

    def claim(self, h: Inbound, target: torch.Tensor | None) -> None:
        """(ordered) ``h``'s bytes go to ``target``, or to scratch when None."""
        with self.lock:
            if target is None:
                h.consume = True
            else:
                h.target = target
            h.posted = True
            self.cond.notify_all()
