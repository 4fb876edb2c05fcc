"""Every variable-size value of every route's schema has a size bound; a value over it is a 400 naming the
field, the bound and whose it is; a tenant's ``field_bounds`` replaces a bound by name; the costly ones
follow the cost table and the model's vocabulary; the field roles the rest of the proxy reads are the
schema's."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pytest

from proxy.admission import cost
from proxy.routes import prompt_tokens
from proxy.schema import Context, FieldError, check_body
from proxy.schema.bounds import MAX_TOKEN_FIELDS
from proxy.schema.costs import BUDGET_S, COSTS, REFERENCE_VOCAB, UNKNOWN_VOCAB, cost_limit
from proxy.schema.reference import Found, bound_names, sizes, walk
from proxy.schema.routes import SCHEMAS, is_prompt_list, with_role
from proxy.schema.values import Arr, Size, Str
from proxy.schema.values import Context as Ctx
from proxy.settings import TenantSettings
from proxy.telemetry import request as telemetry_request
from supervisor.config.load import parse_config
from supervisor.config.proxy_settings import proxy_settings
from supervisor.errors import ConfigError

T = TenantSettings("t", max_concurrency=2)
DEMO = 49_152


def check(
    schema: str, payload: dict[str, Any], tenant: TenantSettings = T, n_vocab: int | None = DEMO
) -> None:
    check_body(schema, payload, Context(tenant, False, 4, n_vocab), "refuse")


def test_every_value_of_every_route_has_a_size_bound() -> None:
    found = list(sizes())
    unbounded = [f"{f.schema}: {f.path} ({type(f.kind).__name__})" for f in found if f.size is None]
    assert not unbounded, "variable-size values without a bound:\n" + "\n".join(unbounded)
    # The walk reached the values the issue names, nested ones included.
    names = bound_names()
    for name in ("dry_sequence_breakers", "logit_bias", "stop", "stop[]", "tools", "messages", "prompt"):
        assert name in names
    assert {"tools[].function.parameters", "grammar_triggers[].value", "input_extra[].text"} <= names


def test_the_walk_reports_a_value_without_a_bound() -> None:
    """The test above can fail: a kind that holds a variable-size value and no ``Size`` is reported."""

    @dataclass(frozen=True)
    class Bare:
        def check(self, value: Any, path: str, ctx: Ctx) -> None:
            return None

        def describe(self) -> str:
            return "anything"

    assert [f.size for f in walk(Bare(), "x")] == [None]
    nested = list(walk(Arr(Bare()), "x"))
    assert sorted((f.path, f.size is None) for f in nested) == [("x", False), ("x[]", True)]
    assert all(isinstance(f, Found) for f in nested)


def test_a_bound_has_one_meaning_per_unit() -> None:
    """Where routes share a name (``tools``, ``stop``), a bound of one unit has one default: a tenant's
    override means the same on every route."""
    seen: dict[tuple[str, str], set[tuple[int, str | None]]] = {}
    for f in sizes():
        assert f.size is not None
        seen.setdefault((f.path, f.size.unit), set()).add((f.size.most, f.size.cost))
    mixed = {k: v for k, v in seen.items() if len(v) > 1 and k[0] not in ("prompt", "input", "content")}
    assert not mixed


@pytest.mark.parametrize(
    ("schema", "field", "unit", "make"),
    [
        ("completion", "dry_sequence_breakers", "elements", lambda n: ["\n"] * n),
        ("messages", "dry_sequence_breakers", "elements", lambda n: ["\n"] * n),
        ("completion", "logit_bias", "entries", lambda n: [[i, 1.0] for i in range(n)]),
        ("chat", "logit_bias", "entries", lambda n: {str(i): -1.0 for i in range(n)}),
        # A grammar the structural check (``proxy.schema.programs``) passes: one literal, n characters in all.
        ("completion", "grammar", "characters", lambda n: 'root ::= "' + "a" * (n - 11) + '"'),
        ("tokenize", "content", "characters", lambda n: "<|im_start|>" * (n // 12) + "a" * (n % 12)),
        ("completion", "json_schema", "characters of JSON", lambda n: {"description": "d" * (n - 18)}),
    ],
)
def test_a_costly_value_passes_at_its_bound_and_is_refused_one_above(
    schema: str, field: str, unit: str, make: Any
) -> None:
    body: dict[str, Any] = {"prompt": "a"}
    if schema in ("chat", "messages"):
        body = {"messages": [{"role": "user", "content": "hi"}]}
    elif schema == "tokenize":
        body = {}
    size = next(f.size for f in sizes() if f.schema == schema and f.path == field and f.size and f.size.cost)
    most, _ = cost_limit(size.cost or "", size.most, DEMO)
    assert 4 <= most < size.most  # tightened by its cost, yet above llama.cpp's own defaults
    check(schema, {**body, field: make(most)})
    with pytest.raises(FieldError) as refused:
        check(schema, {**body, field: make(most + 1)})
    assert refused.value.param == field
    message = str(refused.value)
    assert f"has {most + 1} {unit}" in message and f"the bound '{field}'" in message
    assert "tenants[].field_bounds" in message


def test_a_plain_bound_names_the_element_and_its_bound() -> None:
    with pytest.raises(FieldError) as refused:
        check("completion", {"prompt": "a", "stop": ["ok", "x" * 1025]})
    assert refused.value.param == "stop[1]"
    assert "has 1025 characters; the bound 'stop[]'" in str(refused.value)
    with pytest.raises(FieldError) as refused:
        check("chat", {"messages": [{"role": "user", "content": "hi"}], "model": "m" * 1025})
    assert refused.value.param == "model"
    with pytest.raises(FieldError) as refused:
        check("chat", {"messages": [{"role": "user", "content": "hi", **{f"k{i}": 1 for i in range(300)}}]})
    assert refused.value.param == "messages[0]" and "has 302 members" in str(refused.value)


def test_a_larger_vocabulary_tightens_a_bound_in_proportion() -> None:
    dry = COSTS["dry_breaker"]
    assert dry.per_vocab
    demo, _ = cost_limit("dry_breaker", 1024, REFERENCE_VOCAB)
    gemma, why = cost_limit("dry_breaker", 1024, 262_144)
    assert demo == int(BUDGET_S / dry.seconds)
    assert gemma == int(BUDGET_S / (dry.seconds * 262_144 / REFERENCE_VOCAB)) < demo
    assert "262,144 tokens of vocabulary" in why
    # Unknown: as tight as the largest vocabulary tested.
    assert cost_limit("dry_breaker", 1024, None)[0] == cost_limit("dry_breaker", 1024, UNKNOWN_VOCAB)[0]
    check("completion", {"prompt": "a", "dry_sequence_breakers": ["x"] * demo}, n_vocab=REFERENCE_VOCAB)
    with pytest.raises(FieldError):
        check("completion", {"prompt": "a", "dry_sequence_breakers": ["x"] * demo}, n_vocab=262_144)


def test_a_tenants_field_bounds_replace_the_default_by_name() -> None:
    wide = TenantSettings("w", field_bounds=MappingProxyType({"dry_sequence_breakers": 2000, "stop[]": 4}))
    check("completion", {"prompt": "a", "dry_sequence_breakers": ["x"] * 2000}, tenant=wide)
    with pytest.raises(FieldError) as refused:
        check("completion", {"prompt": "a", "dry_sequence_breakers": ["x"] * 2001}, tenant=wide)
    assert "this tenant's bound 'dry_sequence_breakers' (tenants[].field_bounds) is 2000" in str(
        refused.value
    )
    # Lower too, and for nested values: by the path without indices.
    with pytest.raises(FieldError) as refused:
        check("completion", {"prompt": "a", "stop": ["abcd", "abcde"]}, tenant=wide)
    assert refused.value.param == "stop[1]"
    # Other bounds keep their default.
    check("completion", {"prompt": "a", "stop": ["x"] * 100}, tenant=wide)


def test_field_bounds_load_from_the_config_and_an_unknown_name_is_named() -> None:
    cfg = parse_config(
        "tenants:\n- name: a\n  field_bounds: {dry_sequence_breakers: 2000, 'stop[]': 8}\n", env={}
    )
    tenant = proxy_settings(cfg).tenants[0]
    assert dict(tenant.field_bounds) == {"dry_sequence_breakers": 2000, "stop[]": 8}
    hash(tenant)  # a mapping in a frozen settings class that is hashed
    with pytest.raises(ConfigError) as bad:
        parse_config("tenants:\n- name: a\n  field_bounds: {dry_sequence_breaker: 2000}\n", env={})
    assert any(
        "tenants[0].field_bounds" in p and "'dry_sequence_breaker' is not a bound" in p and "breakers?" in p
        for p in bad.value.problems
    )
    with pytest.raises(ConfigError) as bad:
        parse_config("tenants:\n- name: a\n  field_bounds: {stop: 0}\n", env={})
    assert any("'stop' must be at least 1" in p for p in bad.value.problems)
    with pytest.raises(ConfigError) as bad:
        parse_config("tenants:\n- name: a\n  field_bounds: [stop]\n", env={})
    assert any("must be a mapping" in p for p in bad.value.problems)


def test_the_field_roles_are_what_the_rest_of_the_proxy_reads() -> None:
    # Every spelling of the token cap, in the child's precedence (n_predict, then its aliases).
    assert MAX_TOKEN_FIELDS == ("n_predict", "max_completion_tokens", "max_tokens", "max_output_tokens")
    caps = {n for fields in SCHEMAS.values() for n, f in fields.items() if "token_cap" in f.roles}
    assert set(MAX_TOKEN_FIELDS) == caps
    params = dict(telemetry_request._PARAMS)
    assert params["gen_ai.request.max_tokens"] == MAX_TOKEN_FIELDS
    assert params["gen_ai.request.choice.count"] == ("n_cmpl", "n")
    assert set(prompt_tokens._PROMPT_FIELDS) == {
        "messages", "prompt", "input", "content", "system", "instructions", "suffix", "input_extra",
        "input_prefix", "input_suffix",
    }  # fmt: skip
    assert with_role("documents", "rerank") == ("documents", "texts")
    # The child's precedence: n_cmpl before n; input before content; documents before texts.
    assert cost._n({"n": 2, "n_cmpl": 3}) == 3
    assert cost._prompts("embedding", {"input": ["a", "b"], "content": ["c"]}) == 2
    assert cost._prompts("rerank", {"texts": ["a", "b", "c"]}) == 3
    assert is_prompt_list(["a", [1, 2]]) and not is_prompt_list(["a", 1]) and is_prompt_list([True])


def test_every_alias_of_the_token_cap_is_capped() -> None:
    """A field whose doc calls it an alias of n_predict has the role, so the tenant's cap reaches it."""
    for fields in SCHEMAS.values():
        for name, field in fields.items():
            if "alias of n_predict" in field.doc or "most tokens to generate" in field.doc:
                assert "token_cap" in field.roles, name


