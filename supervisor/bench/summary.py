"""Summary of one run, and its verdict against the gates.

How rejections count (decided here, documented in docs/benchmarks.md): the latency gates are
judged over ADMITTED requests only (those that completed); a 429/503 has no TTFT to judge. Rejections
are load shedding, reported on their own and judged by their own check (default: none allowed), so a
load that llamagate sheds is outside the envelope even though every admitted request was fast.
``admitted_ok`` answers the other question an operator asks at overload: did the requests that got
in keep their latency objectives?
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from supervisor.bench.records import RequestRecord
from supervisor.bench.stats import Distribution, Gates, distribution, percentile


@dataclass(frozen=True)
class Check:
    name: str
    limit: float
    value: float | None
    passed: bool | None  # None: not applicable (e.g. no request produced 2 tokens)
    detail: str = ""


@dataclass(frozen=True)
class Verdict:
    passed: bool
    admitted_ok: bool
    checks: tuple[Check, ...]

    @property
    def failing(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.checks if c.passed is False)


@dataclass(frozen=True)
class Summary:
    label: str
    submitted: int
    completed: int
    rejected: int
    failed: int
    timeouts: int
    warmup: int
    goodput: int
    goodput_fraction: float | None
    goodput_per_s: float | None
    admitted_violations: int
    unknown_ttft: int
    ttft_ms: Distribution
    tpot_ms: Distribution
    e2e_ms: Distribution
    prompt_tokens: int
    completion_tokens: int
    tokens_per_s: float | None
    duration_s: float | None
    gates: Gates
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["verdict"]["failing"] = list(self.verdict.failing)
        return out


def _latency_check(name: str, values: Sequence[float], q: float, limit: float, none_ok: bool) -> Check:
    value = percentile(values, q)
    if value is None:
        if none_ok:
            return Check(name, limit, None, None, "no request produced 2 or more tokens")
        return Check(name, limit, None, False, "no completed request")
    detail = f"{len(values)} samples" + (" (small sample)" if len(values) < 20 else "")
    return Check(name, limit, value, value <= limit, detail)


def verdict(
    ttfts: Sequence[float], tpots: Sequence[float], failed: int, rejected: int, submitted: int, gates: Gates
) -> Verdict:
    q = gates.percentile
    qs = f"{q:g}"
    ttft = _latency_check(f"ttft_p{qs}", ttfts, q, gates.ttft_ms, none_ok=False)
    tpot = _latency_check(f"tpot_p{qs}", tpots, q, gates.tpot_ms, none_ok=True)
    failures = Check("failures", gates.max_failures, failed, failed <= gates.max_failures)
    frac = rejected / submitted if submitted else 0.0
    rejections = Check(
        "rejected",
        gates.max_rejected_fraction,
        frac,
        frac <= gates.max_rejected_fraction,
        f"{rejected} rejected",
    )
    checks = (ttft, tpot, failures, rejections)
    admitted_ok = ttft.passed is True and tpot.passed is not False
    return Verdict(all(c.passed is not False for c in checks), admitted_ok, checks)


def summarize(records: Sequence[RequestRecord], gates: Gates, label: str) -> Summary:
    measured = [r for r in records if not r.warmup]
    completed = [r for r in measured if r.completed]
    ttfts = [r.ttft_ms for r in completed if r.ttft_ms is not None]
    tpots = [r.tpot_ms for r in completed if r.tpot_ms is not None]
    e2es = [r.e2e_ms for r in completed if r.e2e_ms is not None]
    rejected = sum(1 for r in measured if r.rejected)
    failed = sum(1 for r in measured if r.failed)
    good = sum(1 for r in completed if r.met_gates is True)
    starts = [r.t_submit for r in measured]
    ends = [r.t_end for r in measured if r.t_end is not None]
    duration = (max(ends) - min(starts)) if starts and ends else None
    per_s = duration if duration and duration > 0 else None
    completion_tokens = sum(r.completion_tokens or 0 for r in completed)
    return Summary(
        label=label,
        submitted=len(measured),
        completed=len(completed),
        rejected=rejected,
        failed=failed,
        timeouts=sum(1 for r in measured if r.outcome == "timeout"),
        warmup=len(records) - len(measured),
        goodput=good,
        goodput_fraction=(good / len(measured)) if measured else None,
        goodput_per_s=(good / per_s) if per_s else None,
        admitted_violations=sum(1 for r in completed if r.met_gates is False),
        unknown_ttft=sum(1 for r in completed if r.ttft_ms is None),
        ttft_ms=distribution(ttfts),
        tpot_ms=distribution(tpots),
        e2e_ms=distribution(e2es),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in completed),
        completion_tokens=completion_tokens,
        tokens_per_s=(completion_tokens / per_s) if per_s else None,
        duration_s=duration,
        gates=gates,
        verdict=verdict(ttfts, tpots, failed, rejected, len(measured), gates),
    )
