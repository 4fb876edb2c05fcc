"""What a generation request will cost in llama-server, and the tenant's bounds on it.

One call per request, keyed by the route's cost kind, before admission: ``check(kind, payload, tenant, ...)``
refuses (``BadRequest``, naming the field) or rewrites the parsed body, and says how many slots the
request will occupy at once, which is what admission must take.

How llama-server fans a request out (pinned source, tools/server/):
- ``n_cmpl``, alias ``n`` (the first present and non-null wins, server-schema.cpp ``field_num``):
  completions per prompt, hard-limited to ``1..n_parallel``. A task with ``n_cmpl > 1`` starts only when
  ``n_cmpl`` slots are free at once (``get_free_slots``). Chat completions copy every body field into the
  task's parameters (``oaicompat_chat_params_parse``), so chat honours ``n`` too.
- prompt arrays (``tokenize_input_prompts``): an array with no integer at its top level is a list of
  prompts, one task each (strings, token arrays, ``{"prompt_string": ...}`` objects); an array with an
  integer at its top level is *one* prompt (tokens, or tokens mixed with strings). Embeddings read
  ``input`` (else ``content``) the same way; rerank makes one task per ``documents`` (or ``texts``) entry.
  Tasks beyond the free slots wait in the child's queue, so at most ``min(tasks, slots)`` run at once.
- ``id_slot`` pins the task to one slot (``get_available_slot``): a tenant could queue behind a busy slot
  while another is idle, or aim at the slot holding another tenant's cached prompt. Admin keys only.
- response size: ``n_probs`` (alias ``logprobs`` on completions) returns that many candidates per
  generated token, up to the whole vocabulary; chat's ``logprobs: true`` uses ``top_logprobs`` (default
  20 when absent). ``post_sampling_probs`` only changes which candidates, not how many.
- prompt-cache detail: ``timings_per_token`` puts ``timings`` (with ``cache_n``) on every event and
  ``return_progress`` sends progress events with the cached count; both go for tenants that must not see
  cache hits (``proxy.streams.privacy`` strips the rest from answers).

The token cap (``max_tokens``) is per sequence: a request may generate at most ``sequences x max_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from proxy.errors import BadRequest
from proxy.settings import TenantSettings

# How a request is counted (each route's ``cost`` in ``proxy.routes.table``). chat: /v1/chat/completions
# and chat-shaped routes (Responses, Anthropic Messages: one prompt, n applies). completion:
# /v1/completions, /completion, /infill ("prompt" may be an array). embedding: "input" or "content"
# arrays, no n. rerank: one task per document, no n.
CostKind = Literal["chat", "completion", "embedding", "rerank"]

# Fields that bound the number of generated tokens, in the OpenAI API (Responses: max_output_tokens)
# and llama.cpp's own.
_MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")

# Fields that make llama-server send prompt-cache detail with every event.
_CACHE_DETAIL_REQUESTS = ("timings_per_token", "return_progress")


@dataclass(frozen=True, slots=True)
class Cost:
    """``sequences``: tasks the child will run in total; ``slots``: how many of them can run at once
    (what admission takes); ``rewritten``: the body changed and must be serialised again."""

    sequences: int
    slots: int
    rewritten: bool


def check(
    kind: CostKind, payload: dict[str, Any], tenant: TenantSettings, *, admin: bool, capacity: int
) -> Cost:
    """Refuse or rewrite ``payload`` for ``tenant`` and return what it costs. ``capacity``: the child's
    slot count now."""
    sequences, slots = _size(kind, payload, tenant, capacity)
    rewritten = _drop_slot_choice(payload) if not admin else False
    if kind in ("chat", "completion"):
        rewritten = _bound_generation(kind, payload, tenant, admin) or rewritten
    return Cost(sequences=sequences, slots=max(1, slots), rewritten=rewritten)


def _size(kind: CostKind, payload: dict[str, Any], tenant: TenantSettings, capacity: int) -> tuple[int, int]:
    """The tasks the child will run, and how many of them at once; ``BadRequest`` for a request wider than
    the tenant's bounds or than the child."""
    n = _n(payload) if kind in ("chat", "completion") else 1
    if n > tenant.max_n:
        raise BadRequest(f"'n' of {n} exceeds this tenant's limit of {tenant.max_n} completions per prompt")
    prompts = _prompts(kind, payload)
    if prompts > tenant.max_prompts:
        raise BadRequest(
            f"the prompt array has {prompts} elements; this tenant's limit is {tenant.max_prompts}"
        )
    sequences = n * prompts
    if capacity > 0 and n > capacity:
        raise BadRequest(f"'n' of {n} exceeds the server's {capacity} slots: it can never run")
    slots = min(sequences, capacity) if capacity > 0 else sequences
    # Wider than what the tenant may ever hold (per model, or in total across models): a retry cannot help.
    limit = min(tenant.max_concurrency, tenant.max_concurrency_total or tenant.max_concurrency)
    if slots > limit:
        raise BadRequest(
            f"this request would occupy {slots} slots at once ({n} completions x {prompts} prompts); "
            f"this tenant may hold {limit}: send fewer prompts or a smaller 'n'"
        )
    return sequences, slots


