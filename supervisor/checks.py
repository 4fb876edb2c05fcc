"""A setting's range check: a callable taking the value and returning what is wrong with it, or None.

Shared by the config schema (``config/schema.py``) and the llama-server knobs (``launch/knobs.py``),
which declare checks for the same kinds of values.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], str | None]


def at_least(low: float) -> Check:
    return lambda v: None if v is None or v >= low else f"must be >= {low:g}"


def positive(v: Any) -> str | None:
    return None if v is None or v > 0 else "must be > 0"


def multiple_of_256(v: Any) -> str | None:
    # llama-server pads each slot's context to a multiple of 256; any other value would make the
    # served n_ctx differ from the configured one and fail the readiness gate.
    return None if v is None or (v >= 256 and v % 256 == 0) else "must be a multiple of 256 (>= 256)"


def matches(pattern: str, what: str) -> Check:
    """A string (or null) that fully matches ``pattern``, described as ``what``."""
    rx = re.compile(pattern)
    return lambda v: None if v is None or rx.fullmatch(v) else f"must be {what}"
