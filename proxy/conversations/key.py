"""Which conversation a request continues: its key, derived once at the door.

A chat client sends the whole history every turn, so turn k's prompt is turn k-1's prompt plus an answer
and a new message. The key names the conversation so that its turns go where its state is: to the slot
that holds it (``proxy.conversations.slots``) and, behind the shipped nginx, to the replica that holds it
(deploy/nginx/conversation.js computes the same *conversation id*). docs/api.md "Conversations" is the
spec; this module and the nginx script are its two implementations, and tests/unit/proxy hold them to
the same vectors.

The conversation id, first source present wins:
1. the ``X-Session-Id`` header: the client (or a gateway before us) says it outright;
2. the body's ``prompt_cache_key`` (OpenAI's field for exactly this);
3. the session headers coding agents send today (``x-claude-code-session-id``, ``session-id``);
4. the conversation's opening: a digest of its system prompt and first user message (chat ``messages``,
   Anthropic ``system`` + ``messages``, Responses ``instructions`` + ``input``), which every later turn
   repeats unchanged. A request with neither (a raw completion prompt) has no conversation.
Explicit ids come before the opening because two conversations may well open the same way (the same
system prompt and "Hello"); a client that names its conversations keeps them apart.

The key is the id namespaced by tenant (two tenants never share one, whatever they send), as a digest:
it is all the gateway keeps and the answer's ``X-Llamagate-Conversation`` header shows; no prompt text
is logged or stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

# Request headers naming a conversation, in the order they win (``X-Session-Id`` before the body's field).
SESSION_HEADER = b"x-session-id"
AGENT_HEADERS = (b"x-claude-code-session-id", b"session-id")
# The answer's header carrying the key (a digest): a client may pin on it.
KEY_HEADER = b"x-llamagate-conversation"
# Longest id taken from a header or the body; a longer one is refused as no id at all (it is hashed, so
# nothing depends on its length, but a 1 MB "session id" is not one).
MAX_ID_CHARS = 256
_KEY_HEX = 32  # 128 bits of the digest: collisions are out of reach for any tenant's traffic


def conversation_id(headers: Iterable[tuple[bytes, bytes]], payload: dict[str, Any]) -> str | None:
    """The conversation id of a request (the spec above), or None. ``source:value``: the source keeps
    ids of different kinds apart (a header saying "abc" is not a body saying "abc")."""
    agents: dict[bytes, str] = {}
    for name, value in headers:
        if name == SESSION_HEADER:
            found = _id(value)
            if found is not None:
                return "session:" + found
        elif name in AGENT_HEADERS and name not in agents:
            found = _id(value)
            if found is not None:
                agents[name] = found
    cache_key = payload.get("prompt_cache_key")
    if isinstance(cache_key, str) and 0 < len(cache_key) <= MAX_ID_CHARS:
        return "prompt_cache_key:" + cache_key
    for name in AGENT_HEADERS:  # in this order, whatever the order the client sent them in
        if name in agents:
            return "agent:" + agents[name]
    opening = _opening(payload)
    return None if opening is None else "opening:" + opening


def named(cid: str) -> bool:
    """The client named conversation ``cid`` (a header or the body's field), rather than the gateway
    deriving it from the opening: it says the conversation will come back (``proxy.conversations.writes``)."""
    return not cid.startswith("opening:")


def conversation_key(tenant: str, cid: str) -> str:
    """The tenant's key for conversation id ``cid``: never equal for two tenants."""
    digest = hashlib.sha256(b"llamagate-conversation-v1\n" + _text(tenant) + b"\n" + _text(cid))
    return digest.hexdigest()[:_KEY_HEX]


def _id(value: bytes) -> str | None:
    try:
        text = value.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    return text if 0 < len(text) <= MAX_ID_CHARS else None


def _opening(payload: dict[str, Any]) -> str | None:
    """sha256 of the opening: the system text and the first user message's text, each preceded by its
    length in UTF-8 bytes (so no text can fake the boundary). None without a user message."""
    system: list[str] = []
    user: str | None = None
    messages = payload.get("messages")
    if isinstance(messages, list):  # chat completions, Anthropic messages
        system.append(_content(payload.get("system")))  # Anthropic's top-level system prompt
        user = _first_user(messages, system)
    else:  # Responses: instructions, and input as a string or a list of items
        system.append(_content(payload.get("instructions")))
        items = payload.get("input")
        if isinstance(items, str):
            user = items
        elif isinstance(items, list):
            user = _first_user(items, system)
    if not user:
        return None
    head, first = _text("\n".join(s for s in system if s)), _text(user)
    opening = b"%d:%s%d:%s" % (len(head), head, len(first), first)
    return hashlib.sha256(opening).hexdigest()


def _first_user(items: list[Any], system: list[str]) -> str | None:
    """The first user message's text of chat messages or Responses input items, adding the system and
    developer texts before it to ``system``; "" without one, None when an item is not an object."""
    for item in items:
        if not isinstance(item, dict):
            return None
        role = item.get("role")
        if role in ("system", "developer"):
            system.append(_content(item.get("content")))
        elif role == "user":
            return _content(item.get("content"))
    return ""


def _content(value: Any) -> str:
    """A message's text: a string, or the ``text`` of its parts joined by newlines (other parts, such as
    images, do not enter the opening)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(
            part["text"] for part in value if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _text(value: str) -> bytes:
    # A lone surrogate cannot reach here from a parsed body (``proxy.asgi.body`` refuses it); a header's
    # bytes were decoded as UTF-8. "surrogatepass" only keeps a caller's odd string from raising.
    return value.encode("utf-8", "surrogatepass")
