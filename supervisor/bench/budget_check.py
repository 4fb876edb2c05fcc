"""The memory budget llamagate computed before a launch (``budget.plan``) against the resident memory the
child then used at its peak under load, and, when they differ by more than ``TOLERANCE``, why.

The budget is a ceiling meant to refuse a launch that cannot fit, so it is built from parts that a
short benchmark need not fill: the prompt cache (``--cache-ram``) and the context checkpoints are
counted at their caps; the model file is counted whole, although only the pages a request touches are
resident. The explanation compares part by part with what the kernel reports (file-backed pages for the
mapped model, anonymous memory for the KV cache, compute buffers and the prompt cache).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from supervisor.bench.rss import Resident

TOLERANCE = 0.15
MIB = 1024 * 1024


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def _pct(f: float) -> str:
    return f"{f * 100:+.0f} %"


def check(budget: Mapping[str, Any] | None, peak: Resident | None) -> dict[str, Any] | None:
    if not budget or peak is None or not peak.rss:
        return None
    weights = int(budget.get("weights_bytes", 0))
    kv = int(budget.get("kv_bytes", 0))
    runtime = int(budget.get("runtime_bytes", 0))
    caps = int(budget.get("prompt_cache_bytes", 0)) + int(budget.get("checkpoint_bytes", 0))
    predicted = int(budget.get("required_bytes", weights + kv + runtime + caps))
    measured = peak.rss
    off = (predicted - measured) / measured
    bare = weights + kv + runtime
    off_bare = (bare - measured) / measured
    within = abs(off) <= TOLERANCE
    return {
        "predicted_bytes": predicted,
        "measured_peak_rss_bytes": measured,
        "measured_peak": peak.to_dict(),
        "off_by_bytes": predicted - measured,
        "off_by_fraction": round(off, 4),
        "tolerance": TOLERANCE,
        "within_tolerance": within,
        "predicted_without_caps_bytes": bare,
        "off_by_fraction_without_caps": round(off_bare, 4),
        "why": None if within else _why(weights, kv, runtime, caps, budget, peak, off, off_bare),
    }


def _why(
    weights: int,
    kv: int,
    runtime: int,
    caps: int,
    budget: Mapping[str, Any],
    peak: Resident,
    off: float,
    off_bare: float,
) -> str:
    reasons: list[str] = []
    head = (
        f"the budget ({_mib(weights + kv + runtime + caps)}) is {_pct(off)} off the peak RSS under load "
        f"({_mib(peak.rss)})"
    )
    if off > 0 and caps:
        reasons.append(
            f"it reserves the prompt cache ({_mib(int(budget.get('prompt_cache_bytes', 0)))}) and the "
            f"context checkpoints ({_mib(int(budget.get('checkpoint_bytes', 0)))}) at their caps, which "
            "this run's requests filled only in part; without those two it predicts "
            f"{_mib(weights + kv + runtime)}, {_pct(off_bare)}"
        )
    if off_bare > TOLERANCE and peak.file < 0.95 * weights:
        reasons.append(
            f"it counts the model file whole ({_mib(weights)}) where {_mib(peak.file)} of file-backed pages "
            "(the mapped model and the binary) were resident"
        )
    beyond_kv = peak.anon - kv
    if off_bare > TOLERANCE and beyond_kv < runtime:
        reasons.append(
            f"its runtime allowance ({_mib(runtime)}: 128 MiB + 5 % of the weights) is more than the "
            f"anonymous memory beyond the KV cache this child used ({_mib(peak.anon)} anonymous - "
            f"{_mib(kv)} KV = {_mib(beyond_kv)}): compute buffers scale with the model's width, not its "
            "file size"
        )
    if off < 0:
        reasons.append(
            f"the child used more than the budget: {_mib(peak.anon)} anonymous (KV {_mib(kv)} + runtime "
            f"allowance {_mib(runtime)} + caps {_mib(caps)} budgeted) and {_mib(peak.file)} file-backed "
            f"(weights {_mib(weights)} budgeted)"
        )
    return head + (": " + "; ".join(reasons) if reasons else "") + "."
