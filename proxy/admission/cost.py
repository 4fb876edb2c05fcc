"""What a generation request will cost in llama-server: how many tasks it runs, how many at once.

One call per request, keyed by the route's cost kind, before admission and after the request schema
(``proxy.schema``) accepted the body (so every field read here has its declared type and range, the
tenant's ``n``, prompt-array, ``id_slot``, logprobs and token-cap bounds included): ``size(kind, payload,
tenant, capacity)`` says how many slots the request occupies at once, which is what admission must take,
and refuses a request wider than the tenant may ever hold.

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

The token cap (``max_tokens``) is per sequence: a request may generate at most ``sequences x max_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from proxy.errors import BadRequest
from proxy.schema.routes import is_prompt_list, with_role
from proxy.settings import TenantSettings

# How a request is counted (each route's ``cost`` in ``proxy.routes.table``). chat: /v1/chat/completions
# and chat-shaped routes (Responses, Anthropic Messages: one prompt, n applies). completion:
# /v1/completions, /completion, /infill ("prompt" may be an array). embedding: "input" or "content"
# arrays, no n. rerank: one task per document, no n.
CostKind = Literal["chat", "completion", "embedding", "rerank"]


@dataclass(frozen=True, slots=True)
class Cost:
    """``sequences``: tasks the child will run in total; ``slots``: how many of them can run at once
    (what admission takes)."""

    sequences: int
    slots: int


def size(kind: CostKind, payload: dict[str, Any], tenant: TenantSettings, capacity: int) -> Cost:
    """What ``payload`` costs; ``capacity``: the child's slot count now."""
    sequences, slots = _size(kind, payload, tenant, capacity)
    return Cost(sequences=sequences, slots=max(1, slots))


def _size(kind: CostKind, payload: dict[str, Any], tenant: TenantSettings, capacity: int) -> tuple[int, int]:
    """The tasks the child will run, and how many of them at once; ``BadRequest`` for a request wider than
    the tenant may ever hold (``n`` and the prompt array are each within their bounds: the schema's)."""
    n = _n(payload) if kind in ("chat", "completion") else 1
    prompts = _prompts(kind, payload)
    sequences = n * prompts
    slots = min(sequences, capacity) if capacity > 0 else sequences
    # Wider than what the tenant may ever hold (per model, or in total across models): a retry cannot help.
    limit = min(tenant.max_concurrency, tenant.max_concurrency_total or tenant.max_concurrency)
    if slots > limit:
        raise BadRequest(
            f"this request would occupy {slots} slots at once ({n} completions x {prompts} prompts); "
            f"this tenant may hold {limit}: send fewer prompts or a smaller 'n'"
        )
    return sequences, slots


# The schema's fields that say how many completions (``n_cmpl`` first, then its alias ``n``: the child's
# precedence) and which hold the prompts of each kind (the first present is read, as the child does:
# ``input`` else ``content``; ``documents`` else ``texts``).
_N_FIELDS = with_role("n", "completion")
_PROMPT_FIELDS: dict[CostKind, tuple[str, ...]] = {
    "completion": with_role("prompts", "completion"),
    "embedding": with_role("prompts", "embeddings"),
    "rerank": with_role("documents", "rerank"),
}


def _n(payload: dict[str, Any]) -> int:
    for name in _N_FIELDS:
        value = payload.get(name)
        if value is not None:
            return int(value)
    return 1


def _prompts(kind: CostKind, payload: dict[str, Any]) -> int:
    if kind == "chat":
        return 1
    prompt = next((payload[name] for name in _PROMPT_FIELDS[kind] if name in payload), None)
    # An empty array is refused by the child itself ("prompt must not be empty"): count it as one.
    return len(prompt) if is_prompt_list(prompt) and prompt else 1
