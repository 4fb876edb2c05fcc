"""The state machine alone: plain numbers for time, no process, no sleep."""

from __future__ import annotations

import pytest

from supervisor.child.machine import (
    Action,
    Exited,
    GateFailed,
    GatePassed,
    HealthFailed,
    HealthOk,
    IllegalTransition,
    LoopAnswered,
    LoopAsked,
    Machine,
    Output,
    Restart,
    SpawnFailed,
    Start,
    State,
    Stop,
    Tick,
)
from supervisor.child.restart import Policy
from supervisor.config.schema import SupervisionConfig

S = State
A = Action


def policy(**kw: object) -> Policy:
    base: dict[str, object] = dict(
        load_timeout_s=60.0,
        stall_timeout_s=10.0,
        health_failures=3,
        stable_after_s=30.0,
        max_restarts=3,
        restart_window_s=100.0,
        stop_grace_s=5.0,
        backoff=lambda attempt: float(attempt),  # deterministic: 1 s, 2 s, 3 s ...
    )
    base.update(kw)
    return Policy(**base)  # type: ignore[arg-type]


def ready_machine(**kw: object) -> Machine:
    m = Machine(policy(**kw))
    assert m.step(Start(), 0.0) == [A.SPAWN]
    assert m.step(GatePassed(1), 2.0) == [A.START_LIVENESS]
    assert m.state is S.READY
    return m


def test_start_then_gate_passed_is_ready() -> None:
    m = Machine(policy())
    assert m.state is S.STOPPED
    assert m.step(Start(), 0.0) == [A.SPAWN]
    assert (m.state, m.generation, m.reason) == (S.STARTING, 1, "loading the model")
    assert not m.ready
    assert m.step(GatePassed(1), 1.5) == [A.START_LIVENESS]
    assert m.state is S.READY and m.ready and m.reason is None
    assert [(t.old, t.new) for t in m.transitions] == [(S.STARTING, S.READY)]


def test_transitions_are_guarded() -> None:
    m = Machine(policy())
    with pytest.raises(IllegalTransition):
        m._go(S.READY, None)
    # Events that make no sense in a state are ignored, not forced through.
    assert m.step(GatePassed(0), 1.0) == []
    assert m.step(HealthFailed(0, "x"), 1.0) == []
    assert m.state is S.STOPPED


def test_exit_during_load_backs_off_then_restarts() -> None:
    m = Machine(policy())
    m.step(Start(), 0.0)
    assert m.step(Exited(1, "exited with code 1"), 0.5) == [A.STOP_PROBES]
    assert m.state is S.BACKOFF
    assert m.last_failure == "exited during load: exited with code 1"
    assert m.reason == (
        "restarting in 1.0 s after a failed start (1 within 100 s; FAILED at 4): "
        "exited during load: exited with code 1"
    )
    assert m.next_deadline() == 1.5
    assert m.step(Tick(), 1.4) == []
    assert m.step(Tick(), 1.5) == [A.SPAWN]
    assert (m.state, m.generation, m.restarts) == (S.STARTING, 2, 1)
    assert m.failures == {"load_exit": 1}


def test_stalled_load_is_killed_when_the_log_goes_quiet() -> None:
    m = Machine(policy())
    m.step(Start(), 0.0)
    assert m.next_deadline() == 10.0  # stall deadline comes before the 60 s cap
    assert m.step(Tick(), 9.9) == []
    assert m.step(Tick(), 10.0) == [A.STOP_PROBES, A.KILL]
    assert m.state is S.STOPPING
    assert m.last_failure == "load stalled: no output and no progress for 10 s"
    assert m.step(Exited(1, "killed by SIGKILL"), 10.1) == []
    assert m.state is S.BACKOFF


def test_slow_but_progressing_load_is_extended_until_the_hard_cap() -> None:
    m = Machine(policy())
    m.step(Start(), 0.0)
    for t in range(5, 60, 5):  # output every 5 s: never stalls
        m.step(Output(1), float(t))
        assert m.step(Tick(), float(t) + 0.1) == []
        assert m.state is S.STARTING
    assert m.next_deadline() == 60.0
    assert m.step(Tick(), 60.0) == [A.STOP_PROBES, A.KILL]
    assert m.last_failure == "load timeout: not ready after 60 s"


