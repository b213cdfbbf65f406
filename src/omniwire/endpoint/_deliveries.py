"""What arrived and waits for the application: the delivery queue, its consumers, its budget.

Theory of operation
-------------------
The receiver hands every :class:`~omniwire.delivery.Delivery` to :meth:`Deliveries.put`;
it is queued in arrival order and indexed by request id. Consumers take from the
queue, each the *oldest* delivery it may take, so nothing is reordered:

- **scoped** — ``receive(request_id=r)``, ``deliveries(request_id=r)`` and the
  streams ``requests()`` yields: the deliveries of ``r`` (from ``from_stage``, if
  given; an ``aborted`` delivery whatever stage it names);
- **unscoped** — ``receive()``, ``async for d in ep``, ``deliveries()``: any
  delivery (from ``from_stage``, if given) of a request nobody *holds*;
- ``requests()`` — a :class:`DeliveryStream` for each request nobody holds, at its
  first delivery (from ``from_stage``, if given, or ``aborted`` whatever stage it
  names).

A request is **held** while a :class:`DeliveryStream` for it is open, or while a
``receive(request_id=…)`` waits for it; its deliveries then go to its scoped
consumers only. So a stage serves many requests at once, each in its own task,
with no dispatcher: every task reads its own stream, and what arrives for a
request whose task has not started yet waits in the queue for it. A stream ends
after its request's ``stream_end``, ``error`` or ``aborted`` delivery.

Budget. Undelivered objects are bounded (``receive_buffer`` deliveries,
``receive_buffer_bytes`` bytes): the receiver takes a share of the budget before
it copies an object (a progressive one: as its bytes are announced) and the share
comes back when a consumer takes the delivery, so a slow application makes the
receiver stop taking — and so stop acknowledging — instead of growing memory. The
budget is shared fairly (:class:`~omniwire.flow.FairBudget`): while another peer
waits, no peer holds more than an equal share. Everything else a message carries —
inline data, headers, metadata, stream ends, errors — holds its charge against its
peer's window (spec §7.6) until its delivery is taken or dropped (``ReceiveWindow.give``).

Dispatch. ``requests()`` finds the oldest request nobody holds in O(1): the
queue keeps the ids of unheld requests with queued deliveries in order (a request
let go with deliveries still queued goes to the back). Unscoped consumers take the
oldest unheld delivery in arrival order: O(1) while nothing is held, else the top
of a heap of the unheld deliveries, built when first needed and kept while some
request is held (its stale entries popped: counted in
``counters["deliveries_scanned"]``, amortized O(1) per delivery). Consumers that
filter on a stage (``requests(from_stage=…)``, ``receive(from_stage=…)``) read
indexes by stage, built when the first such consumer comes: heaps of the unheld
requests by the stage of their first delivery and of the unheld deliveries by
stage (``aborted`` ones under "any stage"), so one stage's backlog that nobody reads
costs the others nothing (O(log n) per take).

Deliveries nobody asks for. A delivery of a request nobody holds, waiting while
its consumer never comes (a reply that arrives after its requester gave up, say),
would keep its share forever and, once the budget is full, stop the data of every
other request. So when **the budget is exhausted, some consumer is waiting for
something else, and an unheld delivery has waited more than**
``unclaimed_timeout`` seconds, that delivery is dropped (released, so its sender
gets its ACK): the queue keeps, in its place, one ``error`` delivery of its
request with ``cause="unclaimed"``, which a consumer that comes late still sees.
Each drop is counted (``counters["deliveries_unclaimed"]``) and logged. A slow
consumer loses nothing: nothing is dropped while no consumer waits, nor while
the request is held.

Notices. What the receiver makes itself — ``aborted``, and the ``error`` of a lost
peer or an idle stream — holds no budget and no window, so nothing above bounds
it. For a request nobody holds, a notice is kept until ``_NOTICES`` newer ones
were queued; then, if still nobody holds its request and nothing of the request is
queued before it, it is dropped (counted in ``counters["notices_dropped"]``,
logged). A held request's notice is its consumer's and never dropped, nor one that
ends deliveries still queued (a stream would never end). A request a stream of
which ended or was closed is over for the application (``over``, remembered like
aborted ids): the notices that stream left go with it, and a later notice of the
request is not queued — it would come back from ``requests()`` as a new request.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from ..delivery import Delivery
from ..errors import EndpointClosedError, EndpointNotStartedError
from ..flow import FairBudget
from ._aborts import ABORT_MEMORY, ABORT_MEMORY_BYTES

if TYPE_CHECKING:
    from ._core import Core

__all__ = ["TERMINAL", "Deliveries", "DeliveryStream"]

#: The kinds that end a request's stream.
TERMINAL = frozenset({"stream_end", "error", "aborted"})

_TOMBSTONES = 1024  # "unclaimed" error deliveries kept at most (the oldest go first)
#: Notices (deliveries that hold neither budget nor window: ``aborted``, and the
#: ``error`` of a lost peer or an idle stream) of requests nobody holds: a notice is
#: dropped once this many newer ones were queued, if nobody holds its request by then.
_NOTICES = 1024
#: Requests :meth:`Deliveries.next_request` hands out, at most, between two turns of
#: the event loop: an application starts a task per request, and one frame may open
#: thousands (3,072 held the loop 0.2-0.6 s, most of it there, not in the frame).
REQUESTS_PER_TURN = 64


def _is_notice(d: Delivery) -> bool:
    """Whether ``d`` was made here (an ``aborted``, the ``error`` of a lost peer or an
    idle stream, an ``unclaimed`` tombstone): it holds neither budget nor window."""
    return d.kind in ("aborted", "error") and d._budget is None and d._window is None


class _NoEvent:
    """Stands for the event of a consumer that is not asleep (setting it does nothing)."""

    def set(self) -> None:
        pass


_NO_EVENT: Any = _NoEvent()

#: What :meth:`_Filed.top`'s ``key_of`` says of an entry that no longer counts.
_STALE: Any = object()


def _stage_key(d: Delivery) -> str | None:
    """The stage a consumer filtering on stages must name to take ``d``; None for an
    ``aborted`` delivery, which every such consumer may take."""
    return None if d.kind == "aborted" else d.from_stage


class _Filed:
    """Heaps of ``(order, item)`` filed under a key (a stage; None: any stage), so
    that the oldest item under a key is found without walking past the others. An
    entry goes stale when its item is taken, held or filed again; stale entries are
    popped (or moved to the key their item has now) when they reach the top:
    amortized O(log n) per item. ``size`` counts every entry, stale ones too: the
    owner drops an index that is mostly stale and builds it again when needed."""

    __slots__ = ("heaps", "scanned", "size")

    def __init__(self) -> None:
        self.heaps: dict[str | None, list[tuple[int, Any]]] = {}
        self.size = 0
        self.scanned = 0  # stale entries popped

    def push(self, key: str | None, order: int, item: Any) -> None:
        heap = self.heaps.get(key)
        if heap is None:
            heap = self.heaps[key] = []
        heapq.heappush(heap, (order, item))
        self.size += 1

    def top(self, key: str | None, key_of: Callable[[int, Any], Any]) -> tuple[int, Any] | None:
        """The oldest live entry under ``key``: ``key_of(order, item)`` is the key the
        item belongs under now, or ``_STALE``."""
        heap = self.heaps.get(key)
        while heap:
            order, item = heap[0]
            now = key_of(order, item)
            if now == key:
                return order, item
            heapq.heappop(heap)
            self.size -= 1
            self.scanned += 1
            if now is not _STALE:
                self.push(now, order, item)
        return None

    def oldest(self, key: str, key_of: Callable[[int, Any], Any]) -> tuple[int, Any] | None:
        """The oldest live entry under ``key`` or under None (any stage)."""
        mine, any_stage = self.top(key, key_of), self.top(None, key_of)
        if mine is None or (any_stage is not None and any_stage[0] < mine[0]):
            return any_stage
        return mine


class _Consumer:
    """One waiting consumer: what it wants, and the event that wakes it."""

    __slots__ = ("event", "from_stage", "request_id")

    def __init__(self, request_id: str | None, from_stage: str | None) -> None:
        self.request_id = request_id
        self.from_stage = from_stage
        self.event = _NO_EVENT  # a real one is made when it sleeps

    def stage_ok(self, d: Delivery) -> bool:
        return self.from_stage is None or d.from_stage == self.from_stage or d.kind == "aborted"


class Deliveries:
    """The queue of undelivered deliveries of one endpoint (see the module docstring)."""

    def __init__(self, core: Core) -> None:
        cfg = core.config
        self.core = core
        self.budget = FairBudget(cfg.receive_buffer, cfg.receive_buffer_bytes)
        self._seq = itertools.count()
        self._all: OrderedDict[int, Delivery] = OrderedDict()
        self._by_request: dict[str, OrderedDict[int, Delivery]] = {}
        #: ids of requests with queued deliveries and no hold, oldest first (a set).
        #: Every queue here whose oldest entry is taken is an OrderedDict: a plain
        #: dict finds its first key by skipping the holes its deleted keys left, which
        #: made each dispatch of a burst cost O(requests dispatched before it).
        self._unheld: OrderedDict[str, int] = OrderedDict()  # request id -> its turn
        self._turns = itertools.count()
        self._handed = 0  # requests next_request handed out since it last waited
        #: Told when a delivery that holds a window charge leaves the queue.
        #: request id -> {stage filter (None: every stage) -> streams/receives holding it}
        self._holds: dict[str, dict[str | None, int]] = {}
        self._scoped: dict[str, list[_Consumer]] = {}  # waiting, by request id
        self._unscoped: list[_Consumer] = []  # waiting: receive(), requests()
        self._tombstones: OrderedDict[str, int] = OrderedDict()  # request id -> seq
        #: seqs of the notices queued for requests nobody held then, oldest first
        #: (entries already taken stay until they come out: at most _NOTICES of them)
        self._notices: OrderedDict[int, None] = OrderedDict()
        #: While some request is held: the unheld deliveries, a heap of (seq, delivery),
        #: so an unscoped consumer finds the oldest without walking past held ones.
        #: Entries go stale (taken, dropped, held since) and are discarded when they
        #: reach the top; a request let go pushes its deliveries again. None while
        #: nothing is held (or after too many stale entries: rebuilt when needed).
        self._free: list[tuple[int, Delivery]] | None = None
        #: Built when a consumer first filters on stages (None until then, or after
        #: it went mostly stale): the unheld requests by the stage of their first
        #: delivery, as (turn, request id) — for ``requests(from_stage=…)`` — and the
        #: unheld deliveries by stage, as (seq, delivery) — for unscoped consumers
        #: with ``from_stage``. Both O(log n) whatever other stages left queued.
        self._requests_of: _Filed | None = None
        self._deliveries_of: _Filed | None = None
        #: Requests a stream of which ended or was closed, the newest last (at most
        #: ABORT_MEMORY ids and ABORT_MEMORY_BYTES bytes): over for the application,
        #: unless a consumer comes for one again (see :meth:`over`).
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._ended_bytes = 0
        #: What deliveries reply through (the endpoint; set by it).
        self.replier: Any = None

    def __len__(self) -> int:
        return len(self._all)

    # -- in ------------------------------------------------------------------------

    def put(self, delivery: Delivery, *, notice: bool = False) -> None:
        """Queue ``delivery``; a ``notice`` (it holds neither budget nor window) is
        kept only while fewer than ``_NOTICES`` newer ones came, unless held."""
        delivery._replier = self.replier
        seq = next(self._seq)
        self._all[seq] = delivery
        rid = delivery.request_id
        queue = self._by_request.get(rid)
        if queue is None:
            queue = self._by_request[rid] = OrderedDict()
            queue[seq] = delivery
            if rid not in self._holds:
                if self._requests_of is None:
                    self._unheld[rid] = next(self._turns)  # _line_up's common case
                else:
                    self._line_up(rid)
        else:
            queue[seq] = delivery
        indexed = self._free is not None or self._deliveries_of is not None
        if (notice or indexed) and not self._held(delivery):
            if notice:
                self._note(seq)
            self._unheld_delivery(seq, delivery)
        for consumer in self._scoped.get(rid, ()):
            if consumer.stage_ok(delivery):
                consumer.event.set()
        unscoped = self._unscoped
        if unscoped and not self._held(delivery):
            # a woken consumer leaves the list (it comes back if it finds nothing):
            # the rest of a burst does not wake it again, delivery after delivery
            left = []
            for consumer in unscoped:
                if consumer.stage_ok(delivery):
                    consumer.event.set()
                else:
                    left.append(consumer)
            unscoped[:] = left

    # -- out -----------------------------------------------------------------------

    async def receive(
        self,
        timeout: float | None,
        request_id: str | None = None,
        from_stage: str | None = None,
    ) -> Delivery:
        """The oldest delivery this consumer may take (see the module docstring).

        Raises:
            TimeoutError: none within ``timeout`` seconds.
            EndpointNotStartedError, EndpointClosedError: nothing left and not open.
        """
        if request_id is None:
            if from_stage is None and self._all and not self._holds:
                return self._take(*next(iter(self._all.items())))  # the common case: O(1)
            return await self._wait(_Consumer(None, from_stage), timeout)
        self._hold(request_id, from_stage)
        try:
            return await self._wait(_Consumer(request_id, from_stage), timeout)
        finally:
            self._release(request_id, from_stage)

    def stream(self, request_id: str | None, from_stage: str | None) -> DeliveryStream:
        """A stream of the deliveries of ``request_id`` (held from now), or of every
        unheld delivery when ``request_id`` is None."""
        return DeliveryStream(self, request_id, from_stage)

    async def next_request(self, from_stage: str | None) -> DeliveryStream:
        """A held stream for the oldest request nobody holds (waiting for one).

        Raises:
            EndpointNotStartedError, EndpointClosedError: not open.
        """
        consumer = _Consumer(None, from_stage)
        while True:
            rid = self._unheld_request(from_stage)
            if rid is None:
                self._handed = 0
                await self._sleep(consumer, None)
            elif self._handed < REQUESTS_PER_TURN:
                self._handed += 1
                return DeliveryStream(self, rid, from_stage)
            else:  # a portion went out without a wait: a turn of the loop first
                self._handed = 0
                await asyncio.sleep(0)

    def _unheld_request(self, from_stage: str | None) -> str | None:
        """The oldest request nobody holds whose first delivery is ``from_stage``'s
        (or an ``aborted`` one: whatever stage it names, as for scoped consumers)."""
        if from_stage is None:
            return next(iter(self._unheld), None)  # O(1)
        index = self._requests_of
        if index is None:
            index = self._requests_of = _Filed()
            for rid, turn in self._unheld.items():
                index.push(_stage_key(next(iter(self._by_request[rid].values()))), turn, rid)
            index.scanned += len(self._unheld)
        found = index.oldest(from_stage, self._request_key)
        self.core.counters["deliveries_scanned"] += index.scanned
        index.scanned = 0
        return None if found is None else found[1]

    def _request_key(self, turn: int, rid: str) -> object:
        """Where the unheld request ``rid`` filed at ``turn`` belongs in
        ``_requests_of`` now (its first delivery changes as deliveries are taken)."""
        if self._unheld.get(rid) != turn:
            return _STALE  # held since, taken, or in the line again at a later turn
        return _stage_key(next(iter(self._by_request[rid].values())))

    def _line_up(self, rid: str) -> None:
        """``rid`` (with deliveries queued) is held by nobody now: to the back of the line."""
        turn = self._unheld[rid] = next(self._turns)
        index = self._requests_of
        if index is not None:
            index.push(_stage_key(next(iter(self._by_request[rid].values()))), turn, rid)
            if index.size > 2 * len(self._unheld) + 64:
                self._requests_of = None  # mostly stale: built again when needed

    async def _wait(self, consumer: _Consumer, timeout: float | None) -> Delivery:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            found = self._find(consumer)
            if found is not None:
                return self._take(*found)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                what = "" if consumer.request_id is None else f" of request {consumer.request_id!r}"
                if consumer.from_stage is not None:
                    what += f" from {consumer.from_stage!r}"
                raise TimeoutError(f"no delivery{what} within {timeout:g} s")
            await self._sleep(consumer, left)

    async def _sleep(self, consumer: _Consumer, timeout: float | None) -> None:
        """Wait until a delivery this consumer may want arrives (or ``timeout``)."""
        self.core.check_open()
        consumer.event = anyio.Event()
        rid = consumer.request_id
        waiting = self._unscoped if rid is None else self._scoped.setdefault(rid, [])
        waiting.append(consumer)
        try:
            if timeout is None:  # no cancel scope: it costs a few µs per receive
                await consumer.event.wait()
            else:
                with anyio.move_on_after(timeout):
                    await consumer.event.wait()
        finally:
            if rid is None:
                with contextlib.suppress(ValueError):  # (put() took it off once it woke it)
                    waiting.remove(consumer)
            else:
                waiting.remove(consumer)
                if not waiting:
                    del self._scoped[rid]

    def _find(self, consumer: _Consumer) -> tuple[int, Delivery] | None:
        rid = consumer.request_id
        if rid is not None:
            for seq, d in self._by_request.get(rid, {}).items():
                if consumer.stage_ok(d):
                    return seq, d
            return None
        if consumer.from_stage is None:
            if not self._holds:
                return next(iter(self._all.items()), None)  # the common case: O(1)
            return self._oldest_unheld()
        index = self._deliveries_of
        if index is None:
            index = self._deliveries_of = _Filed()
            for seq, d in self._all.items():
                if not self._held(d):
                    index.push(_stage_key(d), seq, d)
            index.scanned += len(self._all)
        found = index.oldest(consumer.from_stage, self._delivery_key)
        self.core.counters["deliveries_scanned"] += index.scanned
        index.scanned = 0
        return found

    def _delivery_key(self, seq: int, d: Delivery) -> object:
        if self._all.get(seq) is not d or self._held(d):
            return _STALE
        return _stage_key(d)

    def _oldest_unheld(self) -> tuple[int, Delivery] | None:
        """The oldest delivery nobody holds, while some request is held: the top of
        the heap of unheld deliveries, past its stale entries (amortized O(log n))."""
        free = self._free
        scanned = 0
        if free is None:  # in arrival order: a heap already
            free = self._free = [(seq, d) for seq, d in self._all.items() if not self._held(d)]
            scanned = len(self._all)
        try:
            while free:
                seq, d = free[0]
                if self._all.get(seq) is d and not self._held(d):
                    return seq, d  # stale once taken: popped by a later call
                heapq.heappop(free)
                scanned += 1
            return None
        finally:
            if scanned:
                self.core.counters["deliveries_scanned"] += scanned

    def _unheld_delivery(self, seq: int, d: Delivery) -> None:
        """``d`` is queued and nobody holds it: into the indexes there are. One mostly
        of stale entries is dropped, to be rebuilt by the next consumer that needs it."""
        free = self._free
        if free is not None:
            heapq.heappush(free, (seq, d))
            if len(free) > 2 * len(self._all) + 64:
                self._free = None
        index = self._deliveries_of
        if index is not None:
            index.push(_stage_key(d), seq, d)
            if index.size > 2 * len(self._all) + 64:
                self._deliveries_of = None

    def _take(self, seq: int, d: Delivery) -> Delivery:
        self._remove(seq, d)
        self._give_back(d)
        observer = self.core.observer
        if observer is not None:
            observer.taken(self.core.name, d)
        return d

    def _remove(self, seq: int, d: Delivery) -> None:
        del self._all[seq]
        rid = d.request_id
        queue = self._by_request[rid]
        index = self._requests_of
        was_first = index is not None and next(iter(queue)) == seq
        del queue[seq]
        if not queue:
            del self._by_request[rid]
            self._unheld.pop(rid, None)
        elif was_first and index is not None and rid in self._unheld:
            now = _stage_key(next(iter(queue.values())))
            if now != _stage_key(d):  # its first delivery is another stage's now
                index.push(now, self._unheld[rid], rid)
        if d.cause == "unclaimed" and self._tombstones.get(rid) == seq:
            del self._tombstones[rid]

    # -- holds -----------------------------------------------------------------------

    def _held(self, d: Delivery) -> bool:
        holds = self._holds.get(d.request_id)
        return holds is not None and (None in holds or d.from_stage in holds or d.kind == "aborted")

    def over(self, request_id: str) -> bool:
        """Whether ``request_id`` is over for the application: a stream of it ended or
        was closed, nobody holds or waits for it since, and nothing of it is queued. A
        notice of such a request (a later abort, a lost peer) has nobody to tell: it is
        not queued (it would come back as a new request from ``requests()``)."""
        return (
            request_id in self._ended
            and request_id not in self._by_request
            and not self.wanted(request_id)
        )

    def _stream_ended(self, request_id: str) -> None:
        """A stream of ``request_id`` ended or was closed (and let the request go): the
        request is over for the application. The notices of it still queued were that
        stream's (an abort that came while the request was served, say) and go with it,
        unless they end data of the request still queued or someone holds it still."""
        queued = self._by_request.get(request_id)
        if queued and request_id not in self._holds and all(map(_is_notice, queued.values())):
            for seq, d in list(queued.items()):
                self._remove(seq, d)
        ended = self._ended
        if request_id not in ended:
            ended[request_id] = None
            self._ended_bytes += len(request_id)
        ended.move_to_end(request_id)
        while len(ended) > ABORT_MEMORY or self._ended_bytes > ABORT_MEMORY_BYTES:
            rid, _ = ended.popitem(last=False)
            self._ended_bytes -= len(rid)

    def ends_queued(self, request_id: str) -> bool:
        """Whether a delivery that ends ``request_id``'s streams (``TERMINAL``) is queued."""
        return any(d.kind in TERMINAL for d in self._by_request.get(request_id, {}).values())

    def wanted(self, request_id: str) -> bool:
        """Whether a consumer holds or waits for ``request_id``."""
        return request_id in self._holds or request_id in self._scoped

    def _hold(self, request_id: str, from_stage: str | None) -> None:
        holds = self._holds.get(request_id)
        if holds is None:
            holds = self._holds[request_id] = {}
            self._unheld.pop(request_id, None)
        holds[from_stage] = holds.get(from_stage, 0) + 1

    def _release(self, request_id: str, from_stage: str | None, *, wake: bool = True) -> None:
        holds = self._holds.get(request_id)
        if holds is None or from_stage not in holds:
            return
        holds[from_stage] -= 1
        if holds[from_stage] <= 0:
            del holds[from_stage]
            if not holds:
                del self._holds[request_id]
                if request_id in self._by_request:
                    self._line_up(request_id)
                    for seq, d in self._by_request[request_id].items():
                        if d._budget is None and d._window is None and d.kind in TERMINAL:
                            self._note(seq)  # a notice its holder left: nobody's now
            if not self._holds:
                self._free = None  # nothing held: the queue's head is the oldest
            if self._free is not None or self._deliveries_of is not None:
                for seq, d in self._by_request.get(request_id, {}).items():
                    if not self._held(d):
                        self._unheld_delivery(seq, d)
        if wake:  # what it held is anybody's now
            self.wake_unscoped(request_id)

    def wake_unscoped(self, request_id: str) -> None:
        """Wake the unscoped consumers that may take a delivery of ``request_id`` now
        (it was let go; also called for a stream the collector finalized)."""
        queued = self._by_request.get(request_id)
        if queued and self._unscoped:
            for d in queued.values():
                if not self._held(d):
                    for consumer in self._unscoped:
                        if consumer.stage_ok(d):
                            consumer.event.set()

    # -- aborts, expiry, close ---------------------------------------------------------

    def _note(self, seq: int) -> None:
        """Remember the notice ``seq`` of a request nobody holds; drop the oldest such
        notice beyond ``_NOTICES`` if it is all its request has queued and nobody holds
        it by then (a held one is its consumer's; one after queued deliveries ends
        them, and those are bounded by the budget and the windows). Amortized O(1):
        each entry comes out once."""
        notices = self._notices
        notices[seq] = None
        while len(notices) > _NOTICES:
            old_seq, _ = notices.popitem(last=False)
            old = self._all.get(old_seq)
            if old is None or self._held(old):
                continue  # taken already, or held since
            if next(iter(self._by_request[old.request_id])) != old_seq:
                continue  # it ends deliveries of its request still queued: theirs to keep
            self._remove(old_seq, old)
            self.core.counters["notices_dropped"] += 1
            self.core.noisy.warning(
                "notices",
                "%s: dropped the %s delivery of request %r from %r: nobody holds the request "
                "and %d newer notices are queued",
                self.core.name,
                old.kind,
                old.request_id,
                old.from_stage,
                _NOTICES,
            )

    def drop(self, request_id: str) -> None:
        """Drop the undelivered deliveries of an aborted request (zero-copy ones NACK)."""
        for seq, d in list(self._by_request.get(request_id, {}).items()):
            if d.kind != "aborted":
                self._remove(seq, d)
                d.release()
                self._give_back(d)

    def expire(self, now: float) -> int:
        """Drop what blocks everyone (see the module docstring); returns how many."""
        if not self.budget.waiting or not (self._unscoped or self._scoped):
            return 0
        limit = self.core.config.unclaimed_timeout
        dropped = 0
        for seq, d in list(self._all.items()):
            if d._budget is None:
                continue  # takes no share (and a tombstone's clock is its own)
            if now - d.received_at <= limit:
                break  # the rest arrived later
            if self._held(d) or d.request_id in self._scoped:
                continue
            dropped += 1
            self._unclaimed(seq, d, now)
        if dropped:
            self.core.counters["deliveries_unclaimed"] += dropped
        return dropped

    def _unclaimed(self, seq: int, d: Delivery, now: float) -> None:
        rid = d.request_id
        d.release()
        self._give_back(d)
        if rid in self._tombstones:  # the request already has its error in the queue
            self._remove(seq, d)
            return
        error = (
            f"a {d.kind} of request {rid!r} from {d.from_stage!r} waited "
            f"{now - d.received_at:.0f} s for a consumer while the receive budget was "
            "full and others waited: it was dropped"
        )
        tombstone = Delivery("error", rid, d.from_stage, d.chunk_id, error=error, cause="unclaimed")
        tombstone._replier = self.replier
        self._all[seq] = tombstone  # in its place: order holds
        self._unheld_delivery(seq, tombstone)
        self._by_request[rid][seq] = tombstone
        self._tombstones[rid] = seq
        self.core.noisy.warning("unclaimed", "%s: %s", self.core.name, error)
        if len(self._tombstones) > _TOMBSTONES:
            _old_rid, old_seq = self._tombstones.popitem(last=False)
            old = self._all.get(old_seq)
            if old is not None:
                self._remove(old_seq, old)

    def close(self) -> None:
        for d in self._all.values():
            d.release()
            self._give_back(d)
        self._all.clear()
        self._by_request.clear()
        self._unheld.clear()
        self._tombstones.clear()
        self._free = None
        self._requests_of = self._deliveries_of = None
        for consumer in [*self._unscoped, *(c for cs in self._scoped.values() for c in cs)]:
            consumer.event.set()

    def _give_back(self, delivery: Delivery) -> None:
        if delivery._budget is not None:
            self.budget.release(delivery.from_stage, delivery._budget)
            delivery._budget = None
        window = delivery._window
        if window is not None:
            delivery._window = None
            window.give(delivery._charge)


