"""Issue 55, item 4: three replicas behind the shipped nginx, on one real Redis, share what they learn.

The set: three whole daemons (``cluster.redis_url`` one redis-server, ``cluster.replicas: 3``, the default
``cluster.probe_interval_s``), each with the fake llama-server as its child (``--abort-on POISON``:
SIGABRT on a marked body, as a failed ``GGML_ASSERT`` of the pinned server; ``--request-log``: its own
record of every request that reached it, written before it aborts), and the shipped
deploy/nginx/llamagate.conf in front, run twice: as shipped (``balanced``: a conversation hashed to one
replica, so a repeated body goes back to the replica whose child died, and on to the others when that
one answers 503 while its child restarts, or 429) and balancing by load (its ``least_conn`` variant: a
repeated body goes to another replica each time). Checked:

- **a poison body costs at most 2 child deaths in all**: the same marked body, sent through nginx again
  and again (from one key, then from others, then to each replica directly), reaches a child exactly
  twice (the first attempt and its replay, on one replica: 502 ``poison_request``), and every later
  attempt is 429 ``poison_body`` from whichever replica gets it; nginx's retry of a 429 on the next
  replica shows all three refusing it. Without the shared memory, each replica would let it kill its own
  child twice;
- **during a Redis outage every replica's mode gauge switches within its probe interval**, with no
  request sent to any of them: redis-server SIGKILLed, each replica's ``llamagate_cluster_mode`` says
  ``local`` and its log says when (its own timestamp, within the interval of the kill, plus a scheduling
  allowance); Redis started again on its port: each says ``cluster`` again, the same way.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.bench.nginx import Nginx, start_nginx
from supervisor.config.keys import ADMIN, new_key_config
from tests.fakes.fake_child import make_fake_binary
from tests.helpers.redis_server import RedisServer
from tests.integration.clients import served
from tests.integration.conftest import Daemon, DaemonFactory
from tests.integration.replica_set import cluster_mode, log_messages, until

pytestmark = [pytest.mark.integration, pytest.mark.needs_tool("nginx", "nginx-js", "redis-server")]

REPLICAS = 3
MODEL = "smollm2-135m-instruct"
MARKER = "POISON"
ATTEMPTS = 8  # through nginx, from the key of the first attempt
PROBE_INTERVAL_S = 1.0  # cluster.probe_interval_s's default: what the set runs with
# What a loaded test host adds to a switch beyond the interval: the watch's sleep overshooting, the
# event loop busy with something else. Not part of the claim (a refused ping fails at once).
SCHEDULING_S = 0.5


class Set:
    def __init__(self, daemons: list[Daemon], logs: list[Path], nginx: Nginx, redis: RedisServer) -> None:
        self.daemons = daemons
        self.logs = logs  # each child's record of the requests it received (every child of a replica)
        self.nginx = nginx
        self.redis = redis
        self.keys: dict[str, str] = {}

    def headers(self, who: str = "admin") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}


@pytest.fixture(scope="module", params=["balanced", "least-conn"])
def replicas(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    demo_model: Path,
    demo_model_sha256: str,
) -> Iterator[Set]:
    mode = request.param
    folder = tmp_path_factory.mktemp(f"replicas-poison-{mode}")
    redis_server = RedisServer(folder / "redis")
    redis_server.start()
    logs = [folder / f"received{i}.jsonl" for i in range(REPLICAS)]
    fakes = [
        make_fake_binary(folder / f"fake{i}", "--abort-on", MARKER, "--request-log", str(logs[i]))
        for i in range(REPLICAS)
    ]
    factory = DaemonFactory(folder, fakes[0], demo_model, demo_model_sha256)
    nginx: Nginx | None = None
    try:
        # The same config on every replica, as a real replica set has.
        keys = {"admin": new_key_config("default", ADMIN)}
        keys.update((who, new_key_config("default")) for who in ("first", "second", "third"))
        overrides = {
            "tenants": [{"name": "default", "max_concurrency": 4, "max_queue": 8}],
            "keys": [entry for _, entry in keys.values()],
            "cluster": {"redis_url": redis_server.url, "replicas": REPLICAS},
        }
        daemons = [factory(overrides, wait_ready=False, binary=fakes[i]) for i in range(REPLICAS)]
        for d in daemons:
            d.wait_ready()
        nginx = start_nginx([f"127.0.0.1:{d.port}" for d in daemons], folder / "nginx", mode=mode)
        s = Set(daemons, logs, nginx, redis_server)
        s.keys = {who: secret for who, (secret, _) in keys.items()}
        yield s
    finally:
        if nginx is not None:
            nginx.stop()
        factory.close()
        redis_server.stop()


def _received(logs: list[Path]) -> list[dict[str, Any]]:
    out = []
    for i, log in enumerate(logs):
        if log.is_file():
            out += [
                {**json.loads(line), "replica": i} for line in log.read_text().splitlines() if line.strip()
            ]
    return out


def _generations(s: Set) -> list[int]:
    return [int(d.readyz()[1]["generation"]) for d in s.daemons]


def _code(r: httpx.Response) -> tuple[int, str | None]:
    try:
        return r.status_code, r.json().get("error", {}).get("code")
    except ValueError:
        return r.status_code, None


def test_a_poison_body_costs_at_most_two_child_deaths_across_the_three_replicas(replicas: Set) -> None:
    s = replicas
    url = s.nginx.url + "/v1/completions"
    body = {"model": MODEL, "prompt": f"{MARKER}: one body, many times", "max_tokens": 1}
    generations0 = _generations(s)
    access0 = len(s.nginx.access_log())
    with httpx.Client(timeout=120, trust_env=False) as c:
        first = [
            _code(served(c, url, body, headers=s.headers("first"), any_503=True)) for _ in range(ATTEMPTS)
        ]
        for d in s.daemons:  # the replica whose child died twice has its child back
            d.wait_ready()
        # Other keys, through nginx: the body is refused from every key (one strike of 2: the first
        # key does not cool down, so its later refusals are the body's too).
        others = [
            _code(served(c, url, body, headers=s.headers(who), any_503=True)) for who in ("second", "third")
        ]
        # And each replica asked directly: all three refuse it.
        direct = [
            _code(c.post(d.base_url + "/v1/completions", json=body, headers=s.headers("admin")))
            for d in s.daemons
        ]

    assert first == [(502, "poison_request")] + [(429, "poison_body")] * (ATTEMPTS - 1), first
    assert others == [(429, "poison_body")] * 2, others
    assert direct == [(429, "poison_body")] * REPLICAS, direct

    # What the children received: the marked body exactly twice (the attempt and its replay), on one
    # replica; no other child ever saw it.
    marked = [r for r in _received(s.logs) if r["marked"]]
    assert len(marked) == 2, marked
    assert len({r["replica"] for r in marked}) == 1, marked
    # Deaths, by each replica's own count (its child's generation): two in all.
    deaths = [now - then for now, then in zip(_generations(s), generations0, strict=True)]
    assert sum(deaths) == 2 and sorted(deaths) == [0, 0, 2], deaths

    # nginx moved refusals on (a 429 is retried on the next replica): an attempt of the other keys, with
    # every child up, was refused by all three in turn.
    refusals = [r for r in s.nginx.access_log()[access0:] if r.status == 429]
    assert any(len(set(r.tried)) == REPLICAS and set(r.answers) == {"429"} for r in refusals), refusals
    learned = [log_messages(d, "a poison verdict of another replica") for d in s.daemons]
    assert sorted(len(m) for m in learned) == [0, 1, 1], learned


def _switched_at(d: Daemon, text: str, after: float) -> float:
    """When ``d`` logged ``text`` (its own timestamp, Unix seconds), the first time after ``after``."""
    for record in d.log_records():
        if text in str(record.get("msg", "")):
            at = datetime.fromisoformat(str(record["ts"]).replace("Z", "+00:00")).timestamp()
            if at >= after - 0.001:
                return at
    pytest.fail(f"{d.base_url} never logged {text!r}")


async def _all_in_mode(client: httpx.AsyncClient, s: Set, mode: str) -> bool:
    found = await asyncio.gather(*(cluster_mode(client, d, s.headers()) for d in s.daemons))
    return list(found) == [mode] * len(s.daemons)


async def test_every_replica_notices_a_redis_outage_within_its_probe_interval_with_no_traffic(
    replicas: Set,
) -> None:
    s = replicas
    admin = s.headers("admin")
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        await until(lambda: _all_in_mode(client, s, "cluster"), "every replica in cluster mode")
        requests0 = len(s.nginx.access_log())
        killed = time.time()
        s.redis.kill()
        await until(lambda: _all_in_mode(client, s, "local"), "every replica in local mode", 30)
        lost = [_switched_at(d, "Redis unreachable", killed) - killed for d in s.daemons]
        started = time.time()
        s.redis.start()
        await until(lambda: _all_in_mode(client, s, "cluster"), "every replica back in cluster mode", 30)
        back = [_switched_at(d, "Redis answers again", started) - started for d in s.daemons]
        modes = [await cluster_mode(client, d, admin) for d in s.daemons]
    print(
        f"switched to local {[f'{t:.2f}' for t in lost]} s after the kill, back to cluster "
        f"{[f'{t:.2f}' for t in back]} s after Redis started (interval {PROBE_INTERVAL_S} s)"
    )
    assert modes == ["cluster"] * REPLICAS
    # No request reached any replica meanwhile: the watch alone noticed both switches.
    assert len(s.nginx.access_log()) == requests0
    assert all(t <= PROBE_INTERVAL_S + SCHEDULING_S for t in lost), lost
    assert all(t <= PROBE_INTERVAL_S + SCHEDULING_S for t in back), back
    for d in s.daemons:  # one line per switch, not one per failed ping
        assert len(log_messages(d, "Redis unreachable")) == 1, d.base_url
        assert len(log_messages(d, "Redis answers again")) == 1, d.base_url