def test_bad_gate_answer_kills_and_restarts() -> None:
    m = Machine(policy())
    m.step(Start(), 0.0)
    assert m.step(GateFailed(1, "/v1/models reports n_ctx 2048"), 1.0) == [A.STOP_PROBES, A.KILL]
    assert m.step(Exited(1, "killed by SIGKILL"), 1.1) == []
    assert m.state is S.BACKOFF
    assert m.failures == {"gate": 1}


def test_spawn_failure_counts_as_a_failure() -> None:
    m = Machine(policy())
    m.step(Start(), 0.0)
    assert m.step(SpawnFailed(1, "No such file"), 0.0) == [A.STOP_PROBES]
    assert m.state is S.BACKOFF and m.last_failure == "could not start: No such file"


def test_health_failures_make_unhealthy_then_dead() -> None:
    m = ready_machine()
    assert m.step(HealthFailed(1, "timeout"), 10.0) == []
    assert m.state is S.UNHEALTHY and not m.ready
    assert m.step(HealthOk(1), 12.0) == []
    assert m.state is S.READY  # one failure is not death
    m.step(HealthFailed(1, "timeout"), 14.0)
    m.step(HealthFailed(1, "timeout"), 16.0)
    assert m.step(HealthFailed(1, "no answer within 2 s"), 18.0) == [A.STOP_PROBES, A.KILL]
    assert m.state is S.STOPPING
    assert m.last_failure == "not answering /health: 3 consecutive failures (last: no answer within 2 s)"
    m.step(Exited(1, "killed by SIGKILL"), 18.1)
    assert m.state is S.BACKOFF and m.failures == {"unhealthy": 1}


def test_crash_after_ready() -> None:
    m = ready_machine()
    assert m.step(Exited(1, "killed by SIGKILL from outside (out of memory?)"), 5.0) == [A.STOP_PROBES]
    assert m.state is S.BACKOFF
    assert m.last_failure == "killed by SIGKILL from outside (out of memory?)"
    assert m.reason == (
        "restarting in 1.0 s after a crash of a ready child (1 in a row; never gives up): "
        "killed by SIGKILL from outside (out of memory?)"
    )
    assert (m.crashes, m.attempt, m.window.times) == (1, 0, [])  # not a failed start


def test_crash_loop_ends_in_failed() -> None:
    m = Machine(policy(max_restarts=2))
    now = 0.0
    m.step(Start(), now)
    for _ in range(2):
        m.step(Exited(m.generation, "exited with code 1"), now + 0.1)
        assert m.state is S.BACKOFF
        now = m.backoff_until or 0.0
        m.step(Tick(), now)
        assert m.state is S.STARTING
    m.step(Exited(m.generation, "exited with code 1"), now + 0.1)
    assert m.state is S.FAILED
    assert m.reason == (
        "gave up: 3 failed starts within 100 s (max_restarts 2); last: exited during load: exited with code 1"
    )
    assert m.next_deadline() is None
    assert m.step(Tick(), now + 1000) == []  # FAILED stays FAILED
    # An operator's restart (e.g. fixed config + SIGHUP) leaves FAILED with a clean slate.
    assert m.step(Restart("llama settings changed"), now + 1000) == [A.SPAWN]
    assert m.state is S.STARTING and m.attempt == 0


def test_failures_outside_the_window_do_not_accumulate() -> None:
    m = Machine(policy(max_restarts=1, restart_window_s=10.0))
    m.step(Start(), 0.0)
    m.step(Exited(1, "exited with code 1"), 2.0)
    m.step(Tick(), 100.0)
    m.step(Exited(2, "exited with code 1"), 102.0)  # the first failed start is 100 s old
    assert m.state is S.BACKOFF
    m.step(Tick(), 105.0)
    m.step(Exited(3, "exited with code 1"), 106.0)  # the second is 4 s old: one more than max_restarts
    assert m.state is S.FAILED


def test_backoff_grows_then_resets_after_stable() -> None:
    m = ready_machine(stable_after_s=30.0)
    m.step(Exited(1, "crash"), 5.0)
    assert m.backoff_until == 6.0  # attempt 1
    m.step(Tick(), 6.0)
    m.step(GatePassed(2), 7.0)
    m.step(Exited(2, "crash"), 8.0)
    assert m.backoff_until == 10.0  # attempt 2
    m.step(Tick(), 10.0)
    m.step(GatePassed(3), 11.0)
    assert m.next_deadline() == 41.0  # when READY counts as stable
    m.step(Tick(), 41.0)
    assert m.attempt == 0
    m.step(Exited(3, "crash"), 50.0)
    assert m.backoff_until == 51.0  # back to the shortest delay


