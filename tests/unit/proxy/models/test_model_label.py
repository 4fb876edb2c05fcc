"""The proxy's series carry the served model as ``model``: one model's daemon its alias, a several-model
daemon each lane's name (and each lane's own admission gate); ``-`` for a request that reached no model.
A client's raw ``model`` string never becomes a label value (it would make the series unbounded)."""

from __future__ import annotations

import re

from proxy.models.lane import ModelEntry
from tests.fakes.fake_upstream import FakeLlama, StaticSource, snapshot_for
from tests.helpers.exposition import sample
from tests.unit.proxy.conftest import SECRET, Proxy, ProxyFactory

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def exposition(p: Proxy) -> str:
    async with p.client("admin") as c:
        r = await c.get("/metrics")
        assert r.status_code == 200
        return r.text


def label_values(text: str, name: str, label: str) -> set[str]:
    return set(re.findall(rf'^{re.escape(name)}\{{[^}}]*\b{label}="([^"]*)"', text, re.M))


async def test_one_model_labels_its_series_with_the_served_alias(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p:
        async with p.client() as c:
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        async with p.client(None) as c:
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 401
        text = await exposition(p)
        route = "/v1/chat/completions"
        ok = {"tenant": "team", "model": "gemma-3-270m", "route": route, "status": "200"}
        assert sample(text, "llamagate_requests_total", **ok) == 1
        # Authentication failed before any model was reached.
        assert sample(text, "llamagate_requests_total", tenant="-", model="-", route=route, status="401") == 1
        assert sample(text, "llamagate_output_tokens_total", tenant="team", model="gemma-3-270m") == 4
        labels = {"tenant": "team", "model": "gemma-3-270m"}
        assert sample(text, "llamagate_request_duration_seconds_count", **labels) == 1
        assert sample(text, "llamagate_queue_wait_seconds_count", **labels) == 1
        assert sample(text, "llamagate_slots", model="gemma-3-270m") == 4
        assert sample(text, "llamagate_lingering_slots", model="gemma-3-270m") == 0
        assert sample(text, "llamagate_in_flight_requests", model="gemma-3-270m", tenant="team") == 0


async def test_several_models_label_by_lane_and_read_every_lanes_gate(proxy_factory: ProxyFactory) -> None:
    fake = FakeLlama(secret=SECRET, tokens=40, token_interval_s=0.1)
    async with proxy_factory(fake=fake) as p:

        def lane(name: str, slots: int, residency: str = "always") -> ModelEntry:
            snap = snapshot_for(fake.base_url, SECRET, model_alias=name, slots=slots)
            return ModelEntry(name, (), StaticSource(snap), residency)

        p.serve_models(lane("chat", 3), lane("embed", 2, "on_demand"))
        async with p.client() as c:
            for name in ("chat", "embed"):
                r = await c.post("/v1/chat/completions", json={**CHAT, "model": name})
                assert r.status_code == 200
            r = await c.post("/v1/chat/completions", json={**CHAT, "model": "no-such-model"})
            assert r.status_code == 404
            # A stream to one model holds one of its slots: the gauge shows it on that model only.
            body = {**CHAT, "model": "chat", "stream": True, "max_tokens": 40}
            async with c.stream("POST", "/v1/chat/completions", json=body) as s:
                assert s.status_code == 200
                lines = s.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                text = await exposition(p)
                assert sample(text, "llamagate_in_flight_requests", model="chat", tenant="team") == 1
                assert sample(text, "llamagate_in_flight_requests", model="embed", tenant="team") == 0
        text = await exposition(p)
        route = "/v1/chat/completions"
        for name, answered in (("chat", 2), ("embed", 1)):  # chat: the stream too
            ok = {"tenant": "team", "model": name, "route": route, "status": "200"}
            assert sample(text, "llamagate_requests_total", **ok) == answered
            assert sample(text, "llamagate_queue_wait_seconds_count", tenant="team", model=name) is not None
        assert (
            sample(text, "llamagate_requests_total", tenant="team", model="-", route=route, status="404") == 1
        )
        # Each lane's own gate, sized by its child; the door's own gate (unused) is not shown.
        assert sample(text, "llamagate_slots", model="chat") == 3
        assert sample(text, "llamagate_slots", model="embed") == 2
        assert label_values(text, "llamagate_slots", "model") == {"chat", "embed"}
        assert sample(text, "llamagate_lingering_slots", model="embed") == 0
        # Only served names: the client's string is not a label value anywhere.
        assert "no-such-model" not in text
        # A lane removed (SIGHUP) is gone from the gauges at the next scrape.
        p.state.router.remove("embed")
        text = p.state.metrics.render().decode()
        assert label_values(text, "llamagate_slots", "model") == {"chat"}
