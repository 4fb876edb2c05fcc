"""Fault paths with a real (fake) child process: the supervisor's real OS seam and HTTP probes against
``tests/fakes/fake_llama_server.py``. No sleeps: every wait is for a state, with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psutil
import pytest

from supervisor.child.driver import ChildSupervisor
from supervisor.child.gate import HttpProbes
from supervisor.child.machine import State
from supervisor.child.restart import Policy
from supervisor.child.spawn import RealOs
from supervisor.launch.flags import LaunchSpec
from supervisor.launch.knobs import LlamaKnobs
from tests.fakes.fake_child import make_fake_binary

DEADLINE_S = 20.0


class Watch:
    """Records every transition; ``until`` waits (with a deadline) for one matching a predicate."""

    def __init__(self, sup: ChildSupervisor) -> None:
        self.sup = sup
        self.seen: list[tuple[State, State, str | None, float]] = []
        self._changed = asyncio.Event()
        sup.observers.append(self._on)

    def _on(self, old: State, new: State, reason: str | None) -> None:
        self.seen.append((old, new, reason, time.monotonic()))
        self._changed.set()

    async def until(self, pred: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
        async def wait() -> None:
            while not pred():
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(wait(), timeout_s)
        except TimeoutError:
            seen = [(o.value, n.value, r) for o, n, r, _ in self.seen]
            pytest.fail(f"timed out waiting for {what}; transitions: {seen}")

    def reached(self, state: State, generation: int | None = None) -> Callable[[], bool]:
        return lambda: (
            self.sup.state is state and (generation is None or self.sup.machine.generation == generation)
        )


@contextlib.asynccontextmanager
async def supervised(
    tmp_path: Path, *switches: str, **policy: object
) -> AsyncIterator[tuple[ChildSupervisor, Watch]]:
    binary = make_fake_binary(tmp_path / "bin", *switches)
    spec = LaunchSpec(
        binary,
        tmp_path / "model.gguf",
        "fake",
        0,
        LlamaKnobs(threads=1, threads_batch=1, slots=2, ctx_per_slot=1024),
    )
    base: dict[str, object] = dict(
        load_timeout_s=15.0,
        # Well above a Python start on a busy machine (the fake prints its first line after it): only
        # the tests of the stall itself set a short one.
        stall_timeout_s=10.0,
        health_failures=3,
        stop_grace_s=1.0,
        backoff=lambda n: 0.05,
        max_restarts=5,
        restart_window_s=60.0,
    )
    base.update(policy)
    sup = ChildSupervisor(
        spec,
        Policy(**base),
        os=RealOs(),
        probes=HttpProbes(),
        workdir=tmp_path / "w",  # type: ignore[arg-type]
        health_interval_s=0.2,
        health_timeout_s=0.5,
    )
    watch = Watch(sup)
    task = asyncio.create_task(sup.run())
    try:
        yield sup, watch
    finally:
        if not task.done():
            await asyncio.wait_for(sup.stop("test over"), DEADLINE_S)
        await task
        await sup.probes.aclose()


async def test_ready_with_the_fake(tmp_path: Path) -> None:
    async with supervised(tmp_path) as (sup, watch):
        await watch.until(watch.reached(State.READY), "READY")
        assert sup.snapshot().ready
        pid = sup.child_pid
        assert pid is not None and psutil.pid_exists(pid)
    assert sup.state is State.STOPPED
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_exit_during_load_fails_fast_with_the_last_log_lines(tmp_path: Path) -> None:
    # Load and stall deadlines far beyond the wait's: FAILED within it can only come from the exit.
    async with supervised(
        tmp_path, "--exit-during-load", "7", max_restarts=0, load_timeout_s=600.0, stall_timeout_s=300.0
    ) as (sup, watch):
        await watch.until(watch.reached(State.FAILED), "FAILED")
        assert sup.machine.last_failure == "exited during load: exited with code 7"
        assert any("failed to load model (fake)" in line for line in sup.tail)
        assert State.READY not in [n for _, n, _, _ in watch.seen]


async def test_a_stalled_load_is_killed(tmp_path: Path) -> None:
    async with supervised(tmp_path, "--stall-during-load", stall_timeout_s=1.0, max_restarts=0) as (
        sup,
        watch,
    ):
        await watch.until(watch.reached(State.FAILED), "FAILED")
        assert sup.machine.last_failure == "load stalled: no output and no progress for 1 s"


async def test_a_slow_but_progressing_load_is_not_killed(tmp_path: Path) -> None:
    # Loads for 3 s, twice the stall timeout, but prints progress every 0.2 s.
    async with supervised(tmp_path, "--slow-but-progressing-load", "3", stall_timeout_s=1.5) as (sup, watch):
        await watch.until(watch.reached(State.READY), "READY")
        assert sup.machine.generation == 1 and sup.machine.failures == {}
        assert sup.load_seconds is not None and sup.load_seconds >= 3.0


async def test_a_hang_after_ready_is_detected_and_restarted(tmp_path: Path) -> None:
    async with supervised(tmp_path, "--hang-after-ready", "0.5") as (sup, watch):
        await watch.until(watch.reached(State.READY, generation=2), "READY again after the hang")
        assert sup.machine.failures == {"unhealthy": 1}
        assert (sup.machine.last_failure or "").startswith("not answering /health: 3 consecutive failures")
        states = [n for _, n, _, _ in watch.seen]
        dead = states.index(State.STOPPING)
        assert states[dead - 1 : dead + 3] == [State.UNHEALTHY, State.STOPPING, State.BACKOFF, State.STARTING]


async def test_a_sigstopped_child_is_declared_dead(tmp_path: Path) -> None:
    async with supervised(tmp_path) as (sup, watch):
        await watch.until(watch.reached(State.READY), "READY")
        pid = sup.child_pid
        assert pid is not None
        psutil.Process(pid).suspend()  # SIGSTOP: alive, but answers nothing
        await watch.until(watch.reached(State.READY, generation=2), "READY with a new child")
        assert sup.machine.failures == {"unhealthy": 1}
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_a_child_that_keeps_failing_to_load_ends_in_failed(tmp_path: Path) -> None:
    async with supervised(tmp_path, "--exit-during-load", "3", max_restarts=2) as (sup, watch):
        await watch.until(watch.reached(State.FAILED), "FAILED")
        assert sup.machine.generation == 3  # first start + 2 restarts
        assert sup.machine.reason == (
            "gave up: 3 failed starts within 60 s (max_restarts 2); "
            "last: exited during load: exited with code 3"
        )
        snap = sup.snapshot()
        assert not snap.ready and snap.state == "FAILED" and snap.reason == sup.machine.reason


async def test_a_ready_child_killed_again_and_again_is_never_given_up(tmp_path: Path) -> None:
    # max_restarts 0: one failed start would be FAILED. Five deaths of a child that had passed the gate
    # (what a request that aborts llama-server does) are crashes of a ready child: each is restarted.
    async with supervised(tmp_path, max_restarts=0) as (sup, watch):
        for generation in range(1, 6):
            await watch.until(watch.reached(State.READY, generation), f"READY, child {generation}")
            pid = sup.child_pid
            assert pid is not None
            psutil.Process(pid).kill()
        await watch.until(watch.reached(State.READY, 6), "READY, child 6")
        assert sup.machine.failures == {"exit": 5} and sup.machine.crashes == 5
        assert State.FAILED not in [n for _, n, _, _ in watch.seen]
        backoffs = [r or "" for _, n, r, _ in watch.seen if n is State.BACKOFF]
        assert len(backoffs) == 5
        assert all(" after a crash of a ready child (" in r for r in backoffs), backoffs


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    async with supervised(tmp_path, "--ignore-sigterm", stop_grace_s=1.0) as (sup, watch):
        await watch.until(watch.reached(State.READY), "READY")
        pid = sup.child_pid
        assert pid is not None
        started = time.monotonic()
        await asyncio.wait_for(sup.stop("test"), DEADLINE_S)
        took = time.monotonic() - started
        assert sup.state is State.STOPPED
        assert took >= 1.0  # it had to wait the grace out
        assert sup._child is not None and sup._child.returncode == -signal.SIGKILL
        assert sup._child.killed_by_us


async def test_a_wrong_context_never_becomes_ready(tmp_path: Path) -> None:
    async with supervised(tmp_path, "--wrong-ctx", max_restarts=0) as (sup, watch):
        await watch.until(watch.reached(State.FAILED), "FAILED")
        assert "readiness gate failed: /v1/models reports n_ctx 1280 per slot for 'fake', expected 1024" in (
            sup.machine.last_failure or ""
        )
        assert State.READY not in [n for _, n, _, _ in watch.seen]
