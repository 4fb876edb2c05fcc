"""Restart policy: how long to wait before the next start, and when to give up.

The delay is full-jitter exponential backoff, a pure function of the attempt number: the state machine
decides *whether* to restart, ``jittered_backoff`` says *how long* to wait. Full jitter (uniform between
0 and the exponential bound) keeps the first restart after a crash quick (at most ``backoff_initial_s``),
which the kill-to-READY target depends on, and spreads the restarts of several daemons that crashed
together.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from supervisor.config.schema import SupervisionConfig

# 2**62 times any sane initial delay is past every cap; a larger exponent only risks OverflowError
# (float(2**1024)) for a counter that never stops growing (a ready child's crashes never give up).
_MAX_DOUBLINGS = 62


def jittered_backoff(initial_s: float, max_s: float) -> Callable[[int], float]:
    """attempt (1 = first restart) -> seconds; uniform in [0, min(max_s, initial_s * 2**(attempt-1))]."""

    def delay(attempt: int) -> float:
        bound = min(max_s, initial_s * 2.0 ** min(max(1, attempt) - 1, _MAX_DOUBLINGS))
        return random.uniform(0.0, bound)  # noqa: S311 - a restart delay, not a secret

    return delay


@dataclass(frozen=True)
class Policy:
    """The numbers the state machine decides with (from ``supervision:``), plus the delay function."""

    load_timeout_s: float = 300.0
    stall_timeout_s: float = 30.0
    health_failures: int = 3
    loop_deadline_s: float = 10.0
    stable_after_s: float = 60.0
    max_restarts: int = 5
    restart_window_s: float = 300.0
    stop_grace_s: float = 10.0
    backoff: Callable[[int], float] = field(default=lambda attempt: 0.0)

    @classmethod
    def from_config(cls, s: SupervisionConfig) -> Policy:
        return cls(
            load_timeout_s=s.load_timeout_s,
            stall_timeout_s=s.stall_timeout_s,
            health_failures=s.health_failures,
            loop_deadline_s=s.loop_deadline_s,
            stable_after_s=s.stable_after_s,
            max_restarts=s.max_restarts,
            restart_window_s=s.restart_window_s,
            stop_grace_s=s.stop_grace_s,
            backoff=jittered_backoff(s.backoff_initial_s, s.backoff_max_s),
        )


@dataclass
class FailureWindow:
    """Failure times within the sliding window; more than ``max_restarts`` of them means give up."""

    window_s: float
    max_restarts: int
    times: list[float] = field(default_factory=list)

    def record(self, now: float) -> bool:
        """Add a failure; True when the supervisor should give up (FAILED) instead of restarting."""
        self.times = [t for t in self.times if now - t < self.window_s]
        self.times.append(now)
        return len(self.times) > self.max_restarts

    def clear(self) -> None:
        self.times.clear()
