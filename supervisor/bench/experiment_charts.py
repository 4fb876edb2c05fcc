"""PNG charts of the experiments, written beside their records (``chart.png``), as ``bench sweep`` does.

- ``models``: per file, the memory (file size, resident memory idle and at its peak under load, and the
  budget llamagate computed, with and without the prompt cache and checkpoint caps), decode and prompt
  tokens per second, the child's CPU milliseconds per output token, and TTFT and TPOT percentiles.
- ``slots``: per slots x context point, the same memory bars, and latency percentiles with goodput.
- ``kv-reuse``: per answer against N, for both ways with the fitted curves: wall seconds, llama-server's
  CPU seconds, and tokens evaluated on log-log axes (where the slope is the exponent).

matplotlib is the optional ``charts`` extra (``chart.pyplot``); without it the records are still
written and the note says how to get the charts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from supervisor.bench.chart import ChartUnavailable, pyplot
from supervisor.bench.experiments import ExperimentResult, PointResult
from supervisor.bench.hostload import one_minute
from supervisor.bench.kv_reuse import WAYS, KvReuseResult

MIB = 1024 * 1024
CHART_NAME = "chart.png"
_WAY_STYLE = {"reused": ("tab:green", "o"), "recomputed": ("tab:red", "s")}


def _mib(value: Any) -> float:
    return float(value) / MIB if isinstance(value, int | float) else 0.0


def _loads(points: Sequence[PointResult], labels: Sequence[str]) -> str:
    """Each point's load average, start -> end: on a shared host it explains the speed panels."""
    rows = ["host load average (1 min) per point:", ""]
    for label, p in zip(labels, points, strict=True):
        values = one_minute(p.extra.get("load_average"))
        rows.append(f"{label:>10}  {' -> '.join(values) or 'unknown'}")
    return "\n".join(rows)


def _bare(p: PointResult) -> float:
    """Weights + KV + runtime allowance: the budget without the two caps a short run does not fill."""
    b = p.budget or {}
    return _mib(sum(int(b.get(k, 0)) for k in ("weights_bytes", "kv_bytes", "runtime_bytes")))


def _grouped_bars(ax: Any, labels: Sequence[str], series: Sequence[tuple[str, Sequence[float], str]]) -> None:
    width = 0.8 / max(1, len(series))
    xs = list(range(len(labels)))
    for i, (name, values, color) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        bars = ax.bar([x + offset for x in xs], values, width=width * 0.92, color=color, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1)
    ax.set_xticks(xs, list(labels), fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    top = max((v for _, values, _ in series for v in values), default=0.0)
    if top > 0:
        ax.set_ylim(0, top * (1.25 + 0.09 * len(series)))  # room above the bars for the legend
    ax.legend(fontsize=7, loc="upper left")


def _memory(ax: Any, points: Sequence[PointResult], labels: Sequence[str], file_bars: bool) -> None:
    series = []
    if file_bars:
        series.append(("file size", [_mib(p.extra.get("file_bytes")) for p in points], "tab:gray"))
    series += [
        ("RSS idle (loaded)", [_mib(p.rss_loaded) for p in points], "tab:blue"),
        ("RSS peak under load", [_mib(p.extra.get("rss_peak_bytes")) for p in points], "tab:purple"),
        ("budget (required)", [_mib((p.budget or {}).get("required_bytes")) for p in points], "tab:orange"),
        ("budget less prompt cache and checkpoints", [_bare(p) for p in points], "navajowhite"),
    ]
    _grouped_bars(ax, labels, series)
    ax.set_ylabel("MiB")
    ax.set_title("memory: measured against llamagate's budget", fontsize=9)


def _latency(ax: Any, points: Sequence[PointResult], labels: Sequence[str], which: str) -> None:
    dists = [p.summary.ttft_ms if which == "TTFT" else p.summary.tpot_ms for p in points]
    _grouped_bars(
        ax,
        labels,
        [
            (f"{which} p50", [d.p50 or 0.0 for d in dists], "tab:cyan"),
            (f"{which} p95", [d.p95 or 0.0 for d in dists], "tab:blue"),
        ],
    )
    ax.set_ylabel("ms")
    ax.set_title(f"{which} percentiles (client side)", fontsize=9)


def models(result: ExperimentResult, path: Path, title: str) -> Path:
    plt = pyplot()
    labels = [str(p.extra.get("type") or p.label) for p in result.points]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), dpi=110)
    _memory(axes[0][0], result.points, labels, file_bars=True)
    cpu = [p.extra.get("child_cpu_ms_per_output_token") or 0.0 for p in result.points]
    _grouped_bars(axes[0][2], labels, [("child CPU ms per output token", cpu, "tab:brown")])
    axes[0][2].set_ylabel("CPU ms (prompt work included)")
    axes[0][2].set_title("child CPU per output token (other jobs inflate it too)", fontsize=9)
    axes[1][2].axis("off")
    axes[1][2].text(0, 1, _loads(result.points, labels), va="top", ha="left", fontsize=8, family="monospace")
    _grouped_bars(
        axes[0][1],
        labels,
        [
            ("decode tok/s", [p.decode_tps or 0.0 for p in result.points], "tab:green"),
            ("prompt tok/s", [p.prompt_tps or 0.0 for p in result.points], "tab:olive"),
        ],
    )
    axes[0][1].set_ylabel("tokens/s per request (llama-server's timings)")
    axes[0][1].set_title("speed", fontsize=9)
    _latency(axes[1][0], result.points, labels, "TTFT")
    _latency(axes[1][1], result.points, labels, "TPOT")
    return _save(fig, plt, path, title)


