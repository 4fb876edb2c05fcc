"""A request's prompt in tokens, for the charge of a request cut short and for the prompt-size check: the
child's own tokenizer and chat template when a READY child can count it (``/tokenize``, the
``input_tokens`` and ``count_tokens`` routes), else an estimate from the prompt's bytes.

The endpoint makes one ``PromptTokens`` per request and hands it on to the two that count, never counting
itself: the admission pipeline's prompt check (``Ask.check``, run by ``PromptCheck``: ``check``) and the
request's account (``proxy.routes.charge``: ``for_charge``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.asgi import body
from proxy.errors import BadRequest, ContextTooLarge, ProxyError, UpstreamFailure, UpstreamTimeout
from proxy.models.lane import Lane
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


class PromptTokens:
    """One request's prompt, counted by a READY child of its model (``lane``) with the counter of its
    ``route``. ``payload`` is its body as checked (``proxy.schema``), with the child's own name for the
    model: never the stream the endpoint may make of it for the child (``proxy.streams.assemble``)."""

    __slots__ = ("_lane", "_payload", "_request_id", "_route", "_state")

    def __init__(
        self, state: ProxyState, lane: Lane, route: str, payload: dict[str, Any], request_id: str
    ) -> None:
        self._state = state
        self._lane = lane
        self._route = route
        self._payload = payload
        self._request_id = request_id

    async def check(self) -> None:
        """The prompt-size check, when its tenant asks for one (``TenantSettings.check_prompt_size``):
        ``ContextTooLarge`` (a 400 shaped as the child's own) for a prompt its slot cannot hold. A prompt
        that cannot be counted goes on: the child decides, as it would without the check."""
        # Re-read: the child may have restarted while the body was on its way.
        snap = self._lane.ready_snapshot()
        n_tokens = await count_prompt_tokens(self._state, snap, self._route, self._payload, self._request_id)
        # llama-server refuses a prompt of n_ctx tokens or more (it needs room for one generated token).
        if n_tokens is not None and n_tokens >= snap.ctx_per_slot:
            raise ContextTooLarge(n_tokens, snap.ctx_per_slot)

    async def for_charge(self) -> tuple[int, str]:
        """The prompt's tokens of a request the child never reported (``proxy.routes.charge``): counted
        by a READY child of its model within a few seconds, else estimated from the prompt's bytes."""
        try:
            async with asyncio.timeout(CHARGE_COUNT_S):
                counted = await count_prompt_tokens(
                    self._state, self._lane.ready_snapshot(), self._route, self._payload, self._request_id
                )
        except (ProxyError, TimeoutError):
            counted = None
        if counted is not None:
            return counted, "counted"
        return estimate_prompt_tokens(self._payload), "estimated"


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
