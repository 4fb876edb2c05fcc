"""The accounts store on the request path, through the whole app (uvicorn + the fake child) and a real
store (each test on both engines: an SQLite file, then a database on a real PostgreSQL server): store
keys accepted and refused as config keys are, a key's models, the budgets at admission with OpenAI's
rate-limit headers, the usage each answer is charged, and the admin routes."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from urllib.parse import quote

import httpx
import psycopg
import pytest

from proxy.accounts.issue import issue_key
from proxy.accounts.postgres import open_postgres
from proxy.accounts.records import UsageRecord
from proxy.accounts.service import Accounts
from proxy.accounts.sqlite import open_store
from proxy.accounts.store import Store, StoreError
from proxy.models.lane import ModelEntry
from proxy.settings import BudgetSettings, Scope, TenantSettings
from tests.fakes.fake_upstream import FakeLlama, eventually
from tests.helpers.postgres_server import Postgres
from tests.unit.accounts.conftest import ENGINES
from tests.unit.proxy.conftest import SECRET, Proxy, ProxyFactory

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
INFERENCE: frozenset[Scope] = frozenset({"inference"})
# What the fake child reports for every answer of n tokens: 8 prompt tokens, 3 of them cached.
PROMPT, CACHED = 8, 3


def tenants(queue_timeout_s: float = 10, **budgets: int) -> tuple[TenantSettings, ...]:
    team = BudgetSettings(**budgets)
    return (
        TenantSettings("team", max_concurrency=4, max_queue=8, queue_timeout_s=queue_timeout_s, budgets=team),
        TenantSettings("other", max_concurrency=4, max_queue=8, queue_timeout_s=10),
        TenantSettings("ops", max_concurrency=4, max_queue=8, queue_timeout_s=10),
    )


Served = Callable[..., AbstractAsyncContextManager[tuple[Proxy, Accounts]]]


@pytest.fixture(params=ENGINES)
def open_fresh(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    """Opens the test's store: a new SQLite file, or a new PostgreSQL database."""
    if request.param == "postgresql":
        url = request.getfixturevalue("postgres_url")
        return lambda: open_postgres(url)
    return lambda: open_store(tmp_path / "llamagate.db")


@pytest.fixture
def served(proxy_factory: ProxyFactory, open_fresh: Callable[[], Store]) -> Served:
    """The proxy with an ``Accounts`` on a fresh store, started and closed around the test."""

    @asynccontextmanager
    async def make(
        fake: FakeLlama | None = None, queue_timeout_s: float = 10, **budgets: int
    ) -> AsyncIterator[tuple[Proxy, Accounts]]:
        configured = tenants(queue_timeout_s, **budgets)
        accounts = Accounts(open_fresh(), configured, poll_s=0.05, interval_s=0.05)
        accounts.start()
        try:
            async with proxy_factory(fake, accounts=accounts, tenants=configured) as p:
                yield p, accounts
        finally:
            accounts.close()

    return make


def records(accounts: Accounts) -> list[UsageRecord]:
    assert accounts.flush(10.0)
    return accounts.store.usage_records()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def store_key(accounts: Accounts, tenant: str = "team", **kw: object) -> tuple[str, str]:
    key, record = issue_key(tenant, INFERENCE, time.time(), **kw)  # type: ignore[arg-type]
    accounts.store.add_key(record)
    return key, record.key_id


# -- keys -------------------------------------------------------------------------------------------


async def test_a_store_key_made_while_serving_answers_and_once_revoked_gets_the_unknown_keys_401(
    served: Served,
) -> None:
    async with served() as (p, accounts), httpx.AsyncClient(base_url=p.url, timeout=30) as c:
        key, key_id = store_key(accounts)
        await eventually(lambda: key_id in accounts.view._keys, 2.0)  # the poll, not a reload
        r = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        assert r.status_code == 200, r.text
        unknown = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(key[:-4] + "AAAA"))
        accounts.store.revoke_key(key_id, time.time())
        await eventually(lambda: key_id not in accounts.view._keys, 2.0)
        revoked = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        assert revoked.status_code == unknown.status_code == 401
        assert revoked.json() == unknown.json()
        assert revoked.headers["www-authenticate"] == unknown.headers["www-authenticate"]


