"""``nccl``: torch.distributed point-to-point between two endpoints — NCCL for CUDA
objects, gloo for CPU objects.

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
    The endpoint publishes objects in DataReady order and opens them in that order,
    but it may *refuse* (``drop()``) an object early — an abort NACKs queued ones at
    once — so the receiver's calls do not arrive in the sender's order. Two channels
    cope with that:

    - **tagged** (CPU objects, gloo): every object carries its own gloo tag in its
      reference. Sends and receives are posted without blocking (gloo matches them
      by tag) and their completion is awaited in per-link worker threads, so the
      order in which the receiver posts never matters.
    - **ordered** (CUDA objects, NCCL — NCCL ignores tags and pairs operations in
      issue order): before each payload the sender's FIFO thread sends a 24-byte
      header (tag, size, device) on a gloo control tag; the receiver posts one header
      receive per object it opens or drops and its FIFO thread receives payloads in
      header order, i.e. in the sender's order. The ``ordered`` option routes CPU
      objects through this channel too (with gloo payloads), which is how the NCCL
      ordering logic is tested on machines without GPUs.

    Every announced object is received exactly once: a refused object (``drop()``) or
    one closed before its bytes were fetched is received into a scratch buffer. An
    object whose header arrives but which the endpoint never opens or drops within
    ``timeout`` (its DataReady was lost) is consumed the same way.

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

Hello info (``BackendInfo.info``): msgpack ``{"host": str, "port": u16, "cuda": bool}``.
Reference (``BackendRef.info``): msgpack ``{"gen": u32, "tag": u31, "nbytes": u64,
"device": "cpu"|"cuda", "ordered": bool}``.

Options (``backend_options={"nccl": {...}}``): ``timeout`` (s, default 300: every
engine wait, and how long an unclaimed ordered object is kept), ``connect_timeout``
(s, default 30: rendezvous), ``ordered`` (bool: CPU objects use the ordered channel),
``device`` (CUDA device that receives CUDA objects; default the current one),
``pool_bytes`` (idle CPU buffers kept for reuse, default 256 MiB).

Benchmark: ``python -m omniwire.backends.nccl raw-bench`` prints bare gloo GB/s between
two processes (:func:`raw_bench`), the figure to compare omniwire's against.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import datetime
import hashlib
import logging
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import anyio
import msgspec
import torch

from ..errors import BackendClosedError, BackendError
from ..recvpool import RecvPool
from .base import (
    Availability,
    BackendContext,
    ByteBackend,
    Capabilities,
    InboundBuffer,
    Locality,
    OutboundBuffer,
    PeerInfo,
    copy_range,
)

__all__ = ["NcclBackend", "raw_bench"]

log = logging.getLogger("omniwire.nccl")

#: torch.distributed, untyped: its stubs and its runtime disagree (``_Options``).
_dist: Any = torch.distributed
_cuda: Any = torch.cuda  # Stream/Event constructors are untyped

_CTL_TAG = 0  # gloo tag of the ordered channel's headers
_MAX_TAG = 2**31 - 1  # gloo tags are non-negative int32
_HEADER_BYTES = 24  # int64 tag, nbytes, device (0 cpu, 1 cuda)
_MAX_REAPERS = 4
_LOOPBACK = ("127.0.0.1", "localhost", "::1")

_Device = Literal["cpu", "cuda"]


class _HelloInfo(msgspec.Struct, frozen=True):
    host: str
    port: int
    cuda: bool = False


class _Ref(msgspec.Struct, frozen=True):
    gen: int
    tag: int
    nbytes: int
    device: _Device
    ordered: bool


_hello_decoder = msgspec.msgpack.Decoder(_HelloInfo)
_ref_decoder = msgspec.msgpack.Decoder(_Ref)
_encoder = msgspec.msgpack.Encoder()


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


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


def _consume_exception(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception was never retrieved" noise


def _header(tag: int, nbytes: int, device: str) -> torch.Tensor:
    return torch.tensor([tag, nbytes, int(device == "cuda")], dtype=torch.int64).view(torch.uint8)


def _engine_error(what: str, exc: BaseException) -> BackendError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return BackendError(f"{what}: {text[:300]}")


#: Links whose threads may still run. Worker threads are daemons (a gloo wait cannot
#: be interrupted, and must not keep the process alive), but a daemon thread that
#: touches the engine while the interpreter finalizes aborts the process (pybind11
#: retakes the GIL, the thread is unwound through a noexcept destructor). So every
#: link is stopped and its threads joined at exit, and by ``aclose()``.
_live_links: weakref.WeakSet[_Link] = weakref.WeakSet()
_EXIT_JOIN_SECONDS = 10.0
_CLOSE_JOIN_SECONDS = 1.0


def _join_links(links: Sequence[_Link], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for link in links:
        link.join(deadline)


@atexit.register
def _stop_links_at_exit() -> None:
    links = list(_live_links)
    for link in links:
        link.fail(BackendClosedError("the interpreter is exiting"))
    _join_links(links, _EXIT_JOIN_SECONDS)


class _Outbound:
    """Sender state of one object."""

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
        "tensor",
        "works",
    )

    def __init__(
        self, link: _Link, tag: int, nbytes: int, device: _Device, ordered: bool, tensor: Any
    ) -> None:
        self.link = link
        self.tag = tag
        self.nbytes = nbytes
        self.device: _Device = device
        self.ordered = ordered
        self.tensor: torch.Tensor | None = tensor
        self.event: Any = None
        self.works: list[tuple[Any, torch.Tensor]] = []
        self.published = False
        self.posted = False
        self.freed = False


class _Inbound:
    """Receiver state of one object (its handle in an InboundBuffer)."""

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
        "posted",
        "tag",
        "target",
        "work",
    )

    def __init__(self, link: _Link, ref: _Ref) -> None:
        self.link = link
        self.tag = ref.tag
        self.nbytes = ref.nbytes
        self.device: _Device = ref.device
        self.ordered = ref.ordered
        self.target: torch.Tensor | None = None  # where the bytes land
        self.data: torch.Tensor | None = None  # the received bytes, once done
        self.consume = False  # nobody wants the bytes: receive into scratch
        self.posted = False
        self.done = False
        self.error: BackendError | None = None
        self.work: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None


class _Header:
    __slots__ = ("tensor", "work")

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work = work
        self.tensor = tensor


class _Pair:
    """This endpoint and one peer instance: the rendezvous facts and the current link."""

    def __init__(self, backend: NcclBackend, peer: PeerInfo, hello: _HelloInfo) -> None:
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
        self.link: _Link | None = None
        self.max_gen = -1
        self._tags = 0

    def next_tag(self) -> int:
        self._tags = self._tags % (_MAX_TAG - 1) + 1  # 1.._MAX_TAG-1; 0 is the control tag
        return self._tags


class _Link:
    """One generation of a pair's process groups and the threads that drive them.

    Theory of operation: every engine call that may block runs in this link's
    threads; the event loop only posts gloo operations (which never block) and
    puts work on queues. ``lock`` guards the state below; ``submit`` runs a post
    now if the group is ready, or keeps it until the builder thread has built it.
    ``fail`` is the one way out: it marks the link broken, fails every awaited
    object and stops the threads (a thread blocked in a gloo wait stops when the
    wait returns).
    """

    def __init__(self, backend: NcclBackend, pair: _Pair, gen: int) -> None:
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
        self.pg: Any = None
        self.nccl_out: Any = None
        self.nccl_in: Any = None
        self.store: Any = None
        self._deferred: list[Callable[[], None]] = []
        self._queues: dict[str, queue.SimpleQueue[Any]] = {}
        self._threads: dict[str, int] = {}
        self._idle_reapers = 0
        self._graveyard: list[Any] = []  # engine objects of a failed link, kept until it dies
        self.pending: set[_Inbound] = set()  # receiver objects someone may await
        self.regs: dict[int, _Inbound] = {}  # ordered channel: tag -> receiver object
        self.expired: set[int] = set()
        self._expired_order: deque[int] = deque()
        self._thread_objs: list[threading.Thread] = []
        _live_links.add(self)
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

    def _connect_store(self, deadline: float, cancellable: bool = True) -> Any:
        """A client of the rank-0 store. TCPStore's own connect retries until its
        timeout and cannot be interrupted: wait (cancellably) until the store accepts
        connections, then connect with a short timeout, and retry."""
        host, port = self._store_address()
        while True:
            if cancellable and self.error is not None:
                raise BackendError("the rendezvous was cancelled")
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    pass
                store = _dist.TCPStore(host, port, is_master=False, timeout=_seconds(2.0))
            except (OSError, RuntimeError) as exc:
                if time.monotonic() >= deadline:
                    raise BackendError(f"cannot reach its store at {host}:{port}: {exc}") from exc
                time.sleep(0.05)
                continue
            store.set_timeout(_seconds(max(1.0, deadline - time.monotonic())))
            return store

    def _open_store(self) -> Any:
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
            base = _dist.PrefixStore(self.prefix, store)
            with self.lock:
                if self.error is not None:
                    return
                self.store = base
            # Our own handshake first: its wait is bounded by connect_timeout and can
            # be cancelled (``fail`` writes "cancel"); gloo's rendezvous cannot.
            base.set(f"join{self.rank}", "ok")
            base.wait([f"join{self.peer}"], _seconds(b.connect_timeout))
            if base.get(f"join{self.peer}") != b"ok" or self.error is not None:
                raise BackendError("the rendezvous was cancelled")
            opts = _dist.ProcessGroupGloo._Options()
            opts._timeout = _seconds(b.timeout)
            opts._threads = 1
            opts._devices = [_dist.ProcessGroupGloo.create_device(hostname=b.ctx.host)]
            pg = _dist.ProcessGroupGloo(_dist.PrefixStore("gloo", base), self.rank, 2, opts)
            nccl_out = nccl_in = None
            if self.nccl:
                nopts = _dist.ProcessGroupNCCL.Options()
                nopts._timeout = _seconds(b.timeout)
                groups = [
                    _dist.ProcessGroupNCCL(_dist.PrefixStore(f"nccl{r}", base), self.rank, 2, nopts)
                    for r in (0, 1)
                ]
                nccl_out, nccl_in = groups[self.rank], groups[self.peer]
        except Exception as exc:
            err = exc if isinstance(exc, BackendError) else _engine_error("", exc)
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
            self.fail(_engine_error("posting a deferred transfer failed", errors[0]))

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

    def _abort_engine(self, building: bool, groups: list[Any]) -> None:
        if building:  # wake both builders blocked in the handshake (a connection of our own:
            # the builder's may be busy waiting)
            with contextlib.suppress(Exception):
                client = self._connect_store(time.monotonic() + 2.0, cancellable=False)
                store = _dist.PrefixStore(self.prefix, client)
                for rank in (self.peer, self.rank):
                    store.set(f"join{rank}", "cancel")
        for g in groups:
            with contextlib.suppress(Exception):
                g.abort()

    def complete(self, h: _Inbound, error: BackendError | None) -> None:
        """``h`` is received (or failed): wake whoever awaits it."""
        with self.lock:
            if h.done:
                return
            h.done = True
            h.error = error
            if error is not None and h.work is not None:
                self._graveyard.append(h.work)  # may still be posted: never drop it early
            h.work = None
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

    def post_send(self, o: _Outbound) -> None:
        """(lock held) Post the gloo send of ``o``; never blocks."""
        assert o.tensor is not None
        work = self.pg.send([o.tensor], self.peer, o.tag)
        o.works.append((work, o.tensor))
        o.posted = True
        if o.freed:
            self.reap(o)

    def reap(self, o: _Outbound) -> None:
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
                    self.fail(_engine_error(f"send to {self.pair.name!r} failed", exc))
                    break
            else:
                self.backend.counters["sends_completed"] += 1
            with self.lock:
                self._idle_reapers += 1

    # -- receiver: tagged channel ------------------------------------------------------

    def post_recv(self, h: _Inbound) -> None:
        """(lock held) Post the gloo receive of ``h`` into ``h.target``; never blocks."""
        h.work = self.pg.recv([h.target], self.peer, h.tag)
        self._queue("recv", self._recv_loop).put(h)

    def _recv_loop(self, q: queue.SimpleQueue[Any]) -> None:
        while True:
            h = q.get()
            if h is None:
                return
            if self.error is not None:
                self._graveyard.append(h.work)
                continue
            try:
                h.work.wait()
            except Exception as exc:
                self.fail(_engine_error(f"receive from {self.pair.name!r} failed", exc))
                continue
            self.backend.counters["bytes_received"] += h.nbytes
            self.complete(h, None)

    # -- ordered channel -----------------------------------------------------------------

    def send_ordered(self, o: _Outbound) -> None:
        with self.lock:
            self.check()
            self._queue("ordered-out", self._ordered_send_loop).put(o)

    def _ordered_send_loop(self, q: queue.SimpleQueue[Any]) -> None:
        self.ready.wait()
        stream = None
        while True:
            o: _Outbound | None = q.get()
            if o is None:
                return
            if self.error is not None:
                continue
            try:
                assert o.tensor is not None
                header = _header(o.tag, o.nbytes, o.device)
                hwork = self.pg.send([header], self.peer, _CTL_TAG)
                if o.device == "cuda":
                    if stream is None:
                        stream = _cuda.Stream(o.tensor.device)
                    stream.wait_event(o.event)
                    with torch.cuda.stream(stream):
                        work = self.nccl_out.send([o.tensor], self.peer, 0)
                        work.wait()
                    stream.synchronize()  # blocks this thread only
                    # The peer read the header before it posted its NCCL receive.
                    works = [(hwork, header)]
                else:
                    work = self.pg.send([o.tensor], self.peer, o.tag)
                    works = [(hwork, header), (work, o.tensor)]
            except Exception as exc:
                self.fail(_engine_error(f"send to {self.pair.name!r} failed", exc))
                continue
            with self.lock:
                o.works.extend(works)
                o.posted = True
                if o.freed or o.device == "cuda":
                    self.reap(o)

    def register_ordered(self, h: _Inbound) -> None:
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
        tensor = torch.empty(_HEADER_BYTES, dtype=torch.uint8)
        work = self.pg.recv([tensor], self.peer, _CTL_TAG)
        self._queue("ordered-in", self._ordered_recv_loop).put(_Header(work, tensor))

    def claim(self, h: _Inbound, target: torch.Tensor | None) -> None:
        """(ordered) ``h``'s bytes go to ``target``, or to scratch when None."""
        with self.lock:
            if target is None:
                h.consume = True
            else:
                h.target = target
            h.posted = True
            self.cond.notify_all()

    def _await_claim(self, tag: int) -> _Inbound | None:
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
                self.fail(_engine_error(f"receive from {self.pair.name!r} failed", exc))
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
                    self.pg.recv([buf], self.peer, tag).wait()
            except Exception as exc:
                self.fail(_engine_error(f"receive from {self.pair.name!r} failed", exc))
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
        with torch.cuda.stream(stream):
            work = self.nccl_in.recv([buf], self.peer, 0)
            work.wait()
            if target is not None and staged:
                target.copy_(buf)
        stream.synchronize()


