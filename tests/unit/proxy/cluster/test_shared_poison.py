"""``SharedPoison`` with a real redis-server: each ``Replica`` (a limiter, a ``Poison`` and its share) stands
for one replica. A verdict judged on one is in Redis when ``strike`` returns and refused by the others;
a key's strikes count across replicas; the TTLs end it everywhere; a replica that starts later learns
what is in force; Redis killed: each replica's memory decides alone, and what one judged meanwhile reaches
the others once Redis is back; a hung Redis costs a strike its timeout, no more. And the watch: a replica
with no traffic notices an outage and the return."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from proxy.admission.poison import Poison, PoisonRefusal
from proxy.cluster.limiter import ClusterLimiter
from proxy.cluster.poison import SharedPoison
from proxy.cluster.poison_scripts import BODIES, COOLING, strikes_key
from proxy.settings import ClusterSettings, PoisonSettings
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.needs_tool("redis-server")

BODY = b'{"prompt": "POISON"}'
PROBE_S = 0.3


@dataclass
class Replica:
    limiter: ClusterLimiter
    poison: Poison
    share: SharedPoison

    def refused(self, key_id: str, raw: bytes) -> str | None:
        """The refusal's code for this key and body, None when ``check`` lets it through."""
        try:
            self.poison.check(key_id, raw)
        except PoisonRefusal as refusal:
            return refusal.code
        return None


Make = Callable[..., Awaitable[Replica]]


async def until(pred: Callable[[], bool], what: str, timeout_s: float = 15.0) -> float:
    started = time.monotonic()
    while not pred():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


@pytest.fixture
async def make(redis_server: RedisServer) -> AsyncIterator[Make]:
    made: list[Replica] = []

    async def factory(settings: PoisonSettings | None = None, socket_timeout_s: float = 1.0) -> Replica:
        cluster = ClusterSettings(
            redis_server.url, replicas=3, socket_timeout_s=socket_timeout_s, probe_interval_s=PROBE_S
        )
        limiter = ClusterLimiter(cluster)
        poison = Poison(settings or PoisonSettings())
        share = SharedPoison(limiter, poison)
        poison.share = share
        limiter.start()
        share.start()
        replica = Replica(limiter, poison, share)
        made.append(replica)
        await asyncio.wait_for(share.synced(), 10)
        return replica

    yield factory
    for r in made:
        await r.share.aclose()
        await r.limiter.aclose()


