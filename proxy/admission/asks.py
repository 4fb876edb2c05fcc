"""What a generation request may ask of admission in its headers, beside what its tenant gets.

- ``X-LlamaGate-Priority``: a level name (``interactive``, ``default``, ``batch``) or an integer 0-100.
  It may lower the request's priority below its tenant's ``priority``, never raise it: a higher value
  counts as the tenant's own (``proxy.admission.gate``: ``acquire(priority=...)`` clamps it), so a
  client cannot jump a queue by asking, and a batch job sharing an interactive tenant's key can step
  aside.
- ``X-LlamaGate-Max-Wait``: the longest the request waits in its queue, in seconds (a decimal number
  >= 0; ``0`` means "a slot now or a 429 now"). The tenant's ``queue_timeout_s`` caps it: a client can
  give up sooner, never hold a queue place longer.

A value that is not one of these, or a header given twice, is a 400 naming the header. Read once per
generation request from the headers the server already parsed; a request that sends neither (nearly
all) costs one pass over its header list and no allocation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from proxy.errors import BadRequest
from proxy.settings import parse_priority

PRIORITY_HEADER = b"x-llamagate-priority"
MAX_WAIT_HEADER = b"x-llamagate-max-wait"
_PRIORITY_NAME = "X-LlamaGate-Priority"
_MAX_WAIT_NAME = "X-LlamaGate-Max-Wait"
# Longer than any priority name or number: a longer value is refused without being decoded.
_MAX_LEN = 32


@dataclass(frozen=True, slots=True)
class Asked:
    """The request's own priority and maximum queue wait (None: the tenant's)."""

    priority: int | None = None
    max_wait_s: float | None = None


def asked(headers: Iterable[tuple[bytes, bytes]]) -> Asked | None:
    """What the request asks for, or None when it asks nothing; ``BadRequest`` naming a bad header."""
    priority: int | None = None
    max_wait_s: float | None = None
    for name, value in headers:
        if name == PRIORITY_HEADER:
            if priority is not None:
                raise BadRequest(f"{_PRIORITY_NAME} is given twice; send it once")
            priority = parse_priority_header(value)
        elif name == MAX_WAIT_HEADER:
            if max_wait_s is not None:
                raise BadRequest(f"{_MAX_WAIT_NAME} is given twice; send it once")
            max_wait_s = parse_max_wait_header(value)
    if priority is None and max_wait_s is None:
        return None
    return Asked(priority, max_wait_s)


def _text(name: str, value: bytes, expected: str) -> str:
    if len(value) > _MAX_LEN:
        raise BadRequest(f"{name} must be {expected} (got a value of {len(value)} bytes)")
    try:
        return value.decode("ascii").strip()
    except UnicodeDecodeError:
        raise BadRequest(f"{name} must be {expected} (got non-ASCII bytes)") from None


def parse_priority_header(value: bytes) -> int:
    expected = "interactive, default, batch or an integer 0-100"
    text = _text(_PRIORITY_NAME, value, expected)
    try:
        return parse_priority(text)
    except ValueError as exc:
        raise BadRequest(f"{_PRIORITY_NAME} {exc}") from None


def parse_max_wait_header(value: bytes) -> float:
    expected = "a number of seconds >= 0, e.g. 2.5"
    text = _text(_MAX_WAIT_NAME, value, expected)
    try:
        seconds = float(text)
    except ValueError:
        raise BadRequest(f"{_MAX_WAIT_NAME} must be {expected} (got {text!r})") from None
    # float() also reads "nan", "inf" and "1e400"; none is a wait.
    if not (math.isfinite(seconds) and seconds >= 0):
        raise BadRequest(f"{_MAX_WAIT_NAME} must be {expected} (got {text!r})")
    return seconds
