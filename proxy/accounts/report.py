"""How keys and usage are shown and asked for, the same for ``llamagate keys list`` / ``usage`` and the
admin routes (``GET /admin/keys``, ``GET /admin/usage``): times (durations like ``30d``, ISO 8601 dates,
UTC), a key's row (never its digest) and a usage report's JSON.

Parsing raises ``ValueError`` with what to give instead; each caller says which field or flag it was.
Every value has a range, so nothing that could not be shown again is ever stored: a duration is at most
``MAX_DURATION`` (100 years: an expiry stays inside the calendar that ``datetime`` and both engines
render), a point in time lies between the epoch and the end of year 9999, a budget is a whole number
from 1 to ``MAX_BUDGET``. A row a store holds that is out of these ranges anyway (written by hand, or by
an older llamagate) is still listed: ``utc`` shows such a time as ``invalid (<seconds>)``.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from typing import Any, get_args

from proxy.accounts.records import BUDGET_NAMES, GroupBy, KeyRecord, UsageRow

_DURATION = re.compile(r"(\d{1,12}(?:\.\d{1,9})?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The longest duration (an expiry, a grace, how far back a report reads): 100 years.
MAX_DURATION = 100 * 365 * 86400
# The latest point in time shown or accepted: the end of year 9999, the calendar's last (``datetime``).
LATEST = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC).timestamp()
# The largest budget: a trillion tokens or requests. Far above any real limit, well inside both engines'
# 64-bit integers and the exact integers of Redis's Lua numbers (2**53) that count the shared windows.
MAX_BUDGET = 10**12
GROUPS: tuple[GroupBy, ...] = get_args(GroupBy)
SUMS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")
_GROUP_COLUMN = {"key": "key_id", "model": "model", "hour": "hour", "day": "day"}


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``30d``, ``2w`` -> seconds (> 0, at most ``MAX_DURATION``)."""
    match = _DURATION.fullmatch(text.strip())
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else 0.0
    if seconds <= 0:
        raise ValueError("give a duration like 30d, 12h, 30m or 90s")
    if seconds > MAX_DURATION:
        raise ValueError(f"a duration is at most 100 years ({MAX_DURATION // 86400}d)")
    return seconds


def parse_when(text: str, now: float) -> float:
    """A point in time: a duration back from now (``7d``) or an ISO 8601 date or time (UTC unless it
    says otherwise) -> seconds since the epoch."""
    if _DURATION.fullmatch(text.strip()):
        return max(0.0, now - parse_duration(text))
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            "give a date (2026-12-01), a time (2026-12-01T10:00, UTC unless it has an offset) or a "
            "duration back from now (7d, 12h)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    try:
        # An offset can carry a time at either end of the calendar past it (9999-12-31T23:59-23:59).
        seconds = when.astimezone(dt.UTC).timestamp()
    except (OverflowError, ValueError):
        seconds = -1.0
    if not 0 <= seconds <= LATEST:
        raise ValueError("give a time between 1970-01-01 and 9999-12-31 (UTC)")
    return seconds


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A key id in the ledger: a key's 12 hex digits, or the id the proxy gives requests without a key.
_KEY_ID = re.compile(r"[!-~]{1,64}")


def check_tenant_name(text: str) -> str:
    """A tenant name as the configuration allows one (a filter of a report)."""
    if not _NAME.fullmatch(text):
        raise ValueError("a tenant name: letters, digits, '.', '_' or '-' (at most 64)")
    return text


def check_key_id(text: str) -> str:
    if not _KEY_ID.fullmatch(text):
        raise ValueError("a key id: up to 64 printable characters without spaces (the id of keys list)")
    return text


def check_budget(value: object) -> int | None:
    """A budget as given (JSON or a flag's number): a whole number from 1 to ``MAX_BUDGET``, or None."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BUDGET:
        raise ValueError(f"a whole number >= 1 and at most {MAX_BUDGET} (10**12)")
    return value


def utc(seconds: float | None, *, iso: bool = False) -> str:
    """``2026-12-01 10:00`` (tables) or ``2026-12-01T10:00:00Z`` (JSON, CSV); '' for None; ``invalid
    (<seconds>)`` for a time outside the calendar (a row stored before its range was checked)."""
    if seconds is None:
        return ""
    try:
        when = dt.datetime.fromtimestamp(seconds, dt.UTC)
    except (OverflowError, ValueError, OSError):
        return f"invalid ({seconds!r})"
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