def test_stop_from_ready_terminates_then_kills_after_grace() -> None:
    m = ready_machine()
    assert m.step(Stop("SIGTERM"), 10.0) == [A.STOP_PROBES, A.TERMINATE]
    assert m.state is S.STOPPING and m.reason == "stopping: SIGTERM"
    assert m.next_deadline() == 15.0
    assert m.step(Tick(), 14.9) == []
    assert m.step(Tick(), 15.0) == [A.KILL]
    assert m.next_deadline() is None
    assert m.step(Exited(1, "killed by SIGKILL"), 15.1) == []
    assert m.state is S.STOPPED
    # Nothing restarts a stopped daemon's child.
    assert m.step(Start(), 16.0) == []
    assert m.step(Restart("x"), 16.0) == []


def test_stop_during_backoff_or_failed_is_immediate() -> None:
    m = Machine(policy())
    m.step(Start(), 0.0)
    m.step(Exited(1, "exited with code 1"), 0.1)
    assert m.step(Stop(), 0.2) == []
    assert m.state is S.STOPPED


def test_stop_while_restarting_wins() -> None:
    m = ready_machine()
    m.step(Restart("llama.slots: 2 -> 4"), 3.0)
    assert m.state is S.STOPPING
    m.step(Stop("SIGTERM"), 3.1)
    m.step(Exited(1, "exited with code 0"), 3.2)
    assert m.state is S.STOPPED


def test_config_restart_goes_straight_back_to_starting() -> None:
    m = ready_machine()
    assert m.step(Restart("llama.slots: 2 -> 4"), 3.0) == [A.STOP_PROBES, A.TERMINATE]
    assert m.reason == "restarting: llama.slots: 2 -> 4"
    assert m.step(Exited(1, "exited with code 0"), 3.5) == [A.SPAWN]
    assert (m.state, m.generation) == (S.STARTING, 2)
    assert m.failures == {}  # not a failure


def test_events_from_an_old_child_are_ignored() -> None:
    m = ready_machine()
    m.step(Exited(1, "crash"), 5.0)
    m.step(Tick(), 6.0)
    assert m.generation == 2
    assert m.step(GatePassed(1), 6.5) == []
    assert m.step(Exited(1, "late"), 6.6) == []
    assert m.state is S.STARTING


def _running_failure(kind: str, m: Machine) -> list[Action]:
    """Make a running child fail the way ``kind`` says; returns the actions of the failing step."""
    if kind == "stall":  # quiet log for the stall timeout
        return m.step(Tick(), m.spawned_at + 10.0)
    if kind == "load_timeout":  # progressing, but past the hard cap
        for t in range(5, 60, 5):
            m.step(Output(m.generation), m.spawned_at + t)
        return m.step(Tick(), m.spawned_at + 60.0)
    if kind == "bad_gate":
        return m.step(GateFailed(m.generation, "/v1/models reports n_ctx 2048"), m.spawned_at + 1.0)
    assert kind == "unhealthy"
    m.step(GatePassed(m.generation), m.spawned_at + 1.0)
    for i in range(2):
        m.step(HealthFailed(m.generation, "timeout"), m.spawned_at + 2.0 + i)
    return m.step(HealthFailed(m.generation, "timeout"), m.spawned_at + 4.0)


@pytest.mark.parametrize(
    ("kind", "last"),
    [
        ("stall", "load stalled: no output and no progress for 10 s"),
        ("load_timeout", "load timeout: not ready after 60 s"),
        ("bad_gate", "readiness gate failed: /v1/models reports n_ctx 2048"),
    ],
)
def test_a_running_childs_last_allowed_failure_ends_in_failed(kind: str, last: str) -> None:
    # The child is still alive when these failures are seen: the machine kills it, and only the exit
    # of the killed child may take it to FAILED (never to BACKOFF, never a restart).
    m = Machine(policy(max_restarts=1))
    m.step(Start(), 0.0)
    m.step(Exited(1, "exited with code 1"), 0.5)  # first failure: restarts
    assert m.state is S.BACKOFF
    m.step(Tick(), m.backoff_until or 0.0)
    assert (m.state, m.generation) == (S.STARTING, 2)
    assert _running_failure(kind, m) == [A.STOP_PROBES, A.KILL]
    assert m.state is S.STOPPING and m.last_failure == last
    assert m.step(Exited(2, "killed by SIGKILL"), m.spawned_at + 70.0) == []
    assert m.state is S.FAILED and not m.ready
    assert m.reason == f"gave up: 2 failed starts within 100 s (max_restarts 1); last: {last}"
    assert m.next_deadline() is None
    assert m.step(Tick(), 10_000.0) == [] and m.state is S.FAILED


