"""What a bench run measured, and its JSON form (``--json``; ``SCHEMA`` below).

Every scenario figure is an omniwire figure beside its baseline from the same
run, with ``ratio = omniwire / baseline`` and the targets it is held to. Values
are in SI base units named by ``unit``: ``s`` (seconds), ``msgs/s``, ``B/s``,
``B`` (bytes), ``core`` (CPU seconds per wall second: 1.0 is one core busy).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "CONTROL_BYTES",
    "SCHEMA",
    "Figure",
    "Results",
    "Row",
    "Scenario",
    "Table",
    "Target",
    "percentile",
    "ratio",
]

#: Version of the ``--json`` layout (1 was the table alone, at the top level).
SCHEMA = 2

Unit = Literal["s", "msgs/s", "B/s", "B", "core"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of ``values``, linearly interpolated; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is not positive."""
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b <= 0:
        return None
    return a / b


@dataclass
class Target:
    """``ratio`` (or, for ``of="value"``, the figure itself) against ``limit``."""

    limit: float
    better: Literal["lower", "higher"]
    stretch: bool = False
    #: what is compared: the figure's ratio to its baseline, or its own value
    of: Literal["ratio", "value"] = "ratio"
    met: bool | None = None
    #: for people: ``omniwire/baseline ≤ 2``, ``value ≤ 0.01 core``
    text: str = ""

    def judge(self, figure: Figure) -> None:
        sign = "≤" if self.better == "lower" else "≥"
        what = "omniwire/baseline" if self.of == "ratio" else "omniwire"
        unit = "" if self.of == "ratio" else f" {figure.unit}"
        self.text = f"{what} {sign} {self.limit:g}{unit}{' (stretch goal)' if self.stretch else ''}"
        value = figure.ratio if self.of == "ratio" else figure.omniwire
        if value is None or math.isnan(value):
            self.met = None
        else:
            self.met = value <= self.limit if self.better == "lower" else value >= self.limit


@dataclass
class Figure:
    """One quantity, omniwire beside its baseline (both from the same rounds)."""

    name: str
    unit: Unit
    omniwire: float
    baseline: float | None
    #: omniwire / baseline
    ratio: float | None = None
    better: Literal["lower", "higher"] = "lower"
    #: the figure per measured round (rounds alternate omniwire and baseline)
    omniwire_per_round: list[float] = field(default_factory=list)
    baseline_per_round: list[float] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.ratio is None:
            self.ratio = ratio(self.omniwire, self.baseline)
        for t in self.targets:
            t.judge(self)


@dataclass
class Scenario:
    """One scenario: what ran, against which baseline, and its figures."""

    name: str
    title: str
    baseline: str
    how: str
    figures: list[Figure] = field(default_factory=list)
    #: counts, sizes, the backend that carried the data, ...
    params: dict[str, Any] = field(default_factory=dict)

    def figure(self, name: str) -> Figure | None:
        return next((f for f in self.figures if f.name == name), None)


@dataclass
class Row:
    """One line of the per-backend table (units in the field names, as in schema 1)."""

    backend: str
    mode: str
    size: int
    rtt_p50_us: float
    rtt_p99_us: float
    oneway_gbps: float
    stream_gbps: float
    msgs_per_s: float
    memcpy_gbps: float
    #: the bare engine's GB/s at this size, its transfers interleaved with this row's
    raw_gbps: float | None = None
    #: which bare transfer ``raw_gbps`` is, for the one-sided engines (mooncake, nixl):
    #: ``"read"``, or ``"write"`` for a row whose transfers landed (written into the peer)
    raw_op: str | None = None
    #: one-way GB/s over ``raw_gbps`` (engines only)
    vs_raw: float | None = None
    #: the most ``vs_raw`` can be with one control round trip per transfer: the bare
    #: transfer's seconds over those plus ``Table.control_rtt_us`` (None for a row whose
    #: transfers landed: no round trip in them)
    bound: float | None = None
    #: raw zmq.asyncio round trip of ``size`` bytes (same run), and rtt_p50 over it
    zmq_rtt_us: float | None = None
    vs_zmq: float | None = None
    #: one-way GB/s over memcpy GB/s
    vs_memcpy: float | None = None
    #: the share of the one-way transfers that landed (written into the peer's memory
    #: before their announcement: their receipts complete without the ACK)
    landed: float | None = None
    #: one-way GB/s counted up to the ACK (the receipt's settled outcome)
    acked_gbps: float | None = None

    def __post_init__(self) -> None:
        self.vs_memcpy = ratio(self.oneway_gbps, self.memcpy_gbps)


