"""``GET /admin/history``: admin only, one row per 10 s bucket per served model, fed by real requests
through the proxy (the fake llama-server behind a real uvicorn port)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from tests.fakes.fake_upstream import eventually
from tests.unit.proxy.conftest import ProxyFactory

FIELDS = {"t", "requests", "tokens", "ttft_p50_s", "ttft_p95_s", "tpot_s", "queued", "running"}


def total(rows: list[dict[str, Any]], field: str) -> int:
    return sum(int(r[field]) for r in rows)


async def test_only_admin_keys_read_the_history(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client("user") as user, p.client(None) as anonymous:
        assert (await user.get("/admin/history")).status_code == 403
        assert (await anonymous.get("/admin/history")).status_code == 401


async def test_the_history_holds_the_generation_requests_their_tokens_times_and_the_gate(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory() as p, p.client("admin") as admin, p.client("user") as user:
        (name,) = p.state.router.lanes
        body = (await admin.get("/admin/history")).json()
        assert body["bucket_s"] == 10 and set(body["models"]) == {name}
        assert total(body["models"][name], "requests") == 0

        chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        for _ in range(2):
            r = await user.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200
        assert (await user.post("/tokenize", json={"content": "hi"})).status_code == 200  # not generation
        answered = (await admin.get("/admin/load")).json()["answered"]
        body = (await admin.get("/admin/history")).json()
        rows = body["models"][name]
        assert rows and all(set(r) == FIELDS for r in rows)
        assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)
        assert all(b["t"] - a["t"] == 10 for a, b in itertools.pairwise(rows))
        assert rows[-1]["t"] <= body["now"] < rows[-1]["t"] + 10
        assert total(rows, "requests") == answered["requests"] == 2
        assert total(rows, "tokens") == answered["output_tokens"] > 0
        timed = [r for r in rows if r["requests"]]
        assert all(r["ttft_p50_s"] > 0 and r["ttft_p95_s"] >= r["ttft_p50_s"] for r in timed), timed
        assert all(r["tpot_s"] is not None and r["tpot_s"] >= 0 for r in timed), timed

        # A request holding its slot shows in the newest bucket's "running" (each read samples the gate).
        slow = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "fake_delay_ms": 60000}
        task = asyncio.create_task(user.post("/v1/chat/completions", json=slow))
        try:
            await eventually(lambda: p.state.in_flight == 1, 10.0)
            rows = (await admin.get("/admin/history")).json()["models"][name]
            assert rows[-1]["running"] == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_the_app_samples_the_gates_by_itself(proxy_factory: ProxyFactory) -> None:
    """The lifespan's timer: a request queued and running between two reads shows without a read."""
    async with proxy_factory() as p, p.client("user") as user:
        (name,) = p.state.router.lanes
        history = p.state.metrics.history
        slow = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "fake_delay_ms": 60000}
        task = asyncio.create_task(user.post("/v1/chat/completions", json=slow))
        try:
            await eventually(lambda: p.state.in_flight == 1, 10.0)

            def running() -> bool:
                models = history.report([name])["models"]
                assert isinstance(models, dict)
                return any(r["running"] == 1 for r in models[name])

            await eventually(running, 10.0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
