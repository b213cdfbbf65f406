"""The text report: every figure in human units, beside its baseline, with its ratio
and its targets (met / NOT met)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from ._model import CONTROL_BYTES, Figure, Results, Scenario, Table, Target
from ._units import MiB, fmt_count, fmt_rate, fmt_ratio, fmt_size, fmt_time

__all__ = ["fmt_figure", "report", "target_text"]


def fmt_figure(value: float | None, unit: str) -> str:
    if value is None or math.isnan(value):
        return "—"
    if unit == "s":
        return fmt_time(value)
    if unit == "msgs/s":
        return fmt_count(value)
    if unit == "B":
        return fmt_size(int(value))
    if unit == "B/s":
        return fmt_rate(value)
    if unit == "core":
        return f"{100 * value:.2f} % of a core ({fmt_time(value)}/s)"
    return f"{value:g} {unit}"


def target_text(t: Target, unit: str) -> str:
    sign = "≤" if t.better == "lower" else "≥"
    what = f"{100 * t.limit:g} % of a core" if unit == "core" else f"{t.limit:g}×"
    if t.of == "value" and unit != "core":
        what = fmt_figure(t.limit, unit)
    verdict = {True: "met", False: "NOT met", None: "n/a"}[t.met]
    return f"{sign} {what}{' (stretch)' if t.stretch else ''}: {verdict}"


def _ratio(f: Figure) -> str:
    if f.ratio is not None and 0 < f.ratio < 0.01:
        return "<0.01×"
    return fmt_ratio(f.ratio)


def _scenario_lines(s: Scenario) -> Iterator[tuple[str, str, str, str, str, str]]:
    for i, f in enumerate(s.figures):
        yield (
            s.title if i == 0 else "",
            f.name,
            fmt_figure(f.omniwire, f.unit),
            fmt_figure(f.baseline, f.unit),
            _ratio(f),
            "; ".join(target_text(t, f.unit) for t in f.targets),
        )


def _scenarios(results: Results) -> Iterator[str]:
    if not results.scenarios:
        return
    yield "Scenarios — through the public Endpoint API, A and B in two processes"
    head = ("scenario", "figure", "omniwire", "baseline", "ratio", "target")
    rows = [head] + [line for s in results.scenarios.values() for line in _scenario_lines(s)]
    width = [max(len(r[i]) for r in rows) for i in range(5)]
    for n, r in enumerate(rows):
        cells = [r[i].ljust(width[i]) if i < 2 else r[i].rjust(width[i]) for i in range(5)]
        yield ("  " + "  ".join(cells) + "  " + r[5]).rstrip()
        if n == 0:
            yield "  " + "-" * (sum(width) + 2 * 5 + len("target"))
    yield ""
    yield "  baselines (same run, rounds interleaved with omniwire's; ratio = omniwire ÷ baseline):"
    for s in results.scenarios.values():
        yield f"    {s.title}: {s.baseline}"
    for s in results.scenarios.values():
        note = s.params.get("note")
        if isinstance(note, str):
            yield f"  note ({s.title}): {note}"
    carried = []
    for s in results.scenarios.values():
        by = s.params.get("carried_by")
        if isinstance(by, dict) and by:
            carried.append(f"{s.name}: " + ", ".join(f"{k} {v}" for k, v in by.items()))
    if carried:
        yield "  carried by: " + "; ".join(carried)
    for s in results.scenarios.values():
        split = s.params.get("cpu_per_msg_by_process")
        if isinstance(split, dict) and {"omniwire", "raw"} <= split.keys():
            ours, raw = split["omniwire"], split["raw"]
            yield (
                f"  cpu/msg by process ({s.name}; A this one, B the peer): omniwire "
                f"A {ours['a_us']:.1f} + B {ours['b_us']:.1f} µs, raw "
                f"A {raw['a_us']:.1f} + B {raw['b_us']:.1f} µs"
            )
    idle = results.scenarios.get("idle")
    if idle is not None:
        share = idle.params.get("self_cpu_share")
        if isinstance(share, float):
            yield (
                f"  idle: this process (endpoint A and the raw sockets) used "
                f"{fmt_figure(share, 'core')} over the same {idle.params['seconds']:.1f} s"
            )
    yield ""


def _table(table: Table, scenarios: dict[str, Scenario]) -> Iterator[str]:
    yield "Per backend — every edge routed to the backend; one tensor per payload; medians"
    if table.memcpy_gbps:
        yield "  memcpy: " + ", ".join(
            f"{fmt_size(s)} {fmt_rate(g * 1e9)}" for s, g in sorted(table.memcpy_gbps.items())
        )
    if table.zmq_rtt_us:
        yield "  raw zmq.asyncio round trip: " + ", ".join(
            f"{fmt_size(s)} {fmt_time(us / 1e6)}" for s, us in sorted(table.zmq_rtt_us.items())
        )
    if table.control_rtt_us is not None:
        yield (
            f"  raw zmq.asyncio round trip of a control message ({fmt_size(CONTROL_BYTES)}): "
            f"{fmt_time(table.control_rtt_us / 1e6)} — a one-way transfer waits at least "
            "the bare engine plus this (its announcement and its ACK): the bound of ×raw"
        )
    for name, figures in table.raw_engine_gbps.items():
        yield f"  raw {name} one-way (mean of the rows' baselines): " + ", ".join(
            f"{fmt_size(s)} {fmt_rate(g * 1e9)}" for s, g in sorted(figures.items())
        )
    head = (
        "backend",
        "mode",
        "size",
        "rtt p50",
        "rtt p99",
        "×zmq",
        "one-way",
        "×memcpy",
        "×raw",
        "bound",
        "streamed",
        "msgs/s",
    )
    rows = [head]
    for r in table.rows:
        rows.append(
            (
                r.backend,
                r.mode,
                fmt_size(r.size),
                fmt_time(r.rtt_p50_us / 1e6),
                fmt_time(r.rtt_p99_us / 1e6),
                _small_ratio(r.vs_zmq),
                fmt_rate(r.oneway_gbps * 1e9),
                _small_ratio(r.vs_memcpy),
                _small_ratio(r.vs_raw),
                _small_ratio(r.bound),
                fmt_rate(r.stream_gbps * 1e9),
                f"{r.msgs_per_s:,.0f}",
            )
        )
    width = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for n, row in enumerate(rows):
        cells = [
            row[i].ljust(width[i]) if i < 2 else row[i].rjust(width[i]) for i in range(len(head))
        ]
        yield "  " + "  ".join(cells)
        if n == 0:
            yield "  " + "-" * (sum(width) + 2 * (len(head) - 1))
    for size, (alone, behind) in sorted(table.obstructed_s.items()):
        yield (
            f"  shm zero-copy {fmt_size(size)} one-way: {fmt_time(alone)} alone, "
            f"{fmt_time(behind)} behind a held 1 KiB object ({fmt_ratio(behind / alone)})"
        )
    targets = list(_table_targets(table, "shm" not in scenarios))
    if targets:
        yield "  targets:"
        yield from targets
    yield ""


def _small_ratio(x: float | None) -> str:
    if x is not None and 0 < x < 0.01:
        return "<0.01×"
    return fmt_ratio(x)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _of_bound(vs_raw: float, bound: float) -> str:
    """How much of the control round trip's bound a row reached."""
    return f"{100 * vs_raw / bound:.0f} % of it"


