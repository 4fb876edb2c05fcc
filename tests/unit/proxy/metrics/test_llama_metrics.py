"""Relabeling of llama-server's /metrics and the single cached upstream scrape.

The fixture ``tests/unit/fixtures/llama_server_metrics.txt`` is the verbatim answer of the pinned llama-server
(``--metrics``, gemma-3-270m, ``-np 2 -c 8192``) after two short chat completions.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics.llama import ModelsLlamaMetrics, relabel
from proxy.source import UpstreamSnapshot
from tests.helpers.promtool import check_metrics

CAPTURED = (Path(__file__).resolve().parents[2] / "fixtures" / "llama_server_metrics.txt").read_text()
LABELS = {"model": "gemma-3-270m", "instance": "gate-1:8080"}


def snapshot(*, base_url: str | None = "http://127.0.0.1:9999", generation: int = 1) -> UpstreamSnapshot:
    return UpstreamSnapshot(
        state="READY" if base_url else "BACKOFF",
        ready=base_url is not None,
        reason=None,
        base_url=base_url,
        secret="boot-secret",
        model_alias="gemma-3-270m",
        slots=2,
        ctx_per_slot=4096,
        generation=generation,
        retry_after_s=1.0,
    )


def render(*collectors: ModelsLlamaMetrics) -> bytes:
    registry = CollectorRegistry(auto_describe=True)
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry)


def served(text: bytes | str) -> dict[str, tuple[str, dict[str, str], float]]:
    """sample name -> (family type, labels, value) as a Prometheus client would read it back."""
    out = {}
    raw = text.decode() if isinstance(text, bytes) else text
    for family in text_string_to_metric_families(raw):
        for sample in family.samples:
            out[sample.name] = (family.type, sample.labels, sample.value)
    return out


def relabel_text(text: str) -> bytes:
    families = relabel(text, LABELS)
    registry = CollectorRegistry()
    registry.register(type("C", (), {"collect": lambda self: iter(families)})())
    return generate_latest(registry)


# --- relabeling ------------------------------------------------------------------------------------------
def test_every_upstream_series_is_renamed_and_labelled() -> None:
    upstream = served(CAPTURED)
    ours = served(relabel_text(CAPTURED))

    assert len(upstream) == 15
    for name, (kind, _labels, value) in upstream.items():
        new = name.replace("llamacpp:", "llamacpp_")
        if name == "llamacpp:n_tokens_max_total":  # the parser's invented name, see below
            continue
        assert new in ours, new
        assert ours[new] == (kind, LABELS, value)
    assert not any(":" in name for name in ours)


def test_help_and_type_lines_are_kept() -> None:
    text = relabel_text(CAPTURED).decode()
    assert "# TYPE llamacpp_tokens_predicted_total counter\n" in text
    assert "# HELP llamacpp_tokens_predicted_total Number of generation tokens processed\n" in text
    assert "# TYPE llamacpp_requests_deferred gauge\n" in text
    assert 'llamacpp_tokens_predicted_total{instance="gate-1:8080",model="gemma-3-270m"} 32.0\n' in text


def test_counter_without_total_suffix_becomes_a_gauge_under_its_own_name() -> None:
    # llama-server types n_tokens_max (a high-water mark) as a counter; prometheus-client's parser would
    # call it n_tokens_max_total, and promtool rejects a counter without the suffix.
    ours = served(relabel_text(CAPTURED))
    assert ours["llamacpp_n_tokens_max"] == ("gauge", LABELS, 44.0)
    assert "llamacpp_n_tokens_max_total" not in ours


def test_labels_and_other_colons_are_handled() -> None:
    text = (
        "# HELP llamacpp:slot_busy Busy by slot\n# TYPE llamacpp:slot_busy gauge\n"
        'llamacpp:slot_busy{slot="0",model="upstream"} 1\n'
        "# HELP other:thing x\n# TYPE other:thing gauge\nother:thing 2\n"
    )
    ours = served(relabel_text(text))
    # Our model label wins: it is the served alias, which is what callers ask for.
    assert ours["llamacpp_slot_busy"] == ("gauge", {"slot": "0", **LABELS}, 1.0)
    assert ours["other_thing"][2] == 2.0


def test_not_the_text_format_is_an_error() -> None:
    with pytest.raises(ValueError):
        relabel("<html>not metrics</html>\n", LABELS)


@pytest.mark.needs_tool("promtool")
def test_promtool_accepts_the_relabeled_exposition() -> None:
    result = check_metrics(relabel_text(CAPTURED))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.needs_tool("promtool")
def test_promtool_rejects_the_raw_upstream_names() -> None:
    # Guards the test above: promtool does lint what we feed it.
    raw = CAPTURED.replace("llamacpp:", "llamacpp_")
    result = check_metrics(raw.encode())
    assert result.returncode != 0
    assert "n_tokens_max" in result.stdout + result.stderr


# --- the cached, single-flight upstream scrape -----------------------------------------------------------
class Upstream:
    """llama-server's /metrics as a MockTransport handler that counts and can be held."""

    def __init__(self) -> None:
        self.calls: list[httpx.Request] = []
        self.status = 200
        self.body = CAPTURED
        self.release: asyncio.Event | None = None
        self.error: Exception | None = None
        self.called = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request)
        self.called.set()
        if self.release is not None:
            await self.release.wait()
        if self.error is not None:
            raise self.error
        return httpx.Response(self.status, text=self.body)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def upstream() -> Upstream:
    return Upstream()


@pytest.fixture
def clock() -> Clock:
    return Clock()


