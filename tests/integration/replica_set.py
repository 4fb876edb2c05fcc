"""Issue 25's replica set for the tests that need it: three replicas behind the shipped nginx, one real
Redis, one real PostgreSQL, and what those tests read from it.

``replica_set`` starts it for a module's fixture (``yield from``; the modules differ only in
``cluster.on_redis_error``, which is fixed at a daemon's start: a SIGHUP reload keeps the ``cluster`` block
as it is, ``supervisor.daemon.service._keep_fixed``). Three whole daemons, each with its own llama-server
child (the demo model, 2 slots, 1 thread, a small context), share ``cluster.redis_url`` (tenant leases and
budget windows) and ``store.url`` (keys and the ledger), with the shipped deploy/nginx/llamagate.conf in
front of them (``supervisor.bench.nginx``). Every replica gets the same config, as a real replica set has.

The helpers: ``Load`` (clients sending through nginx in a loop, each answer kept with the test's phase
when it was sent and answered), ``cluster_mode`` (``llamagate_cluster_mode`` of one replica), ``leases``
(a tenant's lease members in Redis with their expiry, and Redis's clock), ``until`` (a state awaited with a
deadline), ``open_stream`` (a stream that holds its slot from its first token).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, cast

import httpx
import pytest
from redis.asyncio import Redis

from supervisor.bench.nginx import Nginx, start_nginx
from supervisor.config.keys import ADMIN, new_key_config
from tests.helpers.exposition import sample
from tests.helpers.postgres_server import Postgres
from tests.helpers.redis_server import RedisServer
from tests.integration.conftest import Daemon, DaemonFactory

REPLICAS = 3
MODEL = "smollm2-135m-instruct"
BUDGET = 120  # tokens_per_minute of the "metered" tenant
# max_concurrency of the "fleet" tenant: every slot of the set, so a replica holding leases of it never keeps
# the others' requests of it waiting (nor would a request that nginx gives a replica whose slots are full,
# which holds its lease while it waits for a slot there).
FLEET = 6
TTL_S = 3.0  # cluster.lease_ttl_s: a dead replica's leases are free within it (renewed every TTL / 3)


class ReplicaSet:
    def __init__(self, daemons: list[Daemon], nginx: Nginx, redis: RedisServer, keys: dict[str, str]) -> None:
        self.daemons = daemons
        self.nginx = nginx
        self.redis = redis
        self.keys = keys  # tenant -> a key of that tenant (the default one is an admin key)

    def headers(self, tenant: str = "default") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    @property
    def chat_url(self) -> str:
        return self.nginx.url + "/v1/chat/completions"


def replica_set(
    tmp_path_factory: pytest.TempPathFactory,
    llama_server_binary: Path,
    demo_model: Path,
    demo_model_sha256: str,
    postgres_server: Postgres,
    on_redis_error: Literal["local", "refuse"],
) -> Iterator[ReplicaSet]:
    """The set, for a module's fixture (the three daemons and their children start once: the machine is
    small); each test uses a tenant or a key of its own, so they do not meet. Everything started is
    stopped when the generator is closed."""
    folder = tmp_path_factory.mktemp(f"replicas-{on_redis_error}")
    factory = DaemonFactory(folder, llama_server_binary, demo_model, demo_model_sha256)
    redis_server = RedisServer(folder / "redis")
    redis_server.start()
    nginx: Nginx | None = None
    try:
        # The same config on every replica (one ConfigMap and Secret), as a real replica set has.
        admin_key, admin = new_key_config("default", ADMIN)
        metered_key, metered = new_key_config("metered")
        fleet_key, fleet = new_key_config("fleet")
        waiting = {"max_queue": 8, "queue_timeout_s": 300}
        overrides = {
            "llama": {"slots": 2, "threads": 1, "ctx_per_slot": 512},
            "tenants": [
                {"name": "default", "max_concurrency": 2, **waiting},
                {
                    "name": "metered",
                    "max_concurrency": 2,
                    **waiting,
                    "budgets": {"tokens_per_minute": BUDGET},
                },
                {"name": "fleet", "max_concurrency": FLEET, **waiting},
            ],
            "keys": [admin, metered, fleet],
            "cluster": {
                "redis_url": redis_server.url,
                "replicas": REPLICAS,
                "on_redis_error": on_redis_error,
                "lease_ttl_s": TTL_S,
            },
            "store": {"url": postgres_server.create_database(f"replicas_{on_redis_error}")},
        }
        daemons = [factory(overrides, wait_ready=False) for _ in range(REPLICAS)]
        for d in daemons:
            d.wait_ready()
        # Balanced by load (the shipped file's least_conn variant): these tests spread one repeated request
        # over the replicas to check the limits they share; hashed as one conversation, it would stay on one.
        nginx = start_nginx([f"127.0.0.1:{d.port}" for d in daemons], folder / "nginx", mode="least-conn")
        keys = {"default": admin_key, "metered": metered_key, "fleet": fleet_key}
        yield ReplicaSet(daemons, nginx, redis_server, keys)
    finally:
        if nginx is not None:
            nginx.stop()
        factory.close()
        redis_server.stop()


def chat(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # exactly max_tokens long: the slot stays busy that long
        "stream": stream,
    }


async def in_flight(client: httpx.AsyncClient, d: Daemon, tenant: str, headers: dict[str, str]) -> int:
    r = await client.get(f"{d.base_url}/admin/load", headers=headers)
    r.raise_for_status()
    return sum(int(t["in_flight"]) for t in r.json()["tenants"] if t["name"] == tenant)


async def cluster_mode(client: httpx.AsyncClient, d: Daemon, headers: dict[str, str]) -> str | None:
    """The mode ``llamagate_cluster_mode`` says is in force on ``d``: cluster, local or refuse."""
    r = await client.get(f"{d.base_url}/metrics", headers=headers)
    r.raise_for_status()
    for mode in ("cluster", "local", "refuse", "off"):
        if sample(r.text, "llamagate_cluster_mode", mode=mode) == 1.0:
            return mode
    return None


async def all_in_mode(client: httpx.AsyncClient, replicas: ReplicaSet, mode: str) -> bool:
    """Whether every replica of the set reports ``mode`` (asked of all at once, with the admin key)."""
    admin = replicas.headers()
    found = await asyncio.gather(*(cluster_mode(client, d, admin) for d in replicas.daemons))
    return list(found) == [mode] * len(replicas.daemons)


async def until(pred: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 30.0) -> float:
    """Seconds until ``pred()`` holds, asked every 50 ms; the test fails after ``timeout_s``."""
    started = time.monotonic()
    while True:
        held = pred()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.05)


async def open_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[httpx.Response, AsyncIterator[str]]:
    """Start a stream and read until its first content token: from then on it holds a slot. The line
    iterator is returned with it: dropping it would close the stream (the client would have left)."""
    response = await client.send(client.build_request("POST", url, json=body, headers=headers), stream=True)
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: {") and '"content"' in line:
            break
    return response, lines


def lease_key(tenant: str) -> str:
    """A tenant's leases on the model (``proxy.cluster.scripts``): members ``<request id>#<k>``, scored by
    their expiry in ms of Redis's clock."""
    return f"llamagate:{{{tenant}}}:lease:{MODEL}"


