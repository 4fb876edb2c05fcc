"""What a request used, as the child reported it: prompt tokens, the cached part of them, completion
tokens, read from the answer on its way to the client (for the usage ledger and the budgets).

Each stream dialect says it somewhere else (pinned llama-server, tools/server/server-task.cpp):

- OpenAI chat and completions: ``usage`` (``prompt_tokens``, ``completion_tokens``,
  ``prompt_tokens_details.cached_tokens``) in a non-streamed answer, and in a stream only when the
  request asked for it (``stream_options.include_usage``), as a last chunk with ``"choices":[]``. A
  request with ``n`` > 1 or a prompt array has one such chunk per sequence: they are summed, as the
  proxy's assembled answer sums them (``proxy.streams.assemble``).
- llama-server's native API (``/completion``, ``/infill``): ``tokens_evaluated`` (the prompt),
  ``tokens_predicted`` and ``timings.cache_n`` on each sequence's last event (``"stop":true``), or in the
  whole answer (an array of them for a prompt array). Not ``tokens_cached``: that is the slot's whole
  cache after the answer (prompt and generated tokens).
- Responses: ``response.usage`` (``input_tokens``, ``output_tokens``, ``input_tokens_details``) in
  ``response.completed``, or ``usage`` in the whole answer.
- Anthropic Messages: ``input_tokens`` (the part not read from the cache) and ``cache_read_input_tokens``
  in ``message_start``, ``output_tokens`` in ``message_delta``; a whole answer's ``usage`` has all three.
- embeddings and rerank: ``usage.prompt_tokens`` of the OpenAI-shaped answers; llama-server's native
  ``/embeddings`` list reports no usage at all (charged as a request of 0 tokens).

Why a client stream is given ``include_usage`` rather than read from ``timings`` (``prompt_n``,
``cache_n``, ``predicted_n``, always on the last chunk): ``usage.prompt_tokens`` is the task's prompt
length, the number a client of a non-streamed answer sees, while ``prompt_n`` counts prompt tokens as
the slot's batches went through (server-context.cpp notes they are not counted for a slot released
before its batch is accounted), so only ``usage`` is the figure both kinds of client get, exactly. When
the proxy added ``include_usage`` (``strip``), the usage chunk it asked for is removed from what the
client receives, and the ``timings`` llama-server then puts on it go back onto the sequence's finishing
chunk, where they are without ``include_usage``: the client sees the stream it would have had.

Cost: chunks are searched for a few byte markers; only the few events that carry usage (one or two per
sequence) are parsed as JSON. Complete events only: an unfinished one waits for its end.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Usage:
    """Tokens of one request. ``reported``: the child's final figures arrived (else what is known of a
    request cut short: the completion tokens counted on the way, the prompt if it was reported)."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0
    reported: bool = False


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# -- one reader per dialect: (the parsed event or answer, the running usage) -> None -------------------
Reader = Callable[[dict[str, Any], Usage], None]


def _openai_event(obj: dict[str, Any], usage: Usage) -> None:
    u = obj.get("usage")
    if isinstance(u, dict):
        usage.prompt += _int(u.get("prompt_tokens"))
        usage.completion += _int(u.get("completion_tokens"))
        usage.cached += _int(_dict(u.get("prompt_tokens_details")).get("cached_tokens"))
        usage.reported = True
    elif (progress := obj.get("prompt_progress")) is not None and not usage.reported:
        usage.prompt = max(usage.prompt, _int(_dict(progress).get("total")))


def _native_event(obj: dict[str, Any], usage: Usage) -> None:
    if "tokens_evaluated" in obj:
        usage.prompt += _int(obj.get("tokens_evaluated"))
        usage.completion += _int(obj.get("tokens_predicted"))
        usage.cached += _int(_dict(obj.get("timings")).get("cache_n"))
        usage.reported = True
    elif (progress := obj.get("prompt_progress")) is not None and not usage.reported:
        usage.prompt = max(usage.prompt, _int(_dict(progress).get("total")))


def _responses_usage(u: dict[str, Any], usage: Usage) -> None:
    usage.prompt += _int(u.get("input_tokens"))
    usage.completion += _int(u.get("output_tokens"))
    usage.cached += _int(_dict(u.get("input_tokens_details")).get("cached_tokens"))
    usage.reported = True


def _responses_event(obj: dict[str, Any], usage: Usage) -> None:
    if obj.get("type") == "response.completed":
        _responses_usage(_dict(_dict(obj.get("response")).get("usage")), usage)


def _responses_whole(obj: dict[str, Any], usage: Usage) -> None:
    if isinstance(obj.get("usage"), dict):
        _responses_usage(obj["usage"], usage)


def _anthropic_usage(u: dict[str, Any], usage: Usage) -> None:
    if "input_tokens" in u:
        cached = _int(u.get("cache_read_input_tokens"))
        usage.prompt = _int(u.get("input_tokens")) + cached  # Anthropic's input_tokens excludes the cache
        usage.cached = cached
    if "output_tokens" in u:
        usage.completion = _int(u.get("output_tokens"))  # a running total: the last one counts


def _anthropic_event(obj: dict[str, Any], usage: Usage) -> None:
    kind = obj.get("type")
    if kind == "message_start":
        _anthropic_usage(_dict(_dict(obj.get("message")).get("usage")), usage)
    elif kind == "message_delta":
        _anthropic_usage(_dict(obj.get("usage")), usage)
        usage.reported = True


