"""What a request used, as the child reported it: prompt tokens, the cached part of them, completion
tokens, read from the answer on its way to the client (for the usage ledger and the budgets). The answer
goes on unchanged: the tap only reads.

Each stream dialect says it somewhere else (pinned llama-server, tools/server/server-task.cpp):

- OpenAI chat and completions: ``usage`` (``prompt_tokens``, ``completion_tokens``,
  ``prompt_tokens_details.cached_tokens``) in a non-streamed answer, in a completions stream's last chunk,
  and in a chat stream when the client asked for it (``stream_options.include_usage``). A chat stream
  that did not ask carries ``timings`` on each sequence's last chunk instead (``cache_n``, ``prompt_n``,
  ``predicted_n``), and those are read: they are the same counters (server-context.cpp fills the usage's
  ``n_prompt_tokens_cache`` from ``stats.n_prompt_cached`` and ``n_decoded`` from ``stats.n_gen``, which
  ``timings`` prints as ``cache_n`` and ``predicted_n``), and every prompt token not taken from the cache
  is counted in ``prompt_n`` as the slot's batches process it, so ``cache_n + prompt_n`` is the task's
  prompt length, ``usage.prompt_tokens``; the children of ``n`` > 1 copy their parent's counters with its
  state. So the ledger gets exactly what ``usage`` would have said, without asking the child for a chunk
  the client did not want (and taking it out again). A request with ``n`` > 1 or a prompt array reports
  once per sequence: summed, as the proxy's assembled answer sums ``usage`` (``proxy.streams.assemble``);
  with ``timings_per_token`` each sequence's last figures count.
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

Cost: nothing per chunk. A stream's meter already searches every chunk for the child's own count, and
keeps the chunks that carry it (``StreamMeter.reports``, ``EventMeter.reports``): a sequence's last one
or two. Those alone are parsed as JSON, once, after the stream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Usage:
    """Tokens of one request. ``reported``: the child's final figures arrived (else what is known of a
    request cut short: the completion tokens counted on the way, the prompt if it was reported)."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0
    reported: bool = False
    # A chat stream without usage: each sequence's latest timings, by choice index (prompt_n, cache_n,
    # predicted_n); ``final`` makes them the usage when no ``usage`` came.
    timings: dict[int, tuple[int, int, int]] | None = None
    # For OpenTelemetry (``proxy.telemetry``): the answer's id and why each sequence stopped, as the
    # dialect names it (OpenAI's finish_reason, Anthropic's stop_reason, the native stop_type...). Not
    # part of a usage's equality: that is its figures.
    response_id: str | None = field(default=None, compare=False)
    finish_reasons: list[str] | None = field(default=None, compare=False)

    def finished(self, reason: Any) -> None:
        if isinstance(reason, str) and reason:
            if self.finish_reasons is None:
                self.finish_reasons = []
            self.finish_reasons.append(reason)

    def answer_id(self, value: Any) -> None:
        if isinstance(value, str) and value and self.response_id is None:
            self.response_id = value

    def final(self) -> Usage:
        """This usage with the timings made its figures (once: then it is ``reported``)."""
        if self.reported or not self.timings:
            return self
        prompt = cached = completion = 0
        for processed, from_cache, predicted in self.timings.values():
            prompt += processed + from_cache
            cached += from_cache
            completion += predicted
        self.prompt, self.cached, self.completion, self.reported = prompt, cached, completion, True
        self.timings = None  # folded in
        return self


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# -- one reader per dialect: (the parsed event or answer, the running usage) -> None -------------------
Reader = Callable[[dict[str, Any], Usage], None]


def _openai_event(obj: dict[str, Any], usage: Usage) -> None:
    usage.answer_id(obj.get("id"))
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            usage.finished(choice.get("finish_reason"))
    u = obj.get("usage")
    if isinstance(u, dict):
        usage.prompt += _int(u.get("prompt_tokens"))
        usage.completion += _int(u.get("completion_tokens"))
        usage.cached += _int(_dict(u.get("prompt_tokens_details")).get("cached_tokens"))
        usage.reported = True
        return
    timings = obj.get("timings")
    if isinstance(timings, dict):
        first = choices[0] if isinstance(choices, list) and choices else None
        index = first.get("index", 0) if isinstance(first, dict) else 0
        if usage.timings is None:
            usage.timings = {}
        usage.timings[index if isinstance(index, int) else 0] = (
            _int(timings.get("prompt_n")),
            _int(timings.get("cache_n")),
            _int(timings.get("predicted_n")),
        )