class NcclBackend(ByteBackend):
    """torch.distributed point-to-point: NCCL for CUDA objects, gloo for CPU objects.

    See the module docstring for the design and the options.
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
        opt_in=(
            "needs a process group: enable it for an edge, e.g. "
            "Endpoint(backends=[..., 'nccl'], routes={'peer': 'nccl'})"
        ),
        preference=40,
    )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        opts = ctx.options
        self.timeout = float(opts.get("timeout", 300.0))
        self.connect_timeout = float(opts.get("connect_timeout", 30.0))
        self.ordered = bool(opts.get("ordered", False))
        self.cuda = bool(
            torch.cuda.is_available()
            and _dist.is_nccl_available()
            and hasattr(_dist, "ProcessGroupNCCL")
        )
        self._device_option = opts.get("device")
        self._cuda_device: torch.device | None = None
        self.store: Any = None
        self.port = 0
        self._pool = RecvPool(max_idle_bytes=int(opts.get("pool_bytes", 256 << 20)))
        self._pairs: dict[tuple[str, int], _Pair] = {}
        self._gens: dict[tuple[str, int], int] = {}
        self._leases = 0
        self._open = 0
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
        if self._closed:
            raise BackendClosedError("nccl backend is closed")
        if self.store is not None:
            return
        try:
            self.store, self.port = await anyio.to_thread.run_sync(self._host_store)
        except OSError as exc:
            raise BackendError(f"nccl: cannot listen on {self.ctx.host}: {exc}") from exc
        except RuntimeError as exc:
            raise _engine_error("nccl: cannot start the rendezvous store", exc) from exc

    def _host_store(self) -> tuple[Any, int]:
        sock = socket.create_server((self.ctx.host, 0))
        port = int(sock.getsockname()[1])
        fd = sock.detach()  # the store owns the listening socket from here on
        try:
            store = _dist.TCPStore(
                self.ctx.host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=_seconds(self.connect_timeout),
                master_listen_fd=fd,
            )
        except BaseException:
            os.close(fd)
            raise
        return store, port

    def local_info(self) -> bytes:
        return _encoder.encode(_HelloInfo(host=self.ctx.host, port=self.port, cuda=self.cuda))

    async def connect(self, peer: PeerInfo) -> None:
        if self._closed:
            raise BackendClosedError("nccl backend is closed")
        try:
            hello = _hello_decoder.decode(peer.info)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError(f"malformed nccl hello info from {peer.name!r}: {exc}") from None
        if not hello.host or len(hello.host) > 255 or not 0 < hello.port < 65536:
            raise BackendError(
                f"nccl hello info from {peer.name!r} names no usable store "
                f"({hello.host[:80]!r}:{hello.port})"
            )
        old = self._pairs.pop(peer.key, None)
        if old is not None and old.link is not None:
            old.link.fail(BackendError(f"{peer.name!r} connected again"))
        pair = _Pair(self, peer, hello)
        pair.max_gen = self._gens.get(peer.key, -1)
        self._pairs[peer.key] = pair
        self._new_link(pair, pair.max_gen + 1)

    def _new_link(self, pair: _Pair, gen: int) -> _Link:
        if pair.link is not None:
            pair.link.fail(BackendError(f"superseded by generation {gen}"))
        pair.max_gen = max(pair.max_gen, gen)
        self._gens[pair.key] = pair.max_gen
        pair.link = _Link(self, pair, gen)
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
        links = [link for link in list(_live_links) if link.backend is self]
        for link in links:
            link.fail(BackendClosedError("nccl backend is closed"))
        self._pairs.clear()
        # Idle threads end at once; one blocked in the engine (a gloo wait, a store
        # connect) ends with that call — the exit hook waits for it longer.
        await anyio.to_thread.run_sync(_join_links, links, _CLOSE_JOIN_SECONDS)
        self.store = None  # shuts the rendezvous server down once no link holds it
        self._pool.clear()

    def stats(self) -> dict[str, int]:
        return {
            "leases": self._leases,
            "open": self._open,
            "pairs": len(self._pairs),
            **self.counters,
        }

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

    def _pair(self, peer: PeerInfo) -> _Pair:
        if self._closed:
            raise BackendClosedError("nccl backend is closed")
        pair = self._pairs.get(peer.key)
        if pair is None:
            raise BackendError(f"{peer.name!r} did not announce nccl in its Hello")
        return pair

    async def allocate(self, peer: PeerInfo, nbytes: int, device: str) -> OutboundBuffer:
        pair = self._pair(peer)
        link = pair.link
        if link is None or link.error is not None:  # broken: the next generation
            link = self._new_link(pair, pair.max_gen + 1)
        on_cuda = device.startswith("cuda") and link.nccl
        if on_cuda:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:  # CPU (CUDA tensors are staged here when the peer has no NCCL)
            tensor = self._pool.take(nbytes)
        o = _Outbound(
            link,
            pair.next_tag(),
            nbytes,
            "cuda" if on_cuda else "cpu",
            on_cuda or self.ordered,
            tensor,
        )
        self._leases += 1
        return OutboundBuffer(peer, nbytes, tensor, o)

    def describe(self, out: OutboundBuffer) -> bytes:
        o: _Outbound = out.handle
        return _encoder.encode(
            _Ref(gen=o.link.gen, tag=o.tag, nbytes=o.nbytes, device=o.device, ordered=o.ordered)
        )

    async def publish(self, out: OutboundBuffer, lo: int, hi: int) -> None:
        o: _Outbound = out.handle
        if self._closed:
            raise BackendClosedError("nccl backend is closed")
        if o.published or hi < o.nbytes or o.nbytes == 0:
            return  # one message per object, sent once it is whole; nothing for 0 bytes
        o.published = True
        if o.device == "cuda":
            o.event = _cuda.Event()
            assert o.tensor is not None
            o.event.record(torch.cuda.current_stream(o.tensor.device))
        link = o.link
        try:
            if o.ordered:
                link.send_ordered(o)
            else:
                link.submit(lambda: link.post_send(o))
        except BackendError:
            raise
        except Exception as exc:
            link.fail(_engine_error(f"send to {link.pair.name!r} failed", exc))
            raise link.error or BackendError(str(exc)) from exc
        self.counters["objects_sent"] += 1
        self.counters["bytes_sent"] += o.nbytes

    def free(self, out: OutboundBuffer) -> None:
        o: _Outbound | None = out.handle
        if o is None or o.freed:
            return
        out.buffer = None
        self._leases -= 1
        with o.link.lock:
            o.freed = True
            if o.works and o.link.error is None:
                o.link.reap(o)

    # -- receiver ------------------------------------------------------------------------

    def _decode_ref(self, peer: PeerInfo, info: bytes, nbytes: int) -> tuple[_Pair, _Ref]:
        pair = self._pair(peer)
        try:
            ref = _ref_decoder.decode(info)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError(f"malformed nccl reference from {peer.name!r}: {exc}") from None
        if ref.nbytes != nbytes or nbytes < 0:
            raise BackendError(
                f"nccl reference from {peer.name!r} has size {ref.nbytes} != {nbytes}"
            )
        if not 0 < ref.tag < _MAX_TAG or ref.gen < 0:
            raise BackendError(
                f"nccl reference from {peer.name!r} has tag {ref.tag} / generation {ref.gen}"
            )
        if ref.device == "cuda" and not (ref.ordered and self.cuda and pair.peer_cuda):
            raise BackendError(
                f"nccl reference from {peer.name!r} names a CUDA object, but NCCL does not "
                "connect this pair"
            )
        return pair, ref

    def _link_for(self, pair: _Pair, ref: _Ref) -> _Link:
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

    async def open(self, peer: PeerInfo, info: bytes, nbytes: int) -> InboundBuffer:
        pair, ref = self._decode_ref(peer, info, nbytes)
        link = self._link_for(pair, ref)
        h = _Inbound(link, ref)
        if ref.ordered and ref.nbytes:
            link.register_ordered(h)
        self._open += 1
        return InboundBuffer(peer, nbytes, handle=h)

    def _buffer(self, inb: InboundBuffer, h: _Inbound) -> torch.Tensor:
        if inb.buffer is None:
            if h.device == "cuda":
                inb.buffer = torch.empty(h.nbytes, dtype=torch.uint8, device=self.cuda_device)
            else:
                inb.buffer = self._pool.take(h.nbytes)
        return inb.buffer

    async def fetch(
        self, inb: InboundBuffer, lo: int, hi: int, dest: torch.Tensor | None = None
    ) -> None:
        h: _Inbound | None = inb.handle
        if h is None:
            raise BackendError("nccl: fetch on a closed inbound object")
        if hi <= lo:
            return
        if not 0 <= lo < hi <= h.nbytes:
            raise BackendError(f"nccl: range [{lo}, {hi}) outside a {h.nbytes}-byte object")
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
            target = dest[: h.nbytes] if whole and dest is not None else self._buffer(inb, h)
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            fut.add_done_callback(_consume_exception)
            link = h.link
            with link.lock:
                link.check()
                h.loop, h.future = loop, fut
                link.pending.add(h)
            try:
                if h.ordered:
                    link.claim(h, target)
                else:
                    h.target = target
                    h.posted = True
                    link.submit(lambda: link.post_recv(h))
            except BackendError as exc:
                link.complete(h, exc)
            except Exception as exc:
                link.fail(_engine_error(f"receive from {link.pair.name!r} failed", exc))
        if not h.done:
            assert h.future is not None
            await asyncio.shield(h.future)
        if h.error is not None:
            raise h.error
        if h.data is None:
            raise BackendError("nccl: the object's bytes are gone")
        if dest is not None and h.data.data_ptr() != dest.data_ptr():
            await copy_range(dest, h.data, lo, hi)
        self.counters["objects_received"] += 1

    def close(self, inb: InboundBuffer) -> None:
        h: _Inbound | None = inb.handle
        if h is None:
            return
        inb.handle = None
        inb.buffer = None
        self._open -= 1
        if not h.posted and h.nbytes:
            self._consume(h)

    def drop(self, peer: PeerInfo, info: bytes, nbytes: int) -> None:
        try:
            pair, ref = self._decode_ref(peer, info, nbytes)
            if not ref.nbytes:
                return
            link = self._link_for(pair, ref)
            h = _Inbound(link, ref)
            if ref.ordered:
                link.register_ordered(h)
        except BackendError as exc:
            log.info("nccl: refused object from %s not consumed: %s", peer.name, exc)
            return
        self._consume(h)

    def _consume(self, h: _Inbound) -> None:
        """Receive ``h`` into scratch: the sender's send must complete."""
        link = h.link
        try:
            if h.ordered:
                link.claim(h, None)
            else:
                h.consume = True
                h.posted = True
                h.target = self.scratch(h.nbytes)
                link.submit(lambda: link.post_recv(h))
        except BackendError as exc:
            log.info("nccl: cannot consume object from %s: %s", link.pair.name, exc)
        except Exception as exc:
            link.fail(_engine_error(f"receive from {link.pair.name!r} failed", exc))


