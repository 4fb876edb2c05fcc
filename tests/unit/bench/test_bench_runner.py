"""A whole run and a whole sweep against the fake server: records, summary files, envelope, recovery."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fakeserver import FakeServer

from supervisor.bench.client import Target
from supervisor.bench.loadgen import LoadSpec
from supervisor.bench.prompts import load_prompts
from supervisor.bench.records import read_records
from supervisor.bench.runner import RequestOptions, RunSpec, run_async
from supervisor.bench.stats import Gates
from supervisor.bench.sweep import SweepSpec, sweep_async
from supervisor.errors import UsageError

TARGET = Target("http://fake.test")
GATES = Gates(ttft_ms=5000, tpot_ms=1000)


def spec(load: LoadSpec, **opts: object) -> RunSpec:
    return RunSpec(TARGET, load, load_prompts("builtin", 0), RequestOptions(**opts), GATES)  # type: ignore[arg-type]


async def test_run_writes_one_record_per_request(tmp_path: Path) -> None:
    server = FakeServer(slots=2, tokens=5)
    result = await run_async(
        spec(LoadSpec("concurrency", 2, requests=6, warmup=2), max_tokens=5),
        tmp_path / "r",
        None,
        server.transport(),
    )
    records = read_records(tmp_path / "r" / "records.jsonl")
    assert len(records) == len(server.requests) == 8
    assert sorted(r.seq for r in records) == list(range(8))
    assert sum(r.warmup for r in records) == 2
    assert all(r.outcome == "ok" and r.completion_tokens == 5 and r.met_gates for r in records)
    assert all(r.t_submit <= r.t_send <= r.t_first_content <= r.t_end for r in records)  # type: ignore[operator]
    s = result.summary
    assert (s.submitted, s.completed, s.warmup, s.goodput) == (6, 6, 2, 6)
    assert s.verdict.passed
    assert result.model == "fake-model"
    for name in ("run.json", "summary.json", "summary.md"):
        assert (tmp_path / "r" / name).is_file()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["schema"] == "llamagate.bench.summary/1"
    assert summary["submitted"] == 6
    run_meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run_meta["model"] == "fake-model"
    assert run_meta["submitted_including_warmup"] == 8


async def test_request_body_is_streaming_greedy_with_usage(tmp_path: Path) -> None:
    server = FakeServer()
    await run_async(
        spec(
            LoadSpec("concurrency", 1, requests=1),
            max_tokens=9,
            ignore_eos=True,
            extra_body={"cache_prompt": False},
        ),
        tmp_path / "r",
        None,
        server.transport(),
    )
    body = server.requests[0]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0
    assert body["max_tokens"] == 9
    assert body["model"] == "fake-model"
    assert body["ignore_eos"] is True
    assert body["cache_prompt"] is False


async def test_rejected_requests_are_records_too(tmp_path: Path) -> None:
    server = FakeServer(slots=2, tokens=20, gap_s=0.005, reject_over=2)
    started = time.monotonic()
    result = await run_async(
        spec(LoadSpec("concurrency", 4, requests=12)), tmp_path / "r", None, server.transport()
    )
    elapsed = time.monotonic() - started
    records = read_records(tmp_path / "r" / "records.jsonl")
    assert len(records) == len(server.requests) > 12
    rejected = [r for r in records if r.outcome == "rejected"]
    assert len(rejected) == server.rejected > 0
    assert all(r.status == 429 and r.retry_after_s == 1.0 for r in rejected)
    s = result.summary
    # Closed loop: the budget of 12 counts admitted requests; the rejections come on top.
    assert s.completed == 12
    assert s.submitted == s.completed + s.rejected == len(records)
    assert s.verdict.failing == ("rejected",)
    assert s.verdict.admitted_ok
    # Rejected users waited Retry-After (1 s) before going on: without those pauses the 12 requests
    # (0.1 s each, 2 at a time) would be done in well under a second.
    assert elapsed >= 1.0


async def test_unreachable_target_fails_every_request_without_losing_any(tmp_path: Path) -> None:
    import httpx

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    result = await run_async(
        spec(LoadSpec("rate", 500.0, requests=5), model="m"),
        tmp_path / "r",
        None,
        httpx.MockTransport(refuse),
    )
    assert result.summary.failed == result.summary.submitted == 5
    assert not result.summary.verdict.passed


async def test_model_discovery_failure_is_a_usage_error(tmp_path: Path) -> None:
    import httpx

    transport = httpx.MockTransport(lambda r: httpx.Response(401, json={"error": {"message": "bad key"}}))
    with pytest.raises(UsageError, match="HTTP 401"):
        await run_async(spec(LoadSpec("concurrency", 1, requests=1)), tmp_path / "r", None, transport)


async def test_folder_with_a_run_is_not_overwritten(tmp_path: Path) -> None:
    server = FakeServer()
    await run_async(spec(LoadSpec("concurrency", 1, requests=1)), tmp_path / "r", None, server.transport())
    before = (tmp_path / "r" / "records.jsonl").read_text()
    with pytest.raises(UsageError, match="already holds a run"):
        await run_async(
            spec(LoadSpec("concurrency", 1, requests=1)), tmp_path / "r", None, server.transport()
        )
    assert (tmp_path / "r" / "records.jsonl").read_text() == before


async def test_sweep_finds_envelope_and_runs_recovery(tmp_path: Path) -> None:
    # Two slots, requests beyond them wait: TTFT grows with concurrency. A TTFT gate between one token
    # gap (30 ms: c=1 and c=2) and one service time (300 ms: what c=4 waits for a slot) puts the knee
    # between c=2 and c=4, with margins a busy machine's scheduling delays stay inside (a loaded run saw the
    # earlier 10 ms gap against a 60 ms gate fail there).
    server = FakeServer(slots=2, tokens=10, gap_s=0.03)
    gates = Gates(ttft_ms=150, tpot_ms=1000)
    loads = [LoadSpec("concurrency", c, requests=8) for c in (1, 2, 4)]
    sweep_spec = SweepSpec(
        {"fake": TARGET}, loads, load_prompts("builtin", 0), RequestOptions(), gates, pause_s=0
    )
    result = await sweep_async(sweep_spec, tmp_path / "s", None, server.transport())
    (series,) = result.series
    assert [load.label for load, _, _ in series.points] == ["c=1", "c=2", "c=4"]
    env = series.envelope
    assert env is not None
    assert env.highest_passing == "c=2"
    assert env.first_failing == "c=4"
    assert env.failing_checks == ("ttft_p95",)
    assert series.recovery is not None and series.recovery[0].label == "c=2"
    assert (tmp_path / "s" / "fake" / "recovery-c=2" / "records.jsonl").is_file()
    data = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert data["series"]["fake"]["envelope"]["first_failing"] == "c=4"
    assert data["series"]["fake"]["recovery"]["label"] == "c=2"
    md = (tmp_path / "s" / "sweep.md").read_text()
    assert "highest passing load c=2" in md
    assert "c=2 (recovery)" in md
    # 3 points + recovery, 8 requests each (+ no warm-up): the server saw exactly those.
    assert len(server.requests) == 4 * 8


async def test_sweep_compares_two_targets_interleaved(tmp_path: Path) -> None:
    server = FakeServer(slots=2, tokens=3)
    targets = {"a": Target("http://a.test"), "b": Target("http://b.test")}
    loads = [LoadSpec("concurrency", c, requests=4) for c in (1, 2)]
    sweep_spec = SweepSpec(targets, loads, load_prompts("builtin", 0), RequestOptions(), GATES, pause_s=0)
    result = await sweep_async(sweep_spec, tmp_path / "s", None, server.transport())
    assert [s.name for s in result.series] == ["a", "b"]
    assert all(len(s.points) == 2 for s in result.series)
    assert all(s.recovery is None for s in result.series)  # nothing failed: no recovery needed
    first_a = json.loads((tmp_path / "s" / "a" / "00-c=1" / "run.json").read_text())["started_at"]
    first_b = json.loads((tmp_path / "s" / "b" / "00-c=1" / "run.json").read_text())["started_at"]
    second_a = json.loads((tmp_path / "s" / "a" / "01-c=2" / "run.json").read_text())["started_at"]
    assert first_a <= first_b <= second_a
