"""The soak's accounting with fakes: the ledger and its targets, and one client call of each kind against
a fake server (``httpx.MockTransport``)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from supervisor.bench.client import Target
from supervisor.bench.soak import (
    CHAOS,
    KINDS,
    SoakSpec,
    chaos_plan,
    one_call,
    parse_gauges,
    parse_replays,
    pick_kind,
    soak_config,
)
from supervisor.bench.soak_ledger import (
    Ledger,
    ResourceSample,
    SlotSample,
    evaluate,
    report,
    rss_drift,
    summary_text,
)

TARGET = Target("http://soak.test", "sk-test")
SPEC = SoakSpec(base_config={}, request_timeout_s=5.0, drop_after_s=0.2)
BODY = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}


def _ledger_with(endings: list[tuple[str, str, int | None, str | None]]) -> Ledger:
    ledger = Ledger()
    for kind, ending, status, reason in endings:
        ledger.finish(ledger.start(), kind, ending, status=status, reason=reason)  # type: ignore[arg-type]
    return ledger


def _targets(ledger: Ledger, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "gauges_at_end": {"llamagate_in_flight_requests": 0.0, "llamagate_queued_requests": 0.0},
        "fds_start": 10,
        "fds_end": 10,
        "load_end_t": 100.0,
        "rss_window_s": 60.0,
    }
    args.update(kw)
    return {t.name: t for t in evaluate(ledger, **args)}


def _steady(ledger: Ledger, rss: Callable[[int], int] = lambda i: 1000) -> Ledger:
    for i in range(10):
        ledger.resource(ResourceSample(50.0 + i * 5, rss(i), 10))
        ledger.slots(SlotSample(50.0 + i, 1, 1, 2))
    return ledger


def test_every_ending_is_counted_and_all_targets_met_on_a_clean_run() -> None:
    ledger = _steady(
        _ledger_with(
            [
                ("stream", "completed", 200, None),
                ("plain", "refused", 429, "HTTP 429"),
                ("plain", "refused", 503, "HTTP 503"),
                ("drop_stream", "abandoned", 200, None),
                ("stream", "failed", 502, "HTTP 502"),
            ]
        )
    )
    targets = _targets(ledger)
    assert all(t.met for t in targets.values()), targets
    result = report(ledger, list(targets.values()))
    assert result["requests"]["endings"] == {"completed": 1, "refused": 2, "abandoned": 1, "failed": 1}
    assert result["requests"]["refused_by_status"] == {"429": 1, "503": 1}
    assert result["requests"]["failed_by_reason"] == {"HTTP 502": 1}
    assert result["all_met"] is True
    assert "all targets met" in summary_text(result)


def test_a_request_never_finished_is_lost_and_fails_the_accounting() -> None:
    ledger = _steady(_ledger_with([("stream", "completed", 200, None)]))
    ledger.start()  # started, never finished
    targets = _targets(ledger)
    assert ledger.lost == 1
    assert not targets["every request accounted for"].met
    result = report(ledger, list(targets.values()))
    assert result["all_met"] is False
    assert "targets NOT met" in summary_text(result)


def test_finishing_twice_is_a_runner_bug() -> None:
    ledger = Ledger()
    ticket = ledger.start()
    ledger.finish(ticket, "plain", "completed")
    with pytest.raises(ValueError, match="finished twice"):
        ledger.finish(ticket, "plain", "completed")


def test_a_hung_call_fails_its_target() -> None:
    ledger = _steady(_ledger_with([("plain", "hung", None, "no end within 5 s")]))
    targets = _targets(ledger)
    assert not targets["no request hung"].met
    assert targets["every request accounted for"].met  # hung is accounted, but a failure of its own


def test_gauges_not_zero_or_never_read_fail() -> None:
    ledger = _steady(_ledger_with([("plain", "completed", 200, None)]))
    assert not _targets(ledger, gauges_at_end={"llamagate_in_flight_requests": 1.0})["gauges back to 0"].met
    assert not _targets(ledger, gauges_at_end=None)["gauges back to 0"].met


def test_busy_slots_above_every_permit_reading_fail_but_a_permit_seen_on_either_side_passes() -> None:
    ledger = _steady(_ledger_with([("plain", "completed", 200, None)]))
    ledger.slots(SlotSample(70.0, 2, 1, 2))  # a permit taken between the reads: fine
    assert _targets(ledger)["/slots busy never above permits"].met
    ledger.slots(SlotSample(71.0, 2, 1, 1))  # the child busier than the gate allowed
    target = _targets(ledger)["/slots busy never above permits"]
    assert not target.met
    assert target.value["over"] == 1 and target.value["worst"] == 1


def test_rss_drift_is_judged_over_the_last_window_only() -> None:
    samples = [ResourceSample(float(t), 1000 if t < 40 else 2000, 10) for t in range(0, 100, 5)]
    # Growth before the window does not count; within it the RSS is flat.
    assert rss_drift(samples, end_t=100.0, window_s=55.0) == 0.0
    growing = [ResourceSample(float(t), 1000 + t * 10, 10) for t in range(0, 100, 5)]
    drift = rss_drift(growing, end_t=100.0, window_s=60.0)
    assert drift is not None and drift > 0.05
    ledger = _steady(_ledger_with([("plain", "completed", 200, None)]), rss=lambda i: 1000 + 100 * i)
    assert not _targets(ledger)["daemon RSS drift over the last 1 min"].met
    assert rss_drift(samples[:3], end_t=100.0) is None  # too few samples: not judged as met


def test_descriptors_above_the_start_count_fail() -> None:
    ledger = _steady(_ledger_with([("plain", "completed", 200, None)]))
    assert not _targets(ledger, fds_end=12)["file descriptors back to the start count"].met
    assert not _targets(ledger, fds_end=None)["file descriptors back to the start count"].met


def test_gauges_are_summed_over_tenants_from_the_exposition() -> None:
    text = (
        "# TYPE llamagate_in_flight_requests gauge\n"
        'llamagate_in_flight_requests{tenant="alpha"} 1\n'
        'llamagate_in_flight_requests{tenant="beta"} 2\n'
        "# TYPE llamagate_lingering_slots gauge\n"
        "llamagate_lingering_slots 1\n"
    )
    assert parse_gauges(text) == {
        "llamagate_in_flight_requests": 3.0,
        "llamagate_queued_requests": 0.0,
        "llamagate_lingering_slots": 1.0,
    }


def test_config_has_three_tenants_an_admin_key_and_no_plaintext_key() -> None:
    config, admin, keys = soak_config({"llama": {"slots": 2}})
    assert [t["name"] for t in config["tenants"]] == ["alpha", "beta", "gamma", "ops"]
    assert set(keys) == {"alpha", "beta", "gamma"}
    text = json.dumps(config)
    assert admin not in text and not any(k in text for k in keys.values())
    assert config["llama"] == {"slots": 2}


def test_chaos_falls_in_the_first_half_and_the_mix_uses_every_kind() -> None:
    plan = chaos_plan(600.0)
    assert [a for _, a in plan] == [a for a, _ in CHAOS]
    assert all(at < 300.0 for at, _ in plan)
    rng = random.Random(1)
    assert {pick_kind(rng) for _ in range(500)} == {k for k, _ in KINDS}


# --- one call against a fake server ---------------------------------------------------------------------
def _sse(*events: Any, done: bool = True) -> bytes:
    out = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}


async def _call(kind: str, handler: Callable[[httpx.Request], Any], spec: SoakSpec = SPEC) -> tuple[Any, ...]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        return await one_call(client, TARGET, kind, BODY, spec)


async def test_a_whole_stream_is_completed() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=_sse(CHUNK, CHUNK))

    assert await _call("stream", handler) == ("completed", 200, None)
    assert seen[0]["stream"] is True


async def test_a_stream_cut_by_an_error_event_or_without_done_fails() -> None:
    def error(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(CHUNK, {"error": {"message": "boom"}}, done=False))

    def short(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(CHUNK, done=False))

    assert await _call("stream", error) == ("failed", 200, "error event mid-stream")
    assert await _call("stream", short) == ("failed", 200, "stream ended without [DONE]")


async def test_a_dropping_stream_client_leaves_after_the_first_token() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(CHUNK, CHUNK))

    assert await _call("drop_stream", handler) == ("abandoned", 200, None)


async def test_statuses_are_refusals_or_failures() -> None:
    def status(code: int) -> Callable[[httpx.Request], httpx.Response]:
        return lambda request: httpx.Response(code, json={"error": {"message": "no"}})

    assert await _call("plain", status(429)) == ("refused", 429, "HTTP 429")
    assert await _call("stream", status(503)) == ("refused", 503, "HTTP 503")
    assert await _call("plain", status(502)) == ("failed", 502, "HTTP 502")


async def test_a_plain_answer_is_completed_and_one_without_choices_fails() -> None:
    def good(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is False
        return httpx.Response(200, json={"choices": [{"message": {"content": "hi"}}]})

    assert await _call("plain", good) == ("completed", 200, None)
    assert await _call("plain", lambda r: httpx.Response(200, json={})) == (
        "failed",
        200,
        "answer without choices",
    )


async def test_a_connection_error_is_a_failure_with_its_type() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    assert await _call("plain", handler) == ("failed", None, "ConnectError")


async def test_a_call_past_its_deadline_is_hung_and_a_slow_drop_is_abandoned() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200, json={"choices": [{}]})

    quick = SoakSpec(base_config={}, request_timeout_s=0.3, drop_after_s=0.1)
    ending, status, reason = await _call("plain", slow, quick)
    assert (ending, status) == ("hung", None) and "0.3 s" in str(reason)
    assert await _call("drop_plain", slow, quick) == ("abandoned", None, None)


def test_replays_are_read_by_reason_and_shown_in_the_summary() -> None:
    text = (
        "# TYPE llamagate_replays_total counter\n"
        'llamagate_replays_total{model="a",reason="closed"} 3\n'
        'llamagate_replays_total{model="b",reason="closed"} 1\n'
        'llamagate_replays_created{model="a",reason="closed"} 1.7e9\n'
        'llamagate_replays_total{model="a",reason="refused"} 1\n'
    )
    assert parse_replays(text) == {"closed": 4.0, "refused": 1.0}
    assert parse_replays("") == {}
    ledger = _steady(_ledger_with([("plain", "completed", 200, None), ("stream", "failed", 502, "HTTP 502")]))
    result = report(ledger, list(_targets(ledger).values()))
    result["replays"] = {"closed": 4.0}
    text = summary_text(result)
    assert "replays (llamagate_replays_total): closed 4" in text
    assert "plain: completed 1" in text and "stream: failed 1" in text


def test_a_failed_non_streamed_call_fails_its_target_and_a_failed_stream_does_not() -> None:
    streams = _steady(_ledger_with([("stream", "failed", 200, "error event mid-stream")]))
    assert _targets(streams)["no non-streamed request failed"].met
    for kind in ("plain", "drop_plain"):
        ledger = _steady(
            _ledger_with([(kind, "failed", 502, "HTTP 502"), (kind, "refused", 503, "HTTP 503")])
        )
        target = _targets(ledger)["no non-streamed request failed"]
        assert not target.met and target.value == 1
