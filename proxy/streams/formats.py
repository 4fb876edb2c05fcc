"""How each generation route's answer is measured and how an error ends its stream.

One ``StreamFormat`` per route kind (see ``proxy.routes.table``): llama-server speaks four stream dialects
from the same slot machinery (``format_oai_sse``, ``format_oai_resp_sse`` and ``format_anthropic_sse``
in server-common.cpp, and its native one), and each hides the first token and the token count in a
different place. The relay stays byte-for-byte; only the meter, the last error event, how a whole
(non-streamed) answer reports its token count, how an error body is shaped and where the answer says
what it used (``proxy.streams.usage``) differ."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from proxy.errors import ProxyError
from proxy.streams import anthropic
from proxy.streams.events import EventMeter, EventSpec
from proxy.streams.meter import Meter
from proxy.streams.openai import StreamMeter, count_tokens_in_body
from proxy.streams.usage import (
    ANTHROPIC_USAGE,
    EMBEDDING_USAGE,
    NATIVE_USAGE,
    OPENAI_USAGE,
    RESPONSES_USAGE,
    UsageFormat,
)


def _openai_error_event(error: ProxyError) -> bytes:
    return error.sse_event()


def _same(status: int, content: bytes) -> bytes:
    return content


@dataclass(frozen=True)
class StreamFormat:
    name: str
    meter: Callable[[], Meter]
    # Generated tokens of a whole answer (0 when it does not say).
    count_tokens: Callable[[bytes], int]
    # The one event that ends a stream whose 200 already went out.
    error_event: Callable[[ProxyError], bytes] = _openai_error_event
    # The body of an error answered by the child, as this route's clients expect it.
    error_body: Callable[[int, bytes], bytes] = _same
    # Where the answer reports prompt, cached and completion tokens (the usage ledger reads them).
    usage: UsageFormat = OPENAI_USAGE
    # The bytes of the event that ends a stream, once per stream (``proxy.asgi.disconnect``: a client
    # that leaves once it has it had the whole answer); None where only the connection's end says so.
    end: bytes | None = None


def _count(pattern: bytes) -> Callable[[bytes], int]:
    rx = re.compile(pattern)

    def count(body: bytes) -> int:
        found = rx.findall(body)
        return int(found[-1]) if found else 0

    return count


# Chat and text completions (/v1/...): ``data: {json}`` per token, ``data: [DONE]`` at the end.
OPENAI = StreamFormat("openai", StreamMeter, count_tokens_in_body, end=b"data: [DONE]")

# llama-server's own API (/completion, /completions, /infill): ``data: {"content":"..."}`` per token, no
# ``[DONE]``; the last event has ``timings.predicted_n`` (the OpenAI meter reads exactly these fields).
# No end event: each prompt of an array ends with its own ``"stop":true``, only the connection's end
# says the last one is out.
_TOKENS_PREDICTED = _count(rb'"tokens_predicted":(\d+)')
NATIVE = StreamFormat(
    "native", StreamMeter, lambda b: _TOKENS_PREDICTED(b) or count_tokens_in_body(b), usage=NATIVE_USAGE
)

_RESPONSES_SPEC = EventSpec(
    delta_events=(
        b"response.output_text.delta",
        b"response.reasoning_text.delta",
        b"response.function_call_arguments.delta",
    ),
    first_text=re.compile(rb'"delta":"[^"]'),
    reported=re.compile(rb'"output_tokens":(\d+)'),
)
# OpenAI Responses: typed events; text in ``response.output_text.delta``, usage in ``response.completed``.
RESPONSES = StreamFormat(
    "responses",
    lambda: EventMeter(_RESPONSES_SPEC),
    _count(rb'"output_tokens":(\d+)'),
    usage=RESPONSES_USAGE,
    end=b"event: response.completed",
)

_ANTHROPIC_SPEC = EventSpec(
    delta_events=(b"content_block_delta",),
    first_text=re.compile(rb'"(?:text|thinking|partial_json)":"[^"]'),
    reported=re.compile(rb'"output_tokens":(\d+)'),
)
# Anthropic Messages: ``content_block_delta`` per piece, ``message_delta`` carries usage.output_tokens.
ANTHROPIC = StreamFormat(
    "anthropic",
    lambda: EventMeter(_ANTHROPIC_SPEC),
    _count(rb'"output_tokens":(\d+)'),
    error_event=anthropic.error_event,
    error_body=anthropic.convert_error_body,
    usage=ANTHROPIC_USAGE,
    end=b"event: message_stop",
)

# Embeddings and reranking: never streamed, no generated tokens.
SILENT = StreamFormat("silent", StreamMeter, lambda body: 0, usage=EMBEDDING_USAGE)
