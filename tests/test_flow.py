"""Flow control over time (spec §7.6): a consumer that takes anything gives its window
back within a bounded time, and a window deadline fails a send only when nothing
came back. Each test was written against the failure it names before the fix."""

from __future__ import annotations

import anyio
import pytest
import torch

from omniwire.endpoint import Endpoint
from omniwire.errors import AckTimeoutError
from omniwire.flow import Credits, Window
from omniwire.testing import PeerProcess
from omniwire.testing.conformance import ipc_address

from test_endpoint import pair

pytestmark = pytest.mark.asyncio


async def test_a_slow_consumer_that_keeps_taking_never_fails_the_sender() -> None:
    """Was: the receiver gave its window back only a quarter at a time, so one that
    took one 1 KiB chunk a second never reopened a 4 MiB window within ``ack_timeout``
    (30 s) and the send failed with "its application took nothing" after it took 30.
    Here: a 64 KiB window (quarter 16 KiB), a 1.5 s deadline, a consumer taking four
    chunks a second for 4 s (16 chunks: about one quarter, so the old receiver would
    reopen at most once, after the sender failed)."""
    chunk = torch.ones(256)  # 1 KiB: inline
    async with pair(
        receive_window=64 << 10, sender={"routes": {"b": "inline"}, "ack_timeout": 1.5}
    ) as (a, b):
        sent = 0
        failure: list[BaseException] = []

        async def produce() -> None:
            nonlocal sent
            try:
                for _ in range(200):
                    await a.stream("b", chunk, request_id="slow")
                    sent += 1
            except AckTimeoutError as exc:
                failure.append(exc)

        taken = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            with anyio.fail_after(20):
                while b.queued() == 0 or a.counters["window_waits"] == 0:
                    await anyio.sleep(0.05)
            for _ in range(16):  # 4 s, more than twice the deadline
                await anyio.sleep(0.25)
                d = await b.receive(5)
                assert d.chunk_id == taken
                taken += 1
            tg.cancel_scope.cancel()
        assert failure == [], failure
        assert sent > 60  # the window (about 45 chunks) reopened as the consumer took


async def test_a_consumer_that_takes_nothing_fails_the_send_with_what_it_took_and_when() -> None:
    """The deadline still holds for a consumer that took nothing since the wait
    began; its message says how much came back before, and when."""
    chunk = torch.ones(256)
    async with pair(
        receive_window=16 << 10, sender={"routes": {"b": "inline"}, "ack_timeout": 1.0}
    ) as (a, b):
        with anyio.fail_after(20), pytest.raises(AckTimeoutError) as caught:
            for i in range(200):
                await a.stream("b", chunk, request_id="stuck")
                if i == 3:  # some taken, then nothing more
                    for _ in range(2):
                        await b.receive(5)
                    await anyio.sleep(0.8)  # given back at a housekeeping tick
        text = str(caught.value)
        assert "reopened no flow-control window within 1 s" in text
        assert "took nothing of the" in text
        assert "it gave back" in text and "s ago" in text, text


async def test_a_window_waiter_waits_while_the_window_reopens_and_not_longer() -> None:
    window = Window(1000)
    assert window.try_acquire(1000)

    async def trickle() -> None:
        for _ in range(6):
            await anyio.sleep(0.1)
            window.reopen(100)  # less than the waiter needs each time

    async with anyio.create_task_group() as tg:
        tg.start_soon(trickle)
        with anyio.fail_after(5):
            assert await window.acquire(500, patience=0.3)  # waits 0.5 s in all
    assert window.returned == 600 and window.available == 100
    with anyio.fail_after(5):
        assert not await window.acquire(500, patience=0.2)  # nothing comes back
    assert window.waiting == 0 and window.available == 100


async def test_a_credit_waiter_waits_while_credits_come_back_and_not_longer() -> None:
    credits = Credits(2, 1 << 20)
    assert credits.try_acquire(10) and credits.try_acquire(10)

    async def acks() -> None:
        await anyio.sleep(0.15)
        credits.release(10)

    async with anyio.create_task_group() as tg:
        tg.start_soon(acks)
        with anyio.fail_after(5):
            assert await credits.acquire(10, patience=0.3)
    with anyio.fail_after(5):
        assert not await credits.acquire(10, patience=0.1)
    assert credits.waiting == 0 and credits.count == 2


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_a_slow_consumer_in_another_process_never_fails_the_sender() -> None:
    """Two processes, as reported: the receiver's application takes one 1 KiB chunk
    every 0.25 s behind its full 4 MiB window; the sender's deadline is 1.5 s. Was:
    the window came back a quarter (1 MiB) at a time — never, at that pace — and
    the send failed with "its application took nothing". Now the sender streams on
    for 5 s (more than three deadlines), slowly."""
    peer = PeerProcess("slow", ipc_address("slow"), "--mode", "sink", "--delay", "0.25")
    try:
        async with Endpoint(
            "src", address=ipc_address("src"), peers={"slow": peer.address}, ack_timeout=1.5
        ) as ep:
            await ep.wait_peer("slow", 30)
            chunk = torch.ones(256)  # 1 KiB: inline
            sent = 0
            with anyio.move_on_after(5):
                for _ in range(100_000):
                    await ep.stream("slow", chunk, request_id="slow")  # AckTimeoutError?
                    sent += 1
            assert ep.counters["window_waits"] >= 1
            assert sent > (4 << 20) // (2 << 10)  # the window filled, and it went on
    finally:
        if peer.proc.poll() is None:
            peer.kill()
