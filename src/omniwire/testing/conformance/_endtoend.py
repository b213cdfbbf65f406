"""Checks through two real endpoints: round trips, order, large objects, release,
credits and abort."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ...backends.base import BackendStats
from ...delivery import Outcome
from ...errors import OmniwireError, RequestAbortedError
from ..strategies import assert_payload_equal, payloads
from ._harness import Configured, Harness
from ._support import to_device

__all__ = ["EndToEndChecks"]


class EndToEndChecks(Configured):
    """Payloads, streams and large objects round trip; nothing stays in flight;
    credits hold a sender back; an abort releases buffers on both sides."""

    # -- end-to-end checks -----------------------------------------------------------

    def test_payload_round_trips(self, harness: Harness) -> None:
        counter = iter(range(10**9))

        @settings(
            max_examples=self.max_examples,
            deadline=None,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.function_scoped_fixture,
            ],
        )
        @given(payloads(max_leaves=8))
        def check(value: Any) -> None:
            if self.device != "cpu":  # an anchor tensor makes every payload the backend's
                value = {"v": value, "anchor": torch.ones(1)}
            value = to_device(value, self.device)
            d = harness.call(harness.round_trip, value, f"rt-{next(counter)}")
            assert d.kind == "payload", d
            assert d.backend == self.backend
            assert_payload_equal(value, d.payload)

        check()

    def test_stream_chunks_arrive_in_order(self, harness: Harness) -> None:
        async def run() -> list[Any]:
            rid = "stream-" + secrets.token_hex(2)
            for i in range(8):
                await harness.ep.stream(
                    harness.peer,
                    {"i": i, "t": torch.full((i + 1,), i, device=self.device)},
                    request_id=rid,
                )
            await harness.ep.end_stream(harness.peer, request_id=rid)
            got = []
            with anyio.fail_after(60):
                while True:
                    d = await harness.ep.receive()
                    got.append(d)
                    if d.kind == "stream_end":
                        return got

        got = harness.call(run)
        chunks = [d for d in got if d.kind == "stream_chunk"]
        assert [d.payload["i"] for d in chunks] == list(range(8))
        assert [d.chunk_id for d in chunks] == list(range(8))
        assert all(d.backend == self.backend for d in chunks)
        assert all(
            torch.equal(d.payload["t"].cpu(), torch.full((i + 1,), i)) for i, d in enumerate(chunks)
        )

    def test_large_object_round_trips(self, harness: Harness) -> None:
        t = torch.randint(-(2**31), 2**31 - 1, (self.large_nbytes // 4,), dtype=torch.int32)
        value = to_device({"big": t, "small": torch.ones(3)}, self.device)
        d = harness.call(harness.round_trip, value, "large")
        assert torch.equal(d.payload["big"].cpu(), t)

    def test_nothing_left_in_flight_after_round_trips(self, harness: Harness) -> None:
        for i in range(5):
            value = {"x": torch.arange(1000 + i, device=self.device)}
            harness.call(harness.round_trip, value, f"flight-{i}")
        mine, theirs = harness.call(harness.settled, self.backend)
        assert isinstance(mine, BackendStats) and mine.idle, mine
        # what it carried is counted (by the base class and the endpoint), live or not
        assert mine.objects_sent >= 5 and mine.objects_received >= 5, mine
        assert mine.bytes_sent >= 5 * 8000 and mine.bytes_received >= 5 * 8000, mine
        assert all(isinstance(v, int) for v in mine.detail.values()), mine.detail
        assert theirs == (0, 0), f"the peer's {self.backend} holds handles: {theirs}"

    # -- flow control and abort, against a slow consumer ------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def slow(cls, backend_class: type[Any]) -> Iterator[Harness]:
        yield from cls._make_harness(mode="sink", max_inflight=2)

    def test_credits_make_the_sender_wait(self, slow: Harness) -> None:
        async def run() -> tuple[int, float]:
            peak = 0
            receipts = []
            started = time.monotonic()
            for i in range(6):
                receipts.append(
                    await slow.ep.send(
                        slow.peer,
                        {"i": torch.ones(256, device=self.device)},
                        request_id=f"credit-{i}",
                    )
                )
                peak = max(peak, slow.ep.in_flight()[slow.peer][0])
            with anyio.fail_after(60):
                for r in receipts:
                    await r.wait()
            return peak, time.monotonic() - started

        peak, elapsed = slow.call(run)
        assert peak <= 2
        assert elapsed >= 0.2  # six sends through two credits to a 0.2 s/delivery consumer

    def test_abort_releases_buffers_on_both_sides(self, slow: Harness) -> None:
        async def run() -> tuple[
            list[BaseException | None], list[Outcome], BackendStats, tuple[int, int]
        ]:
            rid = "abort-" + secrets.token_hex(2)
            receipts = [
                await slow.ep.send(
                    slow.peer, {"t": torch.ones(1 << 16, device=self.device)}, request_id=rid
                )
                for _ in range(3)
            ]
            await slow.ep.abort(rid, "test")
            ends: list[BaseException | None] = []
            for r in receipts:
                try:
                    await r.wait(30)
                    ends.append(None)
                except OmniwireError as exc:
                    ends.append(exc)
            with pytest.raises(OmniwireError):
                await slow.ep.send(
                    slow.peer, {"t": torch.ones(4, device=self.device)}, request_id=rid
                )
            outcomes = [await r.settled(30) for r in receipts]
            mine, theirs = await slow.settled(self.backend)
            return ends, outcomes, mine, theirs

        ends, outcomes, mine, theirs = slow.call(run)
        # a receipt pending at the abort fails with it; one that completed already (an
        # object that landed in the peer's memory) is refused by the peer all the same
        assert any(isinstance(e, RequestAbortedError) for e in ends) or "refused" in outcomes, (
            ends,
            outcomes,
        )
        assert mine.idle, f"{self.backend} still holds handles after abort: {mine}"
        assert theirs == (0, 0), f"the peer's {self.backend} holds handles after abort: {theirs}"
