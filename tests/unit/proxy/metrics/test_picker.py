"""The picker gauges (``proxy.metrics.picker``) and the metrics listener's allow list, with a fake
``/slots`` and an ASGI client; the real child and a real non-loopback bind are in
tests/integration/test_picker_gauges_e2e.py."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.admission.gate import SlotGate
from proxy.metrics.listener import allowed, create_metrics_app, networks
from proxy.metrics.picker import PickerGauges, parse_slots
from proxy.metrics.proxy import ProxyMetrics
from proxy.settings import TenantSettings
from proxy.source import UpstreamSnapshot
from supervisor.config.load import ConfigError, parse_config
from tests.helpers.exposition import SNAPSHOT

# What the pinned llama-server's /slots answered with one of two slots decoding (captured).
SLOTS = [
    {"id": 0, "n_ctx": 2048, "speculative": False, "is_processing": False},
    {
        "id": 1,
        "n_ctx": 2048,
        "speculative": False,
        "is_processing": True,
        "id_task": 0,
        "n_prompt_tokens": 26,
        "n_prompt_tokens_processed": 8,
        "n_prompt_tokens_cache": 0,
        "next_token": [{"has_next_token": True, "has_new_line": True, "n_remain": 1982, "n_decoded": 18}],
    },
]


def test_a_busy_slot_counts_its_tokens_and_an_idle_one_counts_as_free() -> None:
    reading = parse_slots(json.dumps(SLOTS).encode())
    assert reading is not None
    assert (reading.slots, reading.busy, reading.tokens_used, reading.tokens_total) == (2, 1, 26, 4096)
    assert reading.usage_ratio == pytest.approx(26 / 4096)


@pytest.mark.parametrize("body", [b"not json", b'{"slots": []}', b"[1, 2]"])
def test_an_answer_that_is_not_a_list_of_slots_is_no_reading(body: bytes) -> None:
    assert parse_slots(body) is None


class FakeResponse:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self._body = body

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        pass


class FakePool:
    """The upstream pool's ``open``, answering ``/slots`` per child base URL and counting the reads."""

    def __init__(self, answers: Mapping[str, list[dict[str, Any]]]) -> None:
        self.answers = answers
        self.reads: list[str] = []

    async def open(self, snap: UpstreamSnapshot, method: str, path: str, body: bytes | None, rid: str) -> Any:
        assert (method, path) == ("GET", "/slots")
        self.reads.append(str(snap.base_url))
        return FakeResponse(200, json.dumps(self.answers[str(snap.base_url)]).encode())


def _samples(gauges: PickerGauges) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in gauges.collect() for s in family.samples]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_one_series_per_model_per_metric_and_slots_read_at_most_once_per_ttl() -> None:
    a = dataclasses.replace(SNAPSHOT, base_url="http://127.0.0.1:1")
    b = dataclasses.replace(SNAPSHOT, base_url="http://127.0.0.1:2", model_alias="other")
    pool = FakePool({"http://127.0.0.1:1": SLOTS, "http://127.0.0.1:2": SLOTS[:1]})
    gate_a = SlotGate([TenantSettings("x"), TenantSettings("y")], capacity=2)
    gate_b = SlotGate([TenantSettings("x")], capacity=1)
    permits = [await gate_a.acquire("x"), await gate_a.acquire("y")]
    clock = Clock()
    gauges = PickerGauges(
        lambda: {"m1": (gate_a, lambda: a), "m2": (gate_b, lambda: b)},
        pool,  # type: ignore[arg-type]
        ttl_s=0.2,
        clock=clock,
    )
    await gauges.refresh()
    await gauges.refresh()  # within the TTL: from memory
    assert pool.reads == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    clock.now += 0.25
    await gauges.refresh()
    assert len(pool.reads) == 4

    samples = _samples(gauges)
    by_metric: dict[str, list[str]] = {}
    for name, labels, _ in samples:
        assert set(labels) == {"model"}, (name, labels)  # no tenant label
        by_metric.setdefault(name, []).append(labels["model"])
    assert len(by_metric) == 7
    assert all(sorted(models) == ["m1", "m2"] for models in by_metric.values()), by_metric
    values = {(n, lab["model"]): v for n, lab, v in samples}
    assert values[("llamagate_model_running_requests", "m1")] == 2  # two tenants, summed
    assert values[("llamagate_model_queued_requests", "m1")] == 0
    assert values[("llamagate_model_busy_slots", "m1")] == 1
    assert values[("llamagate_model_slots", "m2")] == 1
    assert values[("llamagate_model_context_used_tokens", "m1")] == 26
    assert values[("llamagate_model_context_capacity_tokens", "m1")] == 4096
    assert values[("llamagate_model_kv_cache_usage_ratio", "m2")] == 0
    for permit in permits:
        permit.release()


