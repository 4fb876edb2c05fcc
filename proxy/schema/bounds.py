"""The tenant's bounds that rewrite a generation request instead of refusing it: the token cap, the
prompt cache off, prompt-cache detail withheld, chat's implicit 20 candidates lowered to the tenant's
limit. Entries of the request schema (``proxy.schema.check`` applies them after the fields passed), kept
apart because each changes the body the child gets rather than judging it.
"""

from __future__ import annotations

from typing import Any

from proxy.schema.routes import with_role
from proxy.settings import TenantSettings

# Fields that bound the number of generated tokens, in the OpenAI API (Responses: max_output_tokens)
# and llama.cpp's own (n_predict, with its aliases max_tokens and max_completion_tokens): every field
# the schema declares a ``token_cap``, so a new spelling is capped as soon as it is declared.
MAX_TOKEN_FIELDS = with_role("token_cap")

# Fields that make llama-server send prompt-cache detail with every event.
CACHE_DETAIL_REQUESTS = ("timings_per_token", "return_progress")


def bound_generation(chat: bool, payload: dict[str, Any], tenant: TenantSettings, admin: bool) -> bool:
    """Apply the tenant's rewriting bounds to a generating request (its fields already checked). True if
    the body changed."""
    rewritten = False
    # Chat: logprobs true asks for top_logprobs candidates, 20 when absent (oaicompat_chat_params_parse).
    limit = tenant.max_logprobs
    if chat and payload.get("logprobs") is True and payload.get("top_logprobs") is None and limit < 20:
        payload["top_logprobs"] = limit
        rewritten = True
    if tenant.max_tokens is not None:
        rewritten = cap_max_tokens(payload, tenant.max_tokens) or rewritten
    if not tenant.cache_prompt and payload.get("cache_prompt") is not False:
        payload["cache_prompt"] = False
        rewritten = True
    if not (admin or tenant.show_cache_details):
        for name in CACHE_DETAIL_REQUESTS:
            if payload.pop(name, None) is not None:
                rewritten = True
    return rewritten


def cap_max_tokens(payload: dict[str, Any], cap: int) -> bool:
    """Bound every token-limit field by ``cap`` (adding ``max_tokens`` when none is set); the fields are
    integers already (the schema checked them). True if changed."""
    changed = False
    present = False
    for name in MAX_TOKEN_FIELDS:
        value = payload.get(name)
        if value is None:
            continue
        present = True
        if value < 0 or value > cap:  # -1: "until the context is full"
            payload[name] = cap
            changed = True
    if not present:
        payload["max_tokens"] = cap
        changed = True
    return changed
