"""Keeping one tenant from reading another's prompt-cache hits in its answers.

llama-server's prompt cache is shared by every request: a prompt that shares a prefix with a recent one
(any tenant's) is answered from the cache, and the answer says so: ``usage.prompt_tokens_details.
cached_tokens`` and ``timings`` (``cache_n``, ``prompt_n``, ``prompt_ms``). A tenant guessing another's
recent prompt could read the guess's quality there. These fields are removed from answers to keys that may
not see them (``TenantSettings.show_cache_details``; admin keys always see them).

Cost: a stream is still relayed event by event; only the events that carry one of the fields (the last
one or two of a stream: ``timings`` and the usage chunk) are parsed and written again. A chunk is
checked with a byte search, and only complete events are ever rewritten (``SseRewriter`` holds back an
unfinished event until its end arrives; llama-server writes each event whole, so it rarely has to).

What remains: the time to first token itself still depends on cache hits. ``cache_prompt: false``
(``TenantSettings.cache_prompt``) closes that for a tenant's own requests; see docs/security.md.
"""

from __future__ import annotations

import json
from typing import Any

# Names whose values tell cache hits: OpenAI usage details, llama.cpp timings and progress, Anthropic's
# usage field (for chat-shaped routes that answer in that format).
_HIDDEN = frozenset({"timings", "cached_tokens", "cache_n", "prompt_progress", "cache_read_input_tokens"})
_MARKERS = tuple(b'"' + name.encode() + b'"' for name in sorted(_HIDDEN))


def carries_detail(data: bytes) -> bool:
    # ``find``, not ``in``: see ``proxy.streams.openai`` (five markers per chunk of every stream of a key
    # that may not see cache details).
    return any(data.find(m) >= 0 for m in _MARKERS)


def strip(value: Any) -> Any:
    """``value`` without the hidden fields, at any depth; detail objects left empty are dropped too."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if key in _HIDDEN:
                continue
            cleaned = strip(item)
            if key.endswith("_tokens_details") and cleaned == {}:
                continue
            out[key] = cleaned
        return out
    if isinstance(value, list):
        return [strip(item) for item in value]
    return value


def strip_json(body: bytes) -> bytes:
    """A whole JSON answer without the hidden fields; unchanged when it has none or is not JSON."""
    if not carries_detail(body):
        return body
    try:
        value = json.loads(body)
    except ValueError:
        return body
    return _dump(strip(value))


def _dump(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _strip_event(event: bytes) -> bytes:
    """One SSE event (lines, no trailing blank line): its ``data:`` JSON without the hidden fields."""
    if not carries_detail(event):
        return event
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            try:
                value = json.loads(payload)
            except ValueError:
                continue
            lines[i] = b"data: " + _dump(strip(value))
    return b"\n".join(lines)


class SseRewriter:
    """Feed raw stream chunks, get back what may be sent: complete events, cleaned where needed."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        ready, self._pending = data[: end + 2], data[end + 2 :]
        if not carries_detail(ready):
            return ready
        events = ready[:-2].split(b"\n\n")
        return b"\n\n".join(_strip_event(e) for e in events) + b"\n\n"

    def flush(self) -> bytes:
        """What is left at the end of the stream: an unfinished event, sent as is (cleaned if it can be)."""
        rest, self._pending = self._pending, b""
        return _strip_event(rest) if rest else b""
