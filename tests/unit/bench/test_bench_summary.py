"""Run summaries: counts, goodput (including unknown timings), verdict, and how rejections count."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.bench.records import RequestRecord
from supervisor.bench.stats import Gates, gate_flags
from supervisor.bench.summary import summarize

GATES = Gates(ttft_ms=1000, tpot_ms=100)


def rec(
    seq: int, outcome: str = "ok", ttft: float | None = 200.0, tpot: float | None = 50.0, **kw: Any
) -> RequestRecord:
    completed = outcome == "ok"
    met = gate_flags(completed, ttft, tpot, GATES)
    values: dict[str, Any] = {
        "seq": seq,
        "warmup": False,
        "prompt_id": "builtin:0",
        "outcome": outcome,
        "t_submit": float(seq),
        "t_end": float(seq) + 1.0,
        "ttft_ms": ttft if completed else None,
        "tpot_ms": tpot if completed else None,
        "e2e_ms": 1000.0,
        "prompt_tokens": 10 if completed else None,
        "completion_tokens": 20 if completed else None,
        "status": {"ok": 200, "rejected": 429}.get(outcome),
        "met_ttft": met[0],
        "met_tpot": met[1],
        "met_gates": met[2],
    }
    values.update(kw)
    return RequestRecord(**values)


def test_counts_and_goodput() -> None:
    records = [
        rec(0, warmup=True, ttft=5000.0),  # warm-up: recorded, not measured
        rec(1),
        rec(2, ttft=1500.0),  # admitted but slow
        rec(3, outcome="rejected"),
        rec(4, outcome="failed", error="boom"),
        rec(5, outcome="timeout"),
        rec(6),
    ]
    s = summarize(records, GATES, "c=2")
    assert (s.submitted, s.completed, s.rejected, s.failed, s.timeouts, s.warmup) == (6, 3, 1, 2, 1, 1)
    assert s.goodput == 2
    assert s.goodput_fraction == pytest.approx(2 / 6)
    assert s.admitted_violations == 1
    assert s.ttft_ms.n == 3
    assert s.ttft_ms.max == 1500.0  # the warm-up's 5000 ms is not in it
    assert s.completion_tokens == 60
    # submits at 1..6, last end at 7: 6 s window
    assert s.duration_s == pytest.approx(6.0)
    assert s.tokens_per_s == pytest.approx(10.0)
    assert s.goodput_per_s == pytest.approx(2 / 6)


def test_every_submitted_request_is_accounted_for() -> None:
    outcomes = ["ok", "rejected", "failed", "timeout", "cancelled", "ok"]
    s = summarize([rec(i, outcome=o) for i, o in enumerate(outcomes)], GATES, "x")
    assert s.submitted == s.completed + s.rejected + s.failed == len(outcomes)


def test_goodput_does_not_count_unknown_ttft() -> None:
    records = [rec(0), rec(1, ttft=None, tpot=None, t_first_content=None)]
    s = summarize(records, GATES, "x")
    assert s.completed == 2
    assert s.goodput == 1
    assert s.unknown_ttft == 1
    assert s.ttft_ms.n == 1


def test_goodput_counts_one_token_answers_on_ttft() -> None:
    s = summarize([rec(0, tpot=None, completion_tokens=1)], GATES, "x")
    assert s.goodput == 1
    assert s.tpot_ms.n == 0


def test_verdict_passes_when_all_gates_hold() -> None:
    s = summarize([rec(i) for i in range(25)], GATES, "x")
    assert s.verdict.passed
    assert s.verdict.admitted_ok
    assert s.verdict.failing == ()
    ttft_check = s.verdict.checks[0]
    assert ttft_check.name == "ttft_p95"
    assert "small sample" not in ttft_check.detail


def test_verdict_names_the_failing_gate() -> None:
    records = [rec(i) for i in range(10)] + [rec(10 + i, tpot=500.0) for i in range(10)]
    s = summarize(records, GATES, "x")
    assert not s.verdict.passed
    assert s.verdict.failing == ("tpot_p95",)
    assert not s.verdict.admitted_ok


def test_p95_gate_tolerates_a_few_slow_requests() -> None:
    records = [rec(i) for i in range(99)] + [rec(99, ttft=9000.0)]
    s = summarize(records, GATES, "x")
    assert s.verdict.passed
    assert s.admitted_violations == 1


def test_failures_fail_the_verdict() -> None:
    s = summarize([rec(0), rec(1, outcome="failed")], GATES, "x")
    assert s.verdict.failing == ("failures",)
    assert s.verdict.admitted_ok


def test_rejections_fail_verdict_but_admitted_requests_can_be_ok() -> None:
    # The overload story through llamagate: half shed with 429, the admitted half all fast.
    records = [rec(i) for i in range(10)] + [rec(10 + i, outcome="rejected") for i in range(10)]
    s = summarize(records, GATES, "x")
    assert not s.verdict.passed
    assert s.verdict.failing == ("rejected",)
    assert s.verdict.admitted_ok
    assert s.admitted_violations == 0
    assert s.goodput_fraction == pytest.approx(0.5)


def test_rejections_allowed_when_configured() -> None:
    records = [rec(0), rec(1, outcome="rejected")]
    s = summarize(records, Gates(ttft_ms=1000, tpot_ms=100, max_rejected_fraction=0.5), "x")
    assert s.verdict.passed


def test_no_completed_request_fails_ttft_check() -> None:
    s = summarize([rec(0, outcome="rejected")], GATES, "x")
    assert "ttft_p95" in s.verdict.failing
    assert not s.verdict.admitted_ok
    assert s.ttft_ms.p95 is None


def test_tpot_check_not_applicable_without_two_token_answers() -> None:
    s = summarize([rec(0, tpot=None, completion_tokens=1)], GATES, "x")
    tpot_check = s.verdict.checks[1]
    assert tpot_check.passed is None
    assert s.verdict.passed


def test_small_sample_is_flagged_in_check_and_distribution() -> None:
    s = summarize([rec(i) for i in range(5)], GATES, "x")
    assert s.ttft_ms.small_sample
    assert "small sample" in s.verdict.checks[0].detail


def test_empty_run() -> None:
    s = summarize([], GATES, "x")
    assert s.submitted == 0
    assert s.goodput_fraction is None
    assert s.duration_s is None
    assert not s.verdict.passed


def test_summary_dict_names_failing_checks() -> None:
    d = summarize([rec(0, outcome="failed")], GATES, "x").to_dict()
    assert d["verdict"]["failing"] == ["ttft_p95", "failures"]
    assert d["gates"]["ttft_ms"] == 1000


def test_conversation_figures_against_the_reusable_maximum() -> None:
    from supervisor.bench.commands.conversations import llama_server_defaults
    from supervisor.bench.conversations import TargetResult, Turn

    r = TargetResult("t")
    r.turns = [
        Turn(0, 0, 100, 0, 8, 1.0),
        Turn(0, 1, 200, 108, 8, 0.5, reusable_tokens=108),  # all of the previous turn from cache
        Turn(0, 2, 300, 20, 8, 2.0, reusable_tokens=208),  # most of it recomputed
    ]
    s = r.summary()
    assert s["cached_share"] == 128 / 500 and s["reusable_share"] == 316 / 500
    assert s["of_reusable"] == 128 / 316 and s["turns_below_half"] == 1 and s["later_turns"] == 2
    assert s["prompt_tokens_evaluated"] == 100 + 92 + 280
    assert s["ttft_median_ms_by_turn"] == {1: 1000.0, 2: 500.0, 3: 2000.0}
    argv = ["llama-server", "-m", "x", "-sps", "1.0", "--no-cache-idle-slots", "-np", "2"]
    assert llama_server_defaults(argv) == ["llama-server", "-m", "x", "-np", "2"]
