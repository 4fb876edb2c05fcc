"""Tenant limits shared by replicas through a real redis-server (``cluster.redis_url``).

Two whole daemons (each with its own llama-server child: the demo model, 2 slots) share one Redis and one
key. A tenant's ``max_concurrency: 2`` then holds for both together: each replica's local gate alone would
let it run 2, so without the shared leases the sum reaches 4. What is checked, sampling each replica's
``/admin/load`` every 100 ms: 6 concurrent clients never have more than 2 requests in flight across the
replicas, and every one is answered; a replica SIGKILLed while it holds leases frees them by expiry within
the TTL (no lease it took outlives its death by more than the TTL; measured and printed); redis-server
SIGKILLed under load: the ``local`` replica goes on serving (limit // replicas), the ``refuse`` replica
answers 503 with Retry-After, no request hangs; Redis back: both report cluster mode within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from supervisor.config.keys import ADMIN, new_key_config
from tests.helpers.exposition import sample
from tests.helpers.redis_server import RedisServer
from tests.integration.conftest import Daemon, DaemonFactory

pytestmark = [pytest.mark.integration, pytest.mark.needs_tool("redis-server")]

MODEL = "gemma-3-270m"
TTL_S = 3.0
LEASES = "llamagate:{default}:lease:" + MODEL


class Pair:
    def __init__(self, daemons: list[Daemon], key: str) -> None:
        self.daemons = daemons
        self.headers = {"Authorization": f"Bearer {key}"}


def start_pair(
    factory: DaemonFactory, redis: RedisServer, modes: tuple[str, str], budgets: dict[str, int] | None = None
) -> Pair:
    key, entry = new_key_config("default", ADMIN)
    daemons = []
    tenant: dict[str, Any] = {"name": "default", "max_concurrency": 2, "max_queue": 8, "queue_timeout_s": 300}
    if budgets:
        tenant["budgets"] = budgets
    for mode in modes:
        overrides = {
            "llama": {"slots": 2, "threads": 1, "ctx_per_slot": 1024},
            "tenants": [tenant],
            "keys": [entry],
            "cluster": {"redis_url": redis.url, "replicas": 2, "on_redis_error": mode, "lease_ttl_s": TTL_S},
        }
        daemons.append(factory(overrides, wait_ready=False))
    for d in daemons:
        d.wait_ready()
    return Pair(daemons, key)


def chat(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # exactly max_tokens long: the slot stays busy that long
        "stream": stream,
    }


async def in_flight(client: httpx.AsyncClient, d: Daemon, headers: dict[str, str]) -> int:
    r = await client.get(f"{d.base_url}/admin/load", headers=headers)
    r.raise_for_status()
    return sum(int(t["in_flight"]) for t in r.json()["tenants"] if t["name"] == "default")


async def cluster_mode(client: httpx.AsyncClient, d: Daemon, headers: dict[str, str]) -> str | None:
    r = await client.get(f"{d.base_url}/metrics", headers=headers)
    r.raise_for_status()
    for mode in ("cluster", "local", "refuse", "off"):
        if sample(r.text, "llamagate_cluster_mode", mode=mode) == 1.0:
            return mode
    return None


async def until(pred: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


async def open_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[httpx.Response, AsyncIterator[str]]:
    """Start a stream and read until its first content token: from then on it holds a slot. The line
    iterator is returned with it: dropping it would close the stream (the client would have left)."""
    response = await client.send(client.build_request("POST", url, json=body), stream=True)
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: {") and '"content"' in line:
            break
    return response, lines


async def live_leases(redis: Redis) -> tuple[int, float, float]:
    """(leases not expired, the latest expiry, Redis's clock), both in seconds of Redis's clock."""
    secs, micros = await redis.time()
    now_ms = secs * 1000 + micros // 1000
    live = await redis.zrangebyscore(LEASES, f"({now_ms}", "+inf", withscores=True)
    latest = max((score for _, score in live), default=0.0)
    return len(live), latest / 1000, now_ms / 1000


async def test_six_clients_two_replicas_never_more_than_two_in_flight_and_a_dead_replica_frees_its_leases(
    daemon_factory: DaemonFactory, redis_server: RedisServer
) -> None:
    pair = start_pair(daemon_factory, redis_server, ("local", "local"))
    a, b = pair.daemons
    samples: list[int] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(headers=pair.headers, timeout=300.0, trust_env=False) as client:

        async def sampler() -> None:
            while not done.is_set():
                counts = await asyncio.gather(*(in_flight(client, d, pair.headers) for d in pair.daemons))
                samples.append(sum(counts))
                await asyncio.sleep(0.1)

        async def user(i: int) -> list[int]:
            d = pair.daemons[i % 2]
            return [
                (await client.post(f"{d.base_url}/v1/chat/completions", json=chat(24))).status_code
                for _ in range(2)
            ]

        watching = asyncio.create_task(sampler())
        statuses = await asyncio.gather(*(user(i) for i in range(6)))
        done.set()
        await watching
        assert statuses == [[200, 200]] * 6
        print(f"in flight across the replicas, sampled every 100 ms: max {max(samples)} of {len(samples)}")
        assert max(samples) == 2, samples  # reached, never passed (each replica alone would allow 2)

        # Replica b holds both leases with two streams, then dies by SIGKILL (its child with it).
        streams = [
            await open_stream(client, f"{b.base_url}/v1/chat/completions", chat(600, stream=True))
            for _ in range(2)
        ]
        redis = Redis.from_url(redis_server.url)
        try:
            count, _, _ = await live_leases(redis)
            assert count == 2
            b.proc.send_signal(signal.SIGKILL)
            b.proc.wait(30)
            _, latest, killed_at = await live_leases(redis)
            for response, _ in streams:
                with contextlib.suppress(httpx.HTTPError):
                    await response.aclose()
            # No lease of the dead replica counts longer than one TTL after its death (the renewal may
            # have just run: a full TTL from then).
            assert latest <= killed_at + TTL_S
            started = time.monotonic()

            async def freed() -> bool:
                return (await live_leases(redis))[0] == 0

            await until(freed, "the dead replica's leases to expire", timeout_s=4 * TTL_S)
            print(
                f"a SIGKILLed replica's leases were free {time.monotonic() - started:.2f} s after its death"
            )
        finally:
            await redis.aclose()
        # The surviving replica gets both leases (and its two slots) again.
        again = [
            await open_stream(client, f"{a.base_url}/v1/chat/completions", chat(200, stream=True))
            for _ in range(2)
        ]
        assert await in_flight(client, a, pair.headers) == 2
        for response, _ in again:
            await response.aclose()


async def test_redis_killed_local_goes_on_refuse_answers_503_and_both_resume_when_it_returns(
    daemon_factory: DaemonFactory, redis_server: RedisServer
) -> None:
    pair = start_pair(daemon_factory, redis_server, ("local", "refuse"))
    local, refuse = pair.daemons
    results: dict[str, list[tuple[int, str | None]]] = {"local": [], "refuse": []}
    failures: list[str] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(headers=pair.headers, timeout=120.0, trust_env=False) as client:
        for d in pair.daemons:
            assert await cluster_mode(client, d, pair.headers) == "cluster"

        async def user(d: Daemon, name: str) -> None:
            while not stop.is_set():
                try:
                    r = await client.post(f"{d.base_url}/v1/chat/completions", json=chat(8))
                except httpx.HTTPError as exc:  # a hang ends in the client's timeout: a failure
                    failures.append(f"{name}: {type(exc).__name__}: {exc}")
                    return
                results[name].append((r.status_code, r.headers.get("retry-after")))
                if r.status_code == 503:
                    await asyncio.sleep(0.2)

        users = [
            asyncio.create_task(user(d, n))
            for d, n in ((local, "local"), (refuse, "refuse"))
            for _ in range(2)
        ]
        await until(lambda: _true(len(results["local"]) >= 2 and len(results["refuse"]) >= 2), "load running")
        redis_server.kill()
        before = {n: len(r) for n, r in results.items()}

        async def degraded() -> bool:
            return (
                await cluster_mode(client, local, pair.headers) == "local"
                and await cluster_mode(client, refuse, pair.headers) == "refuse"
            )

        await until(degraded, "both replicas to report their fallback")

        async def answered_through_outage() -> bool:
            after_local = results["local"][before["local"] :]
            after_refuse = results["refuse"][before["refuse"] :]
            return sum(s == 200 for s, _ in after_local) >= 3 and any(s == 503 for s, _ in after_refuse)

        await until(answered_through_outage, "requests answered while Redis is down", timeout_s=120)
        outage_refuse = [(s, ra) for s, ra in results["refuse"][before["refuse"] :] if s == 503]
        assert all(ra is not None and int(ra) >= 1 for _, ra in outage_refuse)
        assert {s for s, _ in results["local"]} == {200}  # local never refused for Redis

        redis_server.start()  # back, empty, on the same port

        async def resumed() -> bool:
            return all([await cluster_mode(client, d, pair.headers) == "cluster" for d in pair.daemons])

        await until(resumed, "cluster mode back on both replicas", timeout_s=15)
        mark = len(results["refuse"])
        await until(
            lambda: _true(any(s == 200 for s, _ in results["refuse"][mark:])), "refuse replica serving"
        )
        stop.set()
        await asyncio.wait_for(asyncio.gather(*users), 120)
    assert not failures, failures
    # One line per switch in each log, not one per request.
    for d, mode in ((local, "local"), (refuse, "refuse")):
        lost = [r for r in d.log_records() if "Redis unreachable" in str(r.get("message", r.get("msg", "")))]
        back = [
            r for r in d.log_records() if "Redis answers again" in str(r.get("message", r.get("msg", "")))
        ]
        assert len(lost) == 1 and len(back) == 1, (mode, lost, back)


async def test_a_tokens_per_minute_budget_holds_across_the_replicas(
    daemon_factory: DaemonFactory, redis_server: RedisServer
) -> None:
    pair = start_pair(daemon_factory, redis_server, ("local", "local"), {"tokens_per_minute": 200})
    async with httpx.AsyncClient(headers=pair.headers, timeout=300.0, trust_env=False) as client:

        async def user(i: int) -> list[httpx.Response]:
            d = pair.daemons[i % 2]
            return [await client.post(f"{d.base_url}/v1/chat/completions", json=chat(64)) for _ in range(2)]

        started = time.monotonic()
        answers = [r for rs in await asyncio.gather(*(user(i) for i in range(6))) for r in rs]
        took = time.monotonic() - started
    admitted = [r.json()["usage"]["total_tokens"] for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    print(
        f"tokens_per_minute 200 across 2 replicas: admitted {admitted} in {took:.1f} s,"
        f" {len(refused)} refused"
    )
    assert took < 60, "the check below assumes every request fell within one minute"
    # Within a minute, the admitted requests' tokens stay within the budget plus one request's (each
    # replica alone would have let its own 200 and more through).
    assert admitted and sum(admitted) <= 200 + max(admitted)
    assert refused and all(r.json()["error"]["code"] == "tokens_per_minute" for r in refused)
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in refused)


async def _true(value: bool) -> bool:
    return value
