"""A sweep: one run per offered load (per target, for a comparison), then the envelope, then a recovery
run at the highest passing load, after the overload, to show the target came back.

Folder layout::

  OUT/provenance.json            identity of the bench host, the targets, the command line
  OUT/<series>/<NN>-<label>/     one run folder per point (see runner.py)
  OUT/<series>/recovery-<label>/ the recovery run
  OUT/sweep.json, sweep.md       every point's summary, the envelope, the recovery verdict
  OUT/chart.png                  when matplotlib is installed

With several targets (``--compare-url``) the points interleave: load 1 on each target, then load 2 on
each, so slow drift of a shared host (thermal, neighbours) hits both series alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from supervisor.bench import chart
from supervisor.bench.client import Target
from supervisor.bench.envelope import Envelope, Point, find_envelope
from supervisor.bench.loadgen import LoadSpec
from supervisor.bench.prompts import PromptSet
from supervisor.bench.report import table, verdict_text
from supervisor.bench.runner import RequestOptions, RunSpec, run_async
from supervisor.bench.stats import Gates
from supervisor.bench.summary import Summary
from supervisor.progress import NullProgress, Progress

SWEEP_SCHEMA = "llamagate.bench.sweep/1"


@dataclass(frozen=True)
class SweepSpec:
    targets: Mapping[str, Target]  # series name -> target, in run order
    loads: Sequence[LoadSpec]  # increasing offered load
    prompts: PromptSet
    options: RequestOptions
    gates: Gates
    recovery: bool = True
    pause_s: float = 2.0  # lets a server finish cancelling timed-out requests before the next point


@dataclass
class SeriesResult:
    name: str
    target: Target
    points: list[tuple[LoadSpec, Summary, Path]] = field(default_factory=list)
    envelope: Envelope | None = None
    recovery: tuple[LoadSpec, Summary, Path] | None = None

    def envelope_points(self) -> list[Point]:
        return [Point(load.label, load.value, s) for load, s, _ in self.points]


@dataclass(frozen=True)
class SweepResult:
    out_dir: Path
    series: tuple[SeriesResult, ...]
    gates: Gates
    chart: Path | None
    chart_note: str | None
    # 1-minute load average before and after, and the cores: how quiet the host was.
    host_load: tuple[float | None, float | None, int | None] = (None, None, None)


def host_load_note(before: float, after: float, cores: int | None) -> str:
    """How quiet the host was. The "after" figure includes the benchmark's own servers and client, so
    only the "before" figure can say that other work shared the host."""
    note = (
        f"Host load average (1 min): {before:g} before, {after:g} after, on {cores} cores "
        "(the benchmark's own work is in the after figure)."
    )
    if cores and before >= cores / 2:
        note += (
            " The host was already busy before the run: other work shared it,"
            " so read the latencies with that in mind."
        )
    return note


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", label).strip("_")


async def sweep_async(
    spec: SweepSpec,
    out_dir: Path,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> SweepResult:
    progress = progress or NullProgress()
    load_before = _loadavg()
    series = [SeriesResult(name, target) for name, target in spec.targets.items()]
    first = True
    for index, load in enumerate(spec.loads):
        for s in series:
            if not first:
                await asyncio.sleep(spec.pause_s)
            first = False
            folder = out_dir / s.name / f"{index:02d}-{_slug(load.label)}"
            run_spec = RunSpec(s.target, load, spec.prompts, spec.options, spec.gates)
            result = await run_async(run_spec, folder, _Prefixed(progress, s.name, len(series)), transport)
            s.points.append((load, result.summary, folder))
    for s in series:
        s.envelope = find_envelope(s.envelope_points())
        env = s.envelope
        if spec.recovery and env.first_failing is not None and env.highest_passing is not None:
            load = next(load for load, _, _ in s.points if load.label == env.highest_passing)
            await asyncio.sleep(spec.pause_s)
            folder = out_dir / s.name / f"recovery-{_slug(load.label)}"
            run_spec = RunSpec(s.target, load, spec.prompts, spec.options, spec.gates)
            result = await run_async(
                run_spec, folder, _Prefixed(progress, f"{s.name} recovery", 2), transport
            )
            s.recovery = (load, result.summary, folder)
    chart_path, note = _chart(series, spec, out_dir)
    host_load = (load_before, _loadavg(), os.cpu_count())
    out = SweepResult(out_dir, tuple(series), spec.gates, chart_path, note, host_load)
    write_outputs(out, spec)
    return out


def sweep(spec: SweepSpec, out_dir: Path, progress: Progress | None = None) -> SweepResult:
    return asyncio.run(sweep_async(spec, out_dir, progress))


class _Prefixed:
    """Names the series in progress lines only when there is more than one."""

    def __init__(self, inner: Progress, name: str, count: int) -> None:
        self._inner = inner
        self._prefix = f"[{name}] " if count > 1 else ""

    def update(self, stage: str, fraction: float | None, detail: str = "") -> None:
        self._inner.update(self._prefix + stage, fraction, detail)

    def done(self, stage: str, detail: str = "") -> None:
        self._inner.done(self._prefix + stage, detail)


def _chart(series: Sequence[SeriesResult], spec: SweepSpec, out_dir: Path) -> tuple[Path | None, str | None]:
    data = [
        chart.Series(
            s.name,
            tuple(
                chart.SeriesPoint(load.label, sm.ttft_ms.p95, sm.tpot_ms.p95, sm.goodput_fraction)
                for load, sm, _ in s.points
            ),
        )
        for s in series
    ]
    labels = [load.label for load in sorted(spec.loads, key=lambda x: x.value)]
    g = spec.gates
    # Names, not URLs: ports are random per run and say nothing on a committed chart.
    title = "TTFT and TPOT p95 and goodput against offered load: " + " vs ".join(s.name for s in series)
    try:
        path = chart.render(data, labels, g.ttft_ms, g.tpot_ms, 95.0, out_dir / "chart.png", title)
    except chart.ChartUnavailable as exc:
        return None, str(exc)
    return path, None


def _summary_entry(load: LoadSpec, summary: Summary, folder: Path, root: Path) -> dict[str, Any]:
    return {
        "label": load.label,
        "mode": load.mode,
        "value": load.value,
        "folder": str(folder.relative_to(root)),
        "summary": summary.to_dict(),
    }


def to_json(result: SweepResult, spec: SweepSpec) -> dict[str, Any]:
    root = result.out_dir
    return {
        "schema": SWEEP_SCHEMA,
        "gates": asdict(result.gates),
        "prompts": spec.prompts.name,
        "options": {**asdict(spec.options), "extra_body": dict(spec.options.extra_body)},
        "chart": None if result.chart is None else result.chart.name,
        "chart_note": result.chart_note,
        "host_load": {
            "loadavg_1m_before": result.host_load[0],
            "loadavg_1m_after": result.host_load[1],
            "cpu_count": result.host_load[2],
        },
        "series": {
            s.name: {
                "target": s.target.base_url,
                "points": [_summary_entry(load, sm, f, root) for load, sm, f in s.points],
                "envelope": None if s.envelope is None else asdict(s.envelope),
                "recovery": None if s.recovery is None else _summary_entry(*s.recovery, root),
            }
            for s in result.series
        },
    }


def markdown(result: SweepResult) -> str:
    g = result.gates
    lines = [
        "# Capacity sweep",
        "",
        f"Gates: TTFT p{g.percentile:g} <= {g.ttft_ms:g} ms, TPOT p{g.percentile:g} <= {g.tpot_ms:g} ms, "
        f"failures <= {g.max_failures}, rejected (429/503) <= {g.max_rejected_fraction * 100:g}%. "
        "Latency percentiles are over admitted (completed) requests; goodput counts requests that "
        "completed within both gates, as a share of all submitted.",
    ]
    before, after, cores = result.host_load
    if before is not None and after is not None:
        lines += ["", host_load_note(before, after, cores)]
    for s in result.series:
        rows = [(load.label, sm) for load, sm, _ in s.points]
        if s.recovery is not None:
            rows.append((f"{s.recovery[0].label} (recovery)", s.recovery[1]))
        lines += ["", f"## {s.name}: {s.target.base_url}", "", table(rows).rstrip(), ""]
        if s.envelope is not None:
            lines.append(f"Envelope: {s.envelope.describe()}.")
        if s.recovery is not None:
            lines.append(
                f"Recovery at {s.recovery[0].label} after the overload: {verdict_text(s.recovery[1])}."
            )
    if result.chart is not None:
        lines += ["", f"![sweep chart]({result.chart.name})"]
    elif result.chart_note:
        lines += ["", result.chart_note]
    return "\n".join(lines) + "\n"


def write_outputs(result: SweepResult, spec: SweepSpec) -> None:
    out = result.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(to_json(result, spec), indent=2, default=str) + "\n", "utf-8")
    (out / "sweep.md").write_text(markdown(result), encoding="utf-8")