async def test_a_child_not_ready_shows_no_slots_and_is_not_read() -> None:
    down = dataclasses.replace(SNAPSHOT, base_url=None, ready=False, state="BACKOFF")
    pool = FakePool({})
    gauges = PickerGauges(lambda: {"m": (SlotGate([], capacity=0), lambda: down)}, pool)  # type: ignore[arg-type]
    await gauges.refresh()
    assert pool.reads == []
    values = {n: v for n, _, v in _samples(gauges)}
    assert values["llamagate_model_slots"] == 0 and values["llamagate_model_context_capacity_tokens"] == 0


@pytest.mark.parametrize(
    ("peer", "allow", "ok"),
    [
        ("127.0.0.1", ["127.0.0.0/8"], True),
        ("192.0.2.7", ["127.0.0.0/8", "::1/128"], False),
        ("192.0.2.7", ["192.0.2.0/24"], True),
        ("::ffff:192.0.2.7", ["192.0.2.0/24"], True),  # a dual-stack socket's IPv4 peer
        ("fe80::1%eth0", ["fe80::/10"], True),
        ("10.0.0.1", ["10.0.0.2"], False),  # a bare address is a network of one
        (None, ["0.0.0.0/0"], False),
        ("not-an-address", ["0.0.0.0/0"], False),
    ],
)
def test_allow_list_matches_the_peer(peer: str | None, allow: list[str], ok: bool) -> None:
    assert allowed(peer, networks(allow)) is ok


async def test_a_peer_outside_the_allow_list_gets_403_before_any_route() -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    app = create_metrics_app(metrics, ["10.1.0.0/16"])
    inside = httpx.ASGITransport(app, client=("10.1.2.3", 4000))  # type: ignore[arg-type]
    outside = httpx.ASGITransport(app, client=("10.2.0.1", 4000))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=inside, base_url="http://m") as c:
        assert (await c.get("/metrics")).status_code == 200
    async with httpx.AsyncClient(transport=outside, base_url="http://m") as c:
        for path in ("/metrics", "/nothing"):
            response = await c.get(path)
            assert response.status_code == 403
            assert "proxy.metrics_listener.allow" in response.text


@pytest.mark.parametrize(
    ("listener", "problem"),
    [
        ("{port: 9464, allow: []}", "proxy.metrics_listener.allow: must name at least one peer"),
        ("{port: 9464, allow: [10.0.0.0/33]}", "'10.0.0.0/33' is not an IP address or network (CIDR)"),
    ],
)
def test_a_bad_allow_list_is_named_by_path(listener: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(f"proxy: {{metrics_listener: {listener}}}\n", env={})
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_a_non_loopback_bind_is_accepted_and_loopback_is_the_default_allow_list() -> None:
    cfg = parse_config("proxy: {metrics_listener: {host: 0.0.0.0, allow: [10.244.0.0/16]}}\n", env={})
    assert cfg.proxy.metrics_listener is not None
    assert cfg.proxy.metrics_listener.allow == ("10.244.0.0/16",)
    default = parse_config("proxy: {metrics_listener: {port: 9464}}\n", env={})
    assert default.proxy.metrics_listener is not None
    assert default.proxy.metrics_listener.allow == ("127.0.0.0/8", "::1/128")