async def test_an_expired_store_key_gets_the_same_401(served: Served) -> None:
    async with served() as (p, accounts), httpx.AsyncClient(base_url=p.url, timeout=30) as c:
        key, key_id = store_key(accounts, expires=time.time() - 1)
        await eventually(lambda: key_id in accounts.view._keys, 2.0)  # loaded, expired at the lookup
        r = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_a_key_limited_to_one_model_gets_a_403_naming_its_limit_for_another(served: Served) -> None:
    async with served() as (p, accounts), httpx.AsyncClient(base_url=p.url, timeout=30) as c:
        p.serve_models(ModelEntry("a", (), p.source), ModelEntry("b", (), p.source))
        key, key_id = store_key(accounts, models=("a",))
        await eventually(lambda: key_id in accounts.view._keys, 2.0)
        ok = await c.post("/v1/chat/completions", json={**CHAT, "model": "a"}, headers=bearer(key))
        assert ok.status_code == 200, ok.text
        refused = await c.post("/v1/chat/completions", json={**CHAT, "model": "b"}, headers=bearer(key))
        assert refused.status_code == 403
        assert (
            refused.json()["error"]["message"]
            == "this API key may not use the model 'b'; it is limited to 'a'"
        )
        # The counting routes pick a model too: the same limit.
        count = await c.post("/tokenize", json={"model": "b", "content": "x"}, headers=bearer(key))
        assert count.status_code == 403


# -- usage ------------------------------------------------------------------------------------------


async def test_a_non_streamed_answer_is_charged_exactly_its_usage(served: Served) -> None:
    async with served() as (p, accounts), p.client("admin") as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert r.status_code == 200
        usage = r.json()["usage"]
        (rec,) = records(accounts)
        assert (
            (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens)
            == (
                usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
                usage["completion_tokens"],
            )
            == (PROMPT, CACHED, 5)
        )
        assert (rec.tenant, rec.key_id, rec.model, rec.kind, rec.status) == (
            "ops",
            p.entries["admin"].key_id,
            "gemma-3-270m",
            "chat",
            200,
        )
        assert rec.request_id == r.headers["x-request-id"] and rec.duration_s > 0


async def test_the_row_a_request_queues_for_the_ledger_names_its_columns(
    proxy_factory: ProxyFactory, tmp_path: Path
) -> None:
    """The request path queues a ``LedgerRow`` (``UsageRecord``): the ledger table's columns by name."""
    configured = tenants()
    accounts = Accounts(open_store(tmp_path / "llamagate.db"), configured, interval_s=3600.0)
    accounts.start()  # the writer waits for a full batch or an hour: the row stays queued
    try:
        async with proxy_factory(accounts=accounts, tenants=configured) as p, p.client("admin") as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            (row,) = accounts.ledger.take()[0]
            assert isinstance(row, UsageRecord)
            assert (row.tenant, row.key_id, row.model, row.kind) == (
                "ops",
                p.entries["admin"].key_id,
                "gemma-3-270m",
                "chat",
            )
            assert row.request_id == r.headers["x-request-id"]
    finally:
        accounts.close()


async def test_a_stream_that_did_not_ask_for_usage_is_charged_from_its_timings_and_left_alone(
    served: Served,
) -> None:
    async with served() as (p, accounts), p.client("admin") as c:
        body = {**CHAT, "max_tokens": 6, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line]
        assert "stream_options" not in json.loads(p.fake.last_body)  # nothing asked of the child
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert all(e["choices"] for e in events) and not any("usage" in e for e in events)
        # The fake's timings: cache_n 3 + prompt_n 5 = the 8 prompt tokens its usage would say.
        assert events[-1]["timings"] == {"cache_n": 3, "prompt_n": 5, "predicted_n": 6, "predicted_ms": 1.0}
        (rec,) = records(accounts)
        assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (PROMPT, CACHED, 6)


