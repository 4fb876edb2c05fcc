"""Issue 25's acceptance with ``cluster.on_redis_error: refuse``: redis-server SIGKILLed under load, three
replicas behind the shipped nginx.

The set of test_replicas_shared_e2e.py (``tests.integration.replica_set``: three daemons with their
llama-server children, one Redis, one PostgreSQL, the shipped deploy/nginx/llamagate.conf), every replica
configured ``refuse``. A set of its own: ``cluster`` is fixed at a daemon's start (a SIGHUP reload keeps it),
and a replica set runs one config. Clients keep sending through nginx while redis-server is SIGKILLed: all
three report ``refuse``, every request sent during the outage gets 503 ``shared_limits_unavailable`` with
``Retry-After`` >= 1 (nginx having tried all three, as its access log shows), none hangs; Redis started
again on its port: all three back to ``cluster`` within seconds (measured) and every request 200 again, one
log line per switch on each replica.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.postgres_server import Postgres
from tests.integration.replica_set import (
    REPLICAS,
    Load,
    ReplicaSet,
    all_in_mode,
    chat,
    log_messages,
    replica_set,
    until,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.needs_tool("nginx", "nginx-js", "redis-server", "initdb", "postgres"),
]


@pytest.fixture(scope="module")
def refusing(
    tmp_path_factory: pytest.TempPathFactory,
    llama_server_binary: Path,
    demo_model: Path,
    demo_model_sha256: str,
    postgres_server: Postgres,
) -> Iterator[ReplicaSet]:
    yield from replica_set(
        tmp_path_factory, llama_server_binary, demo_model, demo_model_sha256, postgres_server, "refuse"
    )


async def test_redis_killed_under_load_three_refusing_replicas_answer_503_with_retry_after_and_resume(
    refusing: ReplicaSet,
) -> None:
    replicas = refusing
    admin = replicas.headers()
    nginx = replicas.nginx
    access_before = len(nginx.access_log())
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:

        def logged(count: int) -> bool:
            return len(nginx.access_log()) >= access_before + count

        assert await all_in_mode(client, replicas, "cluster")
        async with Load(client, replicas.chat_url, admin, chat(8), clients=6) as load:
            await until(lambda: len(load.answers) >= 6, "the load to run")
            replicas.redis.kill()
            load.phase = "down"
            noticed = await until(
                lambda: all_in_mode(client, replicas, "refuse"), "all three replicas to report refuse"
            )
            # The outage alone: once the requests sent before the kill have their answers, and with none on
            # its way, what comes next in nginx's access log is the outage's (one line per request).
            await until(lambda: not load.pending["before"], "the requests sent before the kill", 120)
            await load.pause()
            start = len(load.answers)
            await until(lambda: logged(start), "nginx's access log")
            load.phase = "outage"
            load.resume()
            await until(lambda: len(load.answered(sent="outage")) >= 12, "requests refused during the outage")
            await load.pause()
            outage = load.answered(sent="outage")
            await until(lambda: logged(start + len(outage)), "nginx's access log")
            records = nginx.access_log()[access_before + start :]
            replicas.redis.start()  # back, empty, on the same port
            load.phase = "back"
            load.resume()
            resumed = await until(
                lambda: all_in_mode(client, replicas, "cluster"),
                "cluster mode back on all three replicas",
                30,
            )
            load.phase = "resumed"
            await until(lambda: len(load.answered(sent="resumed")) >= 6, "requests served again", 120)
    statuses = Counter((a.sent, a.status) for a in load.answers)
    print(
        f"redis-server SIGKILLed under load, on_redis_error refuse: all {REPLICAS} reported refuse"
        f" {noticed:.2f} s after the kill; {len(outage)} requests during the outage, answers"
        f" {sorted(Counter((a.status, a.retry_after, a.code) for a in outage).items())}, nginx's upstream"
        f" answers {sorted(Counter(', '.join(r.answers) for r in records).items())}; Redis back: all"
        f" {REPLICAS} in cluster mode {resumed:.2f} s after its start; answers by phase sent {dict(statuses)}"
    )
    assert not load.failures, load.failures  # no request hung (a client timeout) or was cut
    assert {a.status for a in load.answered(sent="before", done="before")} == {200}
    # During the outage: refused at once, and told when to come back.
    assert outage and all(a.status == 503 and a.code == "shared_limits_unavailable" for a in outage), outage
    assert all(a.retry_after is not None and int(a.retry_after) >= 1 for a in outage), outage
    # What nginx did with them. Its shipped rule (`proxy_next_upstream ... http_503 non_idempotent`,
    # `proxy_next_upstream_tries` = the replica count) passes a 503 on to the next replica, which is safe:
    # llamagate answers 503 before any work. With Redis down every replica refuses alike, so each request
    # was tried on all three, one after the other without waiting, and the client got the third 503, its
    # Retry-After passed through: one access-log line per request, status 503, three tries, three 503s.
    # Not a wait and not a 502: nginx passes the last refusal on as it is.
    addresses = {f"127.0.0.1:{d.port}" for d in replicas.daemons}
    assert len(records) == len(outage), records
    assert all(r.status == 503 and r.answers == ["503"] * REPLICAS for r in records), records
    assert all(set(r.tried) == addresses for r in records), records
    # Between the kill and the switch, and between Redis's return and the last replica's: either answer.
    assert {a.status for a in load.answers} <= {200, 503}, load.answers
    assert {a.status for a in load.answered(sent="resumed")} == {200}, load.answers
    # One line per switch in each log, not one per request.
    for d in replicas.daemons:
        assert len(log_messages(d, "Redis unreachable")) == 1, d.base_url
        assert len(log_messages(d, "Redis answers again")) == 1, d.base_url
