"""Conversations stay on their cache, through the real daemon and llama-server (SmolLM2), with the OpenAI
and Anthropic SDKs: two conversations alternating on one slot each get their whole history from cache on
every later turn; four conversations on two slots too (the RAM prompt cache holds the replaced states);
the answer names the conversation's key; and a tenant never gets a cached count or state of another
tenant's conversation, with conversations replaced and restored under it (llama.cpp issue 27148)."""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

import httpx
import pytest
from anthropic import Anthropic
from openai import OpenAI

from supervisor.config.keys import INFERENCE, new_key_config
from tests.integration.conftest import DaemonFactory

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
# A system prompt every conversation shares (as an application's would), long enough that llama-server's
# own slot choice takes any slot as "similar" (the case that lost conversations before).
SYSTEM = "You are a helpful assistant. " + " ".join(
    f"Rule {i}: answer kindly and precisely." for i in range(30)
)


def _opening(name: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Conversation {name}: tell me about topic {name}. " + "Please. " * 60},
    ]


def _turns(client: OpenAI, names: str, turns: int) -> dict[str, list[tuple[int, int, str]]]:
    """Each conversation in ``names`` in turn, ``turns`` times: (prompt tokens, cached, key) per turn."""
    history = {name: _opening(name) for name in names}
    seen: dict[str, list[tuple[int, int, str]]] = {name: [] for name in names}
    for turn in range(turns):
        for name in names:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=history[name],
                max_tokens=8,
                temperature=0,  # type: ignore[arg-type]
            )
            answer = raw.parse()
            usage = answer.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            seen[name].append((usage.prompt_tokens, cached, raw.headers["x-llamagate-conversation"]))
            history[name] += [
                {"role": "assistant", "content": answer.choices[0].message.content or ""},
                {"role": "user", "content": f"Turn {turn} of {name}: go on. " + "And more. " * 40},
            ]
    return seen


def _history_from_cache(seen: dict[str, list[tuple[int, int, str]]]) -> None:
    for name, turns in seen.items():
        keys = {key for _, _, key in turns}
        assert len(keys) == 1, f"{name}: one key for every turn, got {keys}"
        for (before, _, _), (prompt, cached, _) in itertools.pairwise(turns):
            # Everything the previous turn's prompt held came from cache (and the answer, mostly).
            assert cached >= before, f"{name}: {cached} of {prompt} cached, previous prompt {before}: {turns}"
    keys = [turns[0][2] for turns in seen.values()]
    assert len(set(keys)) == len(keys), "every conversation has its own key"


def test_two_conversations_alternating_on_one_slot_keep_their_history(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"llama": {"slots": 1}, "tenants": [{"name": "default", "max_concurrency": 1}]})
    with OpenAI(base_url=d.base_url + "/v1", api_key=d.admin_key, max_retries=0) as client:
        _history_from_cache(_turns(client, "AB", turns=2))


def test_four_conversations_on_two_slots_keep_their_history(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    with OpenAI(base_url=d.base_url + "/v1", api_key=d.admin_key, max_retries=0) as client:
        _history_from_cache(_turns(client, "ABCD", turns=2))


def test_an_anthropic_conversation_is_placed_too(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"llama": {"slots": 1}})
    with Anthropic(base_url=d.base_url, api_key=d.admin_key, max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "Hello, " + "tell me a story. " * 40}]
        keys = []
        for turn in range(2):
            raw = client.messages.with_raw_response.create(
                model=MODEL, system=SYSTEM, messages=messages, max_tokens=8
            )
            answer = raw.parse()
            keys.append(raw.headers["x-llamagate-conversation"])
            messages += [
                {"role": "assistant", "content": answer.content[0].text or "ok"},  # type: ignore[union-attr]
                {"role": "user", "content": f"Turn {turn}: go on."},
            ]
    assert keys[0] == keys[1]
    # The OpenAI form of the same opening is the same conversation (one spec for every dialect).
    r = httpx.post(
        d.base_url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "system", "content": SYSTEM}, messages[0]],
            "max_tokens": 1,
        },
        headers={"Authorization": f"Bearer {d.admin_key}"},
        timeout=120,
    )
    assert r.status_code == 200 and r.headers["x-llamagate-conversation"] == keys[0]
    # A named session wins over the opening.
    r = httpx.post(
        d.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [messages[0]], "max_tokens": 1},
        headers={"Authorization": f"Bearer {d.admin_key}", "X-Session-Id": "s-1"},
        timeout=120,
    )
    assert r.status_code == 200 and r.headers["x-llamagate-conversation"] not in keys


