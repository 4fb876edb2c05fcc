"""The child's state machine. It decides; it never acts.

``Machine.step(event, now)`` folds one observation (the child wrote output, exited, passed the
readiness gate, failed a health probe, a stop was requested, a timer fired) into the state and
returns the actions the driver must carry out (spawn, signal, start probes). It reads no clock and
touches no process, so every transition is unit-tested with plain numbers for ``now``.

    STOPPED --start--> STARTING --gate passed--> READY <--probe ok-- UNHEALTHY
                          |                       |  --probe failed-->   |
                          | exit / stall /        | exit / hang          | N failures / hang
                          | timeout / bad gate    v                      v
                          +----------------> (kill) --> BACKOFF --timer--> STARTING
                             (failed start)         \\-> FAILED (too many failed starts in the window)
    any running state --stop--> STOPPING (SIGTERM, grace, SIGKILL) --exit--> STOPPED

A READY child is watched twice: ``/health`` (answered by llama-server's HTTP threads: the process
and its listener live) and the *loop probe* (a task through llama-server's task queue, ``GET /slots``,
which only the server loop answers; between batches while a decode runs, so a busy loop answers
within milliseconds). ``LoopAsked`` starts the loop's debt and ``LoopAnswered`` clears it; a debt older
than ``loop_deadline_s`` while the process lives is a *hang* (cause ``hang``): the loop is held (a
costly request's setup, a deadlock, a thread stopped from outside) and /health cannot see it. A hang is
a crash of a ready child: SIGKILL (a held loop does not act on SIGTERM) and a restart after the
crash backoff, never FAILED.

Failures kill the child with SIGKILL at once (a broken child has nothing to drain); a requested stop
or a config restart gets SIGTERM and a grace period first.

Two kinds of failure, two policies. A *failed start* (spawn error, exit during load, bad gate answer,
load timeout or stall) says the binary, the model or the flags may be broken: it counts in the
sliding window, and more than ``max_restarts`` of them within ``restart_window_s`` is FAILED, because
retrying a child that cannot start only burns CPU and disk. A *crash of a ready child* (it exited, or
was killed for failing /health or for a hung loop, after it passed the gate) proves the opposite: the
child can start, and what killed it is usually what it was asked (a request that aborts or holds
llama-server) or the host (an OOM kill). Giving up there would let one tenant's requests take the model
down for everyone, so it never gives up: it restarts after its own full-jitter backoff, counted by
``crashes`` and capped by the same ``backoff_max_s``. Both counters go back to zero once a child has
been READY for ``stable_after_s``.

A config restart may be a *trial* (``Restart(trial=True)``: new llama settings while the previous ones
passed the gate). A trial child that fails before passing the gate is no crash of the service: it is
not counted against ``max_restarts``, and the machine answers ``ROLLBACK`` then ``SPAWN`` (the driver
puts the previous settings back before spawning), so a bad reload cannot take a working service to
BACKOFF or FAILED. ``rejected`` keeps why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from supervisor.child.events import (
    Action,
    After,
    Event,
    Exited,
    GateFailed,
    GatePassed,
    HealthFailed,
    HealthOk,
    LoopAnswered,
    LoopAsked,
    Output,
    Restart,
    SpawnFailed,
    Start,
    Stop,
    Tick,
)
from supervisor.child.restart import FailureWindow, Policy

__all__ = [
    "ALLOWED",
    "Action",
    "After",
    "Event",
    "Exited",
    "GateFailed",
    "GatePassed",
    "HealthFailed",
    "HealthOk",
    "IllegalTransition",
    "LoopAnswered",
    "LoopAsked",
    "Machine",
    "Output",
    "Restart",
    "SpawnFailed",
    "Start",
    "State",
    "Stop",
    "Tick",
    "Transition",
]


class State(enum.Enum):
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    READY = "READY"
    UNHEALTHY = "UNHEALTHY"
    BACKOFF = "BACKOFF"
    STOPPING = "STOPPING"
    FAILED = "FAILED"


S = State
ALLOWED: dict[State, frozenset[State]] = {
    S.STOPPED: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.READY, S.STOPPING, S.BACKOFF, S.FAILED}),
    S.READY: frozenset({S.UNHEALTHY, S.STOPPING, S.BACKOFF, S.FAILED}),
    S.UNHEALTHY: frozenset({S.READY, S.STOPPING, S.BACKOFF, S.FAILED}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED}),
    S.STOPPING: frozenset({S.STOPPED, S.BACKOFF, S.FAILED, S.STARTING}),
    S.FAILED: frozenset({S.STARTING, S.STOPPED}),
}
RUNNING = frozenset({S.STARTING, S.READY, S.UNHEALTHY})


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class Transition:
    old: State
    new: State
    reason: str | None


@dataclass
class Machine:
    policy: Policy
    state: State = State.STOPPED
    reason: str | None = "not started"
    generation: int = 0
    spawned_at: float = 0.0
    last_output_at: float = 0.0
    ready_at: float | None = None
    health_failures: int = 0
    loop_asked_at: float | None = None  # when the loop probe's task was posted and not yet answered
    attempt: int = 0  # failed starts since a child was last stable: the next one's backoff
    crashes: int = 0  # crashes of a ready child since a child was last stable: never gives up
    crashed: bool = False  # the last failure was a ready child's crash (not a failed start)
    backoff_until: float | None = None
    kill_at: float | None = None  # STOPPING: when SIGTERM's grace runs out
    after: After = After.STOP
    last_failure: str | None = None
    last_failure_cause: str | None = None
    stop_requested: bool = False
    trial_pending: bool = False  # the next start runs settings on trial
    trial_generation: int | None = None  # the child on trial, until it passes the gate or fails
    rejected: str | None = None  # why the last trial failed
    restarts: int = 0  # spawns after the first
    failures: dict[str, int] = field(default_factory=dict)  # by cause, for metrics
    transitions: list[Transition] = field(default_factory=list)  # of the last step, for observers
    window: FailureWindow = field(init=False)

    def __post_init__(self) -> None:
        self.window = FailureWindow(self.policy.restart_window_s, self.policy.max_restarts)

    # --- queries ---------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state is State.READY

    def next_deadline(self) -> float | None:
        """When the driver must send a Tick even if nothing else happens."""
        p = self.policy
        if self.state is State.STARTING:
            return min(self.spawned_at + p.load_timeout_s, self.last_output_at + p.stall_timeout_s)
        if self.state is State.BACKOFF:
            return self.backoff_until
        if self.state is State.STOPPING:
            return self.kill_at
        if self.state in (State.READY, State.UNHEALTHY):
            due = [self.loop_due()]
            if self.state is State.READY and self._backing_off() and self.ready_at is not None:
                due.append(self.ready_at + p.stable_after_s)
            return min((d for d in due if d is not None), default=None)
        return None

    def loop_due(self) -> float | None:
        """When the loop probe owed now is a hang; None when nothing is owed."""
        if self.loop_asked_at is None:
            return None
        return self.loop_asked_at + self.policy.loop_deadline_s

    # --- the step --------------------------------------------------------------------------------------
    def step(self, event: Event, now: float) -> list[Action]:
        self.transitions = []
        gen_event = getattr(event, "generation", None)
        if gen_event is not None and gen_event != self.generation:
            return []  # from a previous child: it no longer matters
        match event:
            case Start():
                return self._start(now) if self.state is State.STOPPED and not self.stop_requested else []
            case Stop(reason=reason):
                return self._stop(now, reason)
            case Restart(reason=reason, trial=trial):
                return self._restart(now, reason, trial)
            case Tick():
                return self._tick(now)
            case Output():
                self.last_output_at = now
                return []
            case SpawnFailed(reason=reason):
                if self.state is State.STARTING:
                    return self._fail(now, f"could not start: {reason}", "spawn", running=False)
                return []
            case GatePassed():
                if self.state is State.STARTING:
                    self.ready_at = now
                    self.health_failures = 0
                    self.loop_asked_at = None
                    self.trial_generation = None  # the trial passed: its settings are the good ones now
                    self._go(State.READY, None)
                    return [Action.START_LIVENESS]
                return []
            case GateFailed(reason=reason):
                if self.state is State.STARTING:
                    return self._fail(now, f"readiness gate failed: {reason}", "gate", running=True)
                return []
            case HealthOk():
                self.health_failures = 0
                if self.state is State.UNHEALTHY:
                    self._go(State.READY, None)
                return []
            case HealthFailed(reason=reason):
                return self._health_failed(now, reason)
            case LoopAsked():
                if self.state in (State.READY, State.UNHEALTHY) and self.loop_asked_at is None:
                    self.loop_asked_at = now
                return []
            case LoopAnswered():
                self.loop_asked_at = None
                return []
            case Exited(description=description):
                return self._exited(now, description)
        raise TypeError(f"unknown event {event!r}")

    # --- helpers ---------------------------------------------------------------------------------------
    def _go(self, new: State, reason: str | None) -> None:
        if new is not self.state and new not in ALLOWED[self.state]:
            raise IllegalTransition(f"{self.state.value} -> {new.value}")
        self.transitions.append(Transition(self.state, new, reason))
        self.state = new
        self.reason = reason

    def _start(self, now: float, reason: str = "loading the model") -> list[Action]:
        if self.generation:
            self.restarts += 1
        self.generation += 1
        self.trial_generation = self.generation if self.trial_pending else None
        self.trial_pending = False
        self.spawned_at = now
        self.last_output_at = now
        self.ready_at = None
        self.health_failures = 0
        self.loop_asked_at = None
        self.backoff_until = None
        self.kill_at = None
        self._go(State.STARTING, reason)
        return [Action.SPAWN]

    def _stop(self, now: float, reason: str) -> list[Action]:
        self.stop_requested = True
        if self.state in RUNNING:
            return self._terminate(now, After.STOP, f"stopping: {reason}")
        if self.state is State.STOPPING:
            self.after = After.STOP
            return []
        if self.state in (State.BACKOFF, State.FAILED):
            self._go(State.STOPPED, f"stopped: {reason}")
        return []

    def _restart(self, now: float, reason: str, trial: bool = False) -> list[Action]:
        if self.stop_requested:
            return []
        self.trial_pending = trial
        if self.state in RUNNING:
            return self._terminate(now, After.RESTART_NOW, f"restarting: {reason}")
        if self.state is State.STOPPING:
            if self.after is not After.STOP:
                self.after = After.RESTART_NOW
            return []
        if self.state in (State.BACKOFF, State.FAILED):
            if self.state is State.FAILED:
                self.window.clear()
                self.attempt = self.crashes = 0
            return self._start(now)
        return []

    def _terminate(self, now: float, after: After, reason: str) -> list[Action]:
        self.after = after
        self.kill_at = now + self.policy.stop_grace_s
        self._go(State.STOPPING, reason)
        return [Action.STOP_PROBES, Action.TERMINATE]

    def _tick(self, now: float) -> list[Action]:
        p = self.policy
        if self.state is State.STARTING:
            if now >= self.spawned_at + p.load_timeout_s:
                return self._fail(
                    now, f"load timeout: not ready after {p.load_timeout_s:g} s", "load_timeout", running=True
                )
            if now >= self.last_output_at + p.stall_timeout_s:
                return self._fail(
                    now,
                    f"load stalled: no output and no progress for {p.stall_timeout_s:g} s",
                    "load_stalled",
                    running=True,
                )
        elif self.state is State.BACKOFF and self.backoff_until is not None and now >= self.backoff_until:
            if self.crashed and self.last_failure_cause == "hang":
                # /readyz keeps saying why until the replacement is READY, not only while it waits.
                return self._start(now, f"loading the model to replace a hung child ({self.last_failure})")
            return self._start(now)
        elif self.state is State.STOPPING and self.kill_at is not None and now >= self.kill_at:
            self.kill_at = None
            return [Action.KILL]
        elif self.state in (State.READY, State.UNHEALTHY):
            due = self.loop_due()
            if due is not None and now >= due:
                return self._hung(now)
            if (
                self.state is State.READY
                and self.ready_at is not None
                and self._backing_off()
                and now >= self.ready_at + p.stable_after_s
            ):
                self.attempt = self.crashes = 0  # stable again: the next failure gets the shortest backoff
        return []

    def _hung(self, now: float) -> list[Action]:
        """The loop owes the probe's answer past the deadline while the process lives: replace it."""
        asked = self.loop_asked_at if self.loop_asked_at is not None else now
        self.loop_asked_at = None
        return self._fail(
            now,
            f"hung: the server loop did not answer GET /slots for {now - asked:.1f} s "
            f"(loop_deadline_s {self.policy.loop_deadline_s:g}) while the process lives",
            "hang",
            running=True,
        )

    def _health_failed(self, now: float, reason: str) -> list[Action]:
        if self.state not in (State.READY, State.UNHEALTHY):
            return []
        self.health_failures += 1
        if self.health_failures >= self.policy.health_failures:
            return self._fail(
                now,
                f"not answering /health: {self.health_failures} consecutive failures (last: {reason})",
                "unhealthy",
                running=True,
            )
        if self.state is State.READY:
            self._go(State.UNHEALTHY, f"health probe failed: {reason}")
        return []

    def _exited(self, now: float, description: str) -> list[Action]:
        if self.state is State.STOPPING:
            self.kill_at = None
            if self.after is After.STOP:
                self._go(State.STOPPED, "stopped")
            elif self.after is After.RESTART_NOW:
                return self._start(now)
            elif self.after is After.GIVE_UP:
                self._go(State.FAILED, self._give_up_reason())
            elif self.after is After.ROLLBACK:
                return self._rollback(now)
            else:
                self._backoff(now)
            return []
        if self.state is State.STARTING:
            return self._fail(now, f"exited during load: {description}", "load_exit", running=False)
        if self.state in (State.READY, State.UNHEALTHY):
            return self._fail(now, description, "exit", running=False)
        return []

    def _fail(self, now: float, reason: str, cause: str, *, running: bool) -> list[Action]:
        if self.state is State.STARTING and self.trial_generation == self.generation:
            return self._reject(now, reason, running=running)
        self.last_failure = reason
        self.last_failure_cause = cause
        self.failures[cause] = self.failures.get(cause, 0) + 1
        # The state before the failure tells the kinds apart: a child past the gate could start.
        self.crashed = self.state in (State.READY, State.UNHEALTHY)
        if self.crashed:
            self.crashes += 1
            give_up = False  # requests (or the host) killed a child that works: never FAILED for it
        else:
            self.attempt += 1
            give_up = self.window.record(now)
        after = After.GIVE_UP if give_up else After.RESTART
        if running:
            # A broken child has nothing to drain: SIGKILL now rather than after a grace period.
            self.after = after
            self.kill_at = None
            self._go(State.STOPPING, f"failed: {reason}")
            return [Action.STOP_PROBES, Action.KILL]
        if give_up:
            self._go(State.FAILED, self._give_up_reason())
        else:
            self._backoff(now)
        return [Action.STOP_PROBES]

    def _reject(self, now: float, reason: str, *, running: bool) -> list[Action]:
        """The trial child failed before the gate: back to the previous settings, no crash counted."""
        self.rejected = reason
        self.trial_generation = None
        if running:
            self.after = After.ROLLBACK
            self.kill_at = None
            self._go(State.STOPPING, f"reload rejected: {reason}")
            return [Action.STOP_PROBES, Action.KILL]
        return [Action.STOP_PROBES, *self._rollback(now)]

    def _rollback(self, now: float) -> list[Action]:
        why = f"loading the previous settings (reload rejected: {self.rejected})"
        return [Action.ROLLBACK, *self._start(now, why)]

    def _backing_off(self) -> bool:
        return bool(self.attempt or self.crashes)

    def _backoff(self, now: float) -> None:
        p = self.policy
        if self.crashed:
            delay = p.backoff(self.crashes)
            kind = "a hang" if self.last_failure_cause == "hang" else "a crash"
            why = f"{kind} of a ready child ({self.crashes} in a row; never gives up)"
        else:
            delay = p.backoff(self.attempt)
            why = (
                f"a failed start ({len(self.window.times)} within {p.restart_window_s:g} s; "
                f"FAILED at {p.max_restarts + 1})"
            )
        self.backoff_until = now + delay
        self._go(State.BACKOFF, f"restarting in {delay:.1f} s after {why}: {self.last_failure}")

    def _give_up_reason(self) -> str:
        p, n = self.policy, len(self.window.times)
        return (
            f"gave up: {n} failed start{'' if n == 1 else 's'} within {p.restart_window_s:g} s "
            f"(max_restarts {p.max_restarts}); last: {self.last_failure}"
        )
