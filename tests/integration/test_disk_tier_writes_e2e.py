"""What the disk tier writes, through the real daemon and llama-server (SmolLM2), issue 56: one-shot
traffic (every request a conversation of its own that never comes back) stops being written once its
return rate is known, while a conversation that does come back, named by its client or not, is still
written when it leaves its slot and restored from disk for its next turn."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.conversations.writes import FIRST_WRITES, WRITE_ONE_IN
from tests.integration.conftest import Daemon, DaemonFactory
from tests.integration.test_disk_tier_e2e import MODEL, ONE_SLOT, cached, metric

pytestmark = pytest.mark.integration

# The first-turn states of a tenant written before its return rate is known (the prior's one return).
EXPLORED = FIRST_WRITES
ONE_SHOTS = EXPLORED + 20


class Chat:
    """One conversation, named by ``X-Session-Id`` or (``session`` None) by its opening only."""

    def __init__(self, d: Daemon, name: str, session: str | None) -> None:
        self.d, self.session = d, session
        self.messages: list[dict[str, str]] = [
            {"role": "user", "content": f"Conversation {name}: tell me about {name}. " + "Go on. " * 40}
        ]
        self.last_total = 0

    def turn(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.d.admin_key}"}
        if self.session is not None:
            headers["X-Session-Id"] = self.session
        r = httpx.post(
            self.d.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": self.messages, "max_tokens": 4, "temperature": 0},
            headers=headers,
            timeout=300,
        )
        assert r.status_code == 200, r.text
        answer: dict[str, Any] = r.json()
        usage = answer["usage"]
        self.messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And then? " + "Tell me more. " * 10},
        ]
        answer["reusable"] = self.last_total
        self.last_total = usage["prompt_tokens"] + usage["completion_tokens"]
        return answer


def saves(d: Daemon) -> float:
    return metric(d, "llamagate_conversation_state_saves_total", tenant="default")


def test_one_shot_traffic_is_not_written_and_returning_conversations_still_are(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(ONE_SLOT)
    for i in range(ONE_SHOTS):  # one slot: each request replaces the state of the one before
        Chat(d, f"one-shot {i}", None).turn()
    # Before issue 56 each of the ONE_SHOTS - 1 states that left the slot was written.
    assert saves(d) == EXPLORED
    skipped = "llamagate_conversation_state_writes_skipped_total"
    assert metric(d, skipped, tenant="default", reason="one_shot") == ONE_SHOTS - 1 - EXPLORED
    rate = metric(d, "llamagate_conversation_state_return_rate", tenant="default")
    assert 0 < rate < 1 / WRITE_ONE_IN

    # A conversation named by its client is written on its first turn already; an unnamed one from its
    # second turn on (it came back once); each is restored from disk when its slot went to the other.
    named, unnamed = Chat(d, "named", "session-n"), Chat(d, "unnamed", None)
    written = saves(d)
    named.turn()
    unnamed.turn()  # takes the named one's slot: the named state is written
    assert saves(d) == written + 1
    answer = named.turn()  # restored from disk; the unnamed first turn is not written (one-shot tenant)
    assert cached(answer) >= 0.9 * answer["reusable"], answer["usage"]
    assert saves(d) == written + 1
    unnamed.turn()  # its second turn, computed (nothing on disk); the named one is written again
    named.turn()  # restored; the unnamed one, which came back once, is written now
    answer = unnamed.turn()
    assert cached(answer) >= 0.9 * answer["reusable"], answer["usage"]
    assert saves(d) == written + 4
    assert metric(d, "llamagate_conversation_state_restores_total", tenant="default") == 3
    assert metric(d, "llamagate_conversation_state_misses_total", tenant="default") == 0
