"""Several models through the whole app (uvicorn + the fake child behind two lanes): a tenant's total
across models, and a client that leaves while its model loads."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.models.lane import ModelEntry
from proxy.models.router import ModelRouter
from proxy.settings import TenantSettings
from proxy.source import UpstreamSnapshot
from tests.fakes.fake_upstream import StaticSource, eventually
from tests.unit.proxy.conftest import Proxy, ProxyFactory

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


class ColdSource:
    """An on_demand model whose load never finishes until the test says so."""

    def __init__(self, inner: StaticSource) -> None:
        self.inner = inner
        self.waiting = 0
        self.loaded = asyncio.Event()

    def snapshot(self) -> UpstreamSnapshot:
        return self.inner.snapshot()

    async def ensure_loaded(self) -> None:
        self.waiting += 1
        try:
            await self.loaded.wait()
        finally:
            self.waiting -= 1


def two_lanes(p: Proxy, second: object | None = None) -> ModelRouter:
    """Lanes 'a' and 'b' in front of the one fake child (each lane its own gate, as in the daemon), in
    place of the one model, as a SIGHUP would change them."""
    return p.serve_models(
        ModelEntry("a", ("a",), p.source),
        ModelEntry("b", ("b",), second or p.source, "on_demand" if second else "always"),  # type: ignore[arg-type]
    )


def tenants(total: int | None) -> tuple[TenantSettings, ...]:
    return (
        TenantSettings(
            "team", max_concurrency=4, max_queue=4, queue_timeout_s=30, max_concurrency_total=total
        ),
        TenantSettings("other", max_concurrency=4, max_queue=4, queue_timeout_s=30),
        TenantSettings("ops"),
    )


async def test_a_tenants_total_across_models_is_refused_at_once_and_freed_after(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory(tenants=tenants(2)) as p, p.client() as c, p.client("other") as o:
        two_lanes(p)
        slow = {**CHAT, "fake_delay_ms": 1500}
        first = asyncio.create_task(c.post("/v1/chat/completions", json={**slow, "model": "a"}))
        second = asyncio.create_task(c.post("/v1/chat/completions", json={**slow, "model": "b"}))
        await eventually(lambda: p.state.totals.held("team") == 2, 10.0)
        # Each model's own gate would take it (max_concurrency 4 per model); the total of 2 does not.
        refused = await c.post("/v1/chat/completions", json={**CHAT, "model": "a"})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert "at its total of 2 slots across all models" in refused.json()["error"]["message"]
        # Another tenant, without a total, is not touched by team's.
        assert (await o.post("/v1/chat/completions", json={**CHAT, "model": "a"})).status_code == 200
        assert [(await t).status_code for t in (first, second)] == [200, 200]
        assert p.state.totals.held("team") == 0
        assert (await c.post("/v1/chat/completions", json={**CHAT, "model": "b"})).status_code == 200
        async with p.client("admin") as admin:
            text = (await admin.get("/metrics")).text
        assert 'reason="tenant_total"' in text and 'tenant="team"' in text


async def test_without_a_total_a_tenant_holds_its_limit_on_each_model(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(tenants=tenants(None)) as p, p.client() as c:
        two_lanes(p)
        slow = {**CHAT, "fake_delay_ms": 300}
        answers = await asyncio.gather(
            *(c.post("/v1/chat/completions", json={**slow, "model": m}) for m in ("a", "a", "b", "b"))
        )
        assert [r.status_code for r in answers] == [200] * 4


async def test_a_client_that_leaves_while_its_model_loads_ends_its_wait(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(tenants=tenants(None)) as p:
        cold = ColdSource(StaticSource(p.source.snapshot()))
        router = two_lanes(p, cold)
        lane = router.lanes["b"]
        body = json.dumps({**CHAT, "model": "b"}).encode()
        async with p.client() as c:
            leaving = asyncio.create_task(c.post("/v1/chat/completions", content=body))
            await eventually(lambda: cold.waiting == 1, 10.0)
            assert lane.busy  # an idle unload must not pick a lane a request is loading
            leaving.cancel()  # the client closes its connection mid-wait
            with pytest.raises(asyncio.CancelledError):
                await leaving
        # The request's wait ends: the lane is no longer busy, so the model can be unloaded when idle.
        await eventually(lambda: cold.waiting == 0 and not lane.busy, 10.0)
        cold.loaded.set()
        async with p.client() as c:
            answer = await c.post("/v1/chat/completions", content=body)
        assert answer.status_code == 200, answer.text


def test_held_counts_are_given_back_on_every_path() -> None:
    from proxy.admission.totals import TenantTotals
    from proxy.errors import Rejected

    totals = TenantTotals()
    team = TenantSettings("team", max_concurrency_total=3)
    with totals.hold(team, 2):
        with pytest.raises(Rejected) as refused, totals.hold(team, 2):
            pass
        assert refused.value.reason == "tenant_total" and totals.held("team") == 2
        with pytest.raises(RuntimeError), totals.hold(team, 1):
            assert totals.held("team") == 3
            raise RuntimeError("the request failed")
        assert totals.held("team") == 2
    assert totals.held("team") == 0
    unlimited = TenantSettings("free")
    with totals.hold(unlimited, 100):
        assert totals.held("free") == 100
    assert totals.held("free") == 0


def test_a_request_wider_than_the_tenants_total_is_a_400_not_a_429_to_retry() -> None:
    from proxy.admission import cost as limits
    from proxy.errors import BadRequest

    team = TenantSettings("team", max_concurrency=4, max_n=4, max_concurrency_total=2)
    payload = {**CHAT, "n": 3}
    with pytest.raises(BadRequest, match=r"would occupy 3 slots at once .* this tenant may hold 2"):
        limits.size("chat", payload, team, capacity=4)
    assert limits.size("chat", {**CHAT, "n": 2}, team, capacity=4).slots == 2