# --- a ready child's crashes never give up; failed starts do --------------------------------------------
def crash(m: Machine, now: float, how: str) -> float:
    """The READY child at ``now`` dies as ``how`` says; returns when it is back in BACKOFF."""
    gen = m.generation
    if how == "unhealthy":  # stops answering /health: killed by the machine
        for i in range(3):
            m.step(HealthFailed(gen, "timeout"), now + i)
        assert m.state is S.STOPPING
        now += 3.0
        description = "killed by SIGKILL"
    else:
        description = how
    assert m.step(Exited(gen, description), now) == ([] if how == "unhealthy" else [A.STOP_PROBES])
    assert m.state is S.BACKOFF, m.reason
    return now


def test_twenty_crashes_of_a_ready_child_within_the_window_never_give_up() -> None:
    # max_restarts 1 and a 1000 s window: two counted failures would be FAILED. Twenty crashes of a
    # child that reached READY each time (a request that aborts it, an OOM kill, a hang), all within
    # the window, are not counted there: the model keeps coming back.
    m = ready_machine(max_restarts=1, restart_window_s=1000.0)
    now = 2.0
    hows = ["killed by SIGABRT", "killed by SIGKILL from outside (out of memory?)", "unhealthy"]
    for n in range(1, 21):
        now = crash(m, now + 1.0, hows[n % 3])
        assert m.crashes == n and m.attempt == 0 and m.window.times == []
        assert m.backoff_until == now + n  # the crash counter drives the delay (policy: n seconds)
        assert m.reason is not None
        assert m.reason.startswith(f"restarting in {n}.0 s after a crash of a ready child ({n} in a row;")
        now = m.backoff_until
        assert m.step(Tick(), now) == [A.SPAWN]
        assert m.step(GatePassed(m.generation), now + 1.0) == [A.START_LIVENESS]
        now += 1.0
    assert now < 1000.0 and m.state is S.READY and m.generation == 21
    assert m.failures.get("exit", 0) + m.failures.get("unhealthy", 0) == 20


def test_a_ready_childs_crash_delays_stay_capped_by_backoff_max() -> None:
    # The configured policy itself (full jitter, backoff_initial_s 1, backoff_max_s 8), max_restarts 0:
    # any counted failure would be FAILED at once.
    p = Policy.from_config(
        SupervisionConfig(max_restarts=0, backoff_initial_s=1.0, backoff_max_s=8.0, restart_window_s=3600)
    )
    m = Machine(p)
    m.step(Start(), 0.0)
    m.step(GatePassed(1), 1.0)
    now, delays = 1.0, []
    for _ in range(20):
        now = crash(m, now + 1.0, "killed by SIGABRT")
        assert m.backoff_until is not None
        delays.append(m.backoff_until - now)
        now = m.backoff_until
        m.step(Tick(), now)
        m.step(GatePassed(m.generation), now + 1.0)
        now += 1.0
    assert m.state is S.READY and m.crashes == 20
    assert all(0.0 <= d <= 8.0 for d in delays), delays
    assert all(d <= 2.0**i for i, d in enumerate(delays[:3])), delays  # 1, 2, 4 before the cap


def test_a_child_that_fails_to_load_one_more_than_max_restarts_times_is_failed() -> None:
    m = Machine(policy(max_restarts=3, restart_window_s=100.0))
    m.step(Start(), 0.0)
    now = 0.0
    for n in range(1, 4):
        m.step(Exited(m.generation, "exited with code 1"), now + 0.5)
        assert m.state is S.BACKOFF and m.attempt == n
        now = m.backoff_until or 0.0
        m.step(Tick(), now)
    m.step(Exited(m.generation, "exited with code 1"), now + 0.5)
    assert m.state is S.FAILED
    assert m.reason == (
        "gave up: 4 failed starts within 100 s (max_restarts 3); last: exited during load: exited with code 1"
    )


