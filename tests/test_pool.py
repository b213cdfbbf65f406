"""The shared slot pool (omniwire.backends.pool) and the shared helpers (support)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omniwire.alloc import BuddyAllocator
from omniwire.backends.completion import Pace, TransferStalledError
from omniwire.backends.pool import Lease, SlotPool
from omniwire.backends.support import (
    Completions,
    HostMemory,
    RegisteredRecvPool,
    RegistrationCache,
    Releaser,
    TransferAbandonedError,
    TransferTimeoutError,
    check_range,
    poll_until,
)
from omniwire.backends.threads import Threads
from omniwire.errors import BackendClosedError, BackendError


class Buffers:
    """Dedicated buffers as integers, with what was made and destroyed."""

    def __init__(self) -> None:
        self.made: list[int] = []
        self.destroyed: list[int] = []

    def create(self, size: int) -> int:
        self.made.append(size)
        return len(self.made)

    def destroy(self, buf: int) -> None:
        self.destroyed.append(buf)


def _pool(capacity: int = 64 << 10, **kw: object) -> tuple[SlotPool[int], Buffers]:
    b = Buffers()
    return SlotPool("test pool", capacity=capacity, create=b.create, destroy=b.destroy, **kw), b  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_slots_are_reused_and_dedicated_buffers_destroyed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool, bufs = _pool(option="the_option")
    a = await pool.take(40 << 10)
    assert a.offset == 0 and not a.dedicated and a.size == 64 << 10
    with caplog.at_level(logging.INFO, "omniwire.backends.pool"):
        b = await pool.take(100)  # the region is taken: a dedicated buffer
        c = await pool.take(100)
    assert b.dedicated and c.dedicated and bufs.made == [100, 100]
    assert sum("the_option" in r.message for r in caplog.records) == 1  # warned once
    assert pool.live == 3 and pool.dedicated_live == 2
    a.release()
    a.release()  # idempotent
    b.release()
    assert bufs.destroyed == [1]
    d = await pool.take(40 << 10)
    assert d.offset == 0 and pool.bytes_in_use == 64 << 10
    for x in (c, d):
        x.release()
    assert pool.live == 0 and pool.bytes_in_use == 0 and bufs.destroyed == [1, 2]


@pytest.mark.asyncio
async def test_a_small_object_waits_for_a_slot_a_large_one_never() -> None:
    pool, bufs = _pool(capacity=64 << 10)
    held = await pool.take(4096)
    big = await pool.take(40 << 10, wait=30)  # over half the region: no wait, dedicated
    assert big.dedicated
    filler = await pool.take(32 << 10)
    other = pool.take_slot(16 << 10)
    assert other is not None and pool.take_slot(16 << 10) is None

    async def free_soon() -> None:
        await anyio.sleep(0.05)
        other.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(free_soon)
        with anyio.fail_after(10):
            waited = await pool.take(16 << 10, wait=30)
    assert not waited.dedicated and waited.offset == other.offset
    for x in (held, big, filler, waited):
        x.release()
    assert bufs.made == [40 << 10]


@pytest.mark.asyncio
async def test_a_peer_under_its_share_never_waits_for_slots_another_peer_holds() -> None:
    """Was: one peer that never acknowledged filled the region (the shm arena is one
    per endpoint, shared by every peer), and every send to a healthy peer then waited
    out ``arena_wait`` (1 s) before a dedicated buffer: 5–8 ms sends became 1,003 ms.
    A peer holding less than its fair share of the region (its size over the peers
    holding slots) does not wait for what others hold: a dedicated buffer at once. A
    peer over its share still waits for its own to come back."""
    pool, bufs = _pool(capacity=64 << 10)
    hog = [await pool.take(16 << 10, key="hog") for _ in range(4)]  # the whole region
    with anyio.fail_after(10):
        friend = await pool.take(16 << 10, wait=30, key="friend")
    assert friend.dedicated

    async def free_soon() -> None:
        await anyio.sleep(0.05)
        hog[0].release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(free_soon)
        with anyio.fail_after(10):
            again = await pool.take(16 << 10, wait=30, key="hog")  # over its share: waits
    assert not again.dedicated
    for x in (*hog[1:], friend, again):
        x.release()
    assert bufs.made == [16 << 10]


@pytest.mark.asyncio
async def test_large_objects_use_kept_buffers_of_the_region_size() -> None:
    pool, bufs = _pool(capacity=64 << 10, keep=2)
    small = await pool.take(1024)
    one = await pool.take(33 << 10)  # over half: carved separately, kept
    two = await pool.take(40 << 10)
    three = await pool.take(50 << 10)  # both kept ones busy: a transient one
    assert (one.kept, two.kept, three.kept) == (True, True, False)
    assert bufs.made == [64 << 10, 64 << 10, 50 << 10]
    for x in (one, two, three):
        x.release()
    assert bufs.destroyed == [3]  # the kept ones stay
    again = await pool.take(60 << 10)
    assert again.kept and again.buffer in (1, 2) and len(bufs.made) == 3
    huge = await pool.take(100 << 10)  # beyond the region: never kept
    assert not huge.kept
    for x in (again, huge, small):
        x.release()
    await pool.aclose()
    assert sorted(bufs.destroyed) == [1, 2, 3, 4]


@pytest.mark.asyncio
async def test_deferred_and_quarantined_leases() -> None:
    pool, bufs = _pool(capacity=16 << 10, min_block=4096)
    done = False
    a = await pool.take(8 << 10)
    a.release_when(lambda: done)
    a.release()  # no effect: already on its way
    b = await pool.take(8 << 10)
    assert pool.take_slot(4096) is None and pool.pending == 1
    done = True
    c = pool.take_slot(4096)  # looking for a slot reclaims what is done
    assert c is not None and pool.pending == 0
    b.quarantine()
    b.release()  # no effect on a quarantined lease
    assert pool.quarantined == 1 and pool.bytes_in_use == (8 << 10) + 4096
    d = await pool.take(8 << 10)  # the quarantined slot is not reused
    assert d.dedicated
    d.quarantine()
    c.release()
    await pool.aclose()
    assert bufs.destroyed == [1]  # the quarantined dedicated buffer, at close
    assert pool.live == 0
    with pytest.raises(BackendClosedError):
        await pool.take(10)
    d.release()  # inert after close


@pytest.mark.asyncio
async def test_without_dedicated_buffers_a_full_pool_is_an_error() -> None:
    pool: SlotPool[int] = SlotPool("bare", capacity=8192, option="pool_size")
    x = await pool.take(8192)
    with pytest.raises(BackendError, match="pool_size"):
        await pool.take(1)
    x.release()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "free"]), st.integers(1, 40_000)), max_size=60))
def test_slots_never_overlap(ops: list[tuple[str, int]]) -> None:
    pool: SlotPool[int] = SlotPool("p", capacity=1 << 17, min_block=4096)
    live: list[Lease[int]] = []
    for op, n in ops:
        if op == "take":
            lease = pool.take_slot(n)
            if lease is not None:
                live.append(lease)
        elif live:
            live.pop(n % len(live)).release()
        spans = sorted((x.offset, x.offset + x.size) for x in live)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert all(x.size >= x.nbytes for x in live)
    for x in live:
        x.release()
    assert pool.bytes_in_use == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "free"]), st.integers(1, 40_000)), max_size=60))
def test_fits_says_whether_allocate_would_find_a_block(ops: list[tuple[str, int]]) -> None:
    """``BuddyAllocator.fits`` (a landing's room, asked before packing an object whole)
    is true exactly when ``allocate`` of the same size then succeeds."""
    ranges = BuddyAllocator(3 << 15, min_block=4096)  # not a power of two: 2 top blocks
    live: list[int] = []
    for op, n in ops:
        if op == "take":
            expected = ranges.fits(n)
            offset = ranges.allocate(n)
            assert (offset is not None) == expected, (n, live)
            if offset is not None:
                live.append(offset)
        elif live:
            ranges.free(live.pop(n % len(live)))
    assert not ranges.fits((3 << 15) + 1)


def test_poll_until_times_out_cancels_and_propagates() -> None:
    calls = iter(range(100))
    poll_until(lambda: next(calls) >= 3, timeout=5, what="x")
    with pytest.raises(TransferTimeoutError, match=r"read 1 did not finish within 0\.05 s"):
        poll_until(lambda: False, timeout=0.05, what="read 1")
    with pytest.raises(BackendError, match="cancelled"):
        poll_until(lambda: False, timeout=5, what="read 2", cancelled=lambda: True)

    def fails() -> bool:
        raise BackendError("engine said no")

    with pytest.raises(BackendError, match="engine said no"):
        poll_until(fails, timeout=5, what="read 3")


def test_releaser_runs_in_order_off_the_caller_and_inline_after_stop() -> None:
    r = Releaser("test-releaser")
    seen: list[tuple[int, str]] = []
    for i in range(3):
        r.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    r.submit(lambda: 1 / 0)  # logged, not raised
    assert r.wait_idle(5)
    assert [i for i, _ in seen] == [0, 1, 2] and {n for _, n in seen} == {"test-releaser"}
    r.stop()
    r.submit(lambda: seen.append((9, threading.current_thread().name)))
    assert seen[-1] == (9, threading.current_thread().name)


@pytest.mark.asyncio
async def test_registration_cache_reuses_bounds_and_unregisters() -> None:
    registered: list[tuple[int, int]] = []
    unregistered: list[int] = []
    releaser = Releaser("reg")

    def register(addr: int, n: int, device: torch.device) -> int:
        registered.append((addr, n))
        return addr

    cache = RegistrationCache(register, unregistered.append, releaser, max_entries=2)
    ts = [torch.ones(100 + i) for i in range(3)]
    k0, h0 = await cache.acquire(ts[0])
    k0b, h0b = await cache.acquire(ts[0][10:])  # a view of the same storage: a hit
    assert (k0, h0) == (k0b, h0b) and len(registered) == 1 and cache.hits == 1
    k1, _ = await cache.acquire(ts[1])
    k2, _ = await cache.acquire(ts[2])  # three in use: nothing can be evicted yet
    assert len(cache) == 3 and not unregistered
    for k in (k0, k0b, k1):
        cache.release(k)
    assert releaser.wait_idle(5)
    assert unregistered == [h0] and len(cache) == 2  # the least recently used, unused one
    cache.release(k2)
    assert sorted(h for h, _ in cache.clear()) == sorted(a for a, _ in registered[1:])
    releaser.stop()


@pytest.mark.asyncio
async def test_small_host_storages_register_on_the_loop_and_large_ones_in_a_thread() -> None:
    """``inline_bytes``: a registration the engine makes cheaply needs no trip to a
    worker thread (0.4–0.6 ms on 2 loaded cores); a larger one still goes there."""
    releaser = Releaser("test-releaser")
    threads: list[int] = []

    def register(addr: int, n: int, device: torch.device) -> int:
        threads.append(threading.get_ident())
        return addr

    cache = RegistrationCache(register, lambda h: None, releaser, inline_bytes=1 << 10)
    small, large = torch.ones(256, dtype=torch.uint8), torch.ones(2048, dtype=torch.uint8)
    ks, _ = await cache.acquire(small)
    kl, _ = await cache.acquire(large)
    assert threads[0] == threading.get_ident()  # on the loop: no await, no thread
    assert threads[1] != threading.get_ident()  # beyond inline_bytes: a worker thread
    assert (await cache.acquire(small))[0] == ks and len(threads) == 2  # cached either way
    for k in (ks, ks, kl):
        cache.release(k)
    releaser.stop()


@pytest.mark.asyncio
async def test_an_evicted_registrations_memory_lives_until_it_is_unregistered() -> None:
    """The engine refuses a registration that overlaps a live one (mooncake: "does
    not support overlapped memory region", code -7). An evicted registration is
    unregistered later, in the releaser's thread: if its memory were freed at the
    eviction, a new tensor could be allocated there and its registration refused
    (seen: a lent 1 MiB send failed). The memory must stay alive until then."""
    import weakref

    releaser = Releaser("test-evict")
    go = threading.Event()
    unregistered: list[int] = []

    def unregister(handle: int) -> None:
        go.wait(10)  # the releaser is busy: the unregister runs late
        unregistered.append(handle)

    cache = RegistrationCache(
        lambda addr, n, device: addr, unregister, releaser, max_entries=1, inline_bytes=1 << 20
    )
    first = torch.ones(1 << 10, dtype=torch.uint8)
    storage = weakref.ref(first.untyped_storage())
    key, _ = await cache.acquire(first)
    cache.release(key)
    key2, _ = await cache.acquire(torch.ones(1 << 10, dtype=torch.uint8))  # evicts ``first``
    del first
    assert storage() is not None and not unregistered  # not unregistered yet: still alive
    go.set()
    assert releaser.wait_idle(5) and len(unregistered) == 1
    assert storage() is None  # unregistered, then freed
    cache.release(key2)
    releaser.stop()


@pytest.mark.asyncio
async def test_cleared_registrations_keep_their_memory_until_the_caller_unregisters() -> None:
    """At close the cache is cleared and the backend unregisters what it held, later,
    in a worker thread: memory freed at the clear could be allocated to a new tensor
    meanwhile and refused as an overlap by the engine (shared by the process's
    backends). What ``clear`` returns keeps each registration's memory alive."""
    import weakref

    releaser = Releaser("test-clear")
    cache = RegistrationCache(
        lambda addr, n, device: addr, lambda handle: None, releaser, inline_bytes=1 << 20
    )
    t = torch.ones(1 << 10, dtype=torch.uint8)
    storage = weakref.ref(t.untyped_storage())
    key, handle = await cache.acquire(t)
    cache.release(key)
    del t
    retired = cache.clear()
    assert len(cache) == 0 and [h for h, _ in retired] == [handle]
    assert storage() is not None  # not unregistered yet: still alive
    del retired  # the caller unregistered it
    assert storage() is None
    releaser.stop()


def test_host_memory_and_ranges() -> None:
    m = HostMemory(1 << 16)
    m.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert m.addr == m.tensor.data_ptr() and m.size == 1 << 16
    m.discard()
    assert int(m.tensor[:4].sum()) == 0  # pages given back, mapping kept
    m.close()
    check_range(0, 5, 5, "x")
    with pytest.raises(BackendError, match="outside a 5-byte"):
        check_range(2, 6, 5, "x")
    with pytest.raises(BackendError, match="outside"):
        check_range(3, 2, 5, "x")
    time.sleep(0)


def test_poll_until_never_sleeps_past_a_32nd_of_the_wait_so_far(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The promise that bounds a transfer's overshoot to ~3 %: each sleep is at most
    1/32 of the time already waited (10 µs at least, 500 µs at most). A fake clock
    advanced only by the sleeps, so nothing here depends on the machine's speed."""
    from omniwire.backends import completion as support

    now = [0.0]
    sleeps: list[tuple[float, float]] = []  # (waited so far, sleep)

    def sleep(s: float) -> None:
        sleeps.append((now[0], s))
        now[0] += s

    monkeypatch.setattr(support.time, "sleep", sleep)
    monkeypatch.setattr(support.time, "monotonic", lambda: now[0])
    poll_until(lambda: now[0] >= 0.05, timeout=5, what="x")
    assert sleeps and now[0] >= 0.05
    for waited, s in sleeps:
        assert s <= max(support.POLL_MIN_S, min(support.POLL_MAX_S, waited / 32)) + 1e-12, (
            waited,
            s,
        )
    assert now[0] - 0.05 <= max(support.POLL_MIN_S, 0.05 / 32) * 1.05  # the overshoot


# -- Completions: transfers started on the loop, their ends signalled to it -------------


def _completion_threads(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name == name)


@pytest.mark.asyncio
async def test_completions_wake_each_waiter_when_its_transfer_ends() -> None:
    """Many waits share one thread (no worker thread per transfer), each ends as soon
    as its own ``done()`` turns true, in whatever order."""
    completions = Completions("test-completions-a")
    flags = [threading.Event() for _ in range(8)]
    ended: list[int] = []

    async def wait(i: int) -> None:
        await completions.wait(flags[i].is_set, timeout=10, what=f"t{i}")
        ended.append(i)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(wait, i)
            await anyio.sleep(0.05)
            assert ended == [] and len(completions) == 8
            assert _completion_threads("test-completions-a") == 1
            for i in reversed(range(8)):
                started = time.monotonic()
                flags[i].set()
                while i not in ended:
                    await anyio.sleep(0.001)
                assert time.monotonic() - started < 0.5
        assert ended == list(reversed(range(8))) and completions.waited == 8
    finally:
        await anyio.to_thread.run_sync(completions.stop)
    assert _completion_threads("test-completions-a") == 0


@pytest.mark.asyncio
async def test_completions_raise_the_transfers_failure_timeout_or_abandonment() -> None:
    completions = Completions("test-completions-b")

    def fails() -> bool:
        raise BackendError("engine: read failed (code -1)")

    gone = threading.Event()
    try:
        with pytest.raises(BackendError, match="code -1"):
            await completions.wait(fails, timeout=10, what="x")
        with pytest.raises(TransferTimeoutError, match=r"slow did not finish within 0\.05 s"):
            await completions.wait(lambda: False, timeout=0.05, what="slow")
        gone.set()
        with pytest.raises(TransferAbandonedError, match="lost was cancelled"):
            await completions.wait(lambda: False, timeout=10, what="lost", cancelled=gone.is_set)
    finally:
        await anyio.to_thread.run_sync(completions.stop)
    with pytest.raises(BackendClosedError):
        await completions.wait(lambda: True, timeout=1, what="after stop")


@pytest.mark.asyncio
async def test_a_transfer_past_its_stall_bound_frees_its_waiter_and_is_watched_to_its_end() -> None:
    """A waiter that can do without the transfer (a landing write: the object can be read
    instead) is released at ``stall_after`` with TransferStalledError; the transfer is
    still watched, and ``ended`` says how it ended: True once the engine says it ended
    (nothing of it lands later), False if it timed out or was given up (it may)."""
    completions = Completions("test-completions-stall")
    finish = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(
            TransferStalledError, match=r"w1 did not finish within 0\.1 s \(it still runs\)"
        ) as one:
            await completions.wait(finish.is_set, timeout=30, what="w1", stall_after=0.1)
        assert 0.1 <= time.monotonic() - started < 5
        assert isinstance(one.value, TransferTimeoutError)  # what callers already handle
        assert not one.value.ended.done() and len(completions) == 1  # still watched
        finish.set()
        with anyio.fail_after(5):
            assert await one.value.ended is True
        assert len(completions) == 0
        # started through a worker thread, as a cold write is
        threads = Threads("test-stall-threads", 1)
        try:
            with pytest.raises(TransferStalledError) as two:
                await completions.start_and_wait(
                    threads, _Stuck, timeout=0.5, what="w2", stall_after=0.1
                )
            with anyio.fail_after(5):
                assert await two.value.ended is False  # timed out: it may still land
        finally:
            await anyio.to_thread.run_sync(threads.stop)
        # without stall_after, nothing changes: the wait ends with the transfer
        assert await completions.wait(lambda: True, timeout=1, what="w3") is None
    finally:
        await anyio.to_thread.run_sync(completions.stop)


class _Stuck:
    def done(self) -> bool:
        return False


@pytest.mark.asyncio
async def test_a_completion_wait_outlives_its_cancellation_like_a_worker_thread() -> None:
    """Memory under a transfer must not be reused before the engine is done with it:
    a cancelled waiter still waits for the end, then sees the cancellation."""
    completions = Completions("test-completions-c")
    done = threading.Event()
    seen_at_cancel: list[bool] = []
    try:
        scope = anyio.CancelScope()

        async def cancel_soon() -> None:
            await anyio.sleep(0.05)
            scope.cancel()
            await anyio.sleep(0.1)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_soon)
            with scope:
                try:
                    await completions.wait(done.is_set, timeout=10, what="x")
                except anyio.get_cancelled_exc_class():
                    seen_at_cancel.append(done.is_set())
                    raise
        assert scope.cancel_called and scope.cancelled_caught and seen_at_cancel == [True]
        assert len(completions) == 0
    finally:
        await anyio.to_thread.run_sync(completions.stop)


class _Flagged:
    """A transfer that ends when its event is set; where it was started."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.started_in = threading.current_thread().name

    def done(self) -> bool:
        return self.ended.is_set()


@pytest.mark.asyncio
async def test_start_and_wait_starts_in_a_worker_thread_and_wakes_the_loop_once() -> None:
    """The blocking start runs in one of the backend's threads, which hands the
    transfer on to the completion thread itself: the loop is woken once, at the end
    (a wake-up in between would be a callback scheduled from another thread)."""
    threads = Threads("test-start-wait-t")
    completions = Completions("test-start-wait-c")
    loop = asyncio.get_running_loop()
    wakeups: list[str] = []
    schedule = loop.call_soon_threadsafe

    def counted(callback, *args):  # type: ignore[no-untyped-def]
        wakeups.append(getattr(callback, "__name__", repr(callback)))
        return schedule(callback, *args)

    transfer: list[_Flagged] = []

    def start() -> _Flagged:
        transfer.append(_Flagged())
        return transfer[0]

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        async with anyio.create_task_group() as tg:
            got: list[_Flagged] = []

            async def run() -> None:
                got.append(await completions.start_and_wait(threads, start, timeout=10, what="x"))

            tg.start_soon(run)
            with anyio.fail_after(5):
                while len(completions) == 0:
                    await anyio.sleep(0.005)
            assert wakeups == [] and not got  # started and watched: the loop not woken
            transfer[0].ended.set()
        assert got == transfer and transfer[0].started_in.startswith("test-start-wait-t")
        assert len(wakeups) == 1 and completions.waited == 1
    finally:
        del loop.call_soon_threadsafe
        await anyio.to_thread.run_sync(completions.stop)
        await anyio.to_thread.run_sync(threads.stop)


@pytest.mark.asyncio
async def test_start_and_wait_raises_what_the_start_or_the_transfer_raised() -> None:
    threads = Threads("test-start-wait-e")
    completions = Completions("test-start-wait-f")

    def refused() -> _Flagged:
        raise BackendError("engine: submit refused (code -1)")

    class Failing(_Flagged):
        def done(self) -> bool:
            raise BackendError("engine: read failed (code -2)")

    try:
        with pytest.raises(BackendError, match="code -1"):
            await completions.start_and_wait(threads, refused, timeout=10, what="x")
        with pytest.raises(BackendError, match="code -2"):
            await completions.start_and_wait(threads, Failing, timeout=10, what="x")
        with pytest.raises(TransferTimeoutError, match="slow did not finish"):
            await completions.start_and_wait(threads, _Flagged, timeout=0.05, what="slow")
        assert len(completions) == 0
    finally:
        await anyio.to_thread.run_sync(completions.stop)
    with pytest.raises(BackendClosedError):
        await completions.start_and_wait(threads, _Flagged, timeout=1, what="after stop")
    await anyio.to_thread.run_sync(threads.stop)


@pytest.mark.asyncio
async def test_start_and_wait_still_waits_for_a_transfer_started_as_completions_stop() -> None:
    """Stopped between the start and the watch: the started transfer is still waited
    for (in the worker thread), never left running unseen."""
    threads = Threads("test-start-wait-s")
    completions = Completions("test-start-wait-d")
    made: list[_Flagged] = []

    def start() -> _Flagged:
        completions.stop()  # as the backend closes meanwhile
        made.append(_Flagged())
        return made[0]

    async def end_soon() -> None:
        with anyio.fail_after(5):
            while not made:
                await anyio.sleep(0.005)
        await anyio.sleep(0.05)
        made[0].ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(end_soon)
        got = await completions.start_and_wait(threads, start, timeout=10, what="x")
    assert got is made[0] and made[0].ended.is_set()
    await anyio.to_thread.run_sync(threads.stop)


def test_a_posted_call_that_raises_is_logged_and_the_thread_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    threads = Threads("test-posted")
    ran = threading.Event()

    def bad() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="omniwire.backends"):
        threads.post(bad)
        threads.post(ran.set)
        assert ran.wait(5)
    threads.stop()
    assert "a posted call raised" in caplog.text and "boom" in caplog.text
    with pytest.raises(BackendClosedError):
        threads.post(ran.set)


class _Timed:
    """A transfer that ends ``seconds`` after it starts; counts the checks of it."""

    def __init__(self, seconds: float) -> None:
        self.ends = time.monotonic() + seconds
        self.checks = 0
        self.seen: float | None = None

    def done(self) -> bool:
        self.checks += 1
        now = time.monotonic()
        if now >= self.ends and self.seen is None:
            self.seen = now
        return now >= self.ends


@pytest.mark.asyncio
async def test_completions_check_a_transfer_like_the_last_ones_only_near_its_end() -> None:
    """Each check costs the cores the engine needs (a NIXL check runs UCX's progress):
    once transfers of a size are known to take ~40 ms, the next one is not checked
    every 10-500 µs from its start (about 140 checks) but from close to its
    expected end (checked every 500 µs at most), and its end is still seen promptly."""
    completions = Completions("test-completions-d")
    try:
        for _ in range(3):  # teach it how long 4 MiB take
            t = _Timed(0.04)
            await completions.wait(t.done, timeout=10, what="learn", nbytes=4 << 20)
        t = _Timed(0.04)
        await completions.wait(t.done, timeout=10, what="x", nbytes=4 << 20)
        assert t.checks <= 30, t.checks
        assert t.seen is not None and t.seen - t.ends < 0.01
        # a bigger one after them: expected from the bytes per second seen (before:
        # about 220 checks)
        t = _Timed(0.08)
        await completions.wait(t.done, timeout=10, what="y", nbytes=8 << 20)
        assert t.checks <= 55, t.checks
        # a transfer faster than expected still ends within the check pause cap
        t = _Timed(0.002)
        await completions.wait(t.done, timeout=10, what="z", nbytes=8 << 20)
        assert time.monotonic() - t.ends < 0.07
        # ... and when they keep being faster, the expectation falls to them
        late = []
        for _ in range(8):
            t = _Timed(0.002)
            await completions.wait(t.done, timeout=10, what="z", nbytes=8 << 20)
            late.append(time.monotonic() - t.ends)
        assert late[-1] < 0.005, late
    finally:
        await anyio.to_thread.run_sync(completions.stop)


def test_a_transfer_that_stalled_does_not_delay_the_first_check_of_the_next() -> None:
    """Nothing is expected from fewer than three transfers, so one that took seconds
    (a link down, then up) does not make the next wait seconds for its first check;
    small transfers are expected to take what the last ones of their size took, up to
    a fixed-cost cap; large ones what the best bandwidth seen allows."""
    pace = Pace()
    assert pace.expect(1024) == 0.0
    pace.learn(1024, 3.0)  # stalled
    pace.learn(1024, 0.002)
    assert pace.expect(1024) == 0.0
    pace.learn(1024, 0.002)
    assert pace.expect(1024) == pytest.approx(0.002)  # the stall is not the least
    slow_small = Pace()
    for _ in range(3):
        slow_small.learn(64 << 20, 0.064)  # 1 GB/s
        slow_small.learn(1024, 1.0)  # small ones that stalled: capped
    assert slow_small.expect(1024) == Pace.FIXED_MAX_S
    assert slow_small.expect(128 << 20) == pytest.approx(0.128)


@pytest.mark.asyncio
async def test_a_long_expected_transfer_does_not_delay_another_or_its_abandonment() -> None:
    """While one transfer is not checked (its end is far), a new one is checked at
    once, and the first one's ``cancelled()`` is still looked at."""
    completions = Completions("test-completions-e")
    try:
        for _ in range(2):
            t = _Timed(0.3)
            await completions.wait(t.done, timeout=10, what="learn", nbytes=64 << 20)
        gone = threading.Event()
        long = _Timed(5.0)
        async with anyio.create_task_group() as tg:

            async def wait_long() -> None:
                with pytest.raises(TransferAbandonedError):
                    await completions.wait(
                        long.done, timeout=10, what="long", nbytes=64 << 20, cancelled=gone.is_set
                    )

            tg.start_soon(wait_long)
            await anyio.sleep(0.01)
            short = _Timed(0.003)
            started = time.monotonic()
            await completions.wait(short.done, timeout=10, what="short", nbytes=1024)
            assert time.monotonic() - started < 0.1
            gone.set()
            cancelled_at = time.monotonic()
            with anyio.fail_after(2):
                while len(completions):
                    await anyio.sleep(0.002)
            assert time.monotonic() - cancelled_at < 0.1
    finally:
        await anyio.to_thread.run_sync(completions.stop)


# -- RegisteredRecvPool: receive buffers registered once per block ------------------------


class Registrar:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.calls = 0

    def register(self, addr: int, nbytes: int) -> int:
        self.calls += 1
        self.live[addr] = nbytes
        return addr

    def unregister(self, addr: int) -> None:
        del self.live[addr]


@pytest.mark.asyncio
async def test_a_registered_receive_pool_registers_each_block_once() -> None:
    engine, releaser = Registrar(), Releaser("test-recv-pool")
    pool = RegisteredRecvPool(
        engine.register, engine.unregister, releaser, max_idle_bytes=3 << 20, min_nbytes=4096
    )
    try:
        assert await pool.take_registered(100) is None  # small: the caller's own memory
        addrs = set()
        for i in range(5):
            t = await pool.take_registered((1 << 20) - i)  # one size class
            assert t is not None and t.numel() == (1 << 20) - i and pool.holds(t)
            assert not pool.holds(t[1:]) and not pool.holds(torch.empty(1 << 20, dtype=torch.uint8))
            t.fill_(i)
            addrs.add(t.data_ptr())
            del t  # the block comes back, still registered
        assert len(addrs) == 1 and engine.calls == 1 and pool.registrations == 1
        # blocks beyond the idle limit are unregistered when they come back
        held = [await pool.take_registered(1 << 20) for _ in range(5)]
        assert engine.calls == 5 and len(engine.live) == 5
        del held
        assert releaser.wait_idle()
        assert len(engine.live) == 3 and pool.idle_bytes == 3 << 20
        in_use = await pool.take_registered(1 << 20)
        assert in_use is not None
        handles = pool.close_registered()
        assert sorted(handles) == sorted(engine.live)  # idle and in use alike
        for h in handles:
            engine.unregister(h)
        pool.clear()
        assert await pool.take_registered(1 << 20) is None  # closed
        del in_use  # comes back after close: dropped, not pooled nor unregistered again
        assert pool.idle_bytes == 0 and engine.live == {}
    finally:
        releaser.stop()
