"""Scale-out for real: the shipped deploy/nginx/llamagate.conf in front of three llamagate replicas.

Each replica is a whole daemon with its own llama-server child (the demo model, 1 slot, 1 thread, a small
context) and no queue (``max_queue: 0``): a busy replica refuses at once with 429, and nginx, by the
shipped retry rule, sends the request on to the next replica. What is checked, with real nginx and real
children: three concurrent streams are all admitted, one per replica; a fourth is refused by every
replica and the client sees 429 with Retry-After; a replica whose child was killed (kill -9) or whose
daemon is draining (SIGTERM) answers 503 and the requests that had not started land on the others,
while the one in flight on it ends with a clear error (killed) or completes (drained).
"""

from __future__ import annotations

import asyncio
import json
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

REPLICAS = 3
MODEL = "smollm2-135m-instruct"


class ReplicaSet:
    def __init__(self, daemons: list[Daemon], key: str, nginx: Nginx) -> None:
        self.daemons = daemons
        self.key = key
        self.nginx = nginx
        self.headers = {"Authorization": f"Bearer {key}"}

    def addr(self, d: Daemon) -> str:
        return f"127.0.0.1:{d.port}"

    def in_flight(self, d: Daemon) -> int:
        return int(d.readyz()[1]["in_flight"])

    def child_pid(self, d: Daemon) -> int:
        r = httpx.get(f"{d.base_url}/admin/identity", headers=self.headers, timeout=10.0, trust_env=False)
        r.raise_for_status()
        return int(r.json()["status"]["child_pid"])


def chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # every answer is exactly max_tokens long: the slot stays busy that long
    }
    if stream:
        body["stream"] = True
    return body