def test_a_real_clients_body_is_inside_every_bound() -> None:
    """What llama.cpp's web UI and the SDKs send: far inside."""
    check(
        "completion",
        {
            "prompt": "Hello " * 2000,
            "dry_multiplier": 0.8,
            "dry_sequence_breakers": ["\n", ":", '"', "*"],
            "stop": ["</s>", "\n\n", "User:"],
            "logit_bias": [[15, -1.0], ["Hello", False]],
            "samplers": ["dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
            "n_probs": 5,
        },
    )
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(128)
    ]
    check("chat", {"messages": [{"role": "user", "content": "x"}] * 1000, "tools": tools[:32]})


def test_an_unused_size_does_not_cost_a_name() -> None:
    """The common case (under the plain most, no tenant override) checks without building a name."""
    size = Size(10, "elements")
    ctx = Context(T, False, 4, DEMO)
    size.check(10, "a[3].b", ctx)
    with pytest.raises(FieldError, match=r"'a\[3\]\.b' has 11 elements; the bound 'a\[\]\.b'"):
        size.check(11, "a[3].b", ctx)
    assert Str().size.most == 1024


def test_costly_values_together_are_held_to_the_budget() -> None:
    """Each at 60 % of its own bound passes alone; together they are over the request's budget."""
    dry = int(0.6 * cost_limit("dry_breaker", 1024, DEMO)[0])
    grammar = 'root ::= "' + "a" * int(0.6 * cost_limit("grammar_char", 10**6, DEMO)[0]) + '"'
    check("completion", {"prompt": "a", "dry_sequence_breakers": ["x"] * dry})
    check("completion", {"prompt": "a", "grammar": grammar})
    with pytest.raises(FieldError) as refused:
        check("completion", {"prompt": "a", "dry_sequence_breakers": ["x"] * dry, "grammar": grammar})
    message = str(refused.value)
    assert refused.value.param in ("dry_sequence_breakers", "grammar")
    assert (
        "server loop for about 1.2 s" in message
        and "'grammar'" in message
        and "the bound of a request is 1 s" in message
    )
    # A tenant's own bound is its operator's choice: not counted.
    wide = TenantSettings("w", field_bounds=MappingProxyType({"dry_sequence_breakers": 1000}))
    check(
        "completion", {"prompt": "a", "dry_sequence_breakers": ["x"] * dry, "grammar": grammar}, tenant=wide
    )
    # Checked per request: a Context used again starts from nothing.
    ctx = Context(T, False, 4, DEMO)
    for _ in range(3):
        check_body("completion", {"prompt": "a", "grammar": grammar}, ctx, "refuse")
