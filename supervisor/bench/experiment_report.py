"""Tables and JSON for the experiments (experiment.md, experiment.json in the result folder)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from supervisor.bench.experiments import ExperimentResult, PointResult
from supervisor.bench.hostload import one_minute
from supervisor.bench.report import SMALL_NOTE, fmt_ms, verdict_text

MIB = 1024 * 1024
EXPERIMENT_SCHEMA = "llamagate.bench.experiment/1"


def _mib(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{value / MIB:.0f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _latency(p: PointResult) -> str:
    s = p.summary
    star = "*" if s.ttft_ms.small_sample else ""
    return (
        f"{fmt_ms(s.ttft_ms.p50)}{star} | {fmt_ms(s.ttft_ms.p95)}{star} | {fmt_ms(s.tpot_ms.p50)}{star} "
        f"| {fmt_ms(s.tpot_ms.p95)}{star} | {_rate(s.tokens_per_s)}"
    )


LATENCY_HEAD = "TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95 | tok/s overall"


def _threads(result: ExperimentResult) -> list[str]:
    lines = [
        f"| threads | {LATENCY_HEAD} | decode tok/s per request | prompt tok/s per request | verdict |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in result.points:
        lines.append(
            f"| {p.settings['threads']} | {_latency(p)} | {_rate(p.decode_tps)} | {_rate(p.prompt_tps)} "
            f"| {verdict_text(p.summary)} |"
        )
    bench = result.extra.get("llama_bench")
    if bench:
        lines += ["", "llama.cpp `llama-bench` (same binary tree, same model, no HTTP):", ""]
        lines += ["| threads | test | tokens/s | stddev |", "|---:|---|---:|---:|"]
        lines += [
            f"| {r['threads']} | {r['test']} | {r['tokens_per_s']:.1f} | {r['stddev']:.1f} |" for r in bench
        ]
    return lines


def _cache(result: ExperimentResult) -> list[str]:
    lines = [
        f"| cache_prompt | {LATENCY_HEAD} | prompt tokens processed (median) | cached (median) | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in result.points:
        e = p.extra
        lines.append(
            f"| {'on' if p.settings['cache_prompt'] else 'off'} | {_latency(p)} "
            f"| {e.get('prompt_tokens_processed_median', '-')} | {e.get('prompt_tokens_cached_median', '-')} "
            f"| {verdict_text(p.summary)} |"
        )
    return lines


def _load(p: PointResult) -> str:
    """The host's 1-minute load average at the point's start and end (``2.1-3.4``)."""
    return "-".join(one_minute(p.extra.get("load_average"))) or "-"


def _budget_off(p: PointResult) -> str:
    check = p.extra.get("budget_check")
    if not isinstance(check, dict):
        return "-"
    return f"{check['off_by_fraction'] * 100:+.0f} %" + ("" if check["within_tolerance"] else " (!)")


def _budget_notes(result: ExperimentResult) -> list[str]:
    notes = [
        f"- {p.label}: {p.extra['budget_check']['why']}"
        for p in result.points
        if isinstance(p.extra.get("budget_check"), dict) and p.extra["budget_check"].get("why")
    ]
    if not notes:
        return []
    head = "Memory budget against the peak resident memory under load, where they differ by more than 15 %"
    return ["", f"{head} ((!) above):", "", *notes]


def _slots(result: ExperimentResult) -> list[str]:
    lines = [
        "| slots x ctx | concurrency | KV budget MiB | required MiB | RSS loaded MiB | RSS peak MiB "
        f"| RSS after MiB | budget vs peak | {LATENCY_HEAD} | goodput | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in result.points:
        b = p.budget or {}
        s = p.summary
        lines.append(
            f"| {p.label} | {p.settings['concurrency']:g} | {_mib(b.get('kv_bytes'))} "
            f"| {_mib(b.get('required_bytes'))} "
            f"| {_mib(p.rss_loaded)} | {_mib(p.extra.get('rss_peak_bytes'))} | {_mib(p.rss_after)} "
            f"| {_budget_off(p)} | {_latency(p)} | {s.goodput}/{s.submitted} "
            f"| {verdict_text(s)} |"
        )
    return lines + _budget_notes(result)


def _models(result: ExperimentResult) -> list[str]:
    lines = [
        "| model | type | file MiB | RSS idle MiB | RSS peak MiB | budget MiB | budget vs peak "
        f"| {LATENCY_HEAD} | decode tok/s | prompt tok/s | child CPU ms per output token | quality "
        "| latency verdict | load avg |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for p in result.points:
        q = p.quality
        qtext = "-" if q is None else f"{q.passed}/{q.total}"
        lines.append(
            f"| {p.label} | {p.extra.get('type') or '-'} | {_mib(p.extra.get('file_bytes'))} "
            f"| {_mib(p.rss_loaded)} | {_mib(p.extra.get('rss_peak_bytes'))} "
            f"| {_mib((p.budget or {}).get('required_bytes'))} | {_budget_off(p)} | {_latency(p)} "
            f"| {_rate(p.decode_tps)} | {_rate(p.prompt_tps)} "
            f"| {_rate(p.extra.get('child_cpu_ms_per_output_token'))} | {qtext} | {verdict_text(p.summary)} "
            f"| {_load(p)} |"
        )
    best = result.extra.get("smallest_passing")
    rate = result.extra.get("min_pass_rate", 1.0)
    lines += [
        "",
        f"Smallest model passing the latency gates and a quality pass rate >= {rate * 100:g}%: "
        + (f"**{best}**." if best else "none."),
    ]
    return lines + _budget_notes(result)


_TABLES = {"threads": _threads, "cache-prompt": _cache, "slots": _slots, "models": _models}


def markdown(result: ExperimentResult) -> str:
    lines = [f"# Experiment: {result.name}", "", *_TABLES[result.name](result)]
    if any(p.summary.ttft_ms.small_sample for p in result.points):
        lines += ["", SMALL_NOTE]
    lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def _point_json(p: PointResult) -> dict[str, Any]:
    return {
        "label": p.label,
        "settings": p.settings,
        "folder": str(p.folder),
        "summary": p.summary.to_dict(),
        "prompt_tokens_per_s_median": p.prompt_tps,
        "decode_tokens_per_s_median": p.decode_tps,
        "rss_loaded_bytes": p.rss_loaded,
        "rss_after_bytes": p.rss_after,
        "budget": p.budget,
        "identity": p.identity,
        "quality": None if p.quality is None else {**asdict(p.quality), "rate": p.quality.rate},
        "extra": p.extra,
    }


def write(result: ExperimentResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "schema": EXPERIMENT_SCHEMA,
        "experiment": result.name,
        "points": [_point_json(p) for p in result.points],
        "notes": result.notes,
        "extra": result.extra,
    }
    (out / "experiment.json").write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    (out / "experiment.md").write_text(markdown(result), encoding="utf-8")
