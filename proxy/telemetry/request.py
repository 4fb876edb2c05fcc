"""What the endpoint tells telemetry of a request before it runs: its GenAI operation and the parameters
the conventions name (``gen_ai.request.*``), read from the body the client sent. Numbers only: a stop
sequence is the client's text, and text never leaves the process."""

from __future__ import annotations

from typing import Any

from proxy.asgi.context import GenAI
from proxy.schema.routes import with_role

# A route's kind (``proxy.routes.table``) -> gen_ai.operation.name. "rerank" has no well-known value.
OPERATIONS = {"chat": "chat", "completion": "text_completion", "embedding": "embeddings", "rerank": "rerank"}

# gen_ai.request.* <- the body's field, in each dialect's spelling (OpenAI, Anthropic, Responses, native):
# the token cap and the completion count are every field the schema declares one (``Field.roles``).
_PARAMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gen_ai.request.max_tokens", with_role("token_cap")),
    ("gen_ai.request.temperature", ("temperature",)),
    ("gen_ai.request.top_p", ("top_p",)),
    ("gen_ai.request.top_k", ("top_k",)),
    ("gen_ai.request.frequency_penalty", ("frequency_penalty",)),
    ("gen_ai.request.presence_penalty", ("presence_penalty",)),
    ("gen_ai.request.seed", ("seed",)),
    ("gen_ai.request.choice.count", with_role("n")),
)


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def genai_for(kind: str, headers: list[tuple[bytes, bytes]]) -> GenAI:
    """The request's ``GenAI`` record, with the caller's W3C trace context when it sent one."""
    traceparent = tracestate = None
    for name, value in headers:
        if name == b"traceparent":
            traceparent = value.decode("latin-1")
        elif name == b"tracestate":
            tracestate = value.decode("latin-1")
    return GenAI(OPERATIONS.get(kind, kind), traceparent, tracestate)


def read_params(payload: dict[str, Any]) -> dict[str, int | float]:
    """The gen_ai.request.* figures of ``payload`` (``RequestContext.request_params``)."""
    params: dict[str, int | float] = {}
    for attribute, fields in _PARAMS:
        for field in fields:
            value = _number(payload.get(field))
            if value is not None:
                params[attribute] = value
                break
    return params
