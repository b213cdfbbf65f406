"""Rate limits for hostile input: a token bucket and a log that counts what it holds back."""

from __future__ import annotations

import logging
import threading

import pytest

from omniwire._ratelimit import RateLimitedLog, TokenBucket


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def caplog_warnings(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="omniwire.test.ratelimit")
    return caplog


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "omniwire.test.ratelimit"]


# -- token bucket ----------------------------------------------------------------------


def test_bucket_allows_a_burst_then_the_rate(clock: FakeClock) -> None:
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    clock.now += 0.25  # half a token
    assert not bucket.take()
    clock.now += 0.25
    assert bucket.take() and not bucket.take()
    clock.now += 3600  # refills up to the burst, no further
    assert bucket.available() == 3.0
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]


def test_bucket_with_rate_zero_never_refills(clock: FakeClock) -> None:
    bucket = TokenBucket(rate=0, burst=1, clock=clock)
    assert bucket.take()
    clock.now += 1e6
    assert not bucket.take()


@pytest.mark.parametrize(("rate", "burst"), [(-1.0, 1), (1.0, 0)])
def test_bucket_refuses_impossible_settings(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="TokenBucket"):
        TokenBucket(rate=rate, burst=burst)


# -- rate-limited log --------------------------------------------------------------------


def test_a_burst_per_key_then_a_count_on_the_next_record(
    clock: FakeClock, caplog_warnings: pytest.LogCaptureFixture
) -> None:
    rl = RateLimitedLog("omniwire.test.ratelimit", burst=2, interval=10, clock=clock)
    results = [rl.warning("bad_frame", "bad frame %d from %s", i, "x") for i in range(5)]
    assert results == [True, True, False, False, False]
    assert rl.warning("bad_hello", "another cause")  # keys are independent
    clock.now += 4
    assert not rl.warning("bad_frame", "bad frame %d from %s", 5, "x")
    assert _messages(caplog_warnings) == [
        "bad frame 0 from x",
        "bad frame 1 from x",
        "another cause",
    ]
    clock.now += 6  # the interval that began at the first record is over
    assert rl.warning("bad_frame", "bad frame %d from %s", 6, "x")
    assert _messages(caplog_warnings)[-1] == (
        "bad frame 6 from x (4 similar messages suppressed in the last 10 s)"
    )
    assert rl.suppressed_total == 4
    assert rl.warning("bad_frame", "bad frame %d from %s", 7, "x")  # a new burst, no count
    assert _messages(caplog_warnings)[-1] == "bad frame 7 from x"
    assert not rl.warning("bad_frame", "bad frame %d from %s", 8, "x")


def test_flush_reports_a_flood_that_stopped(
    clock: FakeClock, caplog_warnings: pytest.LogCaptureFixture
) -> None:
    rl = RateLimitedLog("omniwire.test.ratelimit", burst=1, interval=30, clock=clock)
    for i in range(4):
        rl.info("k", "frame %d", i)
    rl.info("one", "once")
    rl.info("two", "twice %s", "a")
    rl.info("two", "twice %s", "b")  # held back: one record, no count to add
    clock.now += 29
    assert rl.flush() == 0  # the intervals are not over
    clock.now += 1
    assert rl.flush() == 2
    assert _messages(caplog_warnings)[-2:] == [
        "frame 3 (2 similar messages suppressed in the last 30 s)",
        "twice b",
    ]
    assert rl.flush() == 0  # reported once
    assert rl.info("k", "frame %d", 9)  # and the key starts afresh
    assert _messages(caplog_warnings)[-1] == "frame 9"


def test_records_keep_level_caller_and_literal_percent(
    clock: FakeClock, caplog_warnings: pytest.LogCaptureFixture
) -> None:
    rl = RateLimitedLog(
        logging.getLogger("omniwire.test.ratelimit"), burst=1, interval=1, clock=clock
    )
    assert rl.error("k", "100% full")
    assert not rl.error("k", "100% full")
    clock.now += 1
    assert rl.error("k", "100% full")
    records = [r for r in caplog_warnings.records if r.name == "omniwire.test.ratelimit"]
    assert [r.getMessage() for r in records] == [
        "100% full",
        "100% full (1 similar message suppressed in the last 1 s)",
    ]
    assert all(r.levelno == logging.ERROR for r in records)
    assert all(r.pathname == __file__ for r in records)  # the caller, not _ratelimit.py


def test_a_disabled_level_costs_nothing_and_counts_nothing(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="omniwire.test.ratelimit")
    rl = RateLimitedLog("omniwire.test.ratelimit", burst=1, interval=10, clock=clock)
    assert not any(rl.debug("k", "noise") for _ in range(10))
    assert rl.suppressed_total == 0
    assert rl.warning("k", "signal")  # the debug calls did not use the burst up


def test_keys_are_bounded(clock: FakeClock, caplog_warnings: pytest.LogCaptureFixture) -> None:
    rl = RateLimitedLog("omniwire.test.ratelimit", burst=1, interval=10, max_keys=3, clock=clock)
    for key in range(100):
        assert rl.warning(key, "key %d", key)
    assert len(rl._windows) == 3
    assert not rl.warning(99, "key %d", 99)  # a tracked key keeps its count


def test_many_threads_get_exactly_the_burst(
    clock: FakeClock, caplog_warnings: pytest.LogCaptureFixture
) -> None:
    rl = RateLimitedLog("omniwire.test.ratelimit", burst=10, interval=60, clock=clock)
    emitted: list[bool] = []

    def hammer() -> None:
        mine = [rl.warning("flood", "frame") for _ in range(500)]
        emitted.extend(mine)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(emitted) == 10 and len(emitted) == 2000
    assert rl.suppressed_total == 1990
    assert len(_messages(caplog_warnings)) == 10


@pytest.mark.parametrize(
    "kwargs", [{"burst": 0}, {"interval": 0}, {"max_keys": 0}], ids=["burst", "interval", "keys"]
)
def test_log_refuses_impossible_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RateLimitedLog"):
        RateLimitedLog("x", **kwargs)  # type: ignore[arg-type]