async def test_a_stream_that_asked_for_usage_gets_its_usage_chunk_and_is_charged_what_it_says(
    served: Served,
) -> None:
    async with served() as (p, accounts), p.client("admin") as c:
        body = {**CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line]
        usage = json.loads(lines[-2][6:])["usage"]
        (rec,) = records(accounts)
        assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            usage["completion_tokens"],
        )


async def test_a_client_that_leaves_a_stream_is_charged_what_was_generated_until_then(served: Served) -> None:
    fake = FakeLlama(secret=SECRET, tokens=4)
    async with served(fake) as (p, accounts), p.client() as c:
        body = {**CHAT, "max_tokens": 500, "stream": True, "fake_token_interval_ms": 20}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 5:
                    break
        # Charged once the proxy has noticed (the writer may already have written it).
        await eventually(lambda: (s := accounts.stats()).pending + s.written > 0, 5.0)
        (rec,) = records(accounts)
        assert 4 <= rec.completion_tokens < 500  # the role chunk carries no token; the meter counts the rest
        # Never reported (the child stopped before its last chunk): counted again by the child's own
        # counter (the fake's: words + 8), not left at 0 (issue 39: a prefill made free by hanging up).
        assert (rec.prompt_tokens, rec.usage_source) == (9, "counted")


async def test_an_admitted_request_that_never_reaches_the_child_is_not_a_ledger_row(served: Served) -> None:
    async with served() as (p, accounts), p.client() as c:
        p.source.update(ready=False, state="BACKOFF", reason="restarting")
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503
        assert records(accounts) == []


# -- budgets ----------------------------------------------------------------------------------------


async def test_a_spent_token_budget_is_a_429_naming_it_before_any_slot_with_the_rate_limit_headers(
    served: Served,
) -> None:
    async with served(tokens_per_minute=20) as (p, _), p.client() as c:
        first = await c.post("/v1/chat/completions", json=CHAT)  # 8 prompt + 4 completion = 12
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-tokens"] == "20"
        second = await c.post("/v1/chat/completions", json=CHAT)  # 12 < 20: admitted, overshoots to 24
        assert second.status_code == 200
        requests_before = p.fake.requests
        third = await c.post("/v1/chat/completions", json=CHAT)
        assert third.status_code == 429
        error = third.json()["error"]
        assert (error["type"], error["code"]) == ("tokens", "tokens_per_minute")
        assert 1 <= int(third.headers["retry-after"]) <= 60
        assert third.headers["x-ratelimit-limit-tokens"] == "20"
        assert third.headers["x-ratelimit-remaining-tokens"] == "0"
        assert third.headers["x-ratelimit-reset-tokens"].endswith("s")
        assert p.fake.requests == requests_before  # never reached the child
        assert p.lane.gate.in_flight == 0 and p.lane.gate.queued == 0
        # Another tenant is not affected, and unbudgeted answers carry no rate-limit headers.
        async with p.client("other") as other:
            r = await other.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and "x-ratelimit-limit-tokens" not in r.headers


async def test_a_requests_per_minute_budget_counts_requests(served: Served) -> None:
    async with served(requests_per_minute=2) as (p, _), p.client() as c:
        for _ in range(2):
            ok = await c.post("/v1/chat/completions", json=CHAT)
            assert ok.status_code == 200
        assert ok.headers["x-ratelimit-remaining-requests"] == "0"
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and r.json()["error"]["type"] == "requests"
        assert r.headers["x-ratelimit-limit-requests"] == "2"