def _native_event(obj: dict[str, Any], usage: Usage) -> None:
    if "tokens_evaluated" in obj:
        usage.finished(obj.get("stop_type"))
        usage.prompt += _int(obj.get("tokens_evaluated"))
        usage.completion += _int(obj.get("tokens_predicted"))
        usage.cached += _int(_dict(obj.get("timings")).get("cache_n"))
        usage.reported = True


def _responses_usage(u: dict[str, Any], usage: Usage) -> None:
    usage.prompt += _int(u.get("input_tokens"))
    usage.completion += _int(u.get("output_tokens"))
    usage.cached += _int(_dict(u.get("input_tokens_details")).get("cached_tokens"))
    usage.reported = True


def _responses_event(obj: dict[str, Any], usage: Usage) -> None:
    if obj.get("type") == "response.completed":
        _responses_whole(_dict(obj.get("response")), usage)


def _responses_whole(obj: dict[str, Any], usage: Usage) -> None:
    usage.answer_id(obj.get("id"))
    usage.finished(obj.get("status"))
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
        message = _dict(obj.get("message"))
        usage.answer_id(message.get("id"))
        _anthropic_usage(_dict(message.get("usage")), usage)
    elif kind == "message_delta":
        usage.finished(_dict(obj.get("delta")).get("stop_reason"))
        _anthropic_usage(_dict(obj.get("usage")), usage)
        usage.reported = True


def _anthropic_whole(obj: dict[str, Any], usage: Usage) -> None:
    usage.answer_id(obj.get("id"))
    usage.finished(obj.get("stop_reason"))
    if isinstance(obj.get("usage"), dict):
        _anthropic_usage(obj["usage"], usage)
        usage.reported = True


# llama-server writes compact JSON (nlohmann's dump): an OpenAI stream's report is read from its bytes
# with these, as the stream meters read counts (``proxy.streams.openai``); a whole parse of the chunk
# cost the proxy more than the rest of the ledger together. ``"prompt_tokens":`` is not
# ``"prompt_tokens_details":`` (the colon follows the quote).
_FIGURES = {
    name: re.compile(rb'"' + name.encode() + rb'":(\d+)')
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "prompt_n", "cache_n", "predicted_n")
}
_INDEX = re.compile(rb'"index":(\d+)')
# A chunk's id and a sequence's finish reason (for OpenTelemetry), read from the same report bytes.
_ID = re.compile(rb'"id":"([^"\\]{1,200})"')
_FINISH = re.compile(rb'"finish_reason":"([a-z_]{1,40})"')
# The timings as llama-server writes them (server_slot_stats::to_json, in its order): cache_n, prompt_n,
# then predicted_n after the prompt's other figures. Another order is read figure by figure.
_TIMINGS = re.compile(rb'"timings":\{"cache_n":(\d+),"prompt_n":(\d+),[^}]*?"predicted_n":(\d+)')


_PROMPT, _COMPLETION = _FIGURES["prompt_tokens"], _FIGURES["completion_tokens"]
_CACHED, _PROMPT_N = _FIGURES["cached_tokens"], _FIGURES["prompt_n"]
_CACHE_N, _PREDICTED_N = _FIGURES["cache_n"], _FIGURES["predicted_n"]


def _figure(pattern: re.Pattern[bytes], event: bytes) -> int:
    found = pattern.search(event)
    return int(found.group(1)) if found else 0