def slots(result: ExperimentResult, path: Path, title: str) -> Path:
    plt = pyplot()
    labels = [p.label for p in result.points]
    fig, (mem, lat) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    _memory(mem, result.points, labels, file_bars=False)
    kv = [_mib((p.budget or {}).get("kv_bytes")) for p in result.points]
    mem.plot(range(len(labels)), kv, "k--", marker="x", label="KV budget")
    mem.legend(fontsize=7, loc="upper left")
    _latency(lat, result.points, labels, "TPOT")
    ttft = [(p.summary.ttft_ms.p95 or 0.0) / 10 for p in result.points]
    lat.plot(range(len(labels)), ttft, "r-", marker="o", label="TTFT p95 / 10")
    lat.legend(fontsize=7, loc="upper left")
    lat.set_title("latency at concurrency = slots", fontsize=9)
    lat.set_xlabel("slots x context per slot")
    return _save(fig, plt, path, title)


def _growth_panel(ax: Any, result: KvReuseResult, metric: str, ylabel: str, log: bool) -> None:
    ns = result.ns
    smooth = [ns[0] + (ns[-1] - ns[0]) * i / 100 for i in range(101)]
    drawn = False
    for way in WAYS:
        g = result.growth.get(metric, {}).get(way)
        points = [(n, result.median(way, n, metric)) for n in ns]
        known = [(n, v) for n, v in points if v is not None and (v > 0 or not log)]
        if g is None or not known:
            continue
        drawn = True
        color, marker = _WAY_STYLE[way]
        fit = g.quadratic if g.verdict == "quadratic" else g.linear
        slope = "" if g.exponent is None else f", log-log slope {g.exponent:.2f}"
        ax.plot([n for n, _ in known], [v for _, v in known], marker=marker, linestyle="none", color=color,
                label=f"{way}")  # fmt: skip
        if fit is not None:
            ax.plot(smooth, [max(fit(n), 1e-6) for n in smooth], color=color, alpha=0.6,
                    label=f"{way}: {g.verdict} fit{slope}")  # fmt: skip
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xlabel("N (tokens in the answer)" + (", log scale" if log else ""))
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, loc="upper left")
    else:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)


def kv_reuse(result: KvReuseResult, path: Path, title: str) -> Path:
    plt = pyplot()
    fig, (wall, cpu, work) = plt.subplots(1, 3, figsize=(14, 4.4), dpi=110)
    _growth_panel(wall, result, "seconds", "wall seconds per answer (client)", log=False)
    wall.set_title("time a client waits", fontsize=9)
    _growth_panel(cpu, result, "cpu_seconds", "llama-server CPU seconds per answer", log=False)
    cpu.set_title("CPU the server spent", fontsize=9)
    _growth_panel(work, result, "tokens_evaluated", "tokens evaluated per answer (log)", log=True)
    work.set_title("work: tokens evaluated (log-log: the slope is the exponent)", fontsize=9)
    return _save(fig, plt, path, title)


def _save(fig: Any, plt: Any, path: Path, title: str) -> Path:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


_EXPERIMENTS: dict[str, Callable[[ExperimentResult, Path, str], Path]] = {"models": models, "slots": slots}


def write(result: ExperimentResult | KvReuseResult, out: Path, title: str) -> str:
    """Draw ``out/chart.png`` when this experiment has a chart; a line saying what happened."""
    path = out / CHART_NAME
    try:
        if isinstance(result, KvReuseResult):
            kv_reuse(result, path, title)
        elif result.name in _EXPERIMENTS:
            _EXPERIMENTS[result.name](result, path, title)
        else:
            return f"no chart for the {result.name} experiment"
    except ChartUnavailable as exc:
        return str(exc)
    return f"chart: {path}"
