"""Large copies split over worker threads (``backends.base.in_parts``)."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from omniwire.backends import base
from omniwire.errors import BackendError

MiB = 1 << 20


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "COPY_THREADS", 2)


@pytest.mark.asyncio
async def test_a_large_host_copy_is_split_into_page_aligned_parts_in_threads(
    two_threads: None,
) -> None:
    calls: list[tuple[int, int, int]] = []
    loop_thread = threading.get_ident()

    def copy(a: int, b: int) -> None:
        calls.append((a, b, threading.get_ident()))

    await base.in_parts(copy, 4096, 4096 + 20 * MiB + 5)
    spans = sorted((a, b) for a, b, _ in calls)
    assert len(spans) == 2
    assert spans[0][0] == 4096 and spans[-1][1] == 4096 + 20 * MiB + 5
    assert spans[0][1] == spans[1][0]  # contiguous, no gap, no overlap
    assert (spans[0][1] - spans[0][0]) % 4096 == 0
    assert all(t != loop_thread for *_, t in calls)


@pytest.mark.asyncio
async def test_a_copy_below_two_parts_runs_in_one_thread(two_threads: None) -> None:
    calls: list[tuple[int, int]] = []
    await base.in_parts(lambda a, b: calls.append((a, b)), 0, 12 * MiB)
    assert calls == [(0, 12 * MiB)]


@pytest.mark.asyncio
async def test_copy_range_moves_every_byte_when_split(two_threads: None) -> None:
    src = (torch.arange(40 * MiB, dtype=torch.int64) % 251).to(torch.uint8)
    dest = torch.zeros(40 * MiB, dtype=torch.uint8)
    await base.copy_range(dest, src, 3, 40 * MiB - 7)
    assert torch.equal(dest[3 : 40 * MiB - 7], src[3 : 40 * MiB - 7])
    assert dest[:3].sum() == 0 and dest[40 * MiB - 7 :].sum() == 0


@pytest.mark.asyncio
async def test_a_failing_part_raises_its_own_error_after_every_part_ended(
    two_threads: None,
) -> None:
    ended: list[int] = []

    def copy(a: int, b: int) -> None:
        if a == 0:
            raise BackendError("truncated under the reader")
        ended.append(a)

    with pytest.raises(BackendError, match="truncated"):  # not an ExceptionGroup
        await base.in_parts(copy, 0, 32 * MiB)
    assert len(ended) == 1  # the other part ran to its end before the error was raised


@pytest.mark.asyncio
async def test_a_cancelled_split_copy_returns_only_when_its_threads_are_done(
    two_threads: None,
) -> None:
    release = threading.Event()
    done: list[int] = []

    def copy(a: int, b: int) -> None:
        release.wait(10)
        done.append(a)

    with anyio.move_on_after(0.05):
        async with anyio.create_task_group() as tg:
            tg.start_soon(base.in_parts, copy, 0, 32 * MiB)
            await anyio.sleep(0.01)
            threading.Timer(0.2, release.set).start()
            await anyio.sleep(5)
    assert len(done) == 2  # no thread still writes after the caller moved on


def test_the_thread_count_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIWIRE_COPY_THREADS", "3")
    assert base._copy_threads() == 3
    monkeypatch.setenv("OMNIWIRE_COPY_THREADS", "0")
    assert base._copy_threads() == 1
    monkeypatch.setenv("OMNIWIRE_COPY_THREADS", "many")
    with pytest.raises(ValueError, match="OMNIWIRE_COPY_THREADS"):
        base._copy_threads()
    monkeypatch.delenv("OMNIWIRE_COPY_THREADS")
    assert 1 <= base._copy_threads() <= 4