def _openai_report(event: bytes, usage: Usage) -> None:
    """One event of an OpenAI stream that has a marker: its usage, else its timings (by choice)."""
    if usage.response_id is None and (found_id := _ID.search(event)) is not None:
        usage.response_id = found_id.group(1).decode()
    for reason in _FINISH.finditer(event):
        usage.finished(reason.group(1).decode())
    if event.find(b'"usage":{') >= 0:  # not ``in``: see ``proxy.streams.openai``
        usage.prompt += _figure(_PROMPT, event)
        usage.completion += _figure(_COMPLETION, event)
        usage.cached += _figure(_CACHED, event)
        usage.reported = True
        return
    # Once per sequence of a stream: llama-server's own order found in one search, else each figure.
    index = _INDEX.search(event)
    if usage.timings is None:
        usage.timings = {}
    found = _TIMINGS.search(event)
    if found is not None:
        from_cache, processed, predicted = found.groups()
        figures = (int(processed), int(from_cache), int(predicted))
    else:
        figures = (_figure(_PROMPT_N, event), _figure(_CACHE_N, event), _figure(_PREDICTED_N, event))
    usage.timings[int(index.group(1)) if index else 0] = figures


@dataclass(frozen=True, slots=True)
class UsageFormat:
    """How one stream dialect reports usage (``proxy.streams.formats`` gives each format one)."""

    # One of these is in every event that reports usage: of a stream's report chunks, only the events
    # that have one are parsed.
    markers: tuple[bytes, ...]
    event: Reader
    whole: Reader
    # Reads a stream's report event from its bytes (instead of ``event`` on the parsed JSON).
    report: Callable[[bytes, Usage], None] | None = None


OPENAI_USAGE = UsageFormat((b'"usage":{', b'"timings":{'), _openai_event, _openai_event, _openai_report)
NATIVE_USAGE = UsageFormat((b'"tokens_evaluated":',), _native_event, _native_event)
RESPONSES_USAGE = UsageFormat((b'"response.completed"',), _responses_event, _responses_whole)
ANTHROPIC_USAGE = UsageFormat((b'"message_',), _anthropic_event, _anthropic_whole)  # _start, _delta
EMBEDDING_USAGE = UsageFormat((b'"usage":{',), _openai_event, _openai_event)


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
    """The usage of one answer: a whole answer's body (``whole``), the proxy's assembled answer
    (``answered``), or, when neither came, a stream's report chunks as its meter kept them
    (``proxy.streams.openai.StreamMeter.reports``), read by ``result``. ``start`` begins again (a new
    attempt at the request: only the last one's usage is the request's)."""

    __slots__ = ("_answered", "fmt", "usage")

    def __init__(self, fmt: UsageFormat) -> None:
        self.fmt = fmt
        self.usage = Usage()
        self._answered = False

    def start(self) -> None:
        self.usage = Usage()
        self._answered = False

    def whole(self, body: bytes) -> None:
        """A whole answer (a JSON object; llama-server's native answer to a prompt array: an array)."""
        self.start()
        self._answered = True
        try:
            value = json.loads(body)
        except ValueError:
            return
        for obj in value if isinstance(value, list) else [value]:
            if isinstance(obj, dict):
                self.fmt.whole(obj, self.usage)

    def answered(self, answer: dict[str, Any]) -> None:
        """The answer the proxy assembled from the child's stream: its usage is what the client gets."""
        self.start()  # a new attempt's answer: only it counts
        self._answered = True
        self.fmt.whole(answer, self.usage)

    def result(self, reports: Sequence[bytes] = ()) -> Usage:
        """What the answer reported; for a stream, read from ``reports`` (its meter's report chunks;
        timings made usage where it sent no ``usage``)."""
        if not self._answered and reports:
            usage = self.usage = Usage()
            fmt = self.fmt
            data = reports[0] if len(reports) == 1 else b"".join(reports)
            for event in data.split(b"\n\n") if data.count(b"\n\n") > 1 else (data,):
                for marker in fmt.markers:
                    if event.find(marker) >= 0:  # not ``in``: see ``proxy.streams.openai``
                        if fmt.report is not None:
                            fmt.report(event, usage)
                        elif (obj := _data(event)) is not None:
                            fmt.event(obj, usage)
                        break
        return self.usage.final()