def _anthropic_whole(obj: dict[str, Any], usage: Usage) -> None:
    if isinstance(obj.get("usage"), dict):
        _anthropic_usage(obj["usage"], usage)
        usage.reported = True


@dataclass(frozen=True, slots=True)
class UsageFormat:
    """How one stream dialect reports usage (``proxy.streams.formats`` gives each format one)."""

    # Byte markers of the events worth parsing; an event without any of them is never parsed.
    markers: tuple[bytes, ...]
    event: Reader
    whole: Reader
    # The dialect can be asked for usage in a stream (OpenAI's stream_options.include_usage).
    asks: bool = False


OPENAI_USAGE = UsageFormat((b'"usage":{', b'"prompt_progress"'), _openai_event, _openai_event, asks=True)
NATIVE_USAGE = UsageFormat((b'"tokens_evaluated"', b'"prompt_progress"'), _native_event, _native_event)
RESPONSES_USAGE = UsageFormat((b'"response.completed"',), _responses_event, _responses_whole)
ANTHROPIC_USAGE = UsageFormat((b'"message_start"', b'"message_delta"'), _anthropic_event, _anthropic_whole)
EMBEDDING_USAGE = UsageFormat((b'"usage":{',), _openai_event, _openai_event)

_ADDED_USAGE = b'"choices":[]'
_FINISH = b'"finish_reason":"'


def _data(event: bytes) -> dict[str, Any] | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                obj = json.loads(line[5:])
            except ValueError:
                return None
            return obj if isinstance(obj, dict) else None
    return None


class UsageTap:
    """The usage of one answer, read on its way to the client. ``feed`` takes the child's raw stream
    chunks and gives back what may be sent on (the same bytes, unless ``strip``); ``flush`` at the end;
    ``whole`` a whole answer's body; ``answered`` the proxy's assembled answer. ``start`` begins again
    (a new attempt at the request: only the last one's usage is the request's)."""

    __slots__ = ("_held", "_pending", "fmt", "strip", "usage")

    def __init__(self, fmt: UsageFormat, *, strip: bool = False) -> None:
        self.fmt = fmt
        self.strip = strip
        self.usage = Usage()
        self._pending = b""  # the start of an event whose end has not arrived
        self._held = b""  # stripping: a finishing event, kept until we know what follows it

    def start(self) -> None:
        self.usage = Usage()
        self._pending = self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        # The usual case: llama-server writes whole events, and most carry no usage.
        if (
            not self._pending
            and not self._held
            and chunk.endswith(b"\n\n")
            and not any(m in chunk for m in self.fmt.markers)
            and not (self.strip and _FINISH in chunk)
        ):
            return chunk
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b"" if self.strip else chunk
        ready, self._pending = data[:end], data[end + 2 :]
        if not self.strip:
            self._read(ready)
            return chunk
        return self._rewrite(ready)

    def flush(self) -> bytes:
        """The end of the stream: what was held back, and an unfinished last event as it is."""
        rest, self._pending = self._pending, b""
        if rest and any(m in rest for m in self.fmt.markers) and (obj := _data(rest)) is not None:
            self.fmt.event(obj, self.usage)
        if not self.strip:
            return b""
        held, self._held = self._held, b""
        return (held + b"\n\n" if held else b"") + rest

    def _read(self, ready: bytes) -> None:
        markers = self.fmt.markers
        if not any(m in ready for m in markers):
            return
        for event in ready.split(b"\n\n"):
            if any(m in event for m in markers) and (obj := _data(event)) is not None:
                self.fmt.event(obj, self.usage)

    def _rewrite(self, ready: bytes) -> bytes:
        """Complete events (without their blank lines), less the added usage chunks; a finishing
        event is held back until the next event shows whether the timings must join it."""
        out: list[bytes] = []
        markers = self.fmt.markers
        for event in ready.split(b"\n\n"):
            obj = _data(event) if any(m in event for m in markers) else None
            if obj is not None:
                self.fmt.event(obj, self.usage)
                if _ADDED_USAGE in event and "usage" in obj:
                    timings = obj.get("timings")
                    if self._held.endswith(b"}") and isinstance(timings, dict):
                        extra = json.dumps(timings, separators=(",", ":")).encode()
                        self._held = self._held[:-1] + b',"timings":' + extra + b"}"
                    continue  # the chunk the proxy asked for is not the client's
            if self._held:
                out.append(self._held)
                self._held = b""
            if _FINISH in event:
                self._held = event
            else:
                out.append(event)
        return b"".join(e + b"\n\n" for e in out)

    def whole(self, body: bytes) -> None:
        """A whole answer (a JSON object; llama-server's native answer to a prompt array: an array)."""
        self.usage = Usage()
        try:
            value = json.loads(body)
        except ValueError:
            return
        for obj in value if isinstance(value, list) else [value]:
            if isinstance(obj, dict):
                self.fmt.whole(obj, self.usage)

    def answered(self, answer: dict[str, Any]) -> None:
        """The answer the proxy assembled from the child's stream: its usage is what the client gets."""
        self.usage = Usage()
        self.fmt.whole(answer, self.usage)