# -- raw gloo bandwidth, for comparison ------------------------------------------------------


def _raw_group(host: str, port: int, rank: int, store: Any, timeout: float) -> Any:
    if store is None:
        store = _dist.TCPStore(host, port, is_master=False, timeout=_seconds(timeout))
    opts = _dist.ProcessGroupGloo._Options()
    opts._timeout = _seconds(timeout)
    opts._threads = 1
    opts._devices = [_dist.ProcessGroupGloo.create_device(hostname=host)]
    return _dist.ProcessGroupGloo(_dist.PrefixStore("raw", store), rank, 2, opts), store


def _raw_peer(port: int, sizes: Sequence[int], iters: int) -> None:
    """The receiving side of :func:`raw_bench` (rank 1)."""
    pg, _store = _raw_group("127.0.0.1", port, 1, None, 60.0)
    flag = torch.zeros(1, dtype=torch.uint8)
    for size in sizes:
        buf = torch.ones(size, dtype=torch.uint8)  # touched: no page faults while timed
        for _ in range(iters + 1):
            work = pg.recv([buf], 0, 2)
            pg.send([flag], 0, 1).wait()  # ready
            work.wait()
            pg.send([flag], 0, 3).wait()  # received


def raw_bench(sizes: Sequence[int], iters: int) -> dict[int, float]:
    """GB/s of bare gloo send/recv between two processes on 127.0.0.1 (no omniwire).

    For each size, the median over ``iters`` timed transfers (after one warm-up) of
    ``size / (time from send to the receiver's 1-byte "received")``. The receiver
    posts its receive before the timed send starts, as omniwire's receiver does.
    Raises RuntimeError if the peer process fails.
    """
    sock = socket.create_server(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    store = _dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=_seconds(60),
        master_listen_fd=sock.detach(),
    )
    cmd = [
        sys.executable,
        "-m",
        "omniwire.backends.nccl",
        "raw-peer",
        "--port",
        str(port),
        "--iters",
        str(iters),
        "--sizes",
        ",".join(str(s) for s in sizes),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(cmd, env=env)
    results: dict[int, float] = {}
    try:
        pg, _ = _raw_group("127.0.0.1", port, 0, store, 60.0)
        flag = torch.zeros(1, dtype=torch.uint8)
        for size in sizes:
            buf = torch.ones(size, dtype=torch.uint8)
            rates = []
            for i in range(iters + 1):
                pg.recv([flag], 1, 1).wait()
                t0 = time.perf_counter()
                pg.send([buf], 1, 2).wait()
                pg.recv([flag], 1, 3).wait()
                elapsed = time.perf_counter() - t0
                if i:
                    rates.append(size / elapsed / 1e9)
            results[size] = statistics.median(rates)
        code = child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if code != 0:
        raise RuntimeError(f"raw gloo peer exited with {code}")
    return results


def _main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m omniwire.backends.nccl")
    sub = p.add_subparsers(dest="cmd", required=True)
    peer = sub.add_parser("raw-peer", help="the receiving process of raw_bench")
    peer.add_argument("--port", type=int, required=True)
    peer.add_argument("--iters", type=int, required=True)
    peer.add_argument("--sizes", required=True)
    bench = sub.add_parser("raw-bench", help="bare gloo send/recv GB/s between two processes")
    bench.add_argument("--sizes", default=f"{1 << 20},{64 << 20}")
    bench.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.cmd == "raw-peer":
        _raw_peer(args.port, sizes, args.iters)
    else:
        for size, gbps in raw_bench(sizes, args.iters).items():
            print(f"{size:>12} B  {gbps:6.2f} GB/s")


if __name__ == "__main__":
    _main()
