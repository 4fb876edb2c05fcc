"""Statistics of the capacity benchmark: percentiles, TPOT edge cases, per-request gate flags."""

from __future__ import annotations

import random

import pytest

from supervisor.bench.stats import SMALL_SAMPLE, Gates, distribution, gate_flags, percentile, tpot_ms, ttft_ms


def numpy_linear(values: list[float], q: float) -> float:
    # Reference: numpy's default ("linear", type 7) written out independently.
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100
    lo = int(h)
    return xs[lo] + (h - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 95) is None
    d = distribution([])
    assert (d.n, d.p50, d.p95, d.p99, d.mean, d.max) == (0, None, None, None, None, None)
    assert d.small_sample


def test_percentile_of_one_sample_is_that_sample() -> None:
    assert percentile([7.0], 50) == 7.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([1.0, 2.0], 50) == pytest.approx(1.5)
    assert percentile([10.0, 20.0, 30.0, 40.0], 95) == pytest.approx(38.5)
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0


def test_percentile_matches_reference_on_random_samples() -> None:
    rng = random.Random(6)
    for n in (2, 5, 19, 20, 101):
        values = [rng.uniform(0, 1000) for _ in range(n)]
        for q in (50, 95, 99):
            assert percentile(values, q) == pytest.approx(numpy_linear(values, q))


def test_percentile_rejects_out_of_range_q() -> None:
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)


def test_small_sample_flag_flips_at_threshold() -> None:
    assert distribution([1.0] * (SMALL_SAMPLE - 1)).small_sample
    assert not distribution([1.0] * SMALL_SAMPLE).small_sample


def test_distribution_figures() -> None:
    d = distribution([4.0, 1.0, 3.0, 2.0])
    assert d.n == 4
    assert d.mean == pytest.approx(2.5)
    assert (d.min, d.max) == (1.0, 4.0)
    assert d.p50 == pytest.approx(2.5)


def test_ttft_is_from_submit_to_first_content() -> None:
    assert ttft_ms(10.0, 10.25) == pytest.approx(250.0)
    assert ttft_ms(10.0, None) is None


@pytest.mark.parametrize("tokens", [None, 0, 1])
def test_tpot_is_undefined_below_two_tokens(tokens: int | None) -> None:
    assert tpot_ms(1.0, 2.0, tokens) is None


def test_tpot_divides_generation_time_by_gaps() -> None:
    # 11 tokens after the first content at t=1.0, stream ends at t=2.0: 10 gaps of 100 ms.
    assert tpot_ms(1.0, 2.0, 11) == pytest.approx(100.0)
    assert tpot_ms(1.0, 1.05, 2) == pytest.approx(50.0)


def test_tpot_needs_both_timestamps() -> None:
    assert tpot_ms(None, 2.0, 10) is None
    assert tpot_ms(1.0, None, 10) is None


GATES = Gates(ttft_ms=1000, tpot_ms=100)


def test_gate_flags_good_request() -> None:
    assert gate_flags(True, 500.0, 50.0, GATES) == (True, True, True)


def test_gate_flags_limits_are_inclusive() -> None:
    assert gate_flags(True, 1000.0, 100.0, GATES) == (True, True, True)


def test_gate_flags_slow_first_token() -> None:
    assert gate_flags(True, 1500.0, 50.0, GATES) == (False, True, False)


def test_gate_flags_slow_decode() -> None:
    assert gate_flags(True, 500.0, 150.0, GATES) == (True, False, False)


def test_gate_flags_one_token_answer_judged_on_ttft_only() -> None:
    assert gate_flags(True, 500.0, None, GATES) == (True, None, True)


def test_gate_flags_unknown_ttft_is_not_good() -> None:
    assert gate_flags(True, None, None, GATES) == (None, None, None)


def test_gate_flags_unknown_ttft_but_slow_decode_is_bad() -> None:
    assert gate_flags(True, None, 500.0, GATES) == (None, False, False)


def test_gate_flags_not_completed_met_nothing() -> None:
    assert gate_flags(False, 10.0, 10.0, GATES) == (False, False, False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttft_ms": 0},
        {"tpot_ms": -1},
        {"percentile": 0},
        {"percentile": 101},
        {"max_failures": -1},
        {"max_rejected_fraction": 1.5},
    ],
)
def test_gates_reject_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Gates(**kwargs)  # type: ignore[arg-type]
