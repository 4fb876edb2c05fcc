"""The door's declared request schema (issue 48), end to end with the real daemon, child and model.

- A field of the wrong type or out of range is a 400 before admission, in the route's own error shape,
  naming the field's path (OpenAI routes: ``code`` ``invalid_field`` and ``param``; Anthropic routes:
  the path quoted in the message). A field nobody declared is ``unknown_field`` for inference keys,
  unless ``proxy.unknown_fields`` says drop or pass.
- Nothing a real client sends is refused: every field of the pinned server's schema with an in-range
  value (the list read from the locked source), and every parameter the installed OpenAI and Anthropic
  SDKs can send (read from their own TypedDicts), sent with the SDK. The door's refusals are told apart
  from the child's own answers by their string codes ``invalid_field`` / ``unknown_field`` (the child's
  errors carry an integer code). Each of these tests also sends one out-of-range request and expects the
  door to refuse it, so none of them can pass against a door that checks nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import anthropic.types.message_count_tokens_params as anthropic_count_params
import anthropic.types.message_create_params as anthropic_create_params
import httpx
import openai
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import openai.types.embedding_create_params as embedding_params
import openai.types.responses.response_create_params as response_params
import pytest

from proxy.schema.llama import LLAMA
from tests.helpers.llama_schema import SchemaField, pinned_server_schema
from tests.integration.conftest import Daemon, DaemonFactory

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "llama-build.lock"
MODEL = "smollm2-135m-instruct"
DOOR_CODES = ("invalid_field", "unknown_field")
MESSAGES = [{"role": "user", "content": "Say hi."}]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _anthropic_headers(key: str) -> dict[str, str]:
    return {"x-api-key": key, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def schema_fields(llama_server_binary: Path) -> list[SchemaField]:
    """The pinned schema's fields; after the binary, whose build fetched (and cached) the source."""
    fields = pinned_server_schema(LOCK)
    assert len(fields) >= 60, [f.name for f in fields]
    return fields


def _openai_error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, f"{r.request.url.path}: {r.status_code} {r.text[:400]}"
    body = r.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert error["type"] == "invalid_request_error", error
    return error


def _anthropic_error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, f"{r.request.url.path}: {r.status_code} {r.text[:400]}"
    body = r.json()
    assert body.get("type") == "error", body
    error: dict[str, Any] = body["error"]
    assert error["type"] == "invalid_request_error", error
    return error


def _is_door_refusal(status: int, body: Any) -> bool:
    """A 400 of the door's schema. OpenAI-shaped: by its code. Anthropic-shaped (no code): any 400 in
    that shape is the door's, since the child's own errors on those routes pass through in its shape
    (``{"error": {"code": <int>, ...}}``). ``body``: a whole body, or the error object the OpenAI SDK
    hands over."""
    if status != 400 or not isinstance(body, dict):
        return False
    if body.get("type") == "error":
        return True
    error = body.get("error", body)
    return isinstance(error, dict) and error.get("code") in DOOR_CODES


# --- refusals: shape and path -----------------------------------------------------------------------

# (route, body, path): wrong types and values outside the pinned server's hard limits, on OpenAI-shaped
# and llama.cpp routes. tokens[1]: a token id outside the model's vocabulary (the child answers 500
# "vector::_M_range_check" to it at the pin).
OPENAI_SHAPED_REFUSALS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n_probs": "x"}, "n_probs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "n_keep": -2}, "n_keep"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "n_discard": -1}, "n_discard"),
    ("/completion", {"prompt": "Hi", "min_keep": 2**31}, "min_keep"),
    (
        "/completion",
        {
            "prompt": "Hi",
            "grammar": 'root ::= "yes" | "no"',
            "grammar_lazy": True,
            "grammar_triggers": [{"type": 99, "value": "x"}],
        },
        "grammar_triggers[0].type",
    ),
    ("/detokenize", {"tokens": [1, 999_999_999]}, "tokens[1]"),
    ("/tokenize", {"content": 5}, "content"),
)


