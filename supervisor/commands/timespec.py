"""Times on the command line: durations (``30d``, ``12h``), dates (``2026-12-01``, ISO 8601) and how the
``keys`` and ``usage`` commands print them (UTC, to the minute)."""

from __future__ import annotations

import datetime as dt
import re

from supervisor.errors import UsageError

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(flag: str, text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``30d``, ``2w`` -> seconds (> 0)."""
    match = _DURATION.fullmatch(text.strip())
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else 0.0
    if seconds <= 0:
        raise UsageError(f"{flag} {text!r}: give a duration like 30d, 12h, 30m or 90s")
    return seconds


def parse_when(flag: str, text: str, now: float) -> float:
    """A point in time: a duration back from now (``7d``) or an ISO 8601 date or time (UTC unless it
    says otherwise) -> seconds since the epoch."""
    if _DURATION.fullmatch(text.strip()):
        return now - parse_duration(flag, text)
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(
            f"{flag} {text!r}: give a date (2026-12-01), a time (2026-12-01T10:00, UTC unless it has an "
            "offset) or a duration back from now (7d, 12h)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def utc(seconds: float | None, *, iso: bool = False) -> str:
    """``2026-12-01 10:00`` (tables) or ``2026-12-01T10:00:00Z`` (JSON, CSV); '' for None."""
    if seconds is None:
        return ""
    when = dt.datetime.fromtimestamp(seconds, dt.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ") if iso else when.strftime("%Y-%m-%d %H:%M")
