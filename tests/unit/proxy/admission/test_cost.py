"""What a request costs in slots per route kind (llama.cpp's own fan-out rules); the bounds of its fields
are the request schema's (tests/unit/proxy/schema)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.admission.cost import size
from proxy.errors import BadRequest
from proxy.routes.table import ROUTES
from proxy.settings import TenantSettings
from proxy.streams.assemble import assembled_as

T = TenantSettings("t", max_concurrency=2, max_n=4, max_prompts=16, max_logprobs=20)


def cost(kind: Any, payload: dict[str, Any], tenant: TenantSettings = T, cap: int = 4) -> Any:
    return size(kind, payload, tenant, capacity=cap)


@pytest.mark.parametrize(
    ("kind", "payload", "sequences", "slots"),
    [
        ("completion", {"prompt": "a"}, 1, 1),
        ("completion", {"prompt": "a", "n": 2}, 2, 2),
        ("completion", {"prompt": "a", "n_cmpl": 2, "n": 3}, 2, 2),  # n_cmpl wins, as in the child
        ("completion", {"prompt": "a", "n_cmpl": None, "n": 2}, 2, 2),  # null is absent
        ("completion", {"prompt": ["a", "b"]}, 2, 2),
        ("completion", {"prompt": [[1, 2], [3]]}, 2, 2),  # arrays of token arrays: one task each
        ("completion", {"prompt": [1, 2, 3]}, 1, 1),  # tokens: one prompt
        ("completion", {"prompt": ["a", 5, "b"]}, 1, 1),  # mixed with an integer: one prompt
        ("completion", {"prompt": [{"prompt_string": "a"}, "b"]}, 2, 2),
        ("completion", {"prompt": []}, 1, 1),  # the child refuses it itself
        ("completion", {"prompt": ["a", "b", "c"]}, 3, 2),  # never more than the slots at once
        ("chat", {"messages": [], "n": 2}, 2, 2),
        ("chat", {"messages": [], "prompt": ["a", "b"]}, 1, 1),  # chat builds its own prompt
        ("embedding", {"input": ["a", "b", "c"], "n": 3}, 3, 2),  # no n for embeddings
        ("embedding", {"content": ["a", "b"]}, 2, 2),
        ("rerank", {"query": "q", "documents": ["a", "b"]}, 2, 2),
    ],
)
def test_slots_follow_the_childs_fan_out(
    kind: Any, payload: dict[str, Any], sequences: int, slots: int
) -> None:
    c = cost(kind, payload, cap=2)
    assert (c.sequences, c.slots) == (sequences, slots)


def test_wider_than_the_tenant_may_hold() -> None:
    with pytest.raises(BadRequest, match="occupy 3 slots at once"):
        cost("completion", {"prompt": "a", "n": 3})
    with pytest.raises(BadRequest, match="occupy 4 slots at once"):
        cost("completion", {"prompt": ["a", "b"], "n": 2})


def test_route_kinds() -> None:
    # The cost and assembled kinds are columns of each row of the route table.
    by_path = {r.path: r for r in ROUTES}
    assert by_path["/v1/chat/completions"].cost == "chat"
    assert by_path["/v1/completions"].cost == "completion" and by_path["/infill"].cost == "completion"
    assert by_path["/v1/embeddings"].cost == "embedding" and by_path["/v1/rerank"].cost == "rerank"
    assert assembled_as(by_path["/v1/completions"].assembled, {}) == "completion"
    assert assembled_as(by_path["/v1/chat/completions"].assembled, {"logprobs": True, "tools": [{}]}) is None
    assert assembled_as(by_path["/completion"].assembled, {}) is None