async def test_a_store_keys_own_budget_applies_to_that_key_only(served: Served) -> None:
    async with served() as (p, accounts), httpx.AsyncClient(base_url=p.url, timeout=30) as c:
        key, key_id = store_key(accounts, budgets=BudgetSettings(requests_per_minute=1))
        await eventually(lambda: key_id in accounts.view._keys, 2.0)
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=bearer(key))).status_code == 200
        r = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        assert r.status_code == 429 and f"key {key_id}" in r.json()["error"]["message"]
        async with p.client() as same_tenant:  # a config key of the same tenant
            assert (await same_tenant.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_a_running_stream_is_never_cut_by_its_budget(served: Served) -> None:
    async with served(tokens_per_minute=10) as (p, accounts), p.client() as c:
        body = {**CHAT, "max_tokens": 40, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        (rec,) = records(accounts)
        assert rec.completion_tokens == 40 and rec.status == 200  # far past the budget, charged in full


async def test_a_queue_timeout_gives_its_budget_hold_back_and_carries_the_headers(served: Served) -> None:
    fake = FakeLlama(secret=SECRET, tokens=4)
    async with served(fake, queue_timeout_s=0.2, requests_per_minute=100) as (p, accounts), p.client() as c:
        p.source.update(slots=1)
        slow = asyncio.create_task(
            c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 1500}, timeout=30)
        )
        await eventually(lambda: p.lane.gate.in_flight == 1, 5.0)
        waited = await c.post("/v1/chat/completions", json=CHAT)
        assert waited.status_code == 429 and "waited" in waited.json()["error"]["message"]
        assert waited.headers["x-ratelimit-limit-requests"] == "100"
        assert (await slow).status_code == 200
        assert len(records(accounts)) == 1  # the one that was answered


# -- admin routes -----------------------------------------------------------------------------------


async def test_admin_routes_make_list_and_revoke_keys_in_force_at_once(served: Served) -> None:
    async with served() as (p, accounts), p.client("admin") as admin:
        made = await admin.post(
            "/admin/keys",
            json={
                "tenant": "team",
                "name": "ci",
                "models": ["gemma-3-270m"],
                "expires": "1d",
                "budgets": {"tokens_per_day": 1000},
            },
        )
        assert made.status_code == 201, made.text
        new = made.json()
        assert new["key"].startswith("lg_" + new["id"]) and new["tenant"] == "team"
        assert new["scopes"] == ["inference"] and new["tokens_per_day"] == 1000 and new["status"] == "active"
        async with httpx.AsyncClient(base_url=p.url, timeout=30, headers=bearer(new["key"])) as c:
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200  # no poll wait
            listed = await admin.get("/admin/keys")
            assert listed.status_code == 200
            (row,) = [k for k in listed.json()["keys"] if k["id"] == new["id"]]
            assert "key" not in row and "digest" not in row and new["key"] not in listed.text
            digest = accounts.store.get_key(new["id"]).digest  # type: ignore[union-attr]
            assert digest.split(":")[1] not in listed.text
            gone = await admin.delete(f"/admin/keys/{new['id']}")
            assert gone.status_code == 200 and gone.json()["status"] == "revoked"
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 401


