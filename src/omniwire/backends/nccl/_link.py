"""nccl's links: one generation of a pair's process groups and the threads that
drive them (the engine is blocking and cannot be cancelled; the event loop never
waits on it). See the package docstring for the pairing rules."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...errors import BackendClosedError, BackendError
from ..base import Locality, PeerInfo
from ._blobs import MAX_TAG, Device, PiecesHello, PiecesRef
from ._engine import HEADER_BYTES, Group, Store, Work, engine_error, header, seconds

if TYPE_CHECKING:
    from ._backend import NcclBackend

__all__ = ["CLOSE_JOIN_SECONDS", "Inbound", "Link", "Outbound", "Pair", "join_links", "live_links"]

log = logging.getLogger("omniwire.nccl")

_cuda: Any = torch.cuda  # Stream/Event constructors are untyped

CTL_TAG = 0  # gloo tag of the ordered channel's headers
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


#: Links whose threads may still run. Worker threads are daemons (a gloo wait cannot
#: be interrupted, and must not keep the process alive), but a daemon thread that
#: touches the engine while the interpreter finalizes aborts the process (pybind11
#: retakes the GIL, the thread is unwound through a noexcept destructor). So every
#: link is stopped and its threads joined at exit, and by ``aclose()``.
live_links: weakref.WeakSet[Link] = weakref.WeakSet()
_EXIT_JOIN_SECONDS = 10.0
CLOSE_JOIN_SECONDS = 1.0


def join_links(links: Sequence[Link], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for link in links:
        link.join(deadline)


@atexit.register
def _stop_links_at_exit() -> None:
    links = list(live_links)
    for link in links:
        link.fail(BackendClosedError("the interpreter is exiting"))
    join_links(links, _EXIT_JOIN_SECONDS)


class Outbound:
    """Sender state of one object: one tensor (packed), or one per piece (lent), sent
    under tags ``tag``, ``tag + 1``, …"""

    __slots__ = (
        "device",
        "event",
        "freed",
        "link",
        "nbytes",
        "ordered",
        "posted",
        "published",
        "tag",
        "tensors",
        "works",
    )

    def __init__(
        self,
        link: Link,
        tag: int,
        nbytes: int,
        device: Device,
        ordered: bool,
        tensors: list[torch.Tensor],
    ) -> None:
        self.link = link
        self.tag = tag
        self.nbytes = nbytes
        self.device: Device = device
        self.ordered = ordered
        self.tensors: list[torch.Tensor] = tensors
        self.event: Any = None
        self.works: list[tuple[Work, torch.Tensor]] = []
        self.published = False
        self.posted = False
        self.freed = False


class Inbound:
    """Receiver state of one object."""

    __slots__ = (
        "consume",
        "data",
        "device",
        "done",
        "error",
        "future",
        "link",
        "loop",
        "nbytes",
        "ordered",
        "pieces",
        "posted",
        "tag",
        "target",
        "works",
    )

    def __init__(self, link: Link, ref: PiecesRef) -> None:
        self.link = link
        self.tag = ref.tag
        self.nbytes = ref.nbytes
        self.device: Device = ref.device
        self.ordered = ref.ordered
        self.pieces = list(ref.pieces)  # empty: one message of nbytes
        self.target: torch.Tensor | None = None  # where the bytes land
        self.data: torch.Tensor | None = None  # the received bytes, once done
        self.consume = False  # nobody wants the bytes: receive into scratch
        self.posted = False
        self.done = False
        self.error: BackendError | None = None
        self.works: list[Work] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None

    def messages(self, target: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """Where each message lands in ``target``, with its tag."""
        if not self.pieces:
            return [(target[: self.nbytes], self.tag)]
        return [(target[at : at + n], self.tag + i) for i, (at, n) in enumerate(self.pieces)]


class _Header:
    __slots__ = ("tensor", "work")

    def __init__(self, work: Work, tensor: torch.Tensor) -> None:
        self.work = work
        self.tensor = tensor


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
        self._idle_reapers = 0
        self._graveyard: list[Any] = []  # engine objects of a failed link, kept until it dies
        self.pending: set[Inbound] = set()  # receiver objects someone may await
        self.regs: dict[int, Inbound] = {}  # ordered channel: tag -> receiver object
        self.expired: set[int] = set()
        self._expired_order: deque[int] = deque()
        self._thread_objs: list[threading.Thread] = []
        live_links.add(self)
        self._spawn("build", self._build)

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

    def _store_address(self) -> tuple[str, int]:
        if self.rank == 0:
            return self.backend.ctx.host, self.backend.port
        return self.pair.store_host, self.pair.store_port

    def _connect_store(self, deadline: float, cancellable: bool = True) -> Store:
        """A client of the rank-0 store, retried (cancellably) until ``deadline``."""
        host, port = self._store_address()
        while True:
            if cancellable and self.error is not None:
                raise BackendError("the rendezvous was cancelled")
            try:
                return self.backend.dist.client_store(
                    host, port, max(1.0, deadline - time.monotonic())
                )
            except (OSError, RuntimeError) as exc:
                if time.monotonic() >= deadline:
                    raise BackendError(f"cannot reach its store at {host}:{port}: {exc}") from exc
                time.sleep(0.05)

    def _open_store(self) -> Store | None:
        b = self.backend
        if self.rank == 0:
            return b.store
        return self._connect_store(time.monotonic() + b.connect_timeout)

    def _build(self) -> None:
        b = self.backend
        try:
            store = self._open_store()
            if store is None:
                raise BackendError("the backend is closed")
            dist = b.dist
            base = dist.prefix_store(self.prefix, store)
            with self.lock:
                if self.error is not None:
                    return
                self.store = base
            # Our own handshake first: its wait is bounded by connect_timeout and can
            # be cancelled (``fail`` writes "cancel"); gloo's rendezvous cannot.
            base.set(f"join{self.rank}", "ok")
            base.wait([f"join{self.peer}"], seconds(b.connect_timeout))
            if base.get(f"join{self.peer}") != b"ok" or self.error is not None:
                raise BackendError("the rendezvous was cancelled")
            pg = dist.gloo_group(dist.prefix_store("gloo", base), self.rank, b.timeout, b.ctx.host)
            nccl_out = nccl_in = None
            if self.nccl:
                groups = [
                    dist.nccl_group(dist.prefix_store(f"nccl{r}", base), self.rank, b.timeout)
                    for r in (0, 1)
                ]
                nccl_out, nccl_in = groups[self.rank], groups[self.peer]
        except Exception as exc:
            err = exc if isinstance(exc, BackendError) else engine_error("", exc)
            self.fail(
                BackendError(
                    f"cannot build the nccl backend's process group with {self.pair.name!r} "
                    f"(generation {self.gen}): {str(err).lstrip(': ')}"
                )
            )
            return
        errors: list[BaseException] = []
        with self.lock:
            if self.failed():
                self._graveyard.append((pg, nccl_out, nccl_in))
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
        b.counters["links_built"] += 1
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

    def _queue(self, name: str, loop: Callable[[queue.SimpleQueue[Any]], None]) -> Any:
        """The queue of worker ``name``, starting the worker if needed (lock held)."""
        q = self._queues.get(name)
        if q is None:
            self.check()
            q = self._queues[name] = queue.SimpleQueue()
            self._threads[name] = 0
            self._start(name, loop, q)
        return q

    def _start(self, name: str, loop: Callable[[queue.SimpleQueue[Any]], None], q: Any) -> None:
        self._threads[name] += 1
        if name == "reap":
            self._idle_reapers += 1
        self._spawn(name, loop, q)

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
            self._spawn("teardown", self._abort_engine, building, groups)

    def _abort_engine(self, building: bool, groups: list[Group]) -> None:
        dist = self.backend.dist
        if building:  # wake both builders blocked in the handshake (a connection of our own:
            # the builder's may be busy waiting)
            with contextlib.suppress(Exception):
                client = self._connect_store(time.monotonic() + 2.0, cancellable=False)
                store = dist.prefix_store(self.prefix, client)
                for rank in (self.peer, self.rank):
                    store.set(f"join{rank}", "cancel")
        for g in groups:
            with contextlib.suppress(Exception):
                dist.abort(g)

    def _gloo(self) -> Group:
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
                self._graveyard.append(h.works)  # may still be posted: never drop them early
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
        pg = self._gloo()
        for i, t in enumerate(o.tensors):
            o.works.append((pg.send([t], self.peer, o.tag + i), t))
        o.posted = True
        if o.freed:
            self.reap(o)

    def reap(self, o: Outbound) -> None:
        """(lock held) ``o`` was freed: wait for its sends in a reaper thread."""
        if not o.works:
            return
        works, o.works = o.works, []
        if self.error is not None:
            self._graveyard.append(works)
            return
        q = self._queue("reap", self._reap_loop)
        q.put(works)
        if self._idle_reapers == 0 and self._threads["reap"] < _MAX_REAPERS:
            # Every reaper is waiting (on a send whose receiver has not come yet): add
            # one, so that completed sends still release their buffers.
            self._start("reap", self._reap_loop, q)

    def _reap_loop(self, q: queue.SimpleQueue[Any]) -> None:
        while True:
            works = q.get()
            with self.lock:
                self._idle_reapers -= 1
            if works is None:
                return
            for work, _tensor in works:
                if self.error is not None:
                    self._graveyard.append(works)
                    break
                try:
                    work.wait()
                except Exception as exc:
                    self.fail(engine_error(f"send to {self.pair.name!r} failed", exc))
                    break
            else:
                self.backend.counters["sends_completed"] += 1
            with self.lock:
                self._idle_reapers += 1

    # -- receiver: tagged channel ------------------------------------------------------

    def post_recv(self, h: Inbound) -> None:
        """(lock held) Post the gloo receives of ``h`` into ``h.target``; never blocks."""
        assert h.target is not None
        pg = self._gloo()
        h.works = [pg.recv([buf], self.peer, tag) for buf, tag in h.messages(h.target)]
        self._queue("recv", self._recv_loop).put(h)

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

    def _recv_loop(self, q: queue.SimpleQueue[Any]) -> None:
        while True:
            h = q.get()
            if h is None:
                return
            if self.error is not None:
                self._graveyard.append(h.works)
                continue
            try:
                for work in h.works:
                    work.wait()
            except Exception as exc:
                self.fail(engine_error(f"receive from {self.pair.name!r} failed", exc))
                continue
            self.backend.counters["bytes_received"] += h.nbytes
            self.complete(h, None)

    # -- ordered channel -----------------------------------------------------------------

    def send_ordered(self, o: Outbound) -> None:
        with self.lock:
            self.check()
            self._queue("ordered-out", self._ordered_send_loop).put(o)

    def _ordered_send_loop(self, q: queue.SimpleQueue[Any]) -> None:
        self.ready.wait()
        stream = None
        while True:
            o: Outbound | None = q.get()
            if o is None:
                return
            if self.error is not None:
                continue
            try:
                (tensor,) = o.tensors  # the ordered channel carries packed objects only
                head = header(o.tag, o.nbytes, o.device)
                hwork = self._gloo().send([head], self.peer, CTL_TAG)
                works: list[tuple[Work, torch.Tensor]]
                if o.device == "cuda":
                    if stream is None:
                        stream = _cuda.Stream(tensor.device)
                    stream.wait_event(o.event)
                    assert self.nccl_out is not None
                    with torch.cuda.stream(stream):
                        work = self.nccl_out.send([tensor], self.peer, 0)
                        work.wait()
                    stream.synchronize()  # blocks this thread only
                    # The peer read the header before it posted its NCCL receive.
                    works = [(hwork, head)]
                else:
                    work = self._gloo().send([tensor], self.peer, o.tag)
                    works = [(hwork, head), (work, tensor)]
            except Exception as exc:
                self.fail(engine_error(f"send to {self.pair.name!r} failed", exc))
                continue
            with self.lock:
                o.works.extend(works)
                o.posted = True
                if o.freed or o.device == "cuda":
                    self.reap(o)

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
        self.submit(self._post_header)

    def _post_header(self) -> None:
        tensor = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        work = self._gloo().recv([tensor], self.peer, CTL_TAG)
        self._queue("ordered-in", self._ordered_recv_loop).put(_Header(work, tensor))

    def claim(self, h: Inbound, target: torch.Tensor | None) -> None:
        """(ordered) ``h``'s bytes go to ``target``, or to scratch when None."""
        with self.lock:
            if target is None:
                h.consume = True
            else:
                h.target = target
            h.posted = True
            self.cond.notify_all()

    def _await_claim(self, tag: int) -> Inbound | None:
        """The object ``tag`` once claimed; None if it was never claimed in time."""
        deadline = time.monotonic() + self.backend.timeout
        with self.cond:
            while self.error is None:
                h = self.regs.get(tag)
                if h is not None and (h.consume or h.target is not None):
                    del self.regs[tag]
                    return h
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.expire(tag)
                    if h is not None:  # opened but never fetched: fail it
                        del self.regs[tag]
                        h.consume = True
                        h.error = BackendError(f"object (tag {tag}) was not fetched in time")
                        return h
                    return None
                self.cond.wait(remaining)
        return None

    def _ordered_recv_loop(self, q: queue.SimpleQueue[Any]) -> None:
        self.ready.wait()
        stream = None
        while True:
            hd: _Header | None = q.get()
            if hd is None:
                return
            if self.error is not None:
                self._graveyard.append(hd.work)
                continue
            try:
                hd.work.wait()
            except Exception as exc:
                self.fail(engine_error(f"receive from {self.pair.name!r} failed", exc))
                continue
            tag, nbytes, is_cuda = (int(v) for v in hd.tensor.view(torch.int64))
            device = "cuda" if is_cuda else "cpu"
            h = self._await_claim(tag)
            if self.failed():
                continue
            if h is None:  # announced but never opened nor dropped: its DataReady was lost
                log.warning(
                    "nccl: object (tag %d, %d bytes) from %s was never claimed; discarded",
                    tag,
                    nbytes,
                    self.pair.name,
                )
                # That header took a receive posted for another object: post another.
                with self.lock, contextlib.suppress(Exception):
                    self._post_header()
            error = h.error if h is not None else None
            if h is not None and (h.nbytes != nbytes or h.device != device):
                error = BackendError(
                    f"ordered object from {self.pair.name!r}: reference says {h.nbytes} bytes "
                    f"on {h.device}, the sender sent {nbytes} bytes on {device}"
                )
            target = h.target if h is not None and error is None and not h.consume else None
            try:
                if device == "cuda":
                    if stream is None:
                        stream = _cuda.Stream(self.backend.cuda_device)
                    self._recv_cuda(nbytes, tag, target, stream)
                else:
                    buf = target if target is not None else self.backend.scratch(nbytes)
                    self._gloo().recv([buf], self.peer, tag).wait()
            except Exception as exc:
                self.fail(engine_error(f"receive from {self.pair.name!r} failed", exc))
                continue
            self.backend.counters["bytes_received"] += nbytes
            if h is not None:
                self.complete(h, error)
            else:
                self.backend.counters["objects_consumed"] += 1

    def _recv_cuda(self, nbytes: int, tag: int, target: torch.Tensor | None, stream: Any) -> None:
        buf: torch.Tensor
        if target is None or target.device.type != "cuda":
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.backend.cuda_device)
        else:
            buf = target
        staged = buf is not target
        assert self.nccl_in is not None
        with torch.cuda.stream(stream):
            work = self.nccl_in.recv([buf], self.peer, 0)
            work.wait()
            if target is not None and staged:
                target.copy_(buf)
        stream.synchronize()