async def test_a_verdict_is_in_redis_when_strike_returns_and_every_replica_refuses_the_body(
    make: Make, redis_client: Redis
) -> None:
    a, b, c = await make(), await make(), await make()
    assert [r.refused("k1", BODY) for r in (a, b, c)] == [None, None, None]
    assert a.poison.strike("k1", BODY) is False  # one strike of 2: the key does not cool down
    # Synchronous: in Redis before strike returned (before the 502 could leave), with its cool-down.
    digest = hashlib.sha256(BODY).hexdigest()
    until_ms = await redis_client.zscore(BODIES, digest)
    secs, micros = await redis_client.time()
    assert until_ms is not None
    assert 0 < until_ms - (secs * 1000 + micros // 1000) <= 600_000
    # And published: the others refuse the body, from any key, and only that body.
    waited = await until(lambda: b.refused("k2", BODY) == c.refused("k3", BODY) == "poison_body", "b and c")
    print(f"the verdict reached the other replicas {waited * 1000:.1f} ms after strike returned")
    assert a.refused("k2", BODY) == "poison_body"
    assert [r.refused("k1", b"{}") for r in (a, b, c)] == [None, None, None]  # the key: one strike only
    assert b.share.learned == c.share.learned == 1
    assert a.share.learned == 0  # its own message is not learned twice


async def test_a_keys_strikes_count_across_replicas(make: Make, redis_client: Redis) -> None:
    a, b = await make(), await make()
    assert a.poison.strike("k", b"body one") is False
    await until(lambda: b.share.learned == 1, "b learned a's strike")
    # The second strike is judged on another replica: by the shared count, the key now cools down.
    assert b.poison.strike("k", b"body two") is True
    await until(lambda: a.refused("k", b"anything") == "key_cooling_down", "a cools the key down")
    assert b.refused("k", b"anything") == "key_cooling_down"
    assert await redis_client.zscore(COOLING, "k") is not None
    assert not await redis_client.exists(strikes_key("k"))  # its strikes start over
    assert a.refused("other", b"anything") is None


async def test_the_ttls_end_a_verdict_everywhere(make: Make, redis_client: Redis) -> None:
    short = PoisonSettings(strikes=1, window_s=0.5, cooldown_s=0.5)
    a, b = await make(short), await make(short)
    assert a.poison.strike("k", BODY) is True
    await until(lambda: b.refused("k", b"x") == "key_cooling_down", "b cools the key down")
    ttls = [await redis_client.pttl(k) for k in (BODIES, COOLING)]
    assert all(0 < t <= 500 for t in ttls), ttls
    await until(lambda: a.refused("k", BODY) is None and b.refused("k", BODY) is None, "the cool-down's end")
    for _ in range(100):  # Redis's expiry runs on its own clock: asked for up to 5 s
        if not await redis_client.exists(BODIES, COOLING):
            break
        await asyncio.sleep(0.05)
    assert not await redis_client.exists(BODIES, COOLING)  # Redis holds nothing past the cool-down


async def test_a_replica_that_starts_later_learns_what_is_in_force(make: Make) -> None:
    a = await make(PoisonSettings(strikes=1))
    a.poison.strike("k", BODY)
    late = await make()  # ``make`` returns once it has read what is in force
    assert late.refused("other", BODY) == "poison_body"
    assert late.refused("k", b"x") == "key_cooling_down"


async def test_redis_down_each_replica_alone_then_what_it_judged_reaches_the_others(
    make: Make, redis_server: RedisServer
) -> None:
    a, b = await make(), await make()
    redis_server.kill()
    await until(lambda: a.limiter.mode == b.limiter.mode == "local", "both replicas in local mode")
    # Judged alone: refused here at once, unknown to b.
    assert a.poison.strike("k", BODY) is False
    assert a.refused("other", BODY) == "poison_body"
    assert b.refused("other", BODY) is None
    redis_server.start()  # back, empty, on its port
    await until(lambda: a.limiter.mode == b.limiter.mode == "cluster", "both back to cluster")
    await until(lambda: b.refused("other", BODY) == "poison_body", "a's verdict reaching b")
    # And Redis has it for a replica that starts now.
    late = await make()
    assert late.refused("other", BODY) == "poison_body"


async def test_a_replica_with_no_traffic_notices_an_outage_and_the_return(
    make: Make, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llamagate.cluster")
    idle = await make()
    assert idle.limiter.mode == "cluster"
    redis_server.kill()
    # No call of a request, nothing judged: the watch alone switches the mode (a refused ping fails at
    # once, so within one interval of the kill).
    switched = await until(lambda: idle.limiter.mode == "local", "the switch to local")
    print(f"an idle replica switched to local {switched:.2f} s after the kill (interval {PROBE_S} s)")
    assert [r.getMessage() for r in caplog.records if "Redis unreachable" in r.getMessage()]
    redis_server.start()
    back = await until(lambda: idle.limiter.mode == "cluster", "the switch back to cluster")
    print(f"and back to cluster {back:.2f} s after Redis started again")
    assert [r.getMessage() for r in caplog.records if "Redis answers again" in r.getMessage()]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("Redis unreachable" in m for m in messages) == 1  # one line per switch, not per ping
    assert sum("Redis answers again" in m for m in messages) == 1


async def test_a_message_not_understood_is_ignored(make: Make, redis_client: Redis) -> None:
    a, b = await make(), await make()
    await redis_client.publish("llamagate:{poison}:verdicts", "not json")
    await redis_client.publish("llamagate:{poison}:verdicts", json.dumps({"o": "x", "s": 1}))
    a.poison.strike("k", BODY)
    await until(lambda: b.refused("other", BODY) == "poison_body", "b still learning")


class _Says:
    """A share that answers what it is told (no Redis): the shared count decides over the local one."""

    def __init__(self, answer: bool | None) -> None:
        self.answer = answer
        self.calls: list[tuple[str, bytes]] = []

    def strike(self, key_id: str, digest: bytes, settings: PoisonSettings) -> bool | None:
        self.calls.append((key_id, digest))
        return self.answer


def test_the_shared_count_cools_a_key_the_local_count_would_not() -> None:
    poison = Poison(PoisonSettings(strikes=2))
    poison.share = says = _Says(True)  # another replica's strike made it two, in Redis
    assert poison.strike("k", BODY) is True
    with pytest.raises(PoisonRefusal) as refused:
        poison.check("k", b"another body")
    assert refused.value.code == "key_cooling_down"
    alone = Poison(PoisonSettings(strikes=2))
    alone.share = _Says(None)  # Redis out of reach: this replica's count decides
    assert alone.strike("k", BODY) is False
    assert alone.strike("k", b"another") is True
    assert says.calls == [("k", hashlib.sha256(BODY).digest())]


async def test_a_hung_redis_costs_a_strike_its_timeout_and_the_verdict_stays_local(
    make: Make, redis_server: RedisServer
) -> None:
    a = await make(socket_timeout_s=0.5)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # hung: connections open, nothing answered
    try:
        started = time.monotonic()
        assert a.poison.strike("k", BODY) is False
        blocked = time.monotonic() - started
        assert blocked < 2 * 0.5  # one timeout, not retried (redis-py's default would retry it)
        assert a.limiter.mode == "local"  # the failed call switched the mode at once
        assert a.refused("other", BODY) == "poison_body"  # and the verdict holds here
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    print(f"a strike on a hung Redis blocked the loop {blocked:.2f} s (socket_timeout_s 0.5)")
    await until(lambda: a.limiter.mode == "cluster", "back to cluster")
    late = await make()
    assert late.refused("other", BODY) == "poison_body"  # sent to Redis once it answered
