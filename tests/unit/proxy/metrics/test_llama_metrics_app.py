"""The whole ``/metrics`` exposition as the proxy app serves it: proxy series, llama-server's relabeled
series and the status gauges; on the main listener (admin keys) and on the loopback listener app.

llama-server is an ``httpx.MockTransport`` answering with the captured exposition; the real child is in
tests/integration/test_prometheus.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.auth import new_key
from proxy.metrics.listener import create_metrics_app
from proxy.metrics.llama import ModelsLlamaMetrics
from proxy.models.lane import ModelEntry
from proxy.settings import ProxySettings, TenantSettings
from proxy.source import UpstreamSnapshot
from tests.helpers.exposition import CAPTURED
from tests.helpers.exposition import SNAPSHOT as READY
from tests.helpers.promtool import check_metrics

ADMIN_KEY, ADMIN = new_key("ops", frozenset({"admin"}))
USER_KEY, USER = new_key("default", frozenset({"inference"}))


class Source:
    def __init__(self) -> None:
        self.snap = READY

    def snapshot(self) -> UpstreamSnapshot:
        return self.snap

    def identity(self) -> dict[str, object]:
        return {}


def llama_server(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/metrics":
        return httpx.Response(200, text=CAPTURED)
    if request.url.path == "/v1/models":
        return httpx.Response(
            200, json={"object": "list", "data": [{"id": "gemma-3-270m", "object": "model"}]}
        )
    return httpx.Response(404)


@pytest.fixture
async def served() -> AsyncIterator[tuple[httpx.AsyncClient, Source, httpx.AsyncClient]]:
    source = Source()
    settings = ProxySettings(tenants=(TenantSettings("default"), TenantSettings("ops")), keys=(ADMIN, USER))
    llama = ModelsLlamaMetrics.single(
        source.snapshot, "gate-1:8080", transport=httpx.MockTransport(llama_server)
    )
    app = create_app(settings, source, [ModelEntry("gemma-3-270m", (), source)], extra_collectors=[llama])
    loopback = create_metrics_app(app.state.proxy.metrics)
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gate") as main,
        httpx.AsyncClient(transport=httpx.ASGITransport(loopback), base_url="http://gate") as local,
    ):
        try:
            yield main, source, local
        finally:
            await llama.aclose()
            await app.state.proxy.aclose()


def names(text: str) -> dict[str, float]:
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.needs_tool("promtool")
async def test_admin_metrics_serve_proxy_and_relabeled_llama_series(served) -> None:  # type: ignore[no-untyped-def]
    main, _, _ = served
    await main.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    response = await main.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert 'llamacpp_tokens_predicted_total{instance="gate-1:8080",model="gemma-3-270m"} 32.0' in text
    assert 'llamagate_upstream_scrape_ok{model="gemma-3-270m"} 1.0' in text
    assert 'llamagate_requests_total{model="-",route="/metrics",status="200",tenant="ops"} 1.0' in text
    result = check_metrics(response.content)
    assert result.returncode == 0, result.stdout + result.stderr


async def test_inference_keys_and_anonymous_callers_get_no_metrics(served) -> None:  # type: ignore[no-untyped-def]
    main, _, _ = served
    assert (await main.get("/metrics", headers={"authorization": f"Bearer {USER_KEY}"})).status_code == 403
    assert (await main.get("/metrics")).status_code == 401


@pytest.mark.needs_tool("promtool")
async def test_child_down_still_answers_200_without_the_upstream_part(served) -> None:  # type: ignore[no-untyped-def]
    main, source, local = served
    source.snap = replace(READY, state="BACKOFF", ready=False, base_url=None, secret=None, generation=2)
    for client, headers in ((main, {"authorization": f"Bearer {ADMIN_KEY}"}), (local, {})):
        response = await client.get("/metrics", headers=headers)
        assert response.status_code == 200
        assert 'llamagate_upstream_scrape_ok{model="gemma-3-270m"} 0.0' in response.text
        assert not [name for name in names(response.text) if name.startswith("llamacpp_")]
        assert "# TYPE llamagate_requests_total counter" in response.text
        assert check_metrics(response.content).returncode == 0


async def test_loopback_listener_serves_the_same_registry_without_auth(served) -> None:  # type: ignore[no-untyped-def]
    _, _, local = served
    response = await local.get("/metrics")
    assert response.status_code == 200
    assert 'llamacpp_requests_deferred{instance="gate-1:8080",model="gemma-3-270m"} 0.0' in response.text
    assert "llamagate_in_flight_requests" in response.text
    # it serves /metrics and nothing else
    assert (await local.get("/v1/models")).status_code == 404
    assert (await local.post("/metrics")).status_code == 405