async def test_a_written_key_is_201_even_when_reading_the_keys_again_fails(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key view is read again right after the write; when that read fails (a session the database
    ended), the write still happened: a 503 would make the client make the key twice. The view's poll
    brings it in force."""
    async with served() as (p, accounts), p.client("admin") as admin:
        poll = accounts.view.refresh

        def refresh_failing_off_the_poll() -> bool:
            if threading.current_thread().name != "llamagate-keyview":
                raise StoreError("the database ended the session")
            return poll()

        monkeypatch.setattr(accounts.view, "refresh", refresh_failing_off_the_poll)
        made = await admin.post("/admin/keys", json={"tenant": "team"})
        assert made.status_code == 201, made.text
        new = made.json()
        assert accounts.store.get_key(new["id"]) is not None
        async with httpx.AsyncClient(base_url=p.url, timeout=30, headers=bearer(new["key"])) as c:
            deadline = time.monotonic() + 10
            while (await c.post("/v1/chat/completions", json=CHAT)).status_code != 200:
                assert time.monotonic() < deadline, "the key never came into force through the poll"
                await asyncio.sleep(0.05)
        gone = await admin.delete(f"/admin/keys/{new['id']}")
        assert gone.status_code == 200 and gone.json()["status"] == "revoked"


async def test_admin_key_routes_refuse_bad_input_by_name(served: Served) -> None:
    async with served() as (p, _), p.client("admin") as admin:
        cases = [
            ({"tenant": "nobody"}, "'tenant': must name a configured tenant"),
            ({"tenant": "team", "scopes": ["root"]}, "'scopes'"),
            ({"tenant": "team", "models": ["nope"]}, "'models': 'nope' not served"),
            ({"tenant": "team", "expires": "soon"}, "'expires' 'soon'"),
            ({"tenant": "team", "budgets": {"tokens_per_minute": 0}}, "'budgets.tokens_per_minute'"),
            ({"tenant": "team", "colour": "red"}, "unknown field(s) colour"),
        ]
        for body, message in cases:
            r = await admin.post("/admin/keys", json=body)
            assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
        assert (await admin.delete("/admin/keys/0123456789ab")).status_code == 404
        assert (await admin.delete("/admin/keys/NOTANID")).status_code == 404
        assert (await admin.delete("/admin/keys/")).status_code == 404  # no segment: not the row
        assert (await admin.delete("/admin/keys/0123456789ab/x")).status_code == 404
        wrong = await admin.get("/admin/keys/0123456789ab")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "DELETE"
        async with p.client("user") as user:
            assert (await user.get("/admin/keys")).status_code == 403
            assert (await user.delete("/admin/keys/0123456789ab")).status_code == 403


async def test_admin_usage_answers_what_the_usage_command_prints(served: Served) -> None:
    async with served() as (p, accounts), p.client("admin") as admin:
        async with p.client("user") as user:
            for n in (3, 5):
                assert (
                    await user.post("/v1/chat/completions", json={**CHAT, "max_tokens": n})
                ).status_code == 200
        assert (await admin.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert accounts.flush(10.0)
        r = await admin.get("/admin/usage", params={"by": "tenant"})
        assert r.status_code == 200
        body = r.json()
        assert body["by"] == "tenant" and body["since"] is None
        rows = {row["tenant"]: row for row in body["rows"]}
        assert rows["team"]["requests"] == 2 and rows["team"]["completion_tokens"] == 8
        assert rows["team"]["prompt_tokens"] == 2 * PROMPT and rows["team"]["cached_tokens"] == 2 * CACHED
        assert body["total"]["requests"] == 3
        only = (
            await admin.get("/admin/usage", params={"tenant": "ops", "by": "model", "since": "1h"})
        ).json()
        assert [(row["tenant"], row["model"]) for row in only["rows"]] == [("ops", "gemma-3-270m")]
        assert (await admin.get("/admin/usage", params={"by": "week"})).status_code == 400
        assert (await admin.get("/admin/usage", params={"since": "yesterday"})).status_code == 400


async def test_without_a_store_the_admin_routes_say_how_to_configure_one(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client("admin") as admin:
        r = await admin.get("/admin/keys")
        assert r.status_code == 404 and "store" in r.json()["error"]["message"]
        # And nothing is asked of the child that the client did not ask.
        async with admin.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            [line async for line in s.aiter_lines()]
        assert "stream_options" not in json.loads(p.fake.last_body)


async def test_the_usage_series_count_the_ledgers_tokens(served: Served) -> None:
    async with served() as (p, accounts), p.client("admin") as admin:
        assert (await admin.post("/v1/chat/completions", json={**CHAT, "max_tokens": 7})).status_code == 200
        assert accounts.flush(10.0)
        text = (await admin.get("/metrics")).text
    labels = 'kind="{}",model="gemma-3-270m",tenant="ops"'
    assert f"llamagate_usage_tokens_total{{{labels.format('prompt')}}} {float(PROMPT)}" in text
    assert f"llamagate_usage_tokens_total{{{labels.format('cached')}}} {float(CACHED)}" in text
    assert f"llamagate_usage_tokens_total{{{labels.format('completion')}}} 7.0" in text
    assert "llamagate_ledger_written_records_total 1.0" in text
    assert "llamagate_ledger_pending_records 0.0" in text


async def test_budgets_without_a_store_are_kept_in_memory(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(tenants=tenants(requests_per_minute=1)) as p, p.client() as c:
        first = await c.post("/v1/chat/completions", json=CHAT)
        assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "0"
        second = await c.post("/v1/chat/completions", json=CHAT)
        assert second.status_code == 429 and second.json()["error"]["code"] == "requests_per_minute"
        assert second.headers["x-ratelimit-limit-requests"] == "1"
        async with p.client("admin") as admin:
            assert (await admin.get("/admin/usage")).status_code == 404  # no ledger without a store


# -- PostgreSQL going away ----------------------------------------------------------------------------


@pytest.mark.needs_tool("initdb", "postgres")
async def test_a_database_gone_away_is_503_for_admin_changes_and_comes_back_without_a_restart(
    proxy_factory: ProxyFactory, postgres_server: Postgres, postgres_url: str
) -> None:
    configured = tenants()
    accounts = Accounts(open_postgres(postgres_url), configured, poll_s=0.05, interval_s=0.05)
    accounts.start()
    key, _ = store_key(accounts)
    name = postgres_url.rsplit("/", 1)[1]

    def database(allow: bool) -> None:
        with psycopg.connect(postgres_server.url(), autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allow).lower()}')
            if not allow:  # and end the sessions the store holds
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
                )

    try:
        async with proxy_factory(accounts=accounts, tenants=configured) as p, p.client("admin") as admin:
            # The key must be in the view's memory before the database goes: that is what is kept.
            async with httpx.AsyncClient(base_url=p.url, timeout=30, headers=bearer(key)) as c:
                deadline = time.monotonic() + 10
                while (await c.post("/v1/chat/completions", json=CHAT)).status_code != 200:
                    assert time.monotonic() < deadline, "the store key never came into force"
                    await asyncio.sleep(0.05)
            await asyncio.to_thread(database, False)
            refused = await admin.post("/admin/keys", json={"tenant": "team"})
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "store_unavailable" and accounts.store.where in error["message"]
            # The keys in memory keep answering while the database is away.
            async with httpx.AsyncClient(base_url=p.url, timeout=30, headers=bearer(key)) as c:
                assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
            await asyncio.to_thread(database, True)
            made = await admin.post("/admin/keys", json={"tenant": "team"})
            assert made.status_code == 201, made.text
    finally:
        await asyncio.to_thread(database, True)
        accounts.close()


# --- every stream charged its prompt; a dead child's tokens charged to nobody (issue 39) ----------------


async def test_streams_closed_at_their_first_token_are_charged_their_prompt_and_spend_the_budget(
    served: Served,
) -> None:
    """The evasion an outside attack run found: streams without ``include_usage``, each closed at its
    first content token, were charged their few completion tokens and no prompt, so a tenant with a
    token budget could have the child prefill without limit. Each is now charged its prompt, counted
    by the child's own counter (the fake's: words + 8), and once the budget is spent the next is 429."""
    fake = FakeLlama(secret=SECRET, tokens=4)
    words = " ".join(["word"] * 481)  # 489 prompt tokens by the fake's count
    prompt = 481 + 8
    body = {"messages": [{"role": "user", "content": words}], "max_tokens": 500, "stream": True}
    async with served(fake, tokens_per_minute=1500) as (p, accounts), p.client() as c:
        statuses = []
        for _ in range(9):
            async with c.stream(
                "POST", "/v1/chat/completions", json={**body, "fake_token_interval_ms": 50}
            ) as r:
                statuses.append(r.status_code)
                if r.status_code == 200:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and '"content":"tok' in line:
                            break  # the first content token: hang up
            # The proxy notices the client left and charges the request before the next one.
            admitted = statuses.count(200)
            await eventually(lambda: len(records(accounts)) == admitted, 5.0)  # noqa: B023
        rows = records(accounts)
    assert rows and all(row.prompt_tokens == prompt and row.usage_source == "counted" for row in rows)
    assert all(1 <= row.completion_tokens < 500 for row in rows)
    # 1500 tokens a minute: three prompts fit with their completions, the fourth overshoots (the bound's
    # one request), and every later one is refused.
    assert statuses[:4] == [200] * 4 and 429 in statuses[4:], statuses
    assert sum(row.prompt_tokens + row.completion_tokens for row in rows) <= 1500 + prompt + 500


async def test_a_request_whose_replay_dies_too_is_charged_nothing_and_its_row_says_so(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """Its child was killed before any byte reached the client, and the next child too: the client got a
    502 and no token; the ledger row says the same zeros as the access log, and the budget is not spent."""
    import logging

    from tests.unit.proxy.routes.test_replay import DEAD, access, dies, next_child, waiting

    caplog.set_level(logging.INFO, logger="llamagate.access")
    async with served(tokens_per_minute=100_000) as (p, accounts), p.client() as c:
        dies(p, at_token=2)
        task = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 30}))
        await eventually(waiting(p), 10.0)
        async with next_child(p) as second:
            second.die_at_token = 5
            second.on_death = lambda: p.source.update(reason="exited: killed by SIGKILL", **DEAD)
            r = await asyncio.wait_for(task, 10.0)
            assert second.deaths == 1
        assert r.status_code == 502, r.text
        await eventually(lambda: len(records(accounts)) == 1, 5.0)
        (row,) = records(accounts)
        remaining = accounts.budgets.used("tenant", "team", "tokens_per_minute", time.time())
    (line,) = access(caplog)
    assert line["status"] == 502 and line["replayed"] == 1 and line["tokens"] == 0
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (502, 0, 0)
    assert row.usage_source == "undelivered"
    assert remaining == 0


async def test_the_remaining_tokens_of_an_answer_count_its_own_reserve(served: Served) -> None:
    """docs/api.md: the headers are as admitting the request left them, its own worst case counted. A
    request that alone holds the window (nothing spent yet) shows the limit less its reserve (one slot's
    context, 4096 on the fake child), not the whole limit; the next one sees the first one's charge."""
    async with served(tokens_per_minute=100_000) as (p, _), p.client() as c:
        first = await c.post("/v1/chat/completions", json=CHAT)
        second = await c.post("/v1/chat/completions", json=CHAT)
    assert first.status_code == second.status_code == 200
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 100_000 - 4096
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 100_000 - 4096 - (PROMPT + 4)


