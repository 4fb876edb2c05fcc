"""Several models: the admin and counting passthrough routes pick their model (``?model=`` on a GET, the
body's ``model`` on a POST, as llama-server's router mode), default to the first ``always`` model the
tenant may use, never load an unloaded model for a GET, and ``/admin/load`` shows every model's gate.
Each model's child is a fake llama-server of its own slot count, so an answer tells which one it came from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.auth import new_key
from proxy.models.lane import ModelEntry
from proxy.settings import KeyEntry, ProxySettings, TenantSettings, Timeouts
from proxy.state import ProxyState
from tests.fakes.fake_upstream import FakeLlama, StaticSource, eventually, one_model, serve, snapshot_for
from tests.helpers.exposition import sample

SECRET = "per-boot-secret-xyz"


class OnDemandSource(StaticSource):
    """An unloaded ``on_demand`` model: ``ensure_loaded`` points it at its fake child."""

    def __init__(self, fake: FakeLlama) -> None:
        super().__init__(
            snapshot_for(None, None, state="UNLOADED", ready=False, reason="not loaded", slots=fake.slots)
        )
        self.fake = fake
        self.loads = 0

    async def ensure_loaded(self) -> None:
        self.loads += 1
        self.snap = snapshot_for(self.fake.base_url, SECRET, slots=self.fake.slots, model_alias="lazy")


def body_of(fake: FakeLlama) -> dict[str, Any]:
    """The last request body the fake child received."""
    body = json.loads(fake.last_body)
    assert isinstance(body, dict)
    return body


@dataclass
class Door:
    url: str
    state: ProxyState
    fakes: dict[str, FakeLlama]
    lazy: OnDemandSource
    keys: dict[str, str]
    embed: StaticSource

    def client(self, key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"authorization": f"Bearer {self.keys[key]}"}, timeout=30
        )


@asynccontextmanager
async def door(**changes: object) -> AsyncIterator[Door]:
    fakes = {
        "chat": FakeLlama(secret=SECRET, slots=2),
        "embed": FakeLlama(secret=SECRET, slots=3),
        "lazy": FakeLlama(secret=SECRET, slots=5),
    }
    for fake in fakes.values():
        await fake.start()
    keys: dict[str, str] = {}
    entries: dict[str, KeyEntry] = {}
    for name, tenant, scopes in (
        ("admin", "ops", {"inference", "admin"}),
        ("user", "team", {"inference"}),
        ("embed_only", "rag", {"inference"}),
    ):
        keys[name], entries[name] = new_key(tenant, frozenset(scopes))  # type: ignore[arg-type]
    settings = ProxySettings(
        tenants=(TenantSettings("ops"), TenantSettings("team"), TenantSettings("rag", models=("embed",))),
        keys=tuple(entries.values()),
        timeouts=Timeouts(connect_s=2, first_token_s=30, total_s=60),
    )
    settings = dataclasses.replace(settings, **changes)  # type: ignore[arg-type]
    chat = StaticSource(snapshot_for(fakes["chat"].base_url, SECRET, slots=2, model_alias="chat"))
    embed = StaticSource(snapshot_for(fakes["embed"].base_url, SECRET, slots=3, model_alias="embed"))
    lazy = OnDemandSource(fakes["lazy"])
    # An on_demand model listed first: the default is still the first ``always`` one.
    models = [
        ModelEntry("lazy", (), lazy, "on_demand"),
        ModelEntry("chat", ("c",), chat),
        ModelEntry("embed", ("e",), embed),
    ]
    app = create_app(settings, chat, models)
    try:
        async with serve(app) as url:
            yield Door(url, app.state.proxy, fakes, lazy, keys, embed)
    finally:
        for fake in fakes.values():
            await fake.stop()


async def test_props_and_slots_go_to_the_model_named_by_the_query() -> None:
    async with door() as d, d.client("admin") as c:
        for model, slots in (("chat", 2), ("embed", 3), ("e", 3), ("c", 2)):
            r = await c.get("/props", params={"model": model})
            assert r.status_code == 200 and r.json()["total_slots"] == slots, (model, r.text)
            r = await c.get("/slots", params={"model": model})
            assert r.status_code == 200 and len(r.json()) == slots, (model, r.text)
        # No model: the first ``always`` model, as before.
        assert (await c.get("/props")).json()["total_slots"] == 2
        assert len((await c.get("/slots")).json()) == 2


async def test_an_unknown_or_forbidden_model_is_refused_before_any_child_is_asked() -> None:
    async with door() as d, d.client("admin") as c, d.client("embed_only") as rag:
        r = await c.get("/slots", params={"model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "this server serves 'lazy', 'chat', 'embed'" in r.json()["error"]["message"]
        r = await c.post("/tokenize", json={"model": "nope", "content": "a b"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await rag.get("/props", params={"model": "chat"})
        assert r.status_code == 403 and "may not use the model 'chat'" in r.json()["error"]["message"]
        assert [f.connections for f in d.fakes.values()] == [0, 0, 0]
        # A tenant limited to some models gets the first of those when it names none.
        assert (await rag.get("/props")).json()["total_slots"] == 3


async def test_counting_routes_take_the_body_model_then_the_query() -> None:
    async with door() as d, d.client("user") as c:
        r = await c.post("/tokenize", json={"model": "embed", "content": "one two three"})
        assert r.status_code == 200 and r.json()["tokens"] == [0, 1, 2]
        assert body_of(d.fakes["embed"])["content"] == "one two three" and not d.fakes["chat"].last_body
        r = await c.post("/tokenize", params={"model": "c"}, json={"content": "one"})
        assert r.status_code == 200 and body_of(d.fakes["chat"]) == {"content": "one"}
        r = await c.post(
            "/v1/chat/completions/input_tokens",
            json={"model": "e", "messages": [{"role": "user", "content": "hi there"}]},
        )
        assert r.status_code == 200 and r.json()["input_tokens"] == 10
        assert "messages" in body_of(d.fakes["embed"])


async def test_a_starting_model_answers_props_but_not_counting_naming_the_model() -> None:
    async with door() as d, d.client("admin") as c:
        d.embed.update(state="STARTING", ready=False, reason="loading the model")
        assert (await c.get("/props", params={"model": "embed"})).json()["total_slots"] == 3
        r = await c.post("/tokenize", json={"model": "embed", "content": "a"})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["message"] == "the model 'embed' is not ready (loading the model)"


async def test_the_counting_rate_is_one_bucket_per_tenant_over_every_model() -> None:
    async with door(count_rate_per_s=0.001, count_burst=1) as d, d.client("user") as c:
        assert (await c.post("/tokenize", json={"model": "embed", "content": "a"})).status_code == 200
        r = await c.post("/tokenize", json={"model": "chat", "content": "a"})
        assert r.status_code == 429 and r.headers["retry-after"]


async def test_an_unloaded_model_is_not_loaded_by_a_get_but_is_by_a_counting_post() -> None:
    async with door() as d, d.client("admin") as c:
        for path in ("/props", "/slots"):
            r = await c.get(path, params={"model": "lazy"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
            assert "the model 'lazy' is not running" in r.json()["error"]["message"]
            assert "(not loaded; an inference or counting request loads it)" in r.json()["error"]["message"]
            assert r.headers["retry-after"]
        assert d.lazy.loads == 0 and d.fakes["lazy"].connections == 0
        r = await c.post("/tokenize", json={"model": "lazy", "content": "x y"})
        assert r.status_code == 200 and d.lazy.loads == 1 and body_of(d.fakes["lazy"])["content"] == "x y"
        assert (await c.get("/props", params={"model": "lazy"})).json()["total_slots"] == 5
        text = (await c.get("/metrics")).text
        for route, status in (("/tokenize", "200"), ("/props", "503"), ("/slots", "503")):
            labels = {"tenant": "ops", "model": "lazy", "route": route, "status": status}
            assert sample(text, "llamagate_requests_total", **labels) == 1, labels
        # An idle unload must see the model busy while such a request runs; done, it is idle again.
        assert not d.state.router.lanes["lazy"].busy


async def test_admin_load_shows_each_models_gate_and_the_totals() -> None:
    async with door() as d, d.client("admin") as c:
        lanes = d.state.router.lanes
        lanes["chat"].snapshot()  # sizes the gate to the child's slots, as a request does
        chat_gate = lanes["chat"].gate
        permit = await chat_gate.acquire("team", 1)
        try:
            r = await c.get("/admin/load")
            assert r.status_code == 200
            load = r.json()
            assert set(load["models"]) == {"lazy", "chat", "embed"}
            assert load["models"]["chat"]["slots"] == 2 and load["models"]["embed"]["slots"] == 3
            assert load["models"]["chat"]["in_flight"] == 1 and load["models"]["embed"]["in_flight"] == 0
            assert load["slots"] == 2 + 3 + 5 and load["in_flight"] == 1 and load["queued"] == 0
            team = next(t for t in load["tenants"] if t["name"] == "team")
            # The sums over the models beside the tenant's limits (per model, and the total's).
            assert team == {
                "name": "team",
                "in_flight": 1,
                "queued": 0,
                "max_concurrency": TenantSettings("team").max_concurrency,
                "max_queue": TenantSettings("team").max_queue,
                "max_concurrency_total": None,
            }
            chat_team = next(t for t in load["models"]["chat"]["tenants"] if t["name"] == "team")
            assert chat_team["max_concurrency"] == TenantSettings("team").max_concurrency
            ready = (await c.get("/readyz")).json()
            assert ready["in_flight"] == 1 and ready["slots_total"] == 2 + 3 + 5
        finally:
            permit.release()


@pytest.mark.parametrize("query", ["model=gemma-3-270m", ""])
async def test_one_model_daemon_relays_props_as_before(query: str) -> None:
    """Without ``models:`` the query goes on to the child untouched, and /admin/load has the same shape
    as with several: the one model's gate under ``models`` too."""
    fake = FakeLlama(secret=SECRET, slots=4)
    await fake.start()
    key, entry = new_key("ops", frozenset({"admin"}))
    settings = ProxySettings(tenants=(TenantSettings("ops"),), keys=(entry,))
    source = StaticSource(dataclasses.replace(snapshot_for(fake.base_url, SECRET)))
    app = create_app(settings, source, one_model(source))
    try:
        async with (
            serve(app) as url,
            httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"}) as c,
        ):
            r = await c.get("/props" + (f"?{query}" if query else ""))
            assert r.status_code == 200 and r.json()["total_slots"] == 4
            load = (await c.get("/admin/load")).json()
            assert set(load["models"]) == {"gemma-3-270m"} and load["slots"] == 4
    finally:
        await fake.stop()


class ColdSource(StaticSource):
    """An on_demand model whose load does not finish."""

    def __init__(self) -> None:
        super().__init__(snapshot_for(None, None, state="UNLOADED", ready=False, reason="not loaded"))
        self.waiting = 0

    async def ensure_loaded(self) -> None:
        self.waiting += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.waiting -= 1


async def test_a_client_that_leaves_a_counting_request_ends_its_wait_for_the_load() -> None:
    async with door() as d:
        cold = ColdSource()
        lane = d.state.router.add(ModelEntry("cold", (), cold, "on_demand"))
        async with d.client("user") as c:
            leaving = asyncio.create_task(c.post("/tokenize", json={"model": "cold", "content": "a"}))
            await eventually(lambda: cold.waiting == 1, 10.0)
            leaving.cancel()  # the client closes its connection
            with pytest.raises(asyncio.CancelledError):
                await leaving
        await eventually(lambda: cold.waiting == 0 and not lane.busy, 10.0)