async def make(upstream: Upstream, clock: Clock, snap: list[UpstreamSnapshot]) -> ModelsLlamaMetrics:
    return ModelsLlamaMetrics.single(
        lambda: snap[0], "gate-1:8080", ttl_s=1.0, transport=httpx.MockTransport(upstream), clock=clock
    )


async def test_fetch_sends_the_boot_secret_and_serves_relabeled_series(
    upstream: Upstream, clock: Clock
) -> None:
    collector = await make(upstream, clock, [snapshot()])
    try:
        await collector.refresh()
    finally:
        await collector.aclose()
    assert str(upstream.calls[0].url) == "http://127.0.0.1:9999/metrics"
    assert upstream.calls[0].headers["authorization"] == "Bearer boot-secret"
    ours = served(render(collector))
    assert ours["llamacpp_tokens_predicted_total"] == ("counter", LABELS, 32.0)
    # The fetch's status carries the served alias, as each model's does in a several-model daemon.
    assert ours["llamagate_upstream_scrape_ok"] == ("gauge", {"model": "gemma-3-270m"}, 1.0)


async def test_scrapes_within_the_ttl_share_one_fetch(upstream: Upstream, clock: Clock) -> None:
    collector = await make(upstream, clock, [snapshot()])
    try:
        await collector.refresh()
        clock.now += 0.5
        await collector.refresh()
        assert len(upstream.calls) == 1
        clock.now += 0.6
        await collector.refresh()
        assert len(upstream.calls) == 2
    finally:
        await collector.aclose()


async def test_a_new_child_is_fetched_at_once(upstream: Upstream, clock: Clock) -> None:
    snap = [snapshot(generation=1)]
    collector = await make(upstream, clock, snap)
    try:
        await collector.refresh()
        snap[0] = snapshot(generation=2)
        await collector.refresh()
    finally:
        await collector.aclose()
    assert len(upstream.calls) == 2


async def test_a_dead_child_empties_the_cache_at_once(upstream: Upstream, clock: Clock) -> None:
    # The child exited; the supervisor has not started the next one (same generation, no URL).
    snap = [snapshot(generation=1)]
    collector = await make(upstream, clock, snap)
    try:
        await collector.refresh()
        snap[0] = snapshot(base_url=None, generation=1)
        await collector.refresh()
    finally:
        await collector.aclose()
    ours = served(render(collector))
    assert ours["llamagate_upstream_scrape_ok"][2] == 0.0
    assert "llamacpp_tokens_predicted_total" not in ours


async def test_concurrent_scrapers_share_the_fetch_in_flight(upstream: Upstream, clock: Clock) -> None:
    upstream.release = asyncio.Event()
    collector = await make(upstream, clock, [snapshot()])
    try:
        scrapers = [asyncio.create_task(collector.refresh()) for _ in range(5)]
        await upstream.called.wait()
        # One scraper gives up (Prometheus timeout): the others must still get the answer.
        scrapers[0].cancel()
        upstream.release.set()
        results = await asyncio.gather(*scrapers, return_exceptions=True)
    finally:
        await collector.aclose()
    assert isinstance(results[0], asyncio.CancelledError)
    assert results[1:] == [None] * 4
    assert len(upstream.calls) == 1
    assert served(render(collector))["llamagate_upstream_scrape_ok"][2] == 1.0


@pytest.mark.parametrize(
    "failure",
    ["no_child", "connect_error", "loading_503", "not_metrics"],
)
async def test_child_down_leaves_the_upstream_part_absent(
    upstream: Upstream, clock: Clock, failure: str
) -> None:
    snap = [snapshot(base_url=None) if failure == "no_child" else snapshot()]
    if failure == "connect_error":
        upstream.error = httpx.ConnectError("refused")
    elif failure == "loading_503":
        upstream.status = 503
        upstream.body = '{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'
    elif failure == "not_metrics":
        upstream.body = "<html>oops</html>"
    collector = await make(upstream, clock, snap)
    try:
        await collector.refresh()
        ours = served(render(collector))
        assert ours["llamagate_upstream_scrape_ok"][2] == 0.0
        assert not [name for name in ours if name.startswith("llamacpp_")]
        # and it comes back once the child answers again
        upstream.error, upstream.status, upstream.body = None, 200, CAPTURED
        snap[0] = snapshot(generation=2)
        await collector.refresh()
    finally:
        await collector.aclose()
    ours = served(render(collector))
    assert ours["llamagate_upstream_scrape_ok"][2] == 1.0
    assert "llamacpp_tokens_predicted_total" in ours


async def test_a_hung_child_fails_the_fetch_within_the_timeout() -> None:
    # MockTransport ignores timeouts, so the hang is a real socket that accepts and never answers.
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    snap = snapshot(base_url=f"http://127.0.0.1:{port}")
    collector = ModelsLlamaMetrics.single(lambda: snap, "i", timeout_s=0.2)
    try:
        async with asyncio.timeout(5):
            await collector.refresh()
    finally:
        await collector.aclose()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
    last = collector.last("gemma-3-270m")
    assert last is not None and not last.ok


async def test_a_failing_child_is_logged_once_not_every_scrape(
    upstream: Upstream, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.error = httpx.ConnectError("refused")
    collector = await make(upstream, clock, [snapshot()])
    try:
        with caplog.at_level("INFO", logger="llamagate.metrics"):
            for _ in range(3):
                await collector.refresh()
                clock.now += 1.5
            upstream.error = None
            await collector.refresh()
    finally:
        await collector.aclose()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "llama-server /metrics not read: unreachable (ConnectError)"),
        ("INFO", "llama-server /metrics read again"),
    ]