async def test_a_request_admitted_as_its_windows_overshooter_shows_its_reserve_counted_too(
    served: Served,
) -> None:
    """A budget smaller than one request's reserve runs one request at a time (the overshooter, which
    holds no reserve in the window): its answer still counts its own worst case, so what it shows left is
    0, not the whole limit (an outside run saw the full limit on such an answer)."""
    async with served(tokens_per_minute=1500) as (p, _), p.client() as c:
        first = await c.post("/v1/chat/completions", json=CHAT)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "1500"
    assert first.headers["x-ratelimit-remaining-tokens"] == "0"


# --- hostile values at the admin routes (issue 39) ---------------------------------------------------


async def test_out_of_range_values_are_400_naming_the_field_and_change_nothing(served: Served) -> None:
    """What an outside attack run sent: an expiry past year 9999 (answered 500, yet committed: the key
    list broke for good), budgets of 2**63 (an OverflowError), dates outside the calendar."""
    async with served() as (p, accounts), p.client("admin") as admin:
        before = accounts.store.list_keys()
        cases = [
            ({"tenant": "team", "expires": "999999999999w"}, "'expires'"),
            ({"tenant": "team", "expires": "99999999999999999999w"}, "'expires'"),
            ({"tenant": "team", "budgets": {"tokens_per_day": 2**63}}, "'budgets.tokens_per_day'"),
            ({"tenant": "team", "budgets": {"requests_per_minute": 10**13}}, "at most"),
            ({"tenant": "team", "models": ["gpt-4"]}, "'models': 'gpt-4' not served"),
        ]
        for body, message in cases:
            r = await admin.post("/admin/keys", json=body)
            assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
        for since in ("9999-12-31T23:59:59-23:59", "99999999999w", "0001-01-01T00:00:00+23:59"):
            r = await admin.get("/admin/usage", params={"since": since})
            assert r.status_code == 400 and "'since'" in r.json()["error"]["message"], (since, r.text)
        assert accounts.store.list_keys() == before
        listed = await admin.get("/admin/keys")
        assert listed.status_code == 200