MARKER = "tangerine-seventeen"


def test_a_tenant_never_gets_another_tenants_conversation(daemon_factory: DaemonFactory) -> None:
    alpha_key, alpha = new_key_config("alpha", INFERENCE)
    beta_key, beta = new_key_config("beta", INFERENCE)
    strict_key, strict = new_key_config("strict", INFERENCE)
    d = daemon_factory(
        {
            "tenants": [
                {"name": "default", "max_concurrency": 2},
                {"name": "alpha", "max_concurrency": 2},
                {"name": "beta", "max_concurrency": 2, "show_cache_details": True},
                {"name": "strict", "max_concurrency": 2, "show_cache_details": True, "cache_prompt": False},
            ],
            "keys": [alpha, beta, strict],
        }
    )
    # Alpha's conversations: a private note in each, finished, their states in the slots and the RAM cache.
    secret_system = f"You keep a private note: the vault code is {MARKER}. " + " ".join(
        f"Rule {i}: never reveal the code." for i in range(30)
    )
    for n in range(3):
        messages = [
            {"role": "system", "content": secret_system},
            {"role": "user", "content": f"Note {n}: repeat the vault code {MARKER} twice. " + "Now. " * 30},
        ]
        r = httpx.post(
            d.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0},
            headers={"Authorization": f"Bearer {alpha_key}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        alpha_key_header = r.headers["x-llamagate-conversation"]
        assert "cached_tokens" not in json.dumps(r.json())  # alpha's own hits are hidden from alpha
    # Beta and the strict tenant, two at a time (both slots replaced and restored at once, the
    # concurrency of issue 27148), with openings of their own.
    answers: list[tuple[str, dict[str, Any]]] = []
    errors: list[BaseException] = []

    # A first word of its own for every request: what one request may reuse of another is the template's
    # opening only (beta's own earlier requests included).
    words = iter(["Oak", "Elm", "Ash", "Yew", "Fir", "Box", "Bay", "Rue"])

    def ask(key: str, tenant: str, i: int, word: str) -> None:
        try:
            body = {
                "model": MODEL,
                "messages": [
                    {
                        "role": "system",
                        "content": f"{word} garden: you are {tenant}'s gardener. Talk about roses.",
                    },
                    {
                        "role": "user",
                        "content": f"Question {i}: which roses grow in shade? " + "Thanks. " * 20,
                    },
                ],
                "max_tokens": 16,
                "temperature": 0,
            }
            r = httpx.post(
                d.base_url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-llamagate-conversation"] != alpha_key_header
            answers.append((tenant, r.json()))
        except BaseException as exc:
            errors.append(exc)

    for i in range(4):
        threads = [
            threading.Thread(target=ask, args=(beta_key, "beta", i, next(words))),
            threading.Thread(target=ask, args=(strict_key, "strict", i, next(words))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    assert len(answers) == 8
    for tenant, answer in answers:
        text = answer["choices"][0]["message"]["content"]
        assert MARKER not in text and "tangerine" not in text.lower(), (tenant, text)
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        # What any two chats share: the template's opening tokens ("<|im_start|>system\nYou are "), never
        # alpha's note: the first tokens of beta's own text differ from it.
        assert cached <= 8, (tenant, cached, answer["usage"])
        if tenant == "strict":
            assert cached == 0 and answer["timings"]["cache_n"] == 0
