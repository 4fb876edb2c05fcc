"""The numbers: percentiles, per-request TTFT/TPOT, and whether one request met the latency gates.

Definitions (also in docs/benchmarks.md):
- TTFT = first content event - submit. Submit is the request's scheduled arrival, so in open-loop
  runs time lost in the client's own scheduling still counts (no coordinated omission).
- TPOT = (end - first content) / (completion tokens - 1): the mean gap between output tokens after
  the first. Undefined (None) with fewer than 2 completion tokens: there is no gap to measure.
- Percentiles interpolate linearly between closest ranks (numpy's default, "type 7"). Below
  ``SMALL_SAMPLE`` values a p95/p99 is mostly the maximum; summaries flag it instead of hiding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.metrics.percentile import percentile as percentile  # the one definition, re-exported

SMALL_SAMPLE = 20


@dataclass(frozen=True)
class Gates:
    """Latency objectives and verdict limits. Per-request flags use the same ms thresholds."""

    ttft_ms: float = 1500.0
    tpot_ms: float = 120.0
    percentile: float = 95.0
    max_failures: int = 0
    # Rejections (429/503) are load shedding, not failures; a load the host sheds is still outside
    # its envelope, so by default any rejection fails the verdict (see summary.py).
    max_rejected_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError("latency gates must be > 0 ms")
        if not 0 < self.percentile <= 100:
            raise ValueError("gate percentile must be in (0, 100]")
        if self.max_failures < 0:
            raise ValueError("max failures must be >= 0")
        if not 0.0 <= self.max_rejected_fraction <= 1.0:
            raise ValueError("max rejected fraction must be in [0, 1]")


@dataclass(frozen=True)
class Distribution:
    n: int
    p50: float | None
    p95: float | None
    p99: float | None
    mean: float | None
    min: float | None
    max: float | None
    small_sample: bool


def distribution(values: Sequence[float]) -> Distribution:
    n = len(values)
    return Distribution(
        n=n,
        p50=percentile(values, 50),
        p95=percentile(values, 95),
        p99=percentile(values, 99),
        mean=(sum(values) / n) if n else None,
        min=min(values) if n else None,
        max=max(values) if n else None,
        small_sample=n < SMALL_SAMPLE,
    )


def ttft_ms(t_submit: float, t_first_content: float | None) -> float | None:
    if t_first_content is None:
        return None
    return (t_first_content - t_submit) * 1000.0


def tpot_ms(
    t_first_content: float | None, t_end: float | None, completion_tokens: int | None
) -> float | None:
    if t_first_content is None or t_end is None or completion_tokens is None or completion_tokens < 2:
        return None
    return (t_end - t_first_content) * 1000.0 / (completion_tokens - 1)


def gate_flags(
    completed: bool, ttft: float | None, tpot: float | None, gates: Gates
) -> tuple[bool | None, bool | None, bool | None]:
    """(met_ttft, met_tpot, met_gates) for one request.

    Unknown stays unknown (None) rather than being guessed: a completed request that never streamed
    content has no TTFT, so it is not proven good and goodput does not count it. A request with one
    output token has no TPOT; that cannot violate the TPOT gate, so only TTFT decides. A request that
    did not complete (rejected, failed) met no gate.
    """
    if not completed:
        return False, False, False
    met_ttft = None if ttft is None else ttft <= gates.ttft_ms
    met_tpot = None if tpot is None else tpot <= gates.tpot_ms
    if met_ttft is False or met_tpot is False:
        return met_ttft, met_tpot, False
    if met_ttft is None:
        return met_ttft, met_tpot, None
    return met_ttft, met_tpot, True
