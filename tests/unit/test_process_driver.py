"""The driver with a fake OS seam and a fake clock: spawn, gate, crash, restart, stop; no process,
no socket, no sleep."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

import pytest

from proxy.source import ModelInputs
from supervisor.child.driver import ChildSupervisor
from supervisor.child.loading import FileStamp
from supervisor.child.machine import State, Stop, Tick
from supervisor.child.osseam import ProbeUnreachable, ServedModel
from supervisor.child.restart import Policy
from supervisor.launch.flags import LaunchSpec
from supervisor.launch.knobs import LlamaKnobs


class FakeChild:
    def __init__(self, pid: int, ignore_sigterm: bool = False) -> None:
        self.pid = pid
        self.signals: list[int] = []
        self.ignore_sigterm = ignore_sigterm
        self.counter = 0.0
        self.read_bytes = 0
        self.loaded: int | None = 0  # bytes of the model file brought in
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()

    def say(self, text: str) -> None:
        self._out.put_nowait(text.encode())

    def exit(self, rc: int) -> None:
        if not self._exit.done():
            self._out.put_nowait(None)
            self._exit.set_result(rc)

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL or (sig == signal.SIGTERM and not self.ignore_sigterm):
            self.exit(-sig)

    async def wait(self) -> int:
        return await self._exit

    async def output(self) -> AsyncIterator[bytes]:
        while (chunk := await self._out.get()) is not None:
            yield chunk

    def progress_sample(self) -> tuple[float, int] | None:
        return self.counter, self.read_bytes

    def loaded_bytes(self) -> int | None:
        return self.loaded

    def rss_bytes(self) -> int | None:
        return 123

    def cpu_seconds(self) -> float | None:
        return 1.0


class FakeOs:
    def __init__(self) -> None:
        self.t = 100.0
        self.spawned: list[tuple[list[str], dict[str, str]]] = []
        self.children: list[FakeChild] = []
        self.spawn_error: OSError | None = None
        self.ignore_sigterm = False
        self._port = 40000
        # Model files by path: (size, mtime_ns). Unknown paths cannot be read.
        self.files: dict[str, tuple[int, int]] = {"/m.gguf": (1000, 1)}

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> FakeChild:
        if self.spawn_error is not None:
            raise self.spawn_error
        self.spawned.append((list(argv), dict(env)))
        child = FakeChild(1000 + len(self.children), self.ignore_sigterm)
        self.children.append(child)
        return child

    def free_port(self) -> int:
        self._port += 1
        return self._port

    def port_open(self, port: int) -> bool:
        return False

    def now(self) -> float:
        return self.t

    def file_stamp(self, path: Path) -> FileStamp | None:
        found = self.files.get(str(path))
        return FileStamp(str(path), *found) if found is not None else None


class FakeProbes:
    def __init__(self) -> None:
        self.health_status = 200
        self.n_ctx = 4096
        self.loop_held = False
        self.calls: list[str] = []
        self.model_inputs: ModelInputs | None = None  # what the gate reads after the decode step

    async def health(self, base_url: str, timeout_s: float) -> int:
        self.calls.append("health")
        if self.health_status == 0:
            raise ProbeUnreachable("refused")
        return self.health_status

    async def loop(self, base_url: str, secret: str, deadline_s: float) -> bool:
        # ``loop_held``: the server loop answers no task (the real probe returns False at its deadline).
        self.calls.append("loop")
        return not self.loop_held

    async def models(self, base_url: str, secret: str) -> list[ServedModel]:
        self.calls.append("models")
        return [ServedModel("m", self.n_ctx)]

    async def one_token(self, base_url: str, secret: str) -> None:
        self.calls.append("one_token")

    async def inputs(self, base_url: str, secret: str) -> ModelInputs | None:
        return self.model_inputs

    async def aclose(self) -> None:
        return None


SPEC = LaunchSpec(
    Path("/bin/llama-server"),
    Path("/m.gguf"),
    "m",
    0,
    LlamaKnobs(threads=2, threads_batch=2, slots=2, ctx_per_slot=4096),
)


def make(os_: FakeOs, probes: FakeProbes, tmp_path: Path, **policy: object) -> ChildSupervisor:
    base: dict[str, object] = dict(
        load_timeout_s=60.0, stall_timeout_s=10.0, stop_grace_s=5.0, backoff=lambda n: 1.0, max_restarts=5
    )
    base.update(policy)
    return ChildSupervisor(
        SPEC,
        Policy(**base),
        os=os_,
        probes=probes,
        workdir=tmp_path / "w",
        health_interval_s=1000.0,  # type: ignore[arg-type]
    )


async def settle(sup: ChildSupervisor) -> None:
    """Let the child's tasks run and dispatch what they posted, until nothing moves."""
    for _ in range(50):
        for _ in range(5):
            await asyncio.sleep(0)
        if not await sup.dispatch_pending():
            return


