"""Reading and checking request bodies before anything reaches the child.

The size limit is checked twice: against ``Content-Length`` up front (refuse without reading), and by
counting bytes as they arrive (a chunked upload, or a client that lies about its length). llama-server
answers unparsable JSON with a 500; we answer 400, and say what is wrong without echoing the body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.types import Receive

from proxy.disconnect import ClientGone
from proxy.errors import BadRequest, ModelNotFound, PayloadTooLarge

# Fields that bound the number of generated tokens, in the OpenAI API (Responses: max_output_tokens)
# and llama.cpp's own.
_MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")


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
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        detail = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise BadRequest(f"request body is not valid JSON{detail}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(payload).__name__}")
    return payload


def check_model(payload: Mapping[str, Any], served: str, aliases: tuple[str, ...]) -> bool:
    """Raise ``ModelNotFound`` for a model we do not serve; True when the name must be rewritten to
    ``served`` (a configured alias). A missing ``model`` is accepted: there is only one."""
    model = payload.get("model")
    if model is None or model == served:
        return False
    if isinstance(model, str) and model in aliases:
        return True
    shown = model if isinstance(model, str) and len(model) <= 200 else "(invalid)"
    raise ModelNotFound(f"The model '{shown}' does not exist; this server serves '{served}'")


def cap_max_tokens(payload: dict[str, Any], cap: int) -> bool:
    """Bound every token-limit field by ``cap`` (adding ``max_tokens`` when none is set). True if changed."""
    changed = False
    present = False
    for name in _MAX_TOKEN_FIELDS:
        value = payload.get(name)
        if value is None:
            continue
        present = True
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRequest(f"'{name}' must be an integer")
        if value < 0 or value > cap:
            payload[name] = cap
            changed = True
    if not present:
        payload["max_tokens"] = cap
        changed = True
    return changed


def dump(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