def test_crashes_between_failed_starts_neither_count_nor_reset_the_window() -> None:
    # max_restarts 2: the third failed start within 100 s is FAILED, however many crashes of a ready
    # child come in between; and the two counters keep their own backoff.
    m = Machine(policy(max_restarts=2, restart_window_s=100.0))
    m.step(Start(), 0.0)
    m.step(Exited(1, "exited with code 1"), 1.0)  # failed start 1
    assert (m.attempt, m.crashes, m.backoff_until) == (1, 0, 2.0)
    m.step(Tick(), 2.0)
    m.step(GatePassed(2), 3.0)
    now = 3.0
    for n in range(1, 4):  # three crashes of the ready child: delays 1, 2, 3 (its own counter)
        now = crash(m, now + 1.0, "killed by SIGSEGV")
        assert (m.attempt, m.crashes, m.backoff_until) == (1, n, now + n)
        now = m.backoff_until
        m.step(Tick(), now)
        m.step(GatePassed(m.generation), now + 0.5)
        now += 0.5
    now = crash(m, now + 1.0, "killed by SIGSEGV")
    m.step(Tick(), m.backoff_until or 0.0)
    m.step(Exited(m.generation, "exited with code 1"), m.spawned_at + 1.0)  # failed start 2
    assert m.state is S.BACKOFF and (m.attempt, m.crashes) == (2, 4)
    assert m.backoff_until == m.spawned_at + 1.0 + 2.0  # the failed starts' counter: 2nd delay
    assert m.reason is not None and "after a failed start (2 within 100 s; FAILED at 3)" in m.reason
    m.step(Tick(), m.backoff_until or 0.0)
    m.step(GatePassed(m.generation), m.spawned_at + 1.0)
    crash(m, m.spawned_at + 2.0, "killed by SIGABRT")
    m.step(Tick(), m.backoff_until or 0.0)
    assert m.spawned_at < 100.0  # every failure so far within the window
    m.step(Exited(m.generation, "exited with code 1"), m.spawned_at + 1.0)  # failed start 3
    assert m.state is S.FAILED and m.failures == {"load_exit": 3, "exit": 5}
    assert m.reason == (
        "gave up: 3 failed starts within 100 s (max_restarts 2); last: exited during load: exited with code 1"
    )
    # An operator's restart leaves FAILED with both counters clean.
    assert m.step(Restart("SIGHUP"), 200.0) == [A.SPAWN]
    assert (m.attempt, m.crashes, m.window.times) == (0, 0, [])


def test_a_stable_child_resets_the_crash_backoff_but_not_the_window() -> None:
    m = Machine(policy(max_restarts=1, restart_window_s=1000.0, stable_after_s=30.0))
    m.step(Start(), 0.0)
    m.step(Exited(1, "exited with code 1"), 1.0)  # failed start 1 of 2
    m.step(Tick(), 2.0)
    m.step(GatePassed(2), 3.0)
    crash(m, 4.0, "killed by SIGABRT")
    crash_back = m.backoff_until or 0.0
    m.step(Tick(), crash_back)
    m.step(GatePassed(3), crash_back + 1.0)
    assert m.next_deadline() == crash_back + 31.0  # when READY counts as stable
    m.step(Tick(), crash_back + 31.0)
    assert (m.attempt, m.crashes) == (0, 0)
    now = crash(m, crash_back + 40.0, "killed by SIGABRT")
    assert m.backoff_until == now + 1.0  # the shortest delay again
    m.step(Tick(), now + 1.0)
    # Stable does not forget the failed start at 1.0: a second one within 1000 s is FAILED.
    m.step(Exited(m.generation, "exited with code 1"), now + 2.0)
    assert m.state is S.FAILED


# --- a reload's trial: new settings that fail before the gate roll back, and count as no crash -------
def trial_machine(**kw: object) -> Machine:
    """READY on generation 1; a trial restart has stopped it and spawned generation 2."""
    m = ready_machine(**kw)
    assert m.step(Restart("llama.extra_args changed", trial=True), 3.0) == [A.STOP_PROBES, A.TERMINATE]
    assert m.step(Exited(1, "exited with code 0"), 3.5) == [A.SPAWN]
    assert (m.state, m.generation, m.trial_generation) == (S.STARTING, 2, 2)
    return m


