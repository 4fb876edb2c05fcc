"""The conversation key: which source wins, what the opening is, tenants kept apart, and the vectors the
nginx script is held to (deploy/nginx/conversation.js computes the same ids)."""

from __future__ import annotations

import hashlib
from typing import Any

from proxy.conversations.key import conversation_id, conversation_key

CHAT: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "How are you?"},
    ]
}


def _opening(system: str, user: str) -> str:
    head, first = system.encode(), user.encode()
    return "opening:" + hashlib.sha256(b"%d:%s%d:%s" % (len(head), head, len(first), first)).hexdigest()


def test_the_session_header_wins_over_everything() -> None:
    headers = [(b"session-id", b"agent-1"), (b"x-session-id", b" s-42 ")]
    payload = {**CHAT, "prompt_cache_key": "pk"}
    assert conversation_id(headers, payload) == "session:s-42"


def test_prompt_cache_key_comes_before_agent_headers_and_the_opening() -> None:
    assert (
        conversation_id([(b"session-id", b"a")], {**CHAT, "prompt_cache_key": "pk"}) == "prompt_cache_key:pk"
    )
    assert conversation_id([(b"x-claude-code-session-id", b"cc")], CHAT) == "agent:cc"
    assert conversation_id([(b"session-id", b"sid")], CHAT) == "agent:sid"


def test_the_opening_is_the_system_prompt_and_first_user_message() -> None:
    assert conversation_id([], CHAT) == _opening("You are terse.", "Hello")
    # Every later turn of the conversation repeats its opening: same id.
    later = {"messages": [*CHAT["messages"], {"role": "assistant", "content": "Fine."}]}
    assert conversation_id([], later) == conversation_id([], CHAT)
    # Another first message: another conversation.
    other = {"messages": [CHAT["messages"][0], {"role": "user", "content": "Hello!"}]}
    assert conversation_id([], other) != conversation_id([], CHAT)


def test_the_dialects_agree_on_one_opening() -> None:
    anthropic = {
        "system": "You are terse.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
    }
    responses = {"instructions": "You are terse.", "input": [{"role": "user", "content": "Hello"}]}
    assert conversation_id([], anthropic) == conversation_id([], responses) == conversation_id([], CHAT)
    assert conversation_id([], {"input": "Hello"}) == _opening("", "Hello")


def test_lengths_keep_the_boundary_between_system_and_user() -> None:
    a = {"messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "c"}]}
    b = {"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "bc"}]}
    assert conversation_id([], a) != conversation_id([], b)


def test_no_conversation_without_an_opening_or_an_id() -> None:
    assert conversation_id([], {"prompt": "Once upon a time"}) is None
    assert conversation_id([], {"messages": [{"role": "system", "content": "x"}]}) is None
    assert conversation_id([], {"messages": ["not an object"]}) is None
    assert conversation_id([(b"x-session-id", b"")], {"prompt": "p"}) is None
    assert conversation_id([(b"x-session-id", b"x" * 257)], {"prompt": "p"}) is None  # not an id
    assert conversation_id([(b"x-session-id", b"\xff\xfe")], {"prompt": "p"}) is None


def test_the_key_is_per_tenant_and_a_digest() -> None:
    cid = conversation_id([], CHAT)
    assert cid is not None
    a, b = conversation_key("a", cid), conversation_key("b", cid)
    assert a != b and len(a) == 32 and int(a, 16) >= 0
    assert conversation_key("a", cid) == a
    assert "terse" not in a and "Hello" not in a
