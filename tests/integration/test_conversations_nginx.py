"""A conversation stays on one replica behind the shipped nginx (deploy/nginx/llamagate.conf and its
conversation.js), with three real llamagate replicas: every turn of a conversation reaches the same
replica (nginx's access log) and its history comes from that replica's cache; conversations spread over
the replicas; and when a conversation's replica refuses (its child killed: 503), the turn moves on to
another replica and the next turns stay there while the first one refuses."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.bench.nginx import Nginx, start_nginx
from supervisor.config.keys import ADMIN, new_key_config
from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.needs_tool("nginx", "nginx-js")]

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant. " + " ".join(f"Rule {i}: answer kindly." for i in range(20))


class Replicas:
    def __init__(self, daemons: list[Daemon], key: str, nginx: Nginx) -> None:
        self.daemons = daemons
        self.nginx = nginx
        self.headers = {"Authorization": f"Bearer {key}"}

    def by_addr(self, addr: str) -> Daemon:
        (d,) = [d for d in self.daemons if f"127.0.0.1:{d.port}" == addr]
        return d


@pytest.fixture
def replicas(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[Replicas]:
    key, entry = new_key_config("default", ADMIN)  # admin: it sees the cached counts
    overrides = {
        "llama": {"slots": 1, "threads": 1, "ctx_per_slot": 2048},
        "tenants": [{"name": "default", "max_concurrency": 1, "max_queue": 8}],
        "keys": [entry],
        # A killed child stays down long enough for the turns below to meet its 503.
        "supervision": {"backoff_initial_s": 60, "backoff_max_s": 60},
    }
    daemons = [daemon_factory(overrides, wait_ready=False) for _ in range(3)]
    for d in daemons:
        d.wait_ready()
    nginx = start_nginx([f"127.0.0.1:{d.port}" for d in daemons], tmp_path / "nginx")
    try:
        yield Replicas(daemons, key, nginx)
    finally:
        nginx.stop()


class Conversation:
    def __init__(self, name: str) -> None:
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {name}: tell me about {name}. " + "Please. " * 30},
        ]
        self.turns: list[tuple[int, int]] = []  # (prompt tokens, cached)
        self.keys: set[str] = set()

    def turn(self, client: httpx.Client, url: str) -> None:
        body: dict[str, Any] = {"model": MODEL, "messages": self.messages, "max_tokens": 4, "temperature": 0}
        r = client.post(url, json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        usage = answer["usage"]
        self.turns.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
        self.keys.add(r.headers["x-llamagate-conversation"])
        text = answer["choices"][0]["message"]["content"] or "ok"
        self.messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on. " * 10}]


def _served_by(nginx: Nginx) -> list[str]:
    """The replica that answered each request, in order (the last one nginx tried)."""
    return [record.tried[-1] for record in nginx.access_log()]


def test_a_conversations_turns_stay_on_one_replica(replicas: Replicas) -> None:
    url = replicas.nginx.url + "/v1/chat/completions"
    names = [f"topic-{i}" for i in range(10)]
    conversations = {name: Conversation(name) for name in names}
    where: dict[str, list[str]] = {name: [] for name in names}
    with httpx.Client(headers=replicas.headers, timeout=120, trust_env=False) as client:
        for _ in range(2):
            for name in names:
                logged = len(replicas.nginx.access_log()) + 1
                conversations[name].turn(client, url)
                wait_until(
                    lambda n=logged: len(replicas.nginx.access_log()) >= n, "nginx logged the turn", 10
                )
                record = replicas.nginx.access_log()[-1]
                assert record.tried == [record.tried[-1]], "one try: nobody refused"
                where[name].append(record.tried[-1])
    for name in names:
        assert len(set(where[name])) == 1, f"{name} moved: {where[name]}"
        c = conversations[name]
        assert len(c.keys) == 1
        for (before, _), (_, cached) in zip(c.turns, c.turns[1:], strict=False):
            assert cached >= before, f"{name}: history not from cache: {c.turns}"
    # Ten conversations over three replicas: all on one would be a broken hash (odds 3^-9).
    assert len({w[0] for w in where.values()}) >= 2


def test_a_turn_moves_on_when_its_replica_refuses(replicas: Replicas) -> None:
    url = replicas.nginx.url + "/v1/chat/completions"
    conversation = Conversation("refusal")
    with httpx.Client(headers=replicas.headers, timeout=120, trust_env=False) as client:
        conversation.turn(client, url)
        wait_until(lambda: len(replicas.nginx.access_log()) == 1, "nginx logged the turn", 10)
        (home,) = replicas.nginx.access_log()[0].tried
        victim = replicas.by_addr(home)
        child = httpx.get(f"{victim.base_url}/admin/identity", headers=replicas.headers, timeout=10).json()
        os.kill(int(child["status"]["child_pid"]), signal.SIGKILL)
        wait_until(lambda: victim.readyz()[0] == 503, "the replica saw its child die", 30)
        conversation.turn(client, url)
        conversation.turn(client, url)
    wait_until(lambda: len(replicas.nginx.access_log()) == 3, "nginx logged the turns", 10)
    moved, stayed = replicas.nginx.access_log()[1:]
    # Tried at home first (503), then the next replica on the ring, which answered...
    assert moved.tried[0] == home and moved.answers[0] == "503" and moved.status == 200
    new_home = moved.tried[-1]
    assert new_home != home
    # ... and the next turn goes the same way: the conversation stays together while its replica refuses.
    assert stayed.tried == moved.tried and stayed.status == 200
    assert len(conversation.keys) == 1
    (moved_prompt, _), (_, cached) = conversation.turns[1], conversation.turns[2]
    assert cached >= moved_prompt, "on its new replica, the history comes from cache again"