async def test_a_stored_row_outside_the_calendar_is_listed_and_can_be_revoked(served: Served) -> None:
    """A key written with an expiry no calendar holds (by hand, or by an older llamagate) never breaks
    the list: it is shown, saying what is wrong with its date, and it can be revoked."""
    async with served() as (p, accounts), p.client("admin") as admin:
        _, record = issue_key("team", INFERENCE, time.time(), expires=1e20)
        accounts.store.add_key(record)
        listed = await admin.get("/admin/keys")
        assert listed.status_code == 200, listed.text
        (row,) = [k for k in listed.json()["keys"] if k["id"] == record.key_id]
        assert row["expires"].startswith("invalid (")
        gone = await admin.delete(f"/admin/keys/{record.key_id}")
        assert gone.status_code == 200 and gone.json()["status"] == "revoked"


def _hostile(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value of the kinds hostile clients send: huge and negative numbers, floats, the
    wrong types, nesting, unicode, long text."""
    choices: list[object] = [
        None,
        True,
        False,
        0,
        -1,
        2**63,
        -(2**64),
        10**30,
        1e308,
        -0.5,
        3.5,
        "",
        "30d",
        "999999999999w",
        "9999-12-31T23:59:59-23:59",
        "\u202e\u0000\ud7ff\U0001f600",
        "x" * 5000,
        "admin",
        "team",
        "inference",
    ]
    pick = rng.randrange(len(choices) + (3 if depth < 2 else 0))
    if pick < len(choices):
        return choices[pick]
    if pick == len(choices):
        return [_hostile(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    fields = ["tenant", "scopes", "admin", "expires", "models", "name", "budgets", *BUDGETS, "zz"]
    return {rng.choice(fields): _hostile(rng, depth + 1) for _ in range(rng.randint(0, 4))}


BUDGETS = ("tokens_per_minute", "tokens_per_day", "requests_per_minute")


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_hostile_values_at_every_admin_route_are_never_a_500(
    served: Served, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    """Seeded: a failure names its seed and reproduces. Every admin route's body and query: no 500, no
    traceback in the log, and the store unchanged whenever the answer is a refusal."""
    rng = random.Random(seed)
    fields = ("tenant", "scopes", "admin", "expires", "models", "name", "budgets")
    async with served() as (p, accounts), p.client("admin") as admin:
        for i in range(120):
            before = accounts.store.list_keys()
            body: object
            if rng.random() < 0.8:
                body = {f: _hostile(rng) for f in rng.sample(fields, rng.randint(1, len(fields)))}
                if rng.random() < 0.5 and isinstance(body, dict):
                    body["tenant"] = "team"
            else:
                body = _hostile(rng)
            r = await admin.post("/admin/keys", json=body)
            assert r.status_code in (201, 400), (seed, i, body, r.text)
            if r.status_code != 201:
                assert accounts.store.list_keys() == before, (seed, i, body)
            query = {
                k: str(_hostile(rng))[:300] for k in rng.sample(["since", "by", "tenant", "key", "q"], 2)
            }
            u = await admin.get("/admin/usage", params=query)
            assert u.status_code in (200, 400), (seed, i, query, u.text)
            d = await admin.delete(f"/admin/keys/{quote(str(_hostile(rng))[:40], safe='')}")
            assert d.status_code in (200, 404, 405), (seed, i, d.text)
        assert (await admin.get("/admin/keys")).status_code == 200
    assert not [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.getMessage()]