def test_a_bad_field_is_refused_before_admission_naming_its_path(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    pid = d.child_pid
    with httpx.Client(timeout=60, trust_env=False) as c:
        for route, body, path in OPENAI_SHAPED_REFUSALS:
            error = _openai_error(c.post(d.base_url + route, json=body, headers=_auth(d.inference_key)))
            assert error["code"] == "invalid_field", (route, error)
            assert error["param"] == path, (route, error)
            assert f"'{path}'" in error["message"], (route, error)
        anthropic_refusals = (
            ("/v1/messages", {"model": MODEL, "max_tokens": "x", "messages": MESSAGES}, "max_tokens"),
            ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": MESSAGES, "top_k": "x"}, "top_k"),
            ("/v1/messages/count_tokens", {"model": MODEL, "messages": MESSAGES, "system": 5}, "system"),
        )
        for route, body, path in anthropic_refusals:
            r = c.post(d.base_url + route, json=body, headers=_anthropic_headers(d.inference_key))
            error = _anthropic_error(r)
            assert f"'{path}'" in error["message"], (route, error)
        # Refused at the door: the child is the one it started with.
        assert d.child_pid == pid
        code, ready = d.readyz(c)
        assert code == 200, ready


def test_an_undeclared_field_is_refused_for_inference_keys_by_default(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    with httpx.Client(timeout=60, trust_env=False) as c:
        for route, body in (
            ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}),
            ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
            ("/completion", {"prompt": "Hi", "n_predict": 2}),
        ):
            r = c.post(d.base_url + route, json={**body, "no_such_field": 1}, headers=_auth(d.inference_key))
            error = _openai_error(r)
            assert error["code"] == "unknown_field", (route, error)
            assert error["param"] == "no_such_field", (route, error)
            assert "'no_such_field'" in error["message"], (route, error)
        r = c.post(
            d.base_url + "/v1/messages",
            json={"model": MODEL, "max_tokens": 2, "messages": MESSAGES, "no_such_field": 1},
            headers=_anthropic_headers(d.inference_key),
        )
        assert "'no_such_field'" in _anthropic_error(r)["message"]


@pytest.mark.parametrize("policy", ["drop", "pass"])
def test_unknown_fields_drop_and_pass_let_the_request_through(
    daemon_factory: DaemonFactory, policy: str
) -> None:
    d = daemon_factory({"proxy": {"unknown_fields": policy}})
    with httpx.Client(timeout=120, trust_env=False) as c:
        r = c.post(
            d.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "no_such_field": 1},
            headers=_auth(d.inference_key),
        )
        assert r.status_code == 200, r.text
        # The setting is about unknown fields only: a declared field out of range is still refused.
        r = c.post(
            d.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "n_keep": -2},
            headers=_auth(d.inference_key),
        )
        assert _openai_error(r)["code"] == "invalid_field"


# --- within bounds: the pinned schema ---------------------------------------------------------------

# An in-range value for every name of the pinned schema (aliases too), within the hard limits of
# server-schema.cpp. Keyed by name; a name missing here fails the test, so a new pin's fields get values.
GRAMMAR = 'root ::= "yes" | "no"'
IN_RANGE: dict[str, Any] = {
    "verbose": False,
    "timings_per_token": True,
    "stream": False,
    "stream_options": {"include_usage": True},
    "stream_options.include_usage": True,
    "cache_prompt": True,
    "return_tokens": True,
    "return_progress": False,
    "sse_ping_interval": 30,
    "n_predict": 2,
    "max_completion_tokens": 2,
    "max_tokens": 2,
    "n_indent": 0,
    "n_keep": 0,
    "n_discard": 0,
    "n_cmpl": 1,
    "n": 1,
    "n_cache_reuse": 0,
    "t_max_predict_ms": 5000,
    "response_fields": ["content"],
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "typical_p": 1.0,
    "temperature": 0.7,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.1,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.1,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.9,
    "seed": 42,
    "n_probs": 2,
    "logprobs": 2,
    "min_keep": 0,
    "backend_sampling": False,
    "post_sampling_probs": True,
    "lora": [],
    "dry_sequence_breakers": ["\n", ":"],
    "json_schema": {"type": "string"},
    "grammar": GRAMMAR,
    "grammar_lazy": False,
    "chat_format": 0,
    "reasoning_format": "none",
    "generation_prompt": "",
    "parse_tool_calls": False,
    # A serialized PEG arena (common_peg_arena::save) with no parsers and no root: the smallest one
    # common_peg_arena::from_json accepts.
    "chat_parser": json.dumps({"parsers": [], "rules": {}, "root": 2**64 - 1}),
    "continue_final_message": False,
    "echo": False,
    "preserved_tokens": ["yes"],
    "grammar_triggers": [{"type": 2, "value": "yes"}],
    "reasoning_control": False,
    "reasoning_budget_tokens": -1,
    "reasoning_budget_start_tag": "<think>",
    "reasoning_budget_end_tags": ["</think>"],
    "reasoning_budget_end_tag": "</think>",
    "reasoning_budget_message": "Done thinking.",
    "logit_bias": {"1": -1.0},
    "ignore_eos": True,
    "stop": ["\n"],
    "samplers": ["top_k", "top_p", "temperature"],
}
# Where the OpenAI chat route gives a name another type: logprobs is a boolean there (top_logprobs
# counts the candidates).
IN_RANGE_CHAT: dict[str, Any] = {"logprobs": True}

