"""How keys and usage are shown and asked for, the same for ``llamagate keys list`` / ``usage`` and the
admin routes (``GET /admin/keys``, ``GET /admin/usage``): times (durations like ``30d``, ISO 8601 dates,
UTC), a key's row (never its digest) and a usage report's JSON.

Parsing raises ``ValueError`` with what to give instead; each caller says which field or flag it was.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from typing import Any, get_args

from proxy.accounts.records import BUDGET_NAMES, GroupBy, KeyRecord, UsageRow

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
GROUPS: tuple[GroupBy, ...] = get_args(GroupBy)
SUMS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")
_GROUP_COLUMN = {"key": "key_id", "model": "model", "hour": "hour", "day": "day"}


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``30d``, ``2w`` -> seconds (> 0)."""
    match = _DURATION.fullmatch(text.strip())
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else 0.0
    if seconds <= 0:
        raise ValueError("give a duration like 30d, 12h, 30m or 90s")
    return seconds


def parse_when(text: str, now: float) -> float:
    """A point in time: a duration back from now (``7d``) or an ISO 8601 date or time (UTC unless it
    says otherwise) -> seconds since the epoch."""
    if _DURATION.fullmatch(text.strip()):
        return now - parse_duration(text)
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            "give a date (2026-12-01), a time (2026-12-01T10:00, UTC unless it has an offset) or a "
            "duration back from now (7d, 12h)"
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


def key_row(k: KeyRecord, now: float) -> dict[str, object]:
    """One key as ``keys list --format json`` and ``GET /admin/keys`` show it: never its digest."""
    return {
        "id": k.key_id,
        "tenant": k.tenant,
        "scopes": sorted(k.scopes),
        "name": k.name,
        "models": list(k.models),
        "created": utc(k.created, iso=True),
        "expires": utc(k.expires, iso=True) or None,
        "last_used": utc(k.last_used, iso=True) or None,
        "status": k.status(now),
        **{b: getattr(k.budgets, b) for b in BUDGET_NAMES},
    }


def usage_columns(by: GroupBy) -> list[str]:
    return ["tenant", *([_GROUP_COLUMN[by]] if by in _GROUP_COLUMN else []), *SUMS]


def usage_record(row: UsageRow, by: GroupBy) -> dict[str, Any]:
    out: dict[str, Any] = {"tenant": row.tenant}
    if by == "key":
        out["key_id"] = row.key_id
    elif by == "model":
        out["model"] = row.model
    elif by in ("hour", "day"):
        out[by] = utc(row.period, iso=True)
    return {**out, **{name: getattr(row, name) for name in SUMS}}


def usage_total(rows: Sequence[UsageRow]) -> dict[str, int]:
    return {name: sum(getattr(r, name) for r in rows) for name in SUMS}


def usage_report(rows: Sequence[UsageRow], by: GroupBy, since: float | None) -> dict[str, Any]:
    """``llamagate usage --format json`` and ``GET /admin/usage``: the rows, their total, and ``since``
    as the rollup reads it (the start of its hour)."""
    shown_since = utc(since // 3600 * 3600, iso=True) if since is not None else None
    return {
        "by": by,
        "since": shown_since,
        "rows": [usage_record(r, by) for r in rows],
        "total": usage_total(rows),
    }
