"""What a request costs in slots, and the tenant's bounds, per route kind (llama.cpp's own fan-out rules)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.admission.cost import check
from proxy.errors import BadRequest
from proxy.routes.table import ROUTES
from proxy.settings import TenantSettings
from proxy.streams.assemble import assembled_as

T = TenantSettings("t", max_concurrency=2, max_n=4, max_prompts=16, max_logprobs=20)


def cost(
    kind: Any, payload: dict[str, Any], tenant: TenantSettings = T, admin: bool = False, cap: int = 4
) -> Any:
    return check(kind, payload, tenant, admin=admin, capacity=cap)


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


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ({"prompt": "a", "n": 5}, "'n' of 5 exceeds this tenant's limit of 4"),
        ({"prompt": "a", "n": 0}, "'n' must be >= 1"),
        ({"prompt": "a", "n": 1.5}, "'n' must be an integer"),
        ({"prompt": "a", "n": True}, "'n' must be an integer"),
        ({"prompt": ["a"] * 17}, "17 elements; this tenant's limit is 16"),
        ({"prompt": "a", "n": 3}, "occupy 3 slots at once"),
        ({"prompt": ["a", "b"], "n": 2}, "occupy 4 slots at once"),
        ({"prompt": "a", "n_probs": 21}, "'n_probs' of 21"),
        ({"prompt": "a", "logprobs": 21}, "'logprobs' of 21"),
        ({"prompt": "a", "n_probs": -1}, "'n_probs' must be >= 0"),
        ({"prompt": "a", "id_slot": 0}, "'id_slot'"),
    ],
)
def test_refusals_name_what_is_wrong(payload: dict[str, Any], named: str) -> None:
    with pytest.raises(BadRequest) as err:
        cost("completion", payload)
    assert named in err.value.message


def test_n_above_the_childs_slots_can_never_run() -> None:
    wide = TenantSettings("w", max_concurrency=8, max_n=8)
    with pytest.raises(BadRequest, match="server's 2 slots"):
        cost("completion", {"prompt": "a", "n": 3}, wide, cap=2)


def test_chat_logprobs() -> None:
    with pytest.raises(BadRequest, match="'top_logprobs' of 21"):
        cost("chat", {"logprobs": True, "top_logprobs": 21})
    small = TenantSettings("s", max_logprobs=5)
    payload: dict[str, Any] = {"logprobs": True}
    assert cost("chat", payload, small).rewritten and payload["top_logprobs"] == 5  # not the implicit 20
    payload = {"logprobs": True}
    assert not cost("chat", payload).rewritten and "top_logprobs" not in payload
    assert not cost("chat", {"logprobs": False}, small).rewritten


def test_id_slot_is_for_admins() -> None:
    payload: dict[str, Any] = {"prompt": "a", "id_slot": -1}
    assert cost("completion", payload).rewritten and "id_slot" not in payload
    payload = {"prompt": "a", "id_slot": 1}
    assert not cost("completion", payload, admin=True).rewritten and payload["id_slot"] == 1


def test_token_cap_and_cache_settings() -> None:
    strict = TenantSettings("s", max_tokens=8, cache_prompt=False)
    payload: dict[str, Any] = {
        "prompt": "a",
        "max_tokens": 100,
        "timings_per_token": True,
        "return_progress": True,
    }
    assert cost("completion", payload, strict).rewritten
    assert payload == {"prompt": "a", "max_tokens": 8, "cache_prompt": False}
    shown = TenantSettings("v", show_cache_details=True)
    payload = {"prompt": "a", "timings_per_token": True}
    assert not cost("completion", payload, shown).rewritten and payload["timings_per_token"] is True
    payload = {"input": "a", "max_tokens": 100}
    assert not cost("embedding", payload, strict).rewritten  # not a generation: no token cap


def test_route_kinds() -> None:
    # The cost and assembled kinds are columns of each row of the route table.
    by_path = {r.path: r for r in ROUTES}
    assert by_path["/v1/chat/completions"].cost == "chat"
    assert by_path["/v1/completions"].cost == "completion" and by_path["/infill"].cost == "completion"
    assert by_path["/v1/embeddings"].cost == "embedding" and by_path["/v1/rerank"].cost == "rerank"
    assert assembled_as(by_path["/v1/completions"].assembled, {}) == "completion"
    assert assembled_as(by_path["/v1/chat/completions"].assembled, {"logprobs": True, "tools": [{}]}) is None
    assert assembled_as(by_path["/completion"].assembled, {}) is None