IN_RANGE_ROUTES: dict[str, dict[str, Any]] = {
    "/completion": {"prompt": "Say yes or no:", "n_predict": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
}


def _with_value(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(json.dumps(base))
    if "." in path:
        parent, name = path.split(".", 1)
        body[parent] = {name: value}
    else:
        body[path] = value
    return body


def test_every_pinned_schema_field_in_range_passes_the_door(
    daemon_factory: DaemonFactory, schema_fields: list[SchemaField]
) -> None:
    all_paths = [p for f in schema_fields for p in f.paths()]
    missing = [p for p in all_paths if p not in IN_RANGE]
    assert not missing, f"pinned schema names without an in-range value here: {missing}"
    # Fields the door refuses from every key on purpose, each with its reason (the advisories in
    # docs/security.md, llama-server's internal plumbing, adapters never loaded): refused, never sent.
    closed = {name: f.why for name, f in LLAMA.items() if f.who == "nobody"}
    assert set(closed) == {"chat_parser", "chat_format", "lora"} and all(closed.values()), closed
    paths = [p for p in all_paths if p not in closed]
    d = daemon_factory()
    pid = d.child_pid
    refused: list[str] = []
    child_refused: list[str] = []
    with httpx.Client(timeout=120, trust_env=False) as c:
        for route, base in IN_RANGE_ROUTES.items():
            for path in paths:
                value = IN_RANGE_CHAT.get(path, IN_RANGE[path]) if "chat" in route else IN_RANGE[path]
                r = c.post(
                    d.base_url + route, json=_with_value(base, path, value), headers=_auth(d.inference_key)
                )
                body = r.json()
                if _is_door_refusal(r.status_code, body):
                    refused.append(f"{route} {path}={value!r}: {r.text[:200]}")
                assert r.status_code < 500, f"{route} {path}={value!r}: {r.status_code} {r.text[:300]}"
                if r.status_code != 200:
                    child_refused.append(f"{route} {path}={value!r}: {r.status_code} {r.text[:200]}")
        # The control: each route refuses an out-of-range value of the same schema, so this test cannot
        # pass against a door that checks nothing.
        controls = [
            c.post(d.base_url + route, json=_with_value(base, "n_keep", -2), headers=_auth(d.inference_key))
            for route, base in IN_RANGE_ROUTES.items()
        ]
    assert not refused, "in-range values refused by the door:\n" + "\n".join(refused)
    with httpx.Client(timeout=30, trust_env=False) as c:
        for name in closed:
            r = c.post(
                d.base_url + "/completion",
                json=_with_value(IN_RANGE_ROUTES["/completion"], name, IN_RANGE[name]),
                headers=_auth(d.admin_key),
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    # And the child took every one: each value above got 200 from the pinned child through the door of
    # 6143b37, which forwarded bodies unchecked; an answer other than 200 now is the door's doing.
    assert not child_refused, "\n".join(child_refused)
    for control in controls:
        assert _openai_error(control)["code"] == "invalid_field", control.text
    assert d.child_pid == pid


# --- within bounds: what the SDKs send --------------------------------------------------------------

TOOL_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

# A plausible value for every parameter of the installed SDKs' request TypedDicts, per API. A parameter
# missing here fails the test: a new SDK release's parameter must be given one (and then pass the door).
SDK_VALUES: dict[str, dict[str, Any]] = {
    "chat": {
        "messages": MESSAGES,
        "model": MODEL,
        "audio": {"voice": "alloy", "format": "wav"},
        "frequency_penalty": 0.5,
        "function_call": "none",
        "functions": [
            {"name": "get_weather", "description": "Weather in a city", "parameters": TOOL_PARAMETERS}
        ],
        "logit_bias": {"1": -5},
        "logprobs": True,
        "max_completion_tokens": 2,
        "max_tokens": 2,
        "metadata": {"session": "abc"},
        "modalities": ["text"],
        "moderation": {"model": "omni-moderation-latest"},
        "n": 1,
        "parallel_tool_calls": False,
        "prediction": {"type": "content", "content": "Hi"},
        "presence_penalty": 0.5,
        "prompt_cache_key": "user-1",
        "prompt_cache_options": {"mode": "implicit"},
        "prompt_cache_retention": "in_memory",
        "reasoning_effort": "low",
        "response_format": {"type": "json_object"},
        "safety_identifier": "user-1",
        "seed": 42,
        "service_tier": "auto",
        "stop": ["\n"],
        "store": False,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
        "tool_choice": "auto",
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": "Weather", "parameters": TOOL_PARAMETERS},
            }
        ],
        "top_logprobs": 2,
        "top_p": 0.9,
        "user": "user-1",
        "verbosity": "low",
        "web_search_options": {"search_context_size": "low"},
    },
    "completions": {
        "model": MODEL,
        "prompt": "Say hi.",
        "best_of": 1,
        "echo": True,
        "frequency_penalty": 0.5,
        "logit_bias": {"1": -5},
        "logprobs": 2,
        "max_tokens": 2,
        "n": 1,
        "presence_penalty": 0.5,
        "seed": 42,
        "stop": ["\n"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "suffix": "!",
        "temperature": 0.7,
        "top_p": 0.9,
        "user": "user-1",
    },
    "embeddings": {
        "input": "Hello",
        "model": MODEL,
        "dimensions": 64,
        "encoding_format": "float",
        "user": "user-1",
    },
    "responses": {
        "model": MODEL,
        "input": "Say hi.",
        "access_programs": {"cyber": "standard"},
        "background": False,
        "background_options": {"completion_window": "soonest"},
        "context_management": [{"type": "compaction", "compact_threshold": 1000}],
        "conversation": "conv_123",
        "image": {"context_compression": "auto"},
        "include": ["message.output_text.logprobs"],
        "instructions": "Be brief.",
        "max_output_tokens": 16,
        "max_tool_calls": 1,
        "metadata": {"session": "abc"},
        "moderation": {"model": "omni-moderation-latest"},
        "parallel_tool_calls": False,
        "previous_response_id": "resp_123",
        "prompt": {"id": "pmpt_123"},
        "prompt_cache_key": "user-1",
        "prompt_cache_options": {"mode": "implicit"},
        "prompt_cache_retention": "in_memory",
        "reasoning": {"effort": "low"},
        "safety_identifier": "user-1",
        "service_tier": "auto",
        "store": False,
        "stream": True,
        "stream_options": {"include_obfuscation": False},
        "temperature": 0.7,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [
            {"type": "function", "name": "get_weather", "parameters": TOOL_PARAMETERS, "strict": False}
        ],
        "top_logprobs": 2,
        "top_p": 0.9,
        "truncation": "disabled",
        "user": "user-1",
    },
    "messages": {
        "max_tokens": 2,
        "messages": MESSAGES,
        "model": MODEL,
        "cache_control": {"type": "ephemeral"},
        "container": "container_123",
        "diagnostics": {"previous_message_id": "msg_123"},
        "inference_geo": "us",
        "metadata": {"user_id": "user-1"},
        "output_config": {"effort": "low"},
        "service_tier": "auto",
        "speed": "standard",
        "stop_sequences": ["\n"],
        "stream": True,
        "system": "Be brief.",
        "thinking": {"type": "disabled"},
        "tool_choice": {"type": "auto"},
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": TOOL_PARAMETERS}],
        "user_profile_id": "user-1",
        "workspace_id": "ws-1",
        # Older SDK releases and most Anthropic clients send these; this SDK's TypedDict no longer lists
        # them, so they go as extra_body.
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
    },
    "count_tokens": {
        "messages": MESSAGES,
        "model": MODEL,
        "cache_control": {"type": "ephemeral"},
        "output_config": {"effort": "low"},
        "speed": "standard",
        "system": "Be brief.",
        "thinking": {"type": "disabled"},
        "tool_choice": {"type": "auto"},
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": TOOL_PARAMETERS}],
        "user_profile_id": "user-1",
        "workspace_id": "ws-1",
    },
}
# The parameters a call needs whatever is under test.
SDK_BASE: dict[str, tuple[str, ...]] = {
    "chat": ("model", "messages", "max_tokens"),
    "completions": ("model", "prompt", "max_tokens"),
    "embeddings": ("model", "input"),
    "responses": ("model", "input", "max_output_tokens"),
    "messages": ("model", "messages", "max_tokens"),
    "count_tokens": ("model", "messages"),
}
# Parameters a client sends together: chat's top_logprobs counts the candidates logprobs asks for
# (alone, the child answers 400 "top_logprobs requires logprobs to be set to true").
SDK_COMPANIONS: dict[tuple[str, str], dict[str, Any]] = {("chat", "top_logprobs"): {"logprobs": True}}
# Where each API's parameters are declared in the SDK; "stream" is the create methods' own switch.
SDK_TYPEDDICTS: dict[str, tuple[Any, bool]] = {
    "chat": (chat_params.CompletionCreateParamsBase, True),
    "completions": (completion_params.CompletionCreateParamsBase, True),
    "embeddings": (embedding_params.EmbeddingCreateParams, False),
    "responses": (response_params.ResponseCreateParamsBase, True),
    "messages": (anthropic_create_params.MessageCreateParamsBase, True),
    "count_tokens": (anthropic_count_params.MessageCountTokensParams, False),
}


def sdk_parameters(api: str) -> list[str]:
    typed, streams = SDK_TYPEDDICTS[api]
    names = list(typed.__annotations__)
    return [*names, *(["stream"] if streams else [])]


def _call(api: str, oa: openai.OpenAI, an: anthropic.Anthropic) -> Callable[..., Any]:
    methods: dict[str, Callable[..., Any]] = {
        "chat": oa.chat.completions.create,
        "completions": oa.completions.create,
        "embeddings": oa.embeddings.create,
        "responses": oa.responses.create,
        "messages": an.messages.create,
        "count_tokens": an.messages.count_tokens,
    }
    return methods[api]


def _accepted_kwargs(method: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(method).parameters)


def _consume(result: Any) -> None:
    """Read a stream to its end: an error event after the headers raises here."""
    if isinstance(result, (openai.Stream, anthropic.Stream)):
        for _ in result:
            pass


def _send(api: str, oa: openai.OpenAI, an: anthropic.Anthropic, param: str) -> tuple[int, Any]:
    """One call with the base parameters and ``param``; (status, error body) or (200, None)."""
    values = SDK_VALUES[api]
    kwargs = {name: values[name] for name in SDK_BASE[api]}
    kwargs[param] = values[param]
    kwargs.update(SDK_COMPANIONS.get((api, param), {}))
    method = _call(api, oa, an)
    accepted = _accepted_kwargs(method)
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in accepted}
    if extra:
        kwargs["extra_body"] = extra
    try:
        _consume(method(**kwargs))
    except (openai.APIStatusError, anthropic.APIStatusError) as exc:
        return exc.status_code, exc.body if isinstance(exc.body, dict) else {"raw": exc.body}
    return 200, None


@contextlib.contextmanager
def _clients(d: Daemon) -> Iterator[tuple[openai.OpenAI, anthropic.Anthropic]]:
    oa = openai.OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=d.base_url, api_key=d.inference_key, max_retries=0, timeout=120)
    try:
        yield oa, an
    finally:
        oa.close()
        an.close()


