"""``omniwire bench``: figures for people, the JSON document, ratios to baselines, and a
run that survives a failing row. Tiny counts; no timing assertions."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import shutil
import stat
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from omniwire import OmniwireError
from omniwire.bench import _cli, _units
from omniwire.bench._model import Figure, Target, percentile
from omniwire.bench._procs import ipc_base
from omniwire.endpoint import Endpoint
from omniwire.peer import Tally

TINY = [
    "--rounds",
    "1",
    "--round-trips",
    "5",
    "--chunks",
    "5",
    "--mix",
    "3x4",
    "--mix-rounds",
    "1",
    "--shm-rounds",
    "1",
    "--idle-seconds",
    "0.2",
]


def test_human_units() -> None:
    assert _units.fmt_size(1024) == "1 KiB"
    assert _units.fmt_size(256 << 20) == "256 MiB"
    assert _units.fmt_size(64) == "64 B"
    assert _units.fmt_rate(850e3) == "850 kB/s"
    assert _units.fmt_rate(4.1e6) == "4.10 MB/s"
    assert _units.fmt_rate(7.95e9) == "7.95 GB/s"
    assert _units.fmt_time(612e-6) == "612 µs"
    assert _units.fmt_time(1.25e-3) == "1.25 ms"
    assert _units.fmt_time(0.0) == "0 s"
    assert _units.fmt_count(18400.4) == "18,400 msgs/s"
    assert _units.fmt_ratio(0.19) == "0.19×"
    assert _units.parse_size("64M") == 64 << 20
    assert _units.parse_size("1KiB") == 1024
    with pytest.raises(ValueError, match="not a size"):
        _units.parse_size("big")


def test_figure_ratio_and_targets() -> None:
    slower = Figure("p50", "s", 3e-4, 1e-4, targets=[Target(2.0, "lower"), Target(0.5, "lower")])
    assert slower.ratio == pytest.approx(3.0)
    assert [t.met for t in slower.targets] == [False, False]
    faster = Figure(
        "msgs/s", "msgs/s", 20_000, 10_000, better="higher", targets=[Target(1.0, "higher")]
    )
    assert faster.ratio == pytest.approx(2.0)
    assert faster.targets[0].met is True
    idle = Figure("cpu", "core", 0.001, 0.0, targets=[Target(0.01, "lower", of="value")])
    assert idle.ratio is None  # no ratio to a zero baseline
    assert idle.targets[0].met is True
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert math.isnan(percentile([], 99))


def test_peer_tally_answers_a_group_once_every_stream_ended() -> None:
    tally = Tally()
    assert tally.add("r1", {"t": 100}, 150) is None
    assert tally.add("r2", {"t": 100}, 170) is None
    assert tally.add("r1", {"t": 200, "last": True, "group": "g", "streams": 2}, 260) is None
    done = tally.add("r2", {"t": 300, "last": True, "group": "g", "streams": 2}, 310)
    assert done is not None
    group, answer = done
    assert group == "g"
    assert answer["n"] == 4
    assert sorted(answer["lat_ns"].tolist()) == [10, 50, 60, 70]
    assert not tally.counts and not tally.latencies and not tally.groups


def _figures_check(doc: dict[str, Any]) -> None:
    for name, scenario in doc["scenarios"].items():
        assert scenario["figures"], name
        for fname, f in scenario["figures"].items():
            assert f["unit"] in ("s", "msgs/s", "B/s", "core"), (name, fname)
            assert f["omniwire"] is not None and f["omniwire"] >= 0, (name, fname)
            if f["baseline"]:
                assert f["ratio"] == pytest.approx(f["omniwire"] / f["baseline"]), (name, fname)
            for t in f["targets"]:
                assert t["met"] in (True, False), (name, fname, t)


def _socket_files(top: str) -> set[str]:
    """The ipc socket files under ``top``."""
    found: set[str] = set()
    for where, _dirs, files in os.walk(top):
        for f in files:
            path = os.path.join(where, f)
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.add(path)
    return found


@pytest.fixture
def own_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A temp directory of this test alone, for this process and its children (a short
    path: ipc socket paths are limited to 107 bytes). Other processes' bench runs bind
    their sockets in the shared one; what is found here is this run's."""
    top = tempfile.mkdtemp(prefix="owb-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", top)
    monkeypatch.setenv("TMPDIR", top)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_scenarios_smoke_json_and_plot(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], own_tmp: str
) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert ipc_base("x").removeprefix("ipc://").startswith(own_tmp + os.sep)
    code = _cli.main(
        ["--scenarios", "idle,echo,stream,mix,shm", *TINY, "--json", str(out), "--plot", str(png)]
    )
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["errors"] == []
    assert code == 0
    assert doc["schema"] == 2
    assert doc["busy"] == {"requested": False, "ran": False}
    assert doc["host"]["omp_num_threads"] == "1"
    assert doc["table"] is None
    assert list(doc["scenarios"]) == ["idle", "echo", "stream", "mix", "shm"]
    _figures_check(doc)
    s = doc["scenarios"]
    assert set(s["echo"]["figures"]) >= {"p50", "p99"}
    assert [t["limit"] for t in s["echo"]["figures"]["p50"]["targets"]] == [2.0, 0.5]
    assert len(s["echo"]["figures"]["p50"]["omniwire_per_round"]) == 1
    assert s["stream"]["params"]["messages_per_round"] == 5
    assert s["stream"]["figures"]["msgs/s"]["targets"][0]["limit"] == 1.0
    for name in ("echo", "stream"):  # CPU per message of each process, apart
        split = s[name]["params"]["cpu_per_msg_by_process"]
        assert set(split) == {"omniwire", "raw"}
        assert all(side["a_us"] > 0 and side["b_us"] > 0 for side in split.values())
        assert f"cpu/msg by process ({name};" in text
    assert s["mix"]["params"]["streams"] == 3 and s["mix"]["params"]["chunks_per_stream"] == 4
    assert set(s["mix"]["figures"]) >= {"msgs/s", "latency p99"}
    assert set(s["shm"]["figures"]) == {"copy", "zero-copy"}
    assert s["idle"]["figures"]["cpu"]["unit"] == "core"
    # for people: human units, each figure beside its baseline and ratio, targets judged
    assert "1 KiB echo round trip" in text and "µs" in text and "×" in text
    assert "msgs/s" in text and "GB/s" in text and "≤ 2×:" in text
    assert "0.00 GB/s" not in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _socket_files(own_tmp) == set()  # every process of this run removed what it bound


