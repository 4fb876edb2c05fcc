"""A body field as the request schema declares it: its value, who may send it, and why.

``who``: ``any`` key; ``admin`` keys only (an inference key's value is refused, naming the field, or
dropped where it is the default, ``id_slot: -1``); ``nobody``: refused from every key, for fields that
are llama-server's internal plumbing (it sets them itself between its own layers) or reach a published
advisory (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.schema.values import Value

Who = Literal["any", "admin", "nobody"]

# What a field means to the rest of the proxy, declared here once and read by it (``proxy.schema.roles``):
# ``token_cap``: a spelling of the most tokens to generate (the tenant's ``max_tokens`` caps each one);
# ``n``: completions per prompt (the first present wins, as in the child); ``prompt``: text that becomes
# the prompt (the estimate of its tokens); ``prompts``: a prompt or a list of prompts, each a task of
# its own in the child (the first present is read); ``documents``: rerank's documents, one task each.
Role = Literal["token_cap", "n", "prompt", "prompts", "documents"]


@dataclass(frozen=True, slots=True)
class Field:
    value: Value
    doc: str
    who: Who = "any"
    # null means "absent" (llama-server's ``has_value``; the OpenAI SDKs send null for "not given" too).
    nullable: bool = True
    # For ``admin`` and ``nobody``: the reason shown in the refusal.
    why: str = ""
    # ``admin``: an inference key's value that is the default anyway, dropped without a word.
    default: object = ...
    # What the field means beyond its value (``Role``): none for most.
    roles: tuple[Role, ...] = ()
