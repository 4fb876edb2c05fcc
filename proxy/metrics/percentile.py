"""The one percentile of llamagate: the proxy's traffic history (``proxy.metrics.history``) and the bench
(``supervisor.bench.stats``) quote the same definition, so a p95 on the status page and one in a
benchmark record mean the same thing."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values. ``q`` in [0, 100]."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return ordered[lo]
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