class DeliveryStream:
    """The deliveries of one request, in arrival order — or, without a request id,
    every delivery of a request nobody holds.

    An async iterator (``async for d in stream``) and an async context manager. A
    request's stream holds the request from its creation (its deliveries go to it,
    not to unscoped consumers) until it ends: after the request's ``stream_end``,
    ``error`` or ``aborted`` delivery (from ``from_stage``, if given; an
    ``aborted`` delivery whatever stage it names), when it is closed
    (:meth:`aclose`, the end of ``async with``), or when the endpoint closes.
    Close a stream you stop reading before its end, so that the rest of the
    request goes to other consumers. Once a request's stream ended or was closed the
    request is over for the application: the notices it left unread go with it, and
    a later abort of it (or a lost peer's ``error``) is not queued (:meth:`Deliveries.over`).
    """

    def __init__(self, queue: Deliveries, request_id: str | None, from_stage: str | None) -> None:
        self.request_id = request_id
        self.from_stage = from_stage
        self._queue = queue
        self._open = True
        self._loop: asyncio.AbstractEventLoop | None = None
        if request_id is not None:
            queue._hold(request_id, from_stage)
            with contextlib.suppress(RuntimeError):  # (made outside the loop: no wake-up)
                self._loop = asyncio.get_running_loop()

    @property
    def ended(self) -> bool:
        """True once the stream ended (its request's last delivery taken, or closed)."""
        return not self._open

    def __aiter__(self) -> DeliveryStream:
        return self

    async def __anext__(self) -> Delivery:
        if not self._open:
            raise StopAsyncIteration
        queue = self._queue
        if self.request_id is None and self.from_stage is None and queue._all and not queue._holds:
            return queue._take(*next(iter(queue._all.items())))  # the common case: O(1)
        try:
            d = await queue._wait(_Consumer(self.request_id, self.from_stage), None)
        except EndpointNotStartedError:
            raise
        except EndpointClosedError:
            self.close()
            raise StopAsyncIteration from None
        if (
            self.request_id is not None
            and d.kind in TERMINAL
            and (d.kind == "aborted" or self.from_stage in (None, d.from_stage))
        ):
            self.close()
        return d

    def close(self) -> None:
        """Stop reading; later deliveries of the request go to other consumers. Idempotent."""
        if self._open:
            self._open = False
            if self.request_id is not None:
                self._queue._release(self.request_id, self.from_stage)
                self._queue._stream_ended(self.request_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> DeliveryStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # A stream dropped unclosed must not hold its request forever. A finalizer
        # may run anywhere (any thread, mid-operation): the consumers waiting are
        # woken from the event loop, by a call scheduled for it.
        if getattr(self, "_open", False) and self.request_id is not None:
            self._open = False
            self._queue._release(self.request_id, self.from_stage, wake=False)
            self._queue._stream_ended(self.request_id)
            loop = self._loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    loop.call_soon_threadsafe(self._queue.wake_unscoped, self.request_id)

    def __repr__(self) -> str:
        scope = "any request" if self.request_id is None else f"request {self.request_id!r}"
        if self.from_stage is not None:
            scope += f" from {self.from_stage!r}"
        return f"<DeliveryStream {scope}{' (ended)' if self.ended else ''}>"
