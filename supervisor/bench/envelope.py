"""The envelope of a sweep: the highest offered load that passes, the first that fails and why.

Loads are judged in increasing order. The envelope ends at the first failing load even if a higher
one passes again (noise on a shared host); such points are listed so nobody mistakes them for
capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.bench.summary import Summary


@dataclass(frozen=True)
class Point:
    label: str
    value: float
    summary: Summary


@dataclass(frozen=True)
class Envelope:
    highest_passing: str | None
    highest_passing_value: float | None
    first_failing: str | None
    first_failing_value: float | None
    failing_checks: tuple[str, ...]
    admitted_ok_at_first_failing: bool | None
    passed_after_failure: tuple[str, ...]

    def describe(self) -> str:
        if self.highest_passing is None and self.first_failing is None:
            return "no points"
        parts = []
        if self.highest_passing is None:
            parts.append("no load passed")
        else:
            parts.append(f"highest passing load {self.highest_passing}")
        if self.first_failing is None:
            parts.append("no load failed (the envelope may extend beyond the sweep)")
        else:
            why = ", ".join(self.failing_checks)
            admitted = "; the admitted requests met the gates" if self.admitted_ok_at_first_failing else ""
            parts.append(f"first failing {self.first_failing} ({why}{admitted})")
        if self.passed_after_failure:
            parts.append(
                "passed again after a failure (not counted): " + ", ".join(self.passed_after_failure)
            )
        return "; ".join(parts)


def find_envelope(points: Sequence[Point]) -> Envelope:
    ordered = sorted(points, key=lambda p: p.value)
    highest: Point | None = None
    failing: Point | None = None
    after: list[str] = []
    for point in ordered:
        passed = point.summary.verdict.passed
        if failing is None:
            if passed:
                highest = point
            else:
                failing = point
        elif passed:
            after.append(point.label)
    return Envelope(
        highest_passing=highest.label if highest else None,
        highest_passing_value=highest.value if highest else None,
        first_failing=failing.label if failing else None,
        first_failing_value=failing.value if failing else None,
        failing_checks=failing.summary.verdict.failing if failing else (),
        admitted_ok_at_first_failing=failing.summary.verdict.admitted_ok if failing else None,
        passed_after_failure=tuple(after),
    )
