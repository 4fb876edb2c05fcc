"""The host's load average at the start and at the end of a benchmark, kept with its identity.

On a shared 2-core host another job's compiler halves a decode rate, so a recorded number means little
without how busy the machine was while it was taken. ``provenance.collect`` stores the start; a command
calls ``record_end`` when its runs are over, which adds the end to ``provenance.json`` and returns both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def load_average() -> dict[str, float] | None:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:  # not available on this platform
        return None
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def record_end(out: Path) -> dict[str, Any]:
    """Add the load average now to ``out/provenance.json`` (when there is one); ``{start, end}``."""
    end = load_average()
    path = out / "provenance.json"
    try:
        provenance = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"start": None, "end": end}
    window = provenance.get("load_average") if isinstance(provenance, dict) else None
    window = dict(window) if isinstance(window, dict) else {"start": None}
    window["end"] = end
    provenance["load_average"] = window
    path.write_text(json.dumps(provenance, indent=2, default=str) + "\n", encoding="utf-8")
    return window


def one_minute(window: Any) -> list[str]:
    """The 1-minute figures of a ``{start, end}`` window that are known, in that order."""
    ends = [window.get("start"), window.get("end")] if isinstance(window, dict) else []
    return [f"{e['1m']:g}" for e in ends if isinstance(e, dict) and isinstance(e.get("1m"), int | float)]


def describe(window: dict[str, Any] | None) -> str:
    """``load average 1.2 at the start, 3.4 at the end (1 min)``, or why it is unknown."""

    def one(v: Any) -> str:
        return f"{v['1m']:g}" if isinstance(v, dict) and isinstance(v.get("1m"), int | float) else "unknown"

    if not window:
        return "load average unknown"
    start, end = one(window.get("start")), one(window.get("end"))
    return f"load average {start} at the start, {end} at the end (1 min)"
