"""The sweep chart: TTFT p95 and TPOT p95 against offered load (log scale, gates as dashed lines),
goodput as bars on a second axis, one style per target so a comparison reads at a glance.

matplotlib is an optional extra (``pip install 'llamagate[charts]'``); without it the sweep still
writes its table and JSON and says how to get the chart.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.errors import LlamagateError

INSTALL_HINT = "pip install 'llamagate[charts]'"


class ChartUnavailable(LlamagateError):
    exit_code = 1


@dataclass(frozen=True)
class SeriesPoint:
    label: str
    ttft_p95_ms: float | None
    tpot_p95_ms: float | None
    goodput_fraction: float | None


@dataclass(frozen=True)
class Series:
    name: str
    points: tuple[SeriesPoint, ...]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or ChartUnavailable saying how to install it."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ModuleNotFoundError as exc:
        raise ChartUnavailable(f"chart skipped: matplotlib is not installed ({INSTALL_HINT})") from exc
    matplotlib.use("Agg")  # no display on a server
    return importlib.import_module("matplotlib.pyplot")


_TTFT_COLOR = "tab:blue"
_TPOT_COLOR = "tab:orange"
_LINESTYLES = ("-", "--", ":", "-.")
_HATCHES = ("", "//", "..", "xx")


def render(
    series: Sequence[Series],
    labels: Sequence[str],
    ttft_gate_ms: float,
    tpot_gate_ms: float,
    percentile: float,
    path: Path,
    title: str,
) -> Path:
    """Write a PNG; ``labels`` fixes the x order (offered loads, increasing)."""
    plt = pyplot()
    fig, (ax, bars) = plt.subplots(
        2, 1, sharex=True, figsize=(9, 6.4), dpi=110, gridspec_kw={"height_ratios": [3, 1.2]}
    )
    xs = list(range(len(labels)))
    width = 0.8 / max(1, len(series))
    q = f"p{percentile:g}"
    for i, s in enumerate(series):
        by_label = {p.label: p for p in s.points}
        style = _LINESTYLES[i % len(_LINESTYLES)]
        for key, color, name in (("ttft_p95_ms", _TTFT_COLOR, "TTFT"), ("tpot_p95_ms", _TPOT_COLOR, "TPOT")):
            pts = [
                (x, getattr(by_label[lb], key)) for x, lb in zip(xs, labels, strict=True) if lb in by_label
            ]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(
                    [x for x, _ in pts],
                    [y for _, y in pts],
                    style,
                    marker="o",
                    color=color,
                    label=f"{name} {q} ({s.name})",
                )
        offset = (i - (len(series) - 1) / 2) * width
        good = [(by_label[lb].goodput_fraction or 0.0) * 100 if lb in by_label else 0.0 for lb in labels]
        drawn = bars.bar(
            [x + offset for x in xs],
            good,
            width=width * 0.92,
            color="tab:green",
            alpha=0.35 + 0.3 * (i % 2),
            hatch=_HATCHES[i % len(_HATCHES)],
            edgecolor="darkgreen",
            label=s.name,
        )
        bars.bar_label(drawn, fmt="%.0f%%", fontsize=7, padding=1)
    for gate, color, name in ((ttft_gate_ms, _TTFT_COLOR, "TTFT"), (tpot_gate_ms, _TPOT_COLOR, "TPOT")):
        ax.axhline(gate, color=color, linestyle=(0, (6, 3)), linewidth=1.2, alpha=0.8)
        ax.annotate(
            f"{name} gate {gate:g} ms",
            (1.0, gate),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 3),
            textcoords="offset points",
            ha="right",
            color=color,
            fontsize=8,
        )
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    ax.set_ylim(min(low, tpot_gate_ms / 2), max(high, ttft_gate_ms * 2))
    ax.set_ylabel(f"latency {q}, ms (log scale)")
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", ncol=max(1, len(series)))
    ax.set_title(title, fontsize=10)
    bars.set_ylim(0, 119)
    bars.set_yticks([0, 50, 100])
    bars.set_ylabel("goodput %", fontsize=9)
    if len(series) > 1:
        bars.legend(fontsize=7, loc="upper right")
    bars.set_xticks(xs, list(labels))
    bars.set_xlabel("offered load")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
