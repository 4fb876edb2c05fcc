"""Reading and checking request bodies before anything reaches the child.

The size limit is checked twice: against ``Content-Length`` up front (refuse without reading), and by
counting bytes as they arrive (a chunked upload, or a client that lies about its length). llama-server
answers unparsable JSON with a 500; we answer 400, and say what is wrong without echoing the body.

What JSON we accept is stricter than Python's ``json`` and matches what the child and our own
re-serialisation can take (each was a 500 and a traceback before):
- UTF-8 only: ``json.loads`` on bytes also guesses UTF-16 and UTF-32, which the child refuses.
- no ``NaN``/``Infinity``, no number that overflows a double (``1e999``), no integer beyond 64 bits.
- nesting at most ``MAX_DEPTH`` deep (100,000 nested arrays overflowed the parser's recursion).
- no lone UTF-16 surrogate (``"\\ud800"``): it cannot be encoded as UTF-8 again.
The checks that walk the body only run when a cheap scan of the bytes says they may matter.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from starlette.types import Receive

from proxy.asgi.disconnect import ClientGone
from proxy.errors import BadRequest, PayloadTooLarge

# Deepest nesting of arrays and objects accepted. Real requests (tool and JSON schemas included) stay far
# below; Python's parser itself gives up near 1,000.
MAX_DEPTH = 64
# A surrogate escape (\ud800-\udfff) somewhere: only then can a lone one exist.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# 19 digits or more: only then can an integer exceed 64 bits (digits inside strings also match: harmless).
_LONG_DIGITS = re.compile(rb"[0-9]{19,}")
_INT64 = (-(2**63), 2**64 - 1)


class _Refused(ValueError):
    """A value the parser met that we refuse, with the reason shown to the client."""


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused("a number is out of range (it overflows a double)")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not _INT64[0] <= value <= _INT64[1]:
        raise _Refused("an integer is out of range (beyond 64 bits)")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Iterative (a recursive walk would fail the way the parser did)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


async def read_body(receive: Receive, content_length: int | None, limit: int) -> bytes:
    if content_length is not None and content_length > limit:
        raise PayloadTooLarge(f"request body of {content_length} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("request body is not UTF-8 encoded JSON") from None
    try:
        payload = json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=_int64 if _LONG_DIGITS.search(body) else None,
        )
    except _Refused as exc:
        raise BadRequest(f"request body is not acceptable JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(f"request body is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:
        detail = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise BadRequest(f"request body is not valid JSON{detail}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(payload).__name__}")
    # Each "[" or "{" opens at most one level: fewer than the limit in the whole body cannot exceed it.
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _depth_exceeds(payload, MAX_DEPTH):
        raise BadRequest(f"request body is nested more than {MAX_DEPTH} levels deep")
    if _SURROGATE_ESCAPE.search(body):
        try:
            dump(payload)
        except UnicodeEncodeError:
            raise BadRequest("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff)") from None
    return payload


def dump(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def with_field(raw: bytes, name: str, value: int) -> bytes:
    """``raw``, a JSON object that has no field ``name``, with ``"name": value`` added as its first field:
    a per-attempt field (the slot the request runs on) without serialising a long body again."""
    start = raw.index(b"{") + 1
    sep = b"" if raw[start:].lstrip().startswith(b"}") else b","
    return b'{"%s":%d%s%s' % (name.encode(), value, sep, raw[start:])
