"""Markdown for humans: one run's summary, and a sweep's table. Percentiles over fewer than 20 samples
carry a ``*`` and a footnote, never silently."""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.bench.stats import Distribution
from supervisor.bench.summary import Summary

SMALL_NOTE = "`*` percentile over fewer than 20 samples: read it as an indication, not a measurement."


def fmt_ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _pct(dist: Distribution, value: float | None) -> str:
    return fmt_ms(value) + ("*" if dist.small_sample and value is not None else "")


def verdict_text(summary: Summary) -> str:
    v = summary.verdict
    if v.passed:
        return "PASS"
    text = "FAIL: " + ", ".join(v.failing)
    return text + ("; admitted OK" if v.admitted_ok else "")


def _frac(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def summary_markdown(s: Summary) -> str:
    g = s.gates
    rows = [
        ("TTFT (ms)", s.ttft_ms),
        ("TPOT (ms)", s.tpot_ms),
        ("end-to-end (ms)", s.e2e_ms),
    ]
    lines = [
        f"# Benchmark run {s.label}",
        "",
        f"Verdict: **{verdict_text(s)}** (gates: TTFT p{g.percentile:g} <= {g.ttft_ms:g} ms, "
        f"TPOT p{g.percentile:g} <= {g.tpot_ms:g} ms, failures <= {g.max_failures}, "
        f"rejected <= {g.max_rejected_fraction * 100:g}%)",
        "",
        f"- submitted {s.submitted} (plus {s.warmup} warm-up), completed {s.completed}, "
        f"rejected {s.rejected}, failed {s.failed} (of which timeouts {s.timeouts})",
        f"- goodput {s.goodput} requests ({_frac(s.goodput_fraction)} of submitted"
        + (f", {s.goodput_per_s:.2f}/s" if s.goodput_per_s is not None else "")
        + f"); admitted requests missing a gate: {s.admitted_violations}"
        + (f"; completed without a measurable TTFT: {s.unknown_ttft}" if s.unknown_ttft else ""),
        f"- tokens: {s.prompt_tokens} prompt, {s.completion_tokens} completion"
        + (f", {s.tokens_per_s:.1f} completion tokens/s overall" if s.tokens_per_s is not None else "")
        + (f" over {s.duration_s:.1f} s" if s.duration_s is not None else ""),
        "",
        "| | n | p50 | p95 | p99 | mean | max |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, d in rows:
        lines.append(
            f"| {name} | {d.n} | {_pct(d, d.p50)} | {_pct(d, d.p95)} | {_pct(d, d.p99)} "
            f"| {fmt_ms(d.mean)} | {fmt_ms(d.max)} |"
        )
    if any(d.small_sample and d.n for _, d in rows):
        lines += ["", SMALL_NOTE]
    return "\n".join(lines) + "\n"


TABLE_HEADER = (
    "| load | submitted | completed | rejected | failed | goodput | TTFT p50 | TTFT p95 "
    "| TPOT p50 | TPOT p95 | e2e p95 | tok/s | verdict |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
)


def table_row(s: Summary, label: str | None = None) -> str:
    tps = "-" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}"
    return (
        f"| {label or s.label} | {s.submitted} | {s.completed} | {s.rejected} | {s.failed} "
        f"| {s.goodput} ({_frac(s.goodput_fraction)}) "
        f"| {_pct(s.ttft_ms, s.ttft_ms.p50)} | {_pct(s.ttft_ms, s.ttft_ms.p95)} "
        f"| {_pct(s.tpot_ms, s.tpot_ms.p50)} | {_pct(s.tpot_ms, s.tpot_ms.p95)} "
        f"| {_pct(s.e2e_ms, s.e2e_ms.p95)} | {tps} | {verdict_text(s)} |"
    )


def table(rows: Sequence[tuple[str, Summary]]) -> str:
    lines = [*TABLE_HEADER, *(table_row(s, label) for label, s in rows)]
    if any(s.ttft_ms.small_sample or s.tpot_ms.small_sample for _, s in rows):
        lines += ["", SMALL_NOTE]
    return "\n".join(lines) + "\n"