async def start(sup: ChildSupervisor) -> None:
    from supervisor.child.machine import Start

    await sup.dispatch(Start())
    await settle(sup)


async def test_spawn_gate_ready(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    sup = make(os_, probes, tmp_path)
    seen: list[tuple[State, State]] = []
    sup.observers.append(lambda old, new, reason: seen.append((old, new)))
    await start(sup)
    assert sup.state is State.READY
    assert probes.calls[-3:] == ["health", "models", "one_token"]
    assert seen == [(State.STOPPED, State.STARTING), (State.STARTING, State.READY)]
    argv, env = os_.spawned[0]
    snap = sup.snapshot()
    assert snap.ready and snap.generation == 1
    assert snap.base_url == f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    assert snap.secret == env["LLAMA_API_KEY"]
    assert (snap.model_alias, snap.slots, snap.ctx_per_slot) == ("m", 2, 4096)
    assert sup.load_seconds == 0.0  # fake clock did not move
    assert sup.identity()["status"]["child_pid"] == 1000  # type: ignore[index]


async def test_wrong_context_fails_the_gate(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    probes.n_ctx = 2048
    sup = make(os_, probes, tmp_path)
    await start(sup)
    assert sup.state is State.BACKOFF
    assert "expected 4096" in (sup.machine.last_failure or "")
    assert os_.children[0].signals == [signal.SIGKILL]


async def test_crash_is_decoded_and_restarted_with_a_new_port_and_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os_, probes = FakeOs(), FakeProbes()
    sup = make(os_, probes, tmp_path)
    await start(sup)
    first = os_.children[0]
    first.say("0.01.000.000 E srv  boom: something broke\n")
    first.exit(-signal.SIGKILL)  # nobody in llamagate sent it
    with caplog.at_level(logging.DEBUG):
        await settle(sup)
    assert sup.state is State.BACKOFF
    assert sup.machine.last_failure == "killed by SIGKILL from outside (out of memory?)"
    assert "boom: something broke" in sup.tail[-1]
    assert not sup.snapshot().ready and sup.snapshot().base_url is None
    os_.t += 1.0
    await sup.dispatch(Tick())
    await settle(sup)
    assert sup.state is State.READY and sup.machine.generation == 2
    (argv1, env1), (argv2, env2) = os_.spawned
    assert argv1[argv1.index("--port") + 1] != argv2[argv2.index("--port") + 1]
    assert env1["LLAMA_API_KEY"] != env2["LLAMA_API_KEY"]
    assert sup.status()["restarts"] == 1
    # The child's error line was logged at WARNING, the secret never.
    assert any(r.name == "llamagate.child" and r.levelno == logging.WARNING for r in caplog.records)
    assert env1["LLAMA_API_KEY"] not in caplog.text


async def test_stop_escalates_to_sigkill_after_the_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os_, probes = FakeOs(), FakeProbes()
    os_.ignore_sigterm = True
    sup = make(os_, probes, tmp_path)
    await start(sup)
    await sup.dispatch(Stop("SIGTERM"))
    child = os_.children[0]
    assert child.signals == [signal.SIGTERM]
    assert sup.state is State.STOPPING
    os_.t += 4.9
    await sup.dispatch(Tick())
    assert child.signals == [signal.SIGTERM]
    os_.t += 0.1
    with caplog.at_level(logging.INFO):
        await sup.dispatch(Tick())
        await settle(sup)
    assert child.signals == [signal.SIGTERM, signal.SIGKILL]
    assert sup.state is State.STOPPED
    assert "llama-server killed by SIGKILL" in caplog.text
    assert "from outside" not in caplog.text


async def test_cpu_or_disk_progress_extends_a_quiet_load(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    probes.health_status = 503  # loading: the gate keeps polling
    sup = make(os_, probes, tmp_path)
    await start(sup)
    child = os_.children[0]
    os_.t += 5
    await sup.dispatch(Tick())  # first sample
    child.counter += 0.5  # half a core for 4 s: working
    os_.t += 4
    await sup.dispatch(Tick())
    child.read_bytes += 8 << 20  # reading the model from disk
    os_.t += 4
    await sup.dispatch(Tick())
    child.counter += 0.01  # 10 ms of CPU in 4 s: only answering polls, not progress
    os_.t += 4
    await sup.dispatch(Tick())
    os_.t += 5.9
    await sup.dispatch(Tick())
    assert sup.state is State.STARTING  # quiet for 9.9 s only since the last progress
    os_.t += 0.1
    await sup.dispatch(Tick())
    await settle(sup)
    assert sup.machine.last_failure == "load stalled: no output and no progress for 10 s"
    assert child.signals == [signal.SIGKILL]


async def test_spawn_error_is_a_failure(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    os_.spawn_error = FileNotFoundError(2, "No such file or directory")
    sup = make(os_, probes, tmp_path)
    await start(sup)
    assert sup.state is State.BACKOFF
    assert sup.machine.last_failure == "could not start: /bin/llama-server: No such file or directory"


async def test_draining_turns_readiness_off_at_once(tmp_path: Path) -> None:
    sup = make(FakeOs(), FakeProbes(), tmp_path)
    await start(sup)
    sup.draining = True
    snap = sup.snapshot()
    assert snap.state == "READY" and not snap.ready
    assert snap.reason == "draining: the daemon is stopping"
    assert snap.base_url is not None  # in-flight requests still reach the child
    shown = {"uptime_s", "ready_for_s", "restarts", "last_failure", "load_seconds", "last_reload"}
    assert set(snap.info) == shown


async def test_observer_errors_do_not_stop_the_supervisor(tmp_path: Path) -> None:
    sup = make(FakeOs(), FakeProbes(), tmp_path)

    def broken(old: State, new: State, reason: str | None) -> None:
        raise RuntimeError("observer bug")

    sup.observers.append(broken)
    await start(sup)
    assert sup.state is State.READY


async def test_run_and_stop(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    sup = make(os_, probes, tmp_path)
    ready = asyncio.Event()
    sup.observers.append(lambda old, new, reason: ready.set() if new is State.READY else None)
    task = asyncio.create_task(sup.run())
    await asyncio.wait_for(ready.wait(), 5)
    await asyncio.wait_for(sup.stop("test"), 5)
    assert task.done() and sup.state is State.STOPPED
    assert os_.children[0].signals == [signal.SIGTERM]


class BrokenProbes(FakeProbes):
    """Probes that fail in a way nobody planned for (a bug, an unexpected library error)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    async def models(self, base_url: str, secret: str) -> list[ServedModel]:
        if self.where == "gate":
            raise RuntimeError("unplanned")
        return await super().models(base_url, secret)

    async def health(self, base_url: str, timeout_s: float) -> int:
        if self.where == "liveness" and "one_token" in self.calls:
            raise RuntimeError("unplanned")
        return await super().health(base_url, timeout_s)


async def test_an_unexpected_gate_error_fails_the_gate_at_once(tmp_path: Path) -> None:
    # Not a silent dead task that leaves the child STARTING until the stall timeout blames the child.
    os_ = FakeOs()
    sup = make(os_, BrokenProbes("gate"), tmp_path)
    await start(sup)
    assert sup.state is State.BACKOFF
    assert sup.machine.last_failure == "readiness gate failed: RuntimeError: unplanned"


async def test_an_unexpected_probe_error_counts_as_a_failed_health_probe(tmp_path: Path) -> None:
    # Not a silent dead liveness task that would leave a hung child READY forever.
    os_ = FakeOs()
    sup = ChildSupervisor(
        SPEC,
        Policy(health_failures=3, backoff=lambda n: 1.0),
        os=os_,
        probes=BrokenProbes("liveness"),
        workdir=tmp_path / "w",
        health_interval_s=0.0,
    )
    await start(sup)
    await settle(sup)
    assert sup.state is State.BACKOFF
    assert sup.machine.last_failure is not None
    assert "3 consecutive failures (last: RuntimeError: unplanned)" in sup.machine.last_failure


# --- new llama settings on trial (SIGHUP): a child that fails before the gate rolls them back --------
BOGUS = SPEC.with_llama(extra_args=("--bogus-flag",))


class TrialOs(FakeOs):
    """A child started with ``--bogus-flag`` prints llama-server's error and exits 1 during load, and
    its /health never answers 200 (so its gate cannot pass before the exit is seen)."""

    def __init__(self, probes: UrlProbes) -> None:
        super().__init__()
        self.probes = probes

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> FakeChild:
        child = await super().spawn(argv, env, cwd)
        if "--bogus-flag" in argv:
            self.probes.loading.add(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}")
            child.say("error: invalid argument: --bogus-flag\n")
            child.exit(1)
        return child


class UrlProbes(FakeProbes):
    def __init__(self) -> None:
        super().__init__()
        self.loading: set[str] = set()

    async def health(self, base_url: str, timeout_s: float) -> int:
        return 503 if base_url in self.loading else await super().health(base_url, timeout_s)


async def until(sup: ChildSupervisor, pred: Callable[[], bool], what: str) -> None:
    """Dispatch what the child's tasks post until ``pred`` holds (the gate polls on a real timer)."""
    deadline = asyncio.get_running_loop().time() + 10.0
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await settle(sup)
        await asyncio.sleep(0.01)


async def test_new_settings_whose_child_exits_during_load_roll_back(tmp_path: Path) -> None:
    probes = UrlProbes()
    os_ = TrialOs(probes)
    sup = make(os_, probes, tmp_path, max_restarts=0)  # a counted failure would mean FAILED
    sup.set_identity({"model": "old"})
    sup.budget = {"kv_bytes": 1}
    await start(sup)
    trial = asyncio.create_task(sup.try_settings(BOGUS, {"model": "new"}, {"kv_bytes": 2}, "extra_args"))
    await until(sup, lambda: trial.done() and sup.state is State.READY, "READY after the rollback")
    # The child's own first error line names the cause.
    assert trial.result() == (
        "llama-server exited during load: exited with code 1: error: invalid argument: --bogus-flag"
    )
    # Spawned: the first child, the one on trial, then the previous settings again.
    assert ["--bogus-flag" in argv for argv, _ in os_.spawned] == [False, True, False]
    assert os_.children[0].signals == [signal.SIGTERM]  # the working child was stopped politely
    assert sup.machine.generation == 3 and sup.machine.failures == {}
    assert sup.template == SPEC and sup.served_identity == {"model": "old"} and sup.budget == {"kv_bytes": 1}


async def test_new_settings_that_fail_the_gate_roll_back(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()  # answers n_ctx 4096: a child asked for 8192 fails the gate
    sup = make(os_, probes, tmp_path)
    await start(sup)
    trial = asyncio.create_task(sup.try_settings(SPEC.with_llama(ctx_per_slot=8192), {}, None, "ctx"))
    await until(sup, trial.done, "the trial's outcome")
    assert "readiness gate failed" in (trial.result() or "")
    assert os_.children[1].signals == [signal.SIGKILL]
    await until(sup, lambda: sup.state is State.READY, "READY on the previous settings")
    assert sup.snapshot().ctx_per_slot == 4096 and sup.machine.generation == 3


async def test_new_settings_that_pass_the_gate_are_kept_and_become_the_good_ones(tmp_path: Path) -> None:
    probes = UrlProbes()
    os_ = TrialOs(probes)
    sup = make(os_, probes, tmp_path)
    await start(sup)
    three = SPEC.with_llama(slots=3)
    trial = asyncio.create_task(sup.try_settings(three, {"model": "three"}, None, "slots"))
    assert sup.snapshot().slots == 2  # the old child still serves until the new one is spawned
    await until(sup, trial.done, "the trial's outcome")
    assert trial.result() is None
    assert sup.state is State.READY and sup.snapshot().slots == 3 and sup.template == three
    # The next bad settings roll back to these, not to the first ones.
    bad = asyncio.create_task(sup.try_settings(three.with_llama(extra_args=("--bogus-flag",)), {}, None, "x"))
    await until(sup, lambda: bad.done() and sup.state is State.READY, "READY after the rollback")
    assert bad.result() is not None and sup.template == three


async def test_with_no_settings_known_to_work_new_ones_apply_directly(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    probes.n_ctx = 8192  # the first settings (4096) never pass the gate
    sup = make(os_, probes, tmp_path)
    await start(sup)
    assert sup.state is State.BACKOFF
    fixed = SPEC.with_llama(ctx_per_slot=8192)
    assert await sup.try_settings(fixed, {}, None, "ctx") is None  # nothing to protect: no trial
    await settle(sup)
    assert sup.state is State.READY and sup.template == fixed and sup.machine.trial_generation is None


async def test_failed_promises_no_retry_and_says_how_to_recover(tmp_path: Path) -> None:
    os_, probes = FakeOs(), FakeProbes()
    probes.n_ctx = 2048
    sup = make(os_, probes, tmp_path, max_restarts=0)
    await start(sup)
    assert sup.state is State.FAILED
    snap = sup.snapshot()
    assert snap.retry_after_s is None
    assert "SIGHUP" in str(snap.info["recovery"]) and "SIGHUP" in sup.status()["recovery"]
    probes.n_ctx = 4096
    sup.restart("SIGHUP while FAILED")
    await settle(sup)
    assert sup.state is State.READY and "recovery" not in sup.snapshot().info
    assert sup.snapshot().retry_after_s == 0.0


async def test_every_record_of_a_named_models_child_names_it_in_text_and_json(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Several models: the supervisor's lines, the child's own output lines and the log tail of a
    failure all carry ``model``; a one-model daemon's records stay as they were (no field)."""
    import json

    from supervisor.logs import JsonFormatter, TextFormatter

    for model in ("embed", None):
        caplog.clear()
        os_, probes = FakeOs(), FakeProbes()
        sup = make(os_, probes, tmp_path)
        if model is not None:
            sup = ChildSupervisor(
                SPEC, sup.machine.policy, os=os_, probes=probes, workdir=tmp_path / "w", model=model
            )
        with caplog.at_level(logging.DEBUG):
            await start(sup)
            child = os_.children[0]
            child.say("0.01.000.000 E srv  boom: something broke\n")
            child.say("0.01.000.000 I srv  an ordinary line\n")
            child.exit(-signal.SIGKILL)
            await settle(sup)
        ours = [r for r in caplog.records if r.name in ("llamagate.supervisor", "llamagate.child")]
        names = {r.name for r in ours}
        assert names == {"llamagate.supervisor", "llamagate.child"}
        assert any("child_log_tail" in getattr(r, "fields", {}) for r in ours)  # the BACKOFF line
        for record in ours:
            fields = getattr(record, "fields", {})
            assert fields.get("model") == model, (record.getMessage(), fields)
            assert "pid" in fields or record.name == "llamagate.supervisor"
            text = TextFormatter().format(record)
            assert (f" model={model}" in text) is (model is not None)
            assert json.loads(JsonFormatter().format(record)).get("model") == model


# --- the watchdog: a loop that owes the probe's answer past the deadline is hung -----------------------
async def test_a_held_loop_is_killed_and_restarted_like_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os_, probes = FakeOs(), FakeProbes()
    sup = ChildSupervisor(
        SPEC,
        Policy(loop_deadline_s=5.0, backoff=lambda n: 1.0),
        os=os_,
        probes=probes,
        workdir=tmp_path / "w",
        health_interval_s=0.0,
    )
    await start(sup)
    await settle(sup)
    assert sup.state is State.READY and "loop" in probes.calls  # answered: nothing owed
    assert sup.machine.loop_asked_at is None
    probes.loop_held = True  # /health still 200: the HTTP threads run, the loop does not
    await settle(sup)
    assert sup.machine.loop_asked_at == os_.t and sup.state is State.READY
    os_.t += 4.9
    await sup.dispatch(Tick())
    assert sup.state is State.READY  # within the deadline: a busy loop may still answer
    os_.t += 0.1
    with caplog.at_level(logging.INFO):
        await sup.dispatch(Tick())
        await settle(sup)
    assert os_.children[0].signals == [signal.SIGKILL]  # no SIGTERM: a held loop does not act on it
    assert sup.state is State.BACKOFF
    assert sup.machine.failures == {"hang": 1} and sup.machine.crashes == 1
    snap = sup.snapshot()
    assert not snap.ready and snap.reason is not None
    assert "after a hang of a ready child" in snap.reason and "did not answer GET /slots" in snap.reason
    hang_lines = [r for r in caplog.records if getattr(r, "fields", {}).get("cause") == "hang"]
    assert len(hang_lines) == 1 and hang_lines[0].levelno == logging.WARNING
    probes.loop_held = False
    os_.t += 1.0
    await sup.dispatch(Tick())
    await settle(sup)
    assert sup.state is State.READY and sup.machine.generation == 2
