"""Times on the command line: durations (``30d``, ``12h``), dates (``2026-12-01``, ISO 8601) and how the
``keys`` and ``usage`` commands print them (UTC, to the minute). The grammar is the admin routes' too
(``proxy.accounts.report``); here a bad value names its flag."""

from __future__ import annotations

from proxy.accounts import report
from proxy.accounts.report import utc
from supervisor.errors import UsageError

__all__ = ["parse_duration", "parse_when", "utc"]


def parse_duration(flag: str, text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``30d``, ``2w`` -> seconds (> 0)."""
    try:
        return report.parse_duration(text)
    except ValueError as exc:
        raise UsageError(f"{flag} {text!r}: {exc}") from None


def parse_when(flag: str, text: str, now: float) -> float:
    """A point in time: a duration back from now (``7d``) or an ISO 8601 date or time (UTC unless it
    says otherwise) -> seconds since the epoch."""
    try:
        return report.parse_when(text, now)
    except ValueError as exc:
        raise UsageError(f"{flag} {text!r}: {exc}") from None