def test_a_trial_that_exits_during_load_rolls_back_at_once() -> None:
    m = trial_machine(max_restarts=0)  # any counted failure would go straight to FAILED
    actions = m.step(Exited(2, "exited with code 1"), 4.0)
    assert actions == [A.STOP_PROBES, A.ROLLBACK, A.SPAWN]
    assert (m.state, m.generation, m.trial_generation) == (S.STARTING, 3, None)
    assert m.rejected == "exited during load: exited with code 1"
    assert m.reason == (
        "loading the previous settings (reload rejected: exited during load: exited with code 1)"
    )
    # Not a crash of the service: no backoff, nothing in the failure window or counters.
    assert m.attempt == 0 and not m.window.times and m.failures == {} and m.last_failure is None
    assert m.step(GatePassed(3), 5.0) == [A.START_LIVENESS]
    assert m.state is S.READY


def test_a_trial_that_fails_the_gate_is_killed_then_rolls_back() -> None:
    m = trial_machine()
    assert m.step(GateFailed(2, "expected n_ctx 4096"), 4.0) == [A.STOP_PROBES, A.KILL]
    assert m.state is S.STOPPING and m.reason == "reload rejected: readiness gate failed: expected n_ctx 4096"
    assert m.step(Exited(2, "killed by SIGKILL"), 4.1) == [A.ROLLBACK, A.SPAWN]
    assert (m.state, m.generation) == (S.STARTING, 3)
    assert m.failures == {} and m.attempt == 0


def test_a_trial_that_times_out_rolls_back() -> None:
    m = trial_machine()
    m.step(Output(2), 3.6)
    assert m.step(Tick(), 3.6 + 10.0) == [A.STOP_PROBES, A.KILL]
    assert m.rejected == "load stalled: no output and no progress for 10 s"
    assert m.step(Exited(2, "killed by SIGKILL"), 14.0) == [A.ROLLBACK, A.SPAWN]


def test_a_trial_that_passed_the_gate_fails_like_any_child_afterwards() -> None:
    m = trial_machine()
    assert m.step(GatePassed(2), 4.0) == [A.START_LIVENESS]
    assert m.trial_generation is None
    assert m.step(Exited(2, "killed by SIGSEGV"), 9.0) == [A.STOP_PROBES]
    assert m.state is S.BACKOFF and m.failures == {"exit": 1} and m.rejected is None
    assert m.crashes == 1 and m.window.times == []  # a crash of a ready child, as for any other


def test_a_rollback_child_that_fails_is_a_plain_failure() -> None:
    m = trial_machine()
    m.step(Exited(2, "exited with code 1"), 4.0)
    assert m.step(Exited(3, "exited with code 1"), 4.5) == [A.STOP_PROBES]
    assert m.state is S.BACKOFF and m.failures == {"load_exit": 1}


def test_a_restart_without_trial_fails_as_before() -> None:
    m = ready_machine()
    m.step(Restart("llama.slots: 2 -> 4"), 3.0)
    m.step(Exited(1, "exited with code 0"), 3.5)
    assert m.trial_generation is None
    assert m.step(Exited(2, "exited with code 1"), 4.0) == [A.STOP_PROBES]
    assert m.state is S.BACKOFF and m.rejected is None


def test_a_stop_during_a_trial_stops() -> None:
    m = trial_machine()
    assert m.step(Stop("SIGTERM"), 4.0) == [A.STOP_PROBES, A.TERMINATE]
    assert m.step(Exited(2, "exited with code 0"), 4.1) == []
    assert m.state is S.STOPPED


# --- the watchdog: the loop's debt, the deadline, the hang -------------------------------------------------
def test_an_answered_loop_probe_owes_nothing() -> None:
    m = ready_machine(loop_deadline_s=5.0)
    assert m.step(LoopAsked(1), 10.0) == []
    assert m.next_deadline() == 15.0
    assert m.step(LoopAnswered(1), 10.01) == []
    assert m.loop_asked_at is None and m.next_deadline() is None
    assert m.step(Tick(), 100.0) == [] and m.state is S.READY