def _bound_generation(kind: CostKind, payload: dict[str, Any], tenant: TenantSettings, admin: bool) -> bool:
    """The tenant's bounds on what a generating request asks for: candidates per token, the token cap,
    the prompt cache and its details. True if the body changed."""
    rewritten = _bound_logprobs(kind, payload, tenant.max_logprobs)
    if tenant.max_tokens is not None:
        rewritten = cap_max_tokens(payload, tenant.max_tokens) or rewritten
    if not tenant.cache_prompt and payload.get("cache_prompt") is not False:
        payload["cache_prompt"] = False
        rewritten = True
    if not (admin or tenant.show_cache_details):
        for name in _CACHE_DETAIL_REQUESTS:
            if payload.pop(name, None) is not None:
                rewritten = True
    return rewritten


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


def _int_field(payload: dict[str, Any], name: str, low: int) -> int | None:
    value = payload.get(name)
    if value is None:  # llama-server treats null as absent
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"'{name}' must be an integer")
    if value < low:
        raise BadRequest(f"'{name}' must be >= {low}")
    return value


def _n(payload: dict[str, Any]) -> int:
    # Same precedence as the child: n_cmpl first, then its alias n.
    for name in ("n_cmpl", "n"):
        value = _int_field(payload, name, 1)
        if value is not None:
            return value
    return 1


def _is_prompt_list(value: Any) -> bool:
    # tokenize_input_prompts: an array is a list of prompts unless an integer sits at its top level
    # (json is_number_integer: bool is not one, neither is a float).
    return isinstance(value, list) and not any(isinstance(e, int) and not isinstance(e, bool) for e in value)


def _prompts(kind: CostKind, payload: dict[str, Any]) -> int:
    if kind == "chat":
        return 1
    if kind == "rerank":
        docs = payload.get("documents", payload.get("texts"))
        return len(docs) if isinstance(docs, list) and docs else 1
    if kind == "embedding":
        prompt = payload["input"] if "input" in payload else payload.get("content")
    else:
        prompt = payload.get("prompt")
    # An empty array is refused by the child itself ("prompt must not be empty"): count it as one.
    return len(prompt) if _is_prompt_list(prompt) and prompt else 1


def _drop_slot_choice(payload: dict[str, Any]) -> bool:
    """``id_slot`` is for admin keys. -1 (the default, "any slot") is dropped quietly; anything else is
    refused, so a client learns its pinning did not happen."""
    if "id_slot" not in payload:
        return False
    value = payload.pop("id_slot")
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == -1):
        return True
    raise BadRequest("'id_slot' chooses a slot and is only accepted from admin keys")


def _bound_logprobs(kind: CostKind, payload: dict[str, Any], limit: int) -> bool:
    """Refuse a candidate count above ``limit``, naming the field; fill in chat's implicit 20 when the
    limit is lower."""
    for name in ("n_probs", "top_logprobs"):
        value = _int_field(payload, name, 0)
        if value is not None and value > limit:
            raise BadRequest(f"'{name}' of {value} exceeds this tenant's limit of {limit}")
    logprobs = payload.get("logprobs")
    if isinstance(logprobs, bool) or logprobs is None:
        # Chat: logprobs true asks for top_logprobs candidates, 20 when it is absent.
        if logprobs is True and kind == "chat" and payload.get("top_logprobs") is None and limit < 20:
            payload["top_logprobs"] = limit
            return True
        return False
    value = _int_field(payload, "logprobs", 0)
    if value is not None and value > limit:
        raise BadRequest(f"'logprobs' of {value} exceeds this tenant's limit of {limit}")
    return False