@pytest.fixture
def replicas(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[ReplicaSet]:
    # One key valid on every replica, as in a real replica set (same ConfigMap and Secret everywhere).
    key, entry = new_key_config("default", ADMIN)
    overrides = {
        "llama": {"slots": 1, "threads": 1, "ctx_per_slot": 1024},
        "tenants": [{"name": "default", "max_concurrency": 1, "max_queue": 0}],
        "keys": [entry],
        # A killed child stays down for the whole test: its requests must meet its 503, and the last
        # check finds it still down (30 s was not enough for a loaded full-suite run).
        "supervision": {"backoff_initial_s": 300, "backoff_max_s": 300},
        "proxy": {"drain_timeout_s": 60},
    }
    daemons = [daemon_factory(overrides, wait_ready=False) for _ in range(REPLICAS)]
    for d in daemons:
        d.wait_ready()
    nginx = start_nginx([f"127.0.0.1:{d.port}" for d in daemons], tmp_path / "nginx")
    try:
        yield ReplicaSet(daemons, key, nginx)
    finally:
        nginx.stop()


async def _open_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[httpx.Response, Any]:
    """Start a stream and read until its first content token: from then on it holds a slot."""
    request = client.build_request("POST", url, json=body)
    response = await client.send(request, stream=True)
    if response.status_code != 200:
        await response.aread()
        return response, None
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: {") and '"content"' in line:
            break
    return response, lines


async def _finish(response: httpx.Response, lines: Any) -> tuple[bool, str | None]:
    """Read a stream to its end: (ended with [DONE], the error message of an error event if any)."""
    error = None
    try:
        async for line in lines:
            if line == "data: [DONE]":
                return True, error
            if line.startswith("data: {") and '"error"' in line:
                error = json.loads(line[6:])["error"]["message"]
    except httpx.HTTPError as exc:
        error = error or f"{type(exc).__name__}: {exc}"
    finally:
        await response.aclose()
    return False, error


async def test_three_streams_take_three_replicas_and_a_fourth_is_refused_by_all(replicas: ReplicaSet) -> None:
    url = replicas.nginx.url + "/v1/chat/completions"
    async with httpx.AsyncClient(headers=replicas.headers, timeout=120.0, trust_env=False) as client:
        opened = await asyncio.gather(*(_open_stream(client, url, chat(400, True)) for _ in range(REPLICAS)))
        try:
            # Every stream admitted, whichever replica nginx tried first: none refused while one was free.
            assert [r.status_code for r, _ in opened] == [200] * REPLICAS
            assert [replicas.in_flight(d) for d in replicas.daemons] == [1] * REPLICAS

            fourth = await client.post(url, json=chat(8, False))
            assert fourth.status_code == 429, fourth.text
            assert int(fourth.headers["retry-after"]) >= 1
            assert fourth.json()["error"]["type"] == "rate_limit_error"
        finally:
            for response, _ in opened:
                await response.aclose()
    # nginx tried the fourth on every replica, each said 429, and it passed the last 429 on. (The
    # streams' own lines may be written before or after it: they end when their clients close them.)
    (last,) = [r for r in replicas.nginx.access_log() if r.status != 200]
    assert last.status == 429
    assert sorted(last.tried) == sorted(replicas.addr(d) for d in replicas.daemons)
    assert last.answers == ["429"] * REPLICAS
    # Closing the streams frees every slot.
    wait_until(lambda: all(replicas.in_flight(d) == 0 for d in replicas.daemons), "slots freed", 60)


# The conversation of the requests sent through nginx after the victim refuses: the shipped file hashes
# a conversation to one replica, and the victim is that replica, so every one of them meets it first.
SESSION = {"X-Session-Id": "the-victims-conversation"}


async def _sequential(client: httpx.AsyncClient, url: str, n: int) -> list[int]:
    return [(await client.post(url, json=chat(4, False), headers=SESSION)).status_code for _ in range(n)]


async def _home(client: httpx.AsyncClient, replicas: ReplicaSet) -> Daemon:
    """The replica nginx sends the requests of ``SESSION`` to."""
    logged = len(replicas.nginx.access_log()) + 1
    r = await client.post(replicas.nginx.url + "/v1/chat/completions", json=chat(1, False), headers=SESSION)
    assert r.status_code == 200, r.text
    wait_until(lambda: len(replicas.nginx.access_log()) >= logged, "nginx logged the request", 10)
    addr = replicas.nginx.access_log()[-1].tried[-1]
    (home,) = [d for d in replicas.daemons if replicas.addr(d) == addr]
    return home


async def test_killed_child_fails_its_own_stream_and_the_others_take_new_requests(
    replicas: ReplicaSet,
) -> None:
    url = replicas.nginx.url + "/v1/chat/completions"
    async with httpx.AsyncClient(headers=replicas.headers, timeout=120.0, trust_env=False) as client:
        victim = await _home(client, replicas)
        # The in-flight request, straight on the victim (so it is known which replica holds it).
        response, lines = await _open_stream(
            client, victim.base_url + "/v1/chat/completions", chat(400, True)
        )
        assert response.status_code == 200
        before = len(replicas.nginx.access_log())
        os.kill(replicas.child_pid(victim), signal.SIGKILL)
        done, error = await _finish(response, lines)
        assert not done and error, "the stream on the killed child must end with an error, not [DONE]"
        # Until the victim's supervisor has seen the death, the victim still admits a request, and
        # replays it on its next child (issue 28) after the backoff: a 200 from the victim, as a
        # CI run saw. That case is the replay tests'; these requests are sent once it refuses.
        wait_until(lambda: victim.readyz()[0] == 503, "the victim's supervisor saw its child die", 30)

        # Requests that had not started: every one is answered, by the two live replicas.
        statuses = await _sequential(client, url, 2 * REPLICAS)
    records = replicas.nginx.access_log()[before:]
    # On failure, say what nginx tried and heard (a CI run under load once saw a 502 here that three quiet
    # runs did not repeat): which replica answered what, and nginx's own error lines.
    why = f"{records}\n{replicas.nginx.error_log()[-3000:]}"
    assert statuses == [200] * (2 * REPLICAS), why
    assert all(r.tried[-1] != replicas.addr(victim) for r in records)
    # nginx met the victim first every time (the conversation's replica) and moved on from its 503.
    assert all(r.tried[0] == replicas.addr(victim) for r in records)
    assert records and all(r.answers[0] == "503" and r.answers[-1] == "200" for r in records)
    code, body = victim.readyz()
    assert code == 503 and body["ready"] is False


async def test_draining_replica_finishes_its_stream_and_sends_new_requests_elsewhere(
    replicas: ReplicaSet,
) -> None:
    url = replicas.nginx.url + "/v1/chat/completions"
    async with httpx.AsyncClient(headers=replicas.headers, timeout=120.0, trust_env=False) as client:
        victim = await _home(client, replicas)
        response, lines = await _open_stream(
            client, victim.base_url + "/v1/chat/completions", chat(160, True)
        )
        assert response.status_code == 200
        before = len(replicas.nginx.access_log())
        victim.signal(signal.SIGTERM)
        victim.wait_for(lambda code, body: code == 503, "draining")
        # A draining replica refuses new work at once, with its own Retry-After: the balancer moves on.
        refused = await client.post(victim.base_url + "/v1/chat/completions", json=chat(4, False))
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert "draining" in refused.json()["error"]["message"]
        # While the victim drains its stream, new requests through nginx all land on the others.
        statuses = await _sequential(client, url, 2 * REPLICAS)
        draining_while_sent = victim.proc.poll() is None
        done, error = await _finish(response, lines)
    assert statuses == [200] * (2 * REPLICAS)
    assert done and error is None, "a drained stream completes"
    assert victim.wait_exit(60) == 0
    records = replicas.nginx.access_log()[before:]
    assert all(r.tried[-1] != replicas.addr(victim) for r in records)
    # nginx tried the draining replica first every time (the conversation's replica): 503 while draining
    # (or a refused connection, shown as 502, once it had exited).
    assert records and all(r.tried[0] == replicas.addr(victim) for r in records)
    assert all(r.answers[0] in {"503", "502"} and r.answers[-1] == "200" for r in records)
    assert draining_while_sent or any(r.answers[0] == "503" for r in records)