def test_a_loop_owing_past_the_deadline_is_hung_and_killed_at_once() -> None:
    m = ready_machine(loop_deadline_s=5.0)
    m.step(LoopAsked(1), 10.0)
    assert m.step(Tick(), 14.99) == [] and m.state is S.READY
    assert m.step(Tick(), 15.0) == [A.STOP_PROBES, A.KILL]  # SIGKILL: it will not act on SIGTERM
    assert m.state is S.STOPPING and m.reason is not None and m.reason.startswith("failed: hung:")
    assert "did not answer GET /slots for 5.0 s" in m.reason
    assert m.failures == {"hang": 1} and m.crashed and m.crashes == 1 and m.attempt == 0
    assert m.step(Exited(1, "killed by SIGKILL"), 15.1) == []
    assert m.state is S.BACKOFF and m.backoff_until == 16.1  # the crash backoff: 1 s for the first
    assert m.reason is not None and "after a hang of a ready child (1 in a row; never gives up)" in m.reason
    assert m.step(Tick(), 16.1) == [A.SPAWN] and m.generation == 2
    assert m.state is S.STARTING and m.reason is not None
    assert m.reason.startswith("loading the model to replace a hung child (hung: the server loop")
    m.step(GatePassed(2), 18.0)
    assert m.reason is None


def test_a_second_ask_while_owing_keeps_the_first_time() -> None:
    m = ready_machine(loop_deadline_s=5.0)
    m.step(LoopAsked(1), 10.0)
    m.step(LoopAsked(1), 13.0)
    assert m.loop_asked_at == 10.0
    assert m.step(Tick(), 15.0) == [A.STOP_PROBES, A.KILL]


def test_a_busy_loop_that_answers_every_probe_is_never_hung() -> None:
    # A long prefill: the loop answers between batches, each probe within the deadline, for minutes.
    m = ready_machine(loop_deadline_s=5.0)
    t = 10.0
    while t < 600.0:
        m.step(LoopAsked(1), t)
        assert m.step(Tick(), t + 4.9) == []
        m.step(LoopAnswered(1), t + 4.9)
        t += 6.9
    assert m.state is S.READY and m.failures == {}


def test_the_loop_probe_means_nothing_outside_ready() -> None:
    m = Machine(policy(loop_deadline_s=5.0))
    m.step(Start(), 0.0)
    assert m.step(LoopAsked(1), 1.0) == [] and m.loop_asked_at is None  # loading is no hang
    assert m.step(Tick(), 7.0) == [] and m.state is S.STARTING
    m.step(GatePassed(1), 8.0)
    assert m.loop_asked_at is None and m.next_deadline() is None


def test_an_old_childs_answer_does_not_clear_the_new_childs_debt() -> None:
    m = ready_machine(loop_deadline_s=5.0)
    m.step(Exited(1, "killed by SIGSEGV"), 3.0)
    m.step(Tick(), 4.0)
    m.step(GatePassed(2), 5.0)
    m.step(LoopAsked(2), 6.0)
    assert m.step(LoopAnswered(1), 6.5) == [] and m.loop_asked_at == 6.0
    assert m.step(Tick(), 11.0) == [A.STOP_PROBES, A.KILL]


def test_an_unhealthy_childs_held_loop_is_hung_too() -> None:
    m = ready_machine(loop_deadline_s=5.0)
    m.step(LoopAsked(1), 10.0)
    m.step(HealthFailed(1, "no answer within 2 s"), 11.0)
    assert m.state is S.UNHEALTHY
    assert m.step(Tick(), 15.0) == [A.STOP_PROBES, A.KILL] and m.failures == {"hang": 1}


def test_twenty_hangs_of_a_ready_child_never_give_up() -> None:
    m = ready_machine(loop_deadline_s=5.0, max_restarts=1, restart_window_s=1000.0)
    t = 10.0
    for n in range(1, 21):
        m.step(LoopAsked(n), t)
        assert m.step(Tick(), t + 5.0) == [A.STOP_PROBES, A.KILL]
        m.step(Exited(n, "killed by SIGKILL"), t + 5.1)
        assert m.state is S.BACKOFF
        assert m.step(Tick(), m.backoff_until or 0.0) == [A.SPAWN]
        t = (m.backoff_until or 0.0) + 1.0
        m.step(GatePassed(n + 1), t)
    assert m.state is S.READY and m.failures == {"hang": 20} and not m.window.times


def test_loop_deadline_comes_from_the_config() -> None:
    assert Policy.from_config(SupervisionConfig(loop_deadline_s=7.5)).loop_deadline_s == 7.5