def _table_targets(table: Table, shm_rows: bool) -> Iterator[str]:
    size = 64 * MiB
    for mode, target in (("copy", 0.5), ("zero-copy", 0.8)):
        r = table.row("shm", mode, size)
        if shm_rows and r is not None and r.vs_memcpy is not None:
            yield (
                f"    shm {mode} 64 MiB one-way: {fmt_rate(r.oneway_gbps * 1e9)} = "
                f"{fmt_ratio(r.vs_memcpy)} memcpy (≥ {target}×: {_met(r.vs_memcpy >= target)})"
            )
    for name, figures in table.raw_engine_gbps.items():
        for s in (MiB, 64 * MiB):
            raw = figures.get(s)
            for mode in ("copy", "lent"):
                r = table.row(name, mode, s)
                if r is None or not raw or r.vs_raw is None:
                    continue
                met = ""
                if mode == "lent":  # issue #21's goals
                    goal = 0.95 if s == 64 * MiB else 0.6 if name == "nccl" else 0.7
                    met = f" (≥ {goal}×: {_met(r.vs_raw >= goal)})"
                    if r.bound is not None:
                        met += f" (bound {fmt_ratio(r.bound)}: {_of_bound(r.vs_raw, r.bound)})"
                if r.landed:
                    acked = r.acked_gbps or 0.0
                    met += (
                        f"; {100 * r.landed:.0f} % landed (complete without the ACK; up to the "
                        f"ACK {fmt_rate(acked * 1e9)}, {fmt_ratio(acked / (r.raw_gbps or raw))})"
                    )
                op = f"{r.raw_op}s " if r.raw_op else ""
                yield (
                    f"    {name} {mode} {fmt_size(s)}: {fmt_rate(r.oneway_gbps * 1e9)} one-way = "
                    f"{fmt_ratio(r.vs_raw)} the raw engine "
                    f"({op}{fmt_rate((r.raw_gbps or raw) * 1e9)}, interleaved with it){met}; "
                    f"{fmt_rate(r.stream_gbps * 1e9)} streamed"
                )
    for size, (alone, behind) in sorted(table.obstructed_s.items()):
        ratio = behind / alone
        yield (
            f"    shm {fmt_size(size)} behind a held 1 KiB object: {fmt_ratio(ratio)} the time "
            f"alone (< 2×: {_met(ratio < 2)})"
        )


def report(results: Results) -> str:
    """The whole report, for a terminal."""
    host = results.host
    busy = results.busy
    if busy.get("ran"):
        share = busy.get("cpu_share")
        load = (
            f"yes — a CPU burner ran throughout ({100 * share:.0f} % of a core)" if share else "yes"
        )
    else:
        load = "no (--busy runs a CPU burner beside the bench)"
    lines = [
        f"omniwire bench — {host.get('cpus', '?')} CPUs, Python {host.get('python', '?')}, "
        f"torch {host.get('torch', '?')}, pyzmq {host.get('pyzmq', '?')}"
        f"{' — quick' if results.quick else ''}",
        f"other core busy: {load}",
        "",
    ]
    lines += list(_scenarios(results))
    if results.table is not None:
        lines += list(_table(results.table, results.scenarios))
    for e in results.errors:
        lines.append(f"FAILED {e['where']}: {e['error']}")
    lines += [f"note: {n}" for n in results.notes]
    lines.append(f"took {fmt_time(results.wall_s)}")
    return "\n".join(lines)
