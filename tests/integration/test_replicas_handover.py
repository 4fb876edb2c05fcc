"""Replicas hand conversations over (issue 56, item 6): two real llamagate replicas behind the shipped
nginx (deploy/nginx/llamagate.conf: a consistent hash on the conversation). A conversation plays two
turns on the replica it hashes to; that replica stops (a planned stop: its slot's state is saved); the
next turn goes to the replica that takes it on the ring. With one states folder for both (one identity:
they use one folder of it), that replica restores the conversation from it and reuses its history; with
a folder each, it has nothing to restore and computes the history again. One slot and no RAM prompt
cache, so what a turn reuses can only come from its slot or the disk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.bench.nginx import Nginx, start_nginx
from supervisor.config.keys import ADMIN, new_key_config
from tests.helpers.exposition import sample
from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.needs_tool("nginx", "nginx-js")]

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant. " + " ".join(f"Rule {i}: answer kindly." for i in range(6))


class Replicas:
    def __init__(self, daemons: list[Daemon], key: str, nginx: Nginx) -> None:
        self.daemons, self.nginx = daemons, nginx
        self.headers = {"Authorization": f"Bearer {key}"}

    def by_addr(self, addr: str) -> Daemon:
        (d,) = [d for d in self.daemons if f"127.0.0.1:{d.port}" == addr]
        return d

    def restores(self, d: Daemon) -> float:
        """States restored from disk on ``d`` (its /metrics, with the replicas' shared key)."""
        r = httpx.get(d.base_url + "/metrics", headers=self.headers, timeout=30, trust_env=False)
        r.raise_for_status()
        name = "llamagate_conversation_state_restores_total"
        return sample(r.text, name, model=MODEL, tenant="default") or 0.0

    def turn(self, client: httpx.Client, messages: list[dict[str, str]]) -> tuple[dict[str, Any], str]:
        """One turn through nginx: the answer, and the replica that gave it (nginx's access log)."""
        logged = len(self.nginx.access_log()) + 1
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        r = client.post(self.nginx.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        wait_until(lambda: len(self.nginx.access_log()) >= logged, "nginx logged the turn", 10)
        return r.json(), self.nginx.access_log()[-1].tried[-1]


def replicas_for(daemon_factory: DaemonFactory, tmp_path: Path, shared: bool) -> Iterator[Replicas]:
    key, entry = new_key_config("default", ADMIN)  # one key for both; admin: it sees the cached counts
    overrides: dict[str, Any] = {
        "llama": {"slots": 1, "prompt_cache_mib": 0},
        "tenants": [{"name": "default", "max_concurrency": 1, "max_queue": 8}],
        "keys": [entry],
    }
    if shared:
        overrides["llama"]["state_dir"] = str(tmp_path / "shared-states")
    daemons = [daemon_factory(overrides, wait_ready=False) for _ in range(2)]
    for d in daemons:
        d.wait_ready()
    nginx = start_nginx([f"127.0.0.1:{d.port}" for d in daemons], tmp_path / "nginx")
    try:
        yield Replicas(daemons, key, nginx)
    finally:
        nginx.stop()


@pytest.fixture(params=[True, False], ids=["shared-folder", "folder-each"])
def replicas(
    request: pytest.FixtureRequest, daemon_factory: DaemonFactory, tmp_path: Path
) -> Iterator[Replicas]:
    yield from replicas_for(daemon_factory, tmp_path, request.param)


def test_a_conversation_whose_replica_leaves_resumes_on_the_next_from_the_shared_folder(
    replicas: Replicas, request: pytest.FixtureRequest
) -> None:
    shared = request.node.callspec.params["replicas"]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Conversation handover: tell me about rivers. " + "Please go on. " * 60},
    ]
    homes: list[str] = []
    reusable = 0
    with httpx.Client(headers=replicas.headers, timeout=300, trust_env=False) as client:
        for k in range(3):
            if k == 2:  # the conversation's replica leaves the ring between its second and third turns
                (home,) = set(homes)
                replicas.by_addr(home).stop()
            answer, served_by = replicas.turn(client, messages)
            homes.append(served_by)
            text = answer["choices"][0]["message"]["content"] or "ok"
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"And then, turn {k + 2}? " + "Tell me more. " * 20},
            ]
            usage = answer["usage"]
            if k < 2:
                reusable = usage["prompt_tokens"] + usage["completion_tokens"]
    taker = replicas.by_addr(homes[2])
    assert homes[2] != homes[0], "the third turn went to the replica that took the conversation"
    cached = int(usage["prompt_tokens_details"]["cached_tokens"])
    restores = replicas.restores(taker)
    if shared:
        # Restored on the replica that took it, from the folder the leaving one saved it to.
        assert restores == 1
        assert cached >= 0.95 * reusable, usage
    else:
        # Nothing of it there: only the shared system prompt's few tokens could have been reused.
        assert restores == 0
        assert cached < 0.5 * reusable, usage
