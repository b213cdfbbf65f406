"""``--plot FILE.png``: throughput and latency per size (baselines drawn), and the
scenarios as ratios to their baselines (matplotlib, headless)."""

from __future__ import annotations

from typing import Any

from ._model import Results
from ._report import fmt_figure
from ._units import fmt_size

__all__ = ["plot"]


def _tick(value: float, units: tuple[tuple[str, float], ...]) -> str:
    """An axis label: ``10 GB/s``, ``1 ms``, ``500 µs`` (no trailing zeros)."""
    for unit, scale in units:
        if value >= scale * 0.999:
            return f"{value / scale:.3g} {unit}"
    unit, scale = units[-1]
    return f"{value / scale:.3g} {unit}"


RATE_UNITS = (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3), ("B/s", 1.0))
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))
#: figures left out of the ratio panel (they repeat another one's ratio or story)
NOT_PLOTTED = ("mean", "B/s")
RATIO_TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)


MODE_STYLE = {"copy": "o-", "zero-copy": "s--", "lent": "^--"}


def _legend(ax: Any) -> None:
    """Below the axes, so that no line hides behind it."""
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)


def _size_axis(ax: Any, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([fmt_size(s) for s in sizes], rotation=45, ha="right")
    ax.minorticks_off()
    ax.set_xlabel("payload size (one tensor)")
    ax.grid(True, which="major", alpha=0.3)


def plot(results: Results, path: str) -> None:
    """Write the chart to ``path`` (PNG).

    Raises:
        ImportError: matplotlib is missing (``pip install omniwire[bench]``).
        ValueError: nothing was measured.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    table = results.table if results.table is not None and results.table.rows else None
    ratios = [
        (s, f)
        for s in results.scenarios.values()
        for f in s.figures
        if f.ratio is not None and f.name not in NOT_PLOTTED
    ]
    panels = (2 if table is not None else 0) + (1 if ratios else 0)
    if not panels:
        raise ValueError("nothing to plot: no table rows and no scenario ratios")
    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 6.6), squeeze=False)
    ax_iter = iter(axes[0])
    busy = " — other core busy" if results.busy.get("ran") else ""
    fig.suptitle(f"omniwire bench: two processes on one host{busy}", fontsize=12)

    if table is not None:
        sizes = sorted({r.size for r in table.rows} | set(table.memcpy_gbps))
        keys = sorted({(r.backend, r.mode) for r in table.rows})
        backends = sorted({b for b, _ in keys} | set(table.raw_engine_gbps))
        color = {b: f"C{i % 10}" for i, b in enumerate(backends)}
        m = sorted(table.memcpy_gbps)

        def series(ax: Any, value: Any) -> None:
            # colour: the backend; marker and line: the mode
            for key in keys:
                rows = [r for r in table.rows if (r.backend, r.mode) == key]
                ax.plot([r.size for r in rows], [value(r) for r in rows], MODE_STYLE.get(key[1], "o-"),
                        color=color[key[0]], label=f"{key[0]} {key[1]}")  # fmt: skip

        ax = next(ax_iter)
        ax.plot(m, [table.memcpy_gbps[s] * 1e9 for s in m], "k--", label="memcpy (baseline)")
        series(ax, lambda r: r.oneway_gbps * 1e9)
        for name, figures in table.raw_engine_gbps.items():
            s = sorted(figures)
            ax.plot(s, [figures[x] * 1e9 for x in s], "x:", color=color[name], markersize=8,
                    label=f"raw {name} (baseline)")  # fmt: skip
        _size_axis(ax, sizes)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick(v, RATE_UNITS)))
        ax.set_ylabel("one-way throughput (send → ACK)")
        ax.set_title("Throughput (higher is better)")
        _legend(ax)

        ax = next(ax_iter)
        z = sorted(table.zmq_rtt_us)
        if z:
            ax.plot(z, [table.zmq_rtt_us[s] / 1e6 for s in z], "k--",
                    label="raw zmq.asyncio (baseline)")  # fmt: skip
        ax.plot(m, [s / (table.memcpy_gbps[s] * 1e9) for s in m], ":", color="grey",
                label="one memcpy (baseline)")  # fmt: skip
        series(ax, lambda r: r.rtt_p50_us / 1e6)
        _size_axis(ax, sizes)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick(v, TIME_UNITS)))
        ax.set_ylabel("round trip p50 (send → echo received)")
        ax.set_title("Latency (lower is better)")
        _legend(ax)

    if ratios:
        ax = next(ax_iter)
        labels, values, colors_ = [], [], []
        for sc, f in ratios:
            assert f.ratio is not None
            arrow = "↓" if f.better == "lower" else "↑"
            labels.append(
                f"{sc.title}, {f.name} {arrow}\n"
                f"{fmt_figure(f.omniwire, f.unit)} vs {fmt_figure(f.baseline, f.unit)}"
            )
            values.append(f.ratio)
            verdicts = {t.met for t in f.targets}
            colors_.append(
                "tab:grey" if not verdicts else "tab:red" if False in verdicts else "tab:green"
            )
        y = list(range(len(values)))[::-1]
        # bars grow from the baseline (1×) to the ratio, on a log axis
        ax.barh(y, [v - 1 for v in values], left=1, color=colors_, alpha=0.7, height=0.6)
        for yi, (_, f) in zip(y, ratios, strict=True):
            for t in f.targets:
                if t.of == "ratio":
                    ax.plot([t.limit], [yi], marker="|", markersize=16, mew=2, color="k")
        ax.axvline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xscale("log")
        limits = values + [t.limit for _, f in ratios for t in f.targets]
        lo, hi = min(*limits, 1.0) / 1.5, max(*limits, 1.0) * 1.5
        ax.set_xlim(lo, hi)
        ax.set_xticks([t for t in RATIO_TICKS if lo <= t <= hi])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(
            "omniwire ÷ baseline — dashed: the baseline, |: a target\n"
            "green: targets met, red: not met, grey: no target",
            fontsize=9,
        )
        ax.set_title("Scenarios against their baselines\n(↓ lower is better, ↑ higher is better)")
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