def _sdk_round(d: Daemon, apis: tuple[str, ...]) -> None:
    for api in apis:
        missing = [p for p in sdk_parameters(api) if p not in SDK_VALUES[api]]
        assert not missing, f"{api}: SDK parameters without a plausible value here: {missing}"
    refused: list[str] = []
    with _clients(d) as (oa, an):
        for api in apis:
            params = sorted({*sdk_parameters(api), *SDK_VALUES[api]} - set(SDK_BASE[api])) or ["model"]
            for param in params:
                status, body = _send(api, oa, an, param)
                if _is_door_refusal(status, body):
                    refused.append(f"{api} {param}: {status} {json.dumps(body)[:300]}")
                assert status < 500, f"{api} {param}: {status} {body}"
            # The control: an undeclared field is refused on the same route, so this round is not
            # passing against a door that refuses nothing.
            kwargs = {name: SDK_VALUES[api][name] for name in SDK_BASE[api]}
            status, body = (0, None)
            try:
                _consume(_call(api, oa, an)(**kwargs, extra_body={"no_such_field": 1}))
            except (openai.APIStatusError, anthropic.APIStatusError) as exc:
                status, body = exc.status_code, exc.body
            assert status == 400 and "no_such_field" in json.dumps(body), (api, status, body)
    assert not refused, "SDK parameters refused by the door:\n" + "\n".join(refused)


def test_every_sdk_parameter_passes_the_door(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    _sdk_round(d, ("chat", "completions", "responses", "messages", "count_tokens"))


def test_every_embeddings_sdk_parameter_passes_the_door(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"llama": {"embeddings": True, "extra_args": ["--pooling", "mean"]}})
    _sdk_round(d, ("embeddings",))
    # The SDK's own default encoding (base64), which the round above does not send.
    with _clients(d) as (oa, _):
        out = oa.embeddings.create(model=MODEL, input="Hello", encoding_format="base64")
        assert out.data and out.data[0].embedding
