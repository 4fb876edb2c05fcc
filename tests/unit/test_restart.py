"""Backoff delays are full-jitter exponential and capped; the failure window gives up in time."""

from __future__ import annotations

from supervisor.child.restart import FailureWindow, Policy, jittered_backoff
from supervisor.config.schema import SupervisionConfig


def test_backoff_is_bounded_and_grows() -> None:
    delay = jittered_backoff(1.0, 30.0)
    # 10,000: a ready child's crash counter never stops growing; its delay must stay capped (and must not
    # overflow a float on the way: 2**9999 does).
    for attempt, bound in [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (20, 30.0), (10_000, 30.0)]:
        samples = [delay(attempt) for _ in range(300)]
        assert all(0.0 <= s <= bound for s in samples), attempt
        # Full jitter: the samples spread over the window rather than sitting at the bound.
        assert max(samples) > bound * 0.5 and min(samples) < bound * 0.5


def test_zero_initial_backoff_restarts_at_once() -> None:
    delay = jittered_backoff(0.0, 0.0)
    assert {delay(n) for n in range(1, 6)} == {0.0}


def test_failure_window() -> None:
    w = FailureWindow(window_s=10.0, max_restarts=2)
    assert not w.record(0.0)
    assert not w.record(1.0)
    assert w.record(2.0)  # third failure within 10 s with 2 restarts allowed
    w2 = FailureWindow(window_s=10.0, max_restarts=2)
    assert not w2.record(0.0)
    assert not w2.record(5.0)
    assert not w2.record(11.0)  # the failure at 0 has left the window


def test_policy_from_config() -> None:
    p = Policy.from_config(SupervisionConfig(backoff_initial_s=0.5, backoff_max_s=0.5, max_restarts=7))
    assert p.max_restarts == 7
    assert 0 <= p.backoff(3) <= 0.5
