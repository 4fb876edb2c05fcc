"""The operator's model routes through the app: ``GET /admin/models`` lists each model's state, residency,
memory share, loads and load progress; ``POST /admin/models/{name}/load|unload`` act through the model's
``OperatorControl``, refuse with the reason (unknown 404, ``always`` 409, no room 503 naming the
holders), and an unload waits for the lane's requests first. ``/readyz`` shows each model's progress."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from proxy.app import create_app
from proxy.auth import new_key
from proxy.errors import NotReady
from proxy.models.lane import ModelEntry
from proxy.settings import KeyEntry, ProxySettings, TenantSettings
from proxy.state import ProxyState
from tests.fakes.fake_upstream import StaticSource, eventually, serve, snapshot_for

UNLOADED: dict[str, object] = {"state": "UNLOADED", "ready": False, "reason": "not loaded"}


class Controlled(StaticSource):
    """An ``on_demand`` model the operator loads and unloads; ``refusal`` is what a load raises."""

    def __init__(self) -> None:
        super().__init__(snapshot_for(None, None, **UNLOADED))
        self.loads = 0
        self.unloads: list[str] = []
        self.refusal: NotReady | None = None

    def control_report(self) -> Mapping[str, object]:
        return {"budget_bytes": 300, "budget_share": 0.3, "loads": self.loads}

    async def load(self) -> None:
        if self.refusal is not None:
            raise self.refusal
        self.loads += 1
        self.update(state="READY", ready=True, reason=None, progress=1.0, load_step=None)

    async def unload(self, reason: str) -> None:
        self.unloads.append(reason)
        self.snap = snapshot_for(None, None, **UNLOADED)


@dataclass
class Door:
    url: str
    state: ProxyState
    lazy: Controlled
    keys: dict[str, str]

    def client(self, key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"authorization": f"Bearer {self.keys[key]}"}, timeout=30
        )


@asynccontextmanager
async def door(**changes: object) -> AsyncIterator[Door]:
    keys: dict[str, str] = {}
    entries: dict[str, KeyEntry] = {}
    for name, scopes in (("admin", {"inference", "admin"}), ("user", {"inference"})):
        keys[name], entries[name] = new_key("ops", frozenset(scopes))  # type: ignore[arg-type]
    settings = ProxySettings(tenants=(TenantSettings("ops"),), keys=tuple(entries.values()))
    settings = dataclasses.replace(settings, **changes)  # type: ignore[arg-type]
    chat = StaticSource(snapshot_for("http://127.0.0.1:9", "s", model_alias="chat"))
    lazy = Controlled()
    models = [ModelEntry("chat", ("c",), chat), ModelEntry("lazy", (), lazy, "on_demand")]
    app = create_app(settings, chat, models)
    async with serve(app) as url:
        yield Door(url, app.state.proxy, lazy, keys)


async def test_admin_models_lists_each_models_state_share_loads_and_progress() -> None:
    async with door() as d, d.client("admin") as c, d.client("user") as user:
        d.lazy.update(state="STARTING", progress=0.4, load_step="health", load_eta_s=2.5)
        r = await c.get("/admin/models")
        assert r.status_code == 200, r.text
        rows = {m["name"]: m for m in r.json()["models"]}
        assert list(rows) == ["chat", "lazy"]
        lazy = rows["lazy"]
        assert lazy["state"] == "STARTING" and lazy["residency"] == "on_demand"
        assert (lazy["progress"], lazy["load_step"], lazy["load_eta_s"]) == (0.4, "health", 2.5)
        assert (lazy["budget_bytes"], lazy["budget_share"], lazy["loads"]) == (300, 0.3, 0)
        assert lazy["idle_s"] >= 0
        # A source that is no operator control (this ``always`` model's) has no figures to show.
        assert rows["chat"]["residency"] == "always" and rows["chat"]["budget_bytes"] is None
        # /readyz shows the same progress per model, without credentials.
        ready = (await user.get("/readyz")).json()["models"]["lazy"]
        assert (ready["progress"], ready["load_step"], ready["load_eta_s"]) == (0.4, "health", 2.5)
        # Admin only.
        assert (await user.get("/admin/models")).status_code == 403
        assert (await user.post("/admin/models/lazy/load")).status_code == 403
        assert d.lazy.loads == 0


async def test_load_and_unload_act_on_the_named_model_and_refuse_saying_why() -> None:
    async with door() as d, d.client("admin") as c:
        r = await c.post("/admin/models/lazy/load")
        assert r.status_code == 200 and r.json()["state"] == "READY" and d.lazy.loads == 1
        r = await c.post("/admin/models/lazy/unload")
        assert r.status_code == 200 and r.json()["state"] == "UNLOADED"
        assert d.lazy.unloads == ["unloaded by an operator"]

        r = await c.post("/admin/models/nope/unload")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "this server serves 'chat', 'lazy'" in r.json()["error"]["message"]
        r = await c.post("/admin/models/chat/unload")
        assert r.status_code == 409 and "residency 'always'" in r.json()["error"]["message"]
        assert (await c.get("/admin/models/lazy/load")).status_code == 405
        # Requests are labeled by the row's path as written, never by the name in it (a bounded set).
        text = (await c.get("/metrics")).text
        assert '/admin/models/{name}/load",status="405"' in text
        assert '/admin/models/{name}/unload",status="409"' in text
        assert "/admin/models/chat/" not in text

        d.lazy.refusal = NotReady("the model 'lazy' needs 300 MiB and does not fit: held by chat", 30)
        r = await c.post("/admin/models/lazy/load")
        assert r.status_code == 503 and r.headers["retry-after"] == "30"
        assert "held by chat" in r.json()["error"]["message"]


async def test_an_unload_waits_for_the_lanes_requests_and_gives_up_at_the_drain_timeout() -> None:
    async with door(drain_timeout_s=30.0) as d, d.client("admin") as c:
        lane = d.state.router.lanes["lazy"]
        lane.track_active(1)  # a request of this model being handled
        unloading = asyncio.create_task(c.post("/admin/models/lazy/unload"))
        await eventually(lambda: bool(lane._idle._waiters))  # the unload is waiting for the lane
        assert not unloading.done() and d.lazy.unloads == []
        lane.track_active(-1)
        r = await unloading
        assert r.status_code == 200 and d.lazy.unloads == ["unloaded by an operator"]

    async with door(drain_timeout_s=0.05) as d, d.client("admin") as c:
        d.state.router.lanes["lazy"].track_active(1)
        r = await c.post("/admin/models/lazy/unload")
        assert r.status_code == 503 and "proxy.drain_timeout_s" in r.json()["error"]["message"]
        assert d.lazy.unloads == []
