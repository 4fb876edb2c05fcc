"""A sliding-window model keeps its conversations' states by default (issue 56, item 4): the Gemma 3 demo
with nothing added to its config gets ``--swa-full`` from llamagate while the disk tier is on, and a
conversation longer than its 512-token window, restored from disk after another took its only slot, is
reused (the real child). Without ``--swa-full`` the restored state has no context checkpoints and
llama-server processes the whole prompt again (docs/benchmarks.md: 0 % of the reusable maximum)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.exposition import sample
from tests.integration.conftest import Daemon, DaemonFactory

pytestmark = pytest.mark.integration

ALIAS = "gemma-3-270m"


def turn(d: Daemon, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(
        d.base_url + "/v1/chat/completions",
        json={"model": ALIAS, "messages": messages, "max_tokens": 8, "temperature": 0},
        headers={"Authorization": f"Bearer {d.admin_key}"},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    messages += [
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "ok"},
        {"role": "user", "content": "And then? " + "Tell me more. " * 20},
    ]
    return answer


def tier(d: Daemon, name: str) -> float:
    text = httpx.get(
        d.base_url + "/metrics", headers={"Authorization": f"Bearer {d.admin_key}"}, timeout=30
    ).text
    return sample(text, f"llamagate_conversation_state_{name}_total", model=ALIAS, tenant="default") or 0.0


def test_the_gemma_demo_restores_a_conversation_past_its_window(
    daemon_factory: DaemonFactory, gemma_model: Path
) -> None:
    from supervisor.artifacts.demo_model import GEMMA

    model = {"path": str(gemma_model), "sha256": GEMMA.sha256, "alias": ALIAS}
    # One slot and no RAM prompt cache: a conversation's history comes from its slot or the disk only.
    d = daemon_factory(
        {
            "llama": {"model": model, "slots": 1, "prompt_cache_mib": 0},
            "tenants": [{"name": "default", "max_concurrency": 1}],
        }
    )
    assert "--swa-full" in d.log_text()  # the child's argv, as the supervisor logged it
    chats = [
        [
            {"role": "system", "content": "You are a helpful assistant."},
            # ~800 tokens: past the 512-token window of the sliding layers.
            {
                "role": "user",
                "content": f"Conversation {name}: tell me about {name}. " + "Please go on. " * 200,
            },
        ]
        for name in ("alpha", "beta")
    ]
    first = turn(d, chats[0])
    turn(d, chats[1])  # alpha's state leaves the slot: saved to disk
    again = turn(d, chats[0])  # restored from disk into the slot
    reusable = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.95 * reusable, again["usage"]
    assert tier(d, "restores") == 1 and tier(d, "misses") == 0