def test_busy_runs_a_burner_throughout(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    assert _cli.main(["--scenarios", "idle", "--busy", *TINY, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["busy"]["requested"] is True
    assert doc["busy"]["ran"] is True
    assert doc["busy"]["cpu_share"] > 0


def test_a_failing_table_row_is_reported_and_the_run_goes_on(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    send = Endpoint.send

    async def failing_send(self: Endpoint, *args: Any, **kwargs: Any) -> Any:
        if self._core.config.zero_copy:
            raise OmniwireError("injected: this row's engine broke")
        return await send(self, *args, **kwargs)

    monkeypatch.setattr(Endpoint, "send", failing_send)
    out = tmp_path / "bench.json"
    argv = ["--scenarios", "table", "--backends", "shm", "--sizes", "1K,4K", "--iters", "3"]
    code = _cli.main([*argv, "--no-obstructed", "--no-raw", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    doc = json.loads(out.read_text())
    rows = doc["table"]["rows"]
    assert [(r["backend"], r["mode"], r["size"]) for r in rows] == [
        ("shm", "copy", 1024),
        ("shm", "copy", 4096),
    ]
    assert all(r["vs_memcpy"] is not None and r["zmq_rtt_us"] > 0 for r in rows)
    assert [e["where"] for e in doc["errors"]] == ["table shm zero-copy"]
    assert "injected" in doc["errors"][0]["error"]
    assert "FAILED table shm zero-copy" in text


def test_the_forward_scenario_copies_no_byte_on_any_hop(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    code = _cli.main(["--scenarios", "forward", *TINY, "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["errors"] == [] and code == 0
    s = doc["scenarios"]["forward"]
    assert set(s["figures"]) == {"3-stage", "bytes copied per object, all hops"}
    assert set(s["params"]["bytes_copied_per_hop"].values()) == {0.0}
    assert s["params"]["bytes_forwarded_by_reference_per_object"] == s["params"]["bytes"]
    assert s["figures"]["3-stage"]["baseline"] > 0  # the 2-stage chain, same run
