"""The request schema's one check: types, ranges, who may send a field, unknown fields, and the tenant's
bounds that rewrite (moved here from the cost module, whose checks are entries of the schema now)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import BadRequest
from proxy.schema import Context, FieldError, UnknownField, check_body
from proxy.schema.bounds import cap_max_tokens
from proxy.settings import TenantSettings, UnknownPolicy

T = TenantSettings("t", max_concurrency=2, max_n=4, max_prompts=16, max_logprobs=20)


def check(
    schema: str,
    payload: dict[str, Any],
    tenant: TenantSettings = T,
    admin: bool = False,
    cap: int = 4,
    n_vocab: int | None = 1000,
    unknown: UnknownPolicy = "refuse",
) -> bool:
    generates = schema in ("chat", "completions", "completion", "infill", "responses", "messages")
    return check_body(schema, payload, Context(tenant, admin, cap, n_vocab), unknown, generates=generates)


@pytest.mark.parametrize(
    ("schema", "payload", "param", "named"),
    [
        ("completion", {"prompt": "a", "n": 5}, "n", "'n' of 5 exceeds this tenant's limit"),
        ("completion", {"prompt": "a", "n": 0}, "n", "'n' of 0 is below"),
        ("completion", {"prompt": "a", "n": 1.5}, "n", "'n' must be an integer"),
        ("completion", {"prompt": "a", "n": True}, "n", "'n' must be an integer, not a boolean"),
        ("completion", {"prompt": ["a"] * 17}, "prompt", "17 elements; this tenant's limit is 16"),
        ("completion", {"prompt": "a", "n_probs": 21}, "n_probs", "'n_probs' of 21 exceeds this tenant's"),
        ("completion", {"prompt": "a", "logprobs": 21}, "logprobs", "'logprobs' of 21"),
        ("completion", {"prompt": "a", "n_probs": -1}, "n_probs", "'n_probs' of -1 is below"),
        ("completion", {"prompt": "a", "id_slot": 0}, "id_slot", "admin keys only"),
        ("completion", {"prompt": "a", "max_tokens": "lots"}, "max_tokens", "must be an integer"),
        ("completion", {"prompt": "a", "n_predict": 2**31}, "n_predict", "exceeds the maximum of 2147483647"),
        ("completion", {"prompt": "a", "temperature": 1e308}, "temperature", "exceeds the maximum"),
        ("completion", {"prompt": "a", "seed": 2**32}, "seed", "exceeds the maximum of 4294967295"),
        ("completion", {"prompt": "a", "adaptive_decay": 1.0}, "adaptive_decay", "exceeds the maximum"),
        ("completion", {"prompt": "a", "stream": "yes"}, "stream", "must be a boolean"),
        ("completion", {"prompt": "a", "stop": [1]}, "stop[0]", "must be a string"),
        ("completion", {"prompt": "a", "chat_parser": "x"}, "chat_parser", "not accepted from any key"),
        ("completion", {"prompt": "a", "chat_format": 99}, "chat_format", "internal plumbing"),
        ("completion", {"prompt": "a", "lora": [{"id": 0, "scale": 1}]}, "lora", "no LoRA adapters"),
        ("completion", {"prompt": [1, 1000]}, "prompt[1]", "the model's largest token id, 999"),
        ("completion", {"prompt": "a", "logit_bias": [[5000, 1.0]]}, "logit_bias[0][0]", "999"),
        ("completion", {"prompt": "a", "logit_bias": {"5000": 1.0}}, "logit_bias.5000", "999"),
        ("completion", {"prompt": "a", "logit_bias": {"hello": "x"}}, "logit_bias.hello", "or boolean"),
        ("completion", {"prompt": "a", "reasoning_format": "x"}, "reasoning_format", "must be one of"),
        ("completion", {"prompt": None}, "prompt", "must not be null"),
        ("chat", {"messages": "hi"}, "messages", "must be an array"),
        ("chat", {"messages": [], "top_logprobs": 21}, "top_logprobs", "'top_logprobs' of 21"),
        ("detokenize", {"tokens": [1, 999999999]}, "tokens[1]", "the model's largest token id"),
        ("detokenize", {"tokens": [-1]}, "tokens[0]", "below"),
        ("tokenize", {"content": {}}, "content", "must be"),
        ("rerank", {"query": "q", "documents": ["d"] * 17}, "documents", "17 elements"),
        ("embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format", "one of float, base64"),
    ],
)
def test_refusals_name_the_field(schema: str, payload: dict[str, Any], param: str, named: str) -> None:
    with pytest.raises(FieldError) as err:
        check(schema, payload)
    assert err.value.param == param and err.value.status == 400
    assert named in err.value.message
    assert err.value.payload()["param"] == param  # the OpenAI error's param


@pytest.mark.parametrize(
    "trigger",
    [
        {"type": 99, "value": "x"},  # CVE-2026-134540: cast to an enum from any int
        {"type": -1, "value": "x"},
        {"type": 0, "value": "x", "token": 2**31 - 1},  # a token trigger beyond the vocabulary
        {"type": "0", "value": "x"},
        {"value": "x"},
        {"type": 1},
    ],
)
def test_grammar_triggers_are_held_to_the_pinned_enum_and_vocabulary(trigger: dict[str, Any]) -> None:
    payload = {
        "prompt": "a",
        "grammar": 'root ::= "yes"',
        "grammar_lazy": True,
        "grammar_triggers": [trigger],
    }
    with pytest.raises(FieldError) as err:
        check("completion", payload)
    assert err.value.param.startswith("grammar_triggers[0]")


def test_within_bounds_passes_untouched() -> None:
    payload: dict[str, Any] = {
        "prompt": [1, 2, "x"],
        "n": 2,
        "n_probs": 20,
        "seed": -1,
        "temperature": 0.7,
        "top_k": -5,  # soft-limited in the child (clamped): any int32 passes
        "grammar_triggers": [{"type": 0, "value": "x", "token": 999}, {"type": 3, "value": "y"}],
        "logit_bias": {"12": -1.5, "hello": False},
        "stop": "\n",
        "samplers": "kty",
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "n_cmpl": None,  # null: absent
    }
    before = dict(payload)
    assert not check("completion", payload)
    assert payload == before


def test_unknown_fields_by_policy() -> None:
    with pytest.raises(UnknownField) as err:
        check("completion", {"prompt": "a", "frobnicate": 1})
    assert err.value.param == "frobnicate" and err.value.code == "unknown_field"
    payload: dict[str, Any] = {"prompt": "a", "frobnicate": 1}
    assert check("completion", payload, unknown="drop") and payload == {"prompt": "a"}
    payload = {"prompt": "a", "frobnicate": 1}
    assert not check("completion", payload, unknown="pass") and payload["frobnicate"] == 1


def test_chat_logprobs() -> None:
    small = TenantSettings("s", max_logprobs=5)
    payload: dict[str, Any] = {"messages": [], "logprobs": True}
    assert check("chat", payload, small) and payload["top_logprobs"] == 5  # not the implicit 20
    payload = {"messages": [], "logprobs": True}
    assert not check("chat", payload) and "top_logprobs" not in payload
    assert not check("chat", {"messages": [], "logprobs": False}, small)


def test_id_slot_is_for_admins() -> None:
    payload: dict[str, Any] = {"prompt": "a", "id_slot": -1}
    assert check("completion", payload) and "id_slot" not in payload
    payload = {"prompt": "a", "id_slot": 1}
    assert not check("completion", payload, admin=True) and payload["id_slot"] == 1


def test_n_above_the_childs_slots_can_never_run() -> None:
    wide = TenantSettings("w", max_concurrency=8, max_n=8)
    with pytest.raises(BadRequest, match="'n' of 3 exceeds the server's slots, 2"):
        check("completion", {"prompt": "a", "n": 3}, wide, cap=2)


def test_token_cap_and_cache_settings() -> None:
    strict = TenantSettings("s", max_tokens=8, cache_prompt=False)
    payload: dict[str, Any] = {
        "prompt": "a",
        "max_tokens": 100,
        "timings_per_token": True,
        "return_progress": True,
    }
    assert check("completion", payload, strict)
    assert payload == {"prompt": "a", "max_tokens": 8, "cache_prompt": False}
    shown = TenantSettings("v", show_cache_details=True)
    payload = {"prompt": "a", "timings_per_token": True}
    assert not check("completion", payload, shown) and payload["timings_per_token"] is True
    payload = {"input": "a"}
    assert not check("embeddings", payload, strict)  # not a generation: no token cap


def test_cap_max_tokens() -> None:
    payload: dict[str, Any] = {}
    assert cap_max_tokens(payload, 64) and payload == {"max_tokens": 64}
    payload = {"max_tokens": 10}
    assert not cap_max_tokens(payload, 64) and payload == {"max_tokens": 10}
    payload = {"max_tokens": -1, "n_predict": 100}
    assert cap_max_tokens(payload, 64) and payload == {"max_tokens": 64, "n_predict": 64}


def test_unknown_vocabulary_bounds_ids_by_int32() -> None:
    assert not check("completion", {"prompt": [2**31 - 1]}, n_vocab=None)
    with pytest.raises(FieldError):
        check("completion", {"prompt": [2**31]}, n_vocab=None)
