"""How a time grows with N: least-squares fits of a*N + b and a*N^2 + b*N + c, and a log-log slope.

Which fits: the growth is called quadratic when the quadratic fit's N^2 term carries at least
``QUADRATIC_SHARE`` of its value at the largest N measured, and the quadratic fit leaves at most half
the squared residual of the line (one extra coefficient always lowers the residual a little; noise
alone rarely halves it over several points). Otherwise it is linear. The log-log slope (the exponent k
of time ~ N^k) says the same in one number: 1 for work per answer proportional to N, 2 for N^2, and in
between while a per-step constant (a request's overhead) still weighs against the N^2 part.

No numpy: a 3x3 system of normal equations, solved with partial pivoting on N scaled to [0, 1] so
that N^2 of a few hundred does not swamp the conditioning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

QUADRATIC_SHARE = 0.10


@dataclass(frozen=True)
class Fit:
    degree: int
    coefficients: tuple[float, ...]  # highest power first, in the caller's units
    residual: float  # sum of squared residuals
    r_squared: float | None  # None when every y is equal

    def __call__(self, n: float) -> float:
        return sum(c * n ** (self.degree - i) for i, c in enumerate(self.coefficients))

    def to_dict(self) -> dict[str, Any]:
        return {
            "coefficients": list(self.coefficients),
            "residual": self.residual,
            "r_squared": self.r_squared,
        }


@dataclass(frozen=True)
class Growth:
    linear: Fit | None  # None with fewer than 2 distinct N
    quadratic: Fit | None  # None with fewer than 3 distinct N
    exponent: float | None  # slope of log(time) against log(N)
    quadratic_share: float | None  # a*N_max^2 / quadratic(N_max)
    verdict: str  # "linear", "quadratic" or "undetermined (...)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "linear": None if self.linear is None else self.linear.to_dict(),
            "quadratic": None if self.quadratic is None else self.quadratic.to_dict(),
            "loglog_exponent": self.exponent,
            "quadratic_share_at_max_n": self.quadratic_share,
            "verdict": self.verdict,
            "rule": (
                f"quadratic when a*N^2 is >= {QUADRATIC_SHARE:.0%} of the quadratic fit at the largest N "
                "and the quadratic fit leaves at most half the line's squared residual; else linear"
            ),
        }


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    n = len(rhs)
    a = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def polyfit(xs: Sequence[float], ys: Sequence[float], degree: int) -> Fit | None:
    """Least squares polynomial of ``degree`` (1 or 2); None when the points cannot determine it."""
    if len(xs) != len(ys) or len(set(xs)) <= degree:
        return None
    scale = max(abs(x) for x in xs) or 1.0
    us = [x / scale for x in xs]
    k = degree + 1
    # Normal equations in u = x / scale, powers highest first.
    powers = [[u ** (degree - j) for j in range(k)] for u in us]
    matrix = [[sum(p[i] * p[j] for p in powers) for j in range(k)] for i in range(k)]
    rhs = [sum(p[i] * y for p, y in zip(powers, ys, strict=True)) for i in range(k)]
    solved = _solve(matrix, rhs)
    if solved is None:
        return None
    coefficients = tuple(c / scale ** (degree - j) for j, c in enumerate(solved))
    fit = Fit(degree, coefficients, 0.0, None)
    residual = sum((y - fit(x)) ** 2 for x, y in zip(xs, ys, strict=True))
    mean = sum(ys) / len(ys)
    total = sum((y - mean) ** 2 for y in ys)
    return Fit(degree, coefficients, residual, None if total == 0 else 1.0 - residual / total)


def loglog_exponent(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    line = polyfit([p[0] for p in points], [p[1] for p in points], 1)
    return None if line is None else line.coefficients[0]


def growth(ns: Sequence[float], times: Sequence[float]) -> Growth:
    linear = polyfit(ns, times, 1)
    quadratic = polyfit(ns, times, 2)
    exponent = loglog_exponent(ns, times)
    if linear is None or quadratic is None:
        return Growth(linear, quadratic, exponent, None, "undetermined (fewer than 3 distinct N)")
    n_max = max(ns)
    top = quadratic(n_max)
    share = quadratic.coefficients[0] * n_max**2 / top if top > 0 else None
    better = quadratic.residual <= 0.5 * linear.residual
    verdict = "quadratic" if share is not None and share >= QUADRATIC_SHARE and better else "linear"
    return Growth(linear, quadratic, exponent, share, verdict)