#: The message of the control round trip that bounds a one-way transfer (about a
#: DataReady's encoded size; its ACK is smaller).
CONTROL_BYTES = 512


@dataclass
class Table:
    memcpy_gbps: dict[int, float] = field(default_factory=dict)
    zmq_rtt_us: dict[int, float] = field(default_factory=dict)
    #: raw zmq.asyncio round trip of a control-sized message (with the bare engines)
    control_rtt_us: float | None = None
    #: where the raw zmq.asyncio peer served (``ipc://…`` here, ``tcp://…`` another host)
    zmq_peer: str = ""
    raw_engine_gbps: dict[str, dict[int, float]] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    #: size -> (one-way seconds alone, one-way seconds behind a held 1 KiB object)
    obstructed_s: dict[int, tuple[float, float]] = field(default_factory=dict)

    def row(self, backend: str, mode: str, size: int) -> Row | None:
        return next(
            (r for r in self.rows if (r.backend, r.mode, r.size) == (backend, mode, size)), None
        )

    def finish(self) -> None:
        """Fill the per-engine means of the interleaved bare transfers."""
        figures: dict[str, dict[int, list[float]]] = {}
        for r in self.rows:
            if r.raw_gbps is not None:
                figures.setdefault(r.backend, {}).setdefault(r.size, []).append(r.raw_gbps)
        self.raw_engine_gbps = {
            name: {s: statistics.mean(g) for s, g in sorted(per.items())}
            for name, per in figures.items()
        }


@dataclass
class Results:
    command: list[str] = field(default_factory=list)
    started: str = ""
    host: dict[str, Any] = field(default_factory=dict)
    quick: bool = False
    #: requested: --busy given; ran: the burner ran throughout; cpu_share: the
    #: fraction of a core it got (its CPU seconds over the run's wall time)
    busy: dict[str, Any] = field(default_factory=lambda: {"requested": False, "ran": False})
    scenarios: dict[str, Scenario] = field(default_factory=dict)
    table: Table | None = None
    #: what failed ({"where": ..., "error": ...}); the run went on without it
    errors: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def fail(self, where: str, exc: BaseException) -> None:
        self.errors.append({"where": where, "error": f"{type(exc).__name__}: {exc}"})

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (JSON keys are strings: sizes become ``"1024"``)."""
        table = None
        if self.table is not None:
            t = self.table
            table = {
                "memcpy_gbps": t.memcpy_gbps,
                "zmq_rtt_us": t.zmq_rtt_us,
                "control_rtt_us": t.control_rtt_us,
                "zmq_peer": t.zmq_peer,
                "raw_engine_gbps": t.raw_engine_gbps,
                "rows": [asdict(r) for r in t.rows],
                "obstructed_s": {
                    s: {"alone": a, "behind_1KiB": b, "ratio": b / a}
                    for s, (a, b) in t.obstructed_s.items()
                },
            }
        return {
            "schema": SCHEMA,
            "command": self.command,
            "started": self.started,
            "wall_s": self.wall_s,
            "host": self.host,
            "quick": self.quick,
            "busy": self.busy,
            "scenarios": {
                name: {
                    "title": s.title,
                    "baseline": s.baseline,
                    "how": s.how,
                    "params": s.params,
                    "figures": {f.name: _figure_json(f) for f in s.figures},
                }
                for name, s in self.scenarios.items()
            },
            "table": table,
            "errors": self.errors,
            "notes": self.notes,
        }


def _figure_json(f: Figure) -> dict[str, Any]:
    out = asdict(f)
    del out["name"]
    return out