async def leases(redis: Redis, tenant: str) -> tuple[dict[str, float], float]:
    """The tenant's leases that count (not expired) with their expiry, and Redis's clock, in seconds."""
    secs, micros = await redis.time()
    now_ms = secs * 1000 + micros // 1000
    live = cast(
        "list[tuple[bytes, float]]",
        await redis.zrangebyscore(lease_key(tenant), f"({now_ms}", "+inf", withscores=True),
    )
    return {member.decode(): score / 1000 for member, score in live}, now_ms / 1000


@dataclass(frozen=True)
class Answer:
    sent: str  # the load's phase when the request was sent
    done: str  # and when its answer came
    status: int
    retry_after: str | None
    code: str | None  # the error's code, when it is not a 200


class Load:
    """``clients`` clients, each sending ``body`` to ``url`` again as soon as it has its answer (0.2 s later
    after a refusal), until the ``async with`` block ends. The test names the phases (``phase``); every
    answer is kept with the phase it was sent and answered in. A client whose request raises (its timeout:
    a hang) stops, and the error is kept in ``failures``."""

    def __init__(
        self, client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any], clients: int
    ) -> None:
        self.client = client
        self.url = url
        self.headers = headers
        self.body = body
        self.clients = clients
        self.phase = "before"
        self.answers: list[Answer] = []
        self.failures: list[str] = []
        self.pending: Counter[str] = Counter()  # requests sent and not answered yet, by their phase
        self._go = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        self._go.set()
        self._tasks = [asyncio.create_task(self._user()) for _ in range(self.clients)]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stopping = True
        self._go.set()
        if kind is not None:  # the test failed: do not wait for the requests on their way
            for task in self._tasks:
                task.cancel()
        await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=kind is not None), 150)

    def answered(self, sent: str | None = None, done: str | None = None) -> list[Answer]:
        return [
            a for a in self.answers if (sent is None or a.sent == sent) and (done is None or a.done == done)
        ]

    async def pause(self) -> None:
        """No new request until ``resume``; returns once every request sent has its answer."""
        self._go.clear()
        await until(lambda: not +self.pending, "the requests on their way to be answered", 150)

    def resume(self) -> None:
        self._go.set()

    async def _user(self) -> None:
        while True:
            await self._go.wait()
            if self._stopping:
                return
            sent = self.phase
            self.pending[sent] += 1
            try:
                r = await self.client.post(self.url, json=self.body, headers=self.headers)
            except httpx.HTTPError as exc:
                self.failures.append(f"sent in {sent}, failed in {self.phase}: {type(exc).__name__}: {exc}")
                return
            finally:
                self.pending[sent] -= 1
            self.answers.append(
                Answer(sent, self.phase, r.status_code, r.headers.get("retry-after"), _error_code(r))
            )
            if r.status_code != 200:
                await asyncio.sleep(0.2)


def _error_code(r: httpx.Response) -> str | None:
    if r.status_code == 200:
        return None
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None  # not llamagate's answer (nginx's own error page)


def log_messages(d: Daemon, text: str) -> list[dict[str, Any]]:
    """``d``'s log records whose message contains ``text``."""
    return [r for r in d.log_records() if text in str(r.get("message", r.get("msg", "")))]
