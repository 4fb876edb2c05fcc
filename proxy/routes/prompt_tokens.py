"""A request's prompt in tokens, for the charge of a request cut short and for the prompt-size check: the
child's own tokenizer and chat template when a READY child can count it (``/tokenize``, the
``input_tokens`` and ``count_tokens`` routes), else an estimate from the prompt's bytes. It serves the
charge (``proxy.routes.charge``) and the admission check (``PromptCheck``), not the endpoint.
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.asgi import body
from proxy.errors import BadRequest, UpstreamFailure, UpstreamTimeout
from proxy.schema.routes import with_role
from proxy.source import UpstreamSnapshot
from proxy.state import ProxyState
from proxy.upstream.connection import UpstreamClosed

# How long the charge of a request cut short waits for the child to count its prompt.
CHARGE_COUNT_S = 5.0
# Where a request's prompt text is, by dialect: chat messages, completions' prompt, embeddings' input,
# Anthropic's system, Responses' instructions and input, infill's prefix, suffix and files: every field
# the schema declares a ``prompt``.
_PROMPT_FIELDS = with_role("prompt")


def estimate_prompt_tokens(payload: dict[str, Any]) -> int:
    """A prompt's tokens without a tokenizer: a quarter of its text's UTF-8 bytes (the usual rule of thumb
    for byte-pair tokenizers on English), at least 1."""
    size = sum(_text_bytes(payload.get(name)) for name in _PROMPT_FIELDS)
    return max(1, -(-size // 4))


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    return 0


# The child's own counter for a templated request: its chat template, not ours.
COUNT_ROUTES = {
    "/v1/chat/completions": "/v1/chat/completions/input_tokens",
    "/chat/completions": "/v1/chat/completions/input_tokens",
    "/v1/responses": "/v1/responses/input_tokens",
    "/responses": "/v1/responses/input_tokens",
    "/v1/messages": "/v1/messages/count_tokens",
}


async def count_prompt_tokens(
    state: ProxyState, snap: UpstreamSnapshot, route: str, payload: dict[str, Any], request_id: str
) -> int | None:
    """Exact prompt size from the child's own tokenizer and chat template; None when it cannot be told
    (then the child decides, as it would without the check)."""
    counter = COUNT_ROUTES.get(route)
    if counter is not None:
        answer = await _ask(state, snap, counter, body.dump(payload), request_id)
        count = answer.get("input_tokens") if answer else None
        return count if isinstance(count, int) else None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    prompts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    longest: int | None = None
    for text in prompts:
        if not isinstance(text, str):
            return None
        answer = await _ask(
            state, snap, "/tokenize", body.dump({"content": text, "add_special": True}), request_id
        )
        tokens = answer.get("tokens") if answer else None
        if not isinstance(tokens, list):
            return None
        longest = max(longest or 0, len(tokens))
    return longest


async def _ask(
    state: ProxyState, snap: UpstreamSnapshot, path: str, raw: bytes, request_id: str
) -> dict[str, Any]:
    limit = state.settings.timeouts.first_token_s
    try:
        async with asyncio.timeout(limit):
            response = await state.upstream.open(snap, "POST", path, raw, request_id)
            try:
                content = await response.read()
            except UpstreamClosed:
                raise UpstreamFailure(
                    "llama-server closed the connection while counting the prompt's tokens"
                ) from None
            finally:
                response.release()
    except TimeoutError:
        raise UpstreamTimeout(f"llama-server did not count the prompt's tokens within {limit:g} s") from None
    if response.status != 200:
        return {}
    try:
        answer = body.parse_object(content)
    except BadRequest:
        return {}
    return answer
