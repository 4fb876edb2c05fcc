"""The supervisor's driver: carries out what the state machine decides, and feeds it what happens.

One asyncio task (``run``) owns the machine. Everything else (the child's exit, its output, gate and
health probe results, stop and restart requests) arrives as an event on one queue, so the machine is
only ever touched from that task and there is no locking. Timers are the machine's own deadlines:
the loop waits for the next event at most until the earliest one.

New llama settings (SIGHUP) go through ``try_settings``: they take effect when the next child is
spawned, and while the previous settings are known to pass the readiness gate the new child runs on
trial; if it fails before the gate the machine answers ROLLBACK and the previous settings (argv,
identity, budget) are put back before the next spawn. ``try_settings`` returns once the outcome is
known, so the daemon applies the rest of a reload only with the settings that are actually served.

Also the object the proxy reads (``UpstreamSource``: ``snapshot()``, ``identity()``) and the one
metrics read (``state``, ``machine.restarts``, ``machine.failures``, ``load_seconds``,
``child_rss_bytes()``, ``child_cpu_seconds()``, ``budget``). While a child loads, its snapshot
carries the load's progress, step and remaining time (``supervisor.child.loading``), sampled from the
child on this loop, and its ``retry_after_s`` comes from the previous load of the same model file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from proxy.source import ModelInputs, UpstreamSnapshot
from supervisor.child.gate import readiness_gate
from supervisor.child.loading import LOAD_SAMPLE_S, LoadProgress, LoadTimes
from supervisor.child.log import LineFilter, first_error, is_error, is_noise
from supervisor.child.machine import (
    Action,
    Event,
    Exited,
    GateFailed,
    GatePassed,
    HealthFailed,
    HealthOk,
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
from supervisor.child.osseam import (
    ChildHandle,
    ChildOs,
    Probes,
    ProbeUnreachable,
    ProbeWrongAnswer,
    describe_exit,
)
from supervisor.child.restart import Policy
from supervisor.launch.flags import CHILD_HOST, LaunchSpec, build_argv, build_env, new_secret

log = logging.getLogger("llamagate.supervisor")
child_log = logging.getLogger("llamagate.child")


class ModelLog(logging.LoggerAdapter[logging.Logger]):
    """A logger that adds ``model`` to every record's fields: with several models, each child's
    supervisor and output lines say whose they are. No model (one-model daemon): records as before."""

    def __init__(self, logger: logging.Logger, model: str | None) -> None:
        super().__init__(logger, {})
        self.model = model

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        if self.model is not None:
            extra = dict(kwargs.get("extra") or {})
            extra["fields"] = {"model": self.model, **extra.get("fields", {})}
            kwargs["extra"] = extra
        return msg, kwargs


StateObserver = Callable[[State, State, "str | None"], None]
# Called on every loop turn with the monotonic time; returns seconds until it wants the next call.
TickHook = Callable[[float], "float | None"]

# While loading, how often the child's CPU time and disk reads are sampled as a sign of progress, and
# how much counts. Answering our own /health polls with 503 costs llama-server about 2 ms of CPU per
# second; loading costs most of a core, or shows as reads from storage.
PROGRESS_SAMPLE_S = 1.0
PROGRESS_CPU_SHARE = 0.05
PROGRESS_READ_BYTES = 1 << 20


# FAILED: nothing is retried until an operator acts, so /readyz promises no retry time but says this.
RECOVERY = (
    "nothing is retried automatically: fix the cause (see last_failure and the daemon's log), then send "
    "SIGHUP (the daemon reloads its config and starts llama-server again) or restart the daemon"
)


@dataclass(frozen=True)
class _Settings:
    """What one set of llama settings is served as: the child's argv template and what is reported."""

    template: LaunchSpec
    identity: Mapping[str, object]
    budget: Mapping[str, object] | None


@dataclass
class _Trial:
    outcome: asyncio.Future[str | None]
    generation: int | None = None  # set when the child on trial is spawned


@dataclass
class _Child:
    generation: int
    handle: ChildHandle
    port: int
    secret: str
    spec: LaunchSpec
    spawned_at: float
    killed_by_us: bool = False
    returncode: int | None = None
    progress: tuple[float, float, int] | None = None  # (when, CPU seconds, bytes read)
    load: LoadProgress | None = None
    inputs: ModelInputs | None = None  # what the model takes beside text, read by the readiness gate
    output_seen: asyncio.Event = field(default_factory=asyncio.Event)
    scrub: LineFilter = field(default_factory=LineFilter)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{CHILD_HOST}:{self.port}"


class ChildSupervisor:
    def __init__(
        self,
        template: LaunchSpec,
        policy: Policy,
        *,
        os: ChildOs,
        probes: Probes,
        workdir: Path,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 2.0,
        identity: Mapping[str, object] | None = None,
        tail_lines: int = 30,
        model: str | None = None,
        load_times: LoadTimes | None = None,
        n_vocab: int | None = None,
    ) -> None:
        self.template = template
        # The model's vocabulary size (GGUF header), for the request schema's token-id bounds.
        self.n_vocab = n_vocab
        # ``model``: the served model's name (several models); every record of this child carries it.
        self.model = model
        self.log = ModelLog(log, model)
        self.child_log = ModelLog(child_log, model)
        self.machine = Machine(policy)
        self.os = os
        self.probes = probes
        self.workdir = workdir
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self._identity: Mapping[str, object] = identity or {}
        self.observers: list[StateObserver] = []
        self.tick_hooks: list[TickHook] = []
        # The daemon's last word on each child's spec (its states folder made and held, or the tier off).
        self.before_spawn: Callable[[LaunchSpec], Awaitable[LaunchSpec]] | None = None
        self.draining = False
        self.budget: Mapping[str, object] | None = None
        self.load_seconds: float | None = None
        # How long loads of each model file took. Pass one shared store to every supervisor the daemon
        # builds (an on-demand model gets a fresh supervisor per load), with a file to outlive restarts.
        self.load_times = load_times if load_times is not None else LoadTimes()
        self.started_at = os.now()
        self.ready_since: float | None = None
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._child: _Child | None = None
        self._last_port: int | None = None
        self._done = asyncio.Event()
        self._good: _Settings | None = None  # the last settings whose child passed the readiness gate
        self._proposed: _Settings | None = None  # applied at the next spawn
        self._trial: _Trial | None = None
        # The last reload's outcome for status and /readyz (set by the daemon): e.g. why it was rejected.
        self.last_reload: str | None = None
        # Told of each hang the watchdog decides (reason, generation): the daemon's OpenTelemetry span.
        self.on_hang: Callable[[str, int], None] | None = None

    # --- what others read ----------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def child_pid(self) -> int | None:
        return self._child.handle.pid if self._child and self._child.returncode is None else None

    def child_rss_bytes(self) -> int | None:
        return self._child.handle.rss_bytes() if self._child else None

    def child_cpu_seconds(self) -> float | None:
        return self._child.handle.cpu_seconds() if self._child else None

    def identity(self) -> Mapping[str, object]:
        """What is served (for admins), with the memory budget and the live status beside it."""
        return {**self._identity, "budget": self.budget, "status": self.status()}

    @property
    def served_identity(self) -> Mapping[str, object]:
        return self._identity

    def set_identity(self, identity: Mapping[str, object]) -> None:
        self._identity = identity

    def status(self) -> dict[str, Any]:
        """Live, non-secret figures for /readyz, ``llamagate status`` and logs."""
        m, now = self.machine, self.os.now()
        return {
            "state": m.state.value,
            "ready": m.ready and not self.draining,
            "reason": self._reason(),
            "uptime_s": round(now - self.started_at, 1),
            "ready_for_s": round(now - self.ready_since, 1) if self.ready_since is not None else None,
            "restarts": m.restarts,
            "failures": dict(m.failures),
            "last_failure": m.last_failure,
            "load_seconds": round(self.load_seconds, 3) if self.load_seconds is not None else None,
            "generation": m.generation,
            "child_pid": self.child_pid,
            "child_port": self._child.port if self.child_pid is not None and self._child else None,
            "last_reload": self.last_reload,
            "supervision": {
                "health_interval_s": self.health_interval_s,
                "health_timeout_s": self.health_timeout_s,
                "loop_deadline_s": m.policy.loop_deadline_s,
                "max_restarts": m.policy.max_restarts,
                "restart_window_s": m.policy.restart_window_s,
            },
            **({"recovery": RECOVERY} if m.state is State.FAILED else {}),
        }

    def snapshot(self) -> UpstreamSnapshot:
        m, child, spec = self.machine, self._child, self.template
        live = child is not None and child.returncode is None and m.state is not State.STOPPED
        return UpstreamSnapshot(
            state=m.state.value,
            ready=m.ready and not self.draining,
            reason=self._reason(),
            base_url=child.base_url if live and child else None,
            secret=child.secret if live and child else None,
            model_alias=spec.alias,
            slots=spec.llama.slots,
            ctx_per_slot=spec.llama.ctx_per_slot,
            generation=m.generation,
            retry_after_s=self._retry_after(),
            embeddings=spec.llama.embeddings,
            reranking=spec.llama.reranking,
            info=self._public_status(),
            n_vocab=self.n_vocab,
            slot_states=spec.slot_states,
            inputs=child.inputs if live and child else None,
            **self._load_view(),
        )

    def _loading(self) -> LoadProgress | None:
        child = self._child
        if (
            self.machine.state is not State.STARTING
            or child is None
            or child.generation != self.machine.generation
        ):
            return None
        return child.load

    def _load_view(self) -> dict[str, Any]:
        """progress (0..1, 1 once loaded), load_eta_s and load_step for the snapshot."""
        state = self.machine.state
        if state in (State.READY, State.UNHEALTHY):
            return {"progress": 1.0, "load_eta_s": None, "load_step": None}
        if state is not State.STARTING:
            return {"progress": None, "load_eta_s": None, "load_step": None}
        load = self._loading()
        left = self._load_eta(self.os.now())
        return {
            # No record yet: decided, not spawned (the spawn is being awaited), so nothing is done.
            "progress": round(load.fraction, 4) if load is not None else 0.0,
            "load_eta_s": round(left, 1) if left is not None else None,
            "load_step": load.step if load is not None else "health",
        }

    def _load_eta(self, now: float) -> float | None:
        """Seconds left of the load in progress, from the previous load of the same file."""
        load = self._loading()
        if load is not None:
            return load.eta_s(now)
        return self.load_estimate_s() if self.machine.state is State.STARTING else None

    def load_estimate_s(self) -> float | None:
        """How long the next load of the configured model file should take (its previous load's time);
        None when it was never loaded (or the file changed since)."""
        return self.load_times.get(self.os.file_stamp(self.template.model))

    def _public_status(self) -> dict[str, object]:
        """The part of ``status()`` that /readyz shows without credentials (no pid, no paths)."""
        s = self.status()
        keys = (
            "uptime_s",
            "ready_for_s",
            "restarts",
            "last_failure",
            "load_seconds",
            "last_reload",
            "offload",
        )
        return {k: s[k] for k in (*keys, "recovery") if k in s}

    def _reason(self) -> str | None:
        if self.draining:
            return "draining: the daemon is stopping"
        return self.machine.reason

    def _retry_after(self) -> float | None:
        m, now = self.machine, self.os.now()
        if m.state is State.FAILED:
            return None  # no retry is scheduled: the answer says how to recover instead
        if m.state is State.READY and not self.draining:
            return 0.0
        if (eta := self._load_eta(now)) is not None:
            return max(1.0, eta)  # the previous load of the same file says how long this one takes
        # BACKOFF: the next load is of the configured file; otherwise the last load of any file.
        load = self.load_estimate_s() if m.state is State.BACKOFF else None
        if load is None:
            load = self.load_seconds if self.load_seconds is not None else 5.0
        if m.state is State.STARTING:
            return max(1.0, load - (now - m.spawned_at))
        if m.state is State.BACKOFF and m.backoff_until is not None:
            return max(1.0, m.backoff_until - now + load)
        if m.state is State.UNHEALTHY:
            return max(1.0, self.health_interval_s)
        return 30.0 if m.state in (State.STOPPING, State.STOPPED) else 5.0

    def _hang_verdict(self, reason: str | None) -> bool:
        """Whether a transition's reason is the watchdog's verdict (the machine's ``_hung``)."""
        return self.machine.last_failure_cause == "hang" and (reason or "").startswith("failed: hung:")

    # --- what others ask -----------------------------------------------------------------------------
    def post(self, event: Event) -> None:
        self._events.put_nowait(event)

    async def stop(self, reason: str = "stop requested") -> None:
        """Stop the child (SIGTERM, grace, SIGKILL) and return once it is reaped and ``run`` ended."""
        self.post(Stop(reason))
        await self._done.wait()

    def govern(self, policy: Policy, health_interval_s: float, health_timeout_s: float) -> None:
        """New ``supervision:`` settings (SIGHUP): the machine decides by ``policy`` from its next step,
        and the liveness probe runs at the new interval from now (not after the old one's wait)."""
        self.machine.policy = policy
        self.machine.window.window_s = policy.restart_window_s
        self.machine.window.max_restarts = policy.max_restarts
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        child = self._child
        liveness = child.tasks.get("liveness") if child is not None else None
        if child is not None and liveness is not None and not liveness.done():
            liveness.cancel()
            # A loop probe cancelled mid-flight can no longer be answered: its debt goes with it (the
            # new task asks again within one interval), or a slow answer lost here would read as a hang.
            self.machine.loop_asked_at = None
            self._start_task(child, "liveness", self._liveness(child))

    def restart(self, reason: str, template: LaunchSpec | None = None) -> None:
        """Restart the child now, e.g. because a llama setting changed (SIGHUP)."""
        if template is not None:
            self.template = template
        self.post(Restart(reason))

    async def try_settings(
        self,
        template: LaunchSpec,
        identity: Mapping[str, object],
        budget: Mapping[str, object] | None,
        reason: str,
    ) -> str | None:
        """Restart the child on new llama settings. Returns None once a child on them passed the gate,
        or why it failed, after the previous settings were put back (a new child is then starting on
        them). With no settings known to work (never READY, or FAILED now) there is nothing to protect:
        the new ones simply apply and this returns None at once."""
        settings = _Settings(template, identity, budget)
        self._proposed = settings
        if self._good is None or self.machine.state is State.FAILED:
            self.post(Restart(reason))
            return None
        trial = _Trial(asyncio.get_running_loop().create_future())
        self._trial = trial
        self.post(Restart(reason, trial=True))
        try:
            return await trial.outcome
        finally:
            if self._trial is trial:
                self._trial = None

    # --- the loop ------------------------------------------------------------------------------------
    async def run(self) -> None:
        self.post(Start())
        try:
            while not (self.machine.state is State.STOPPED and self.machine.stop_requested):
                await self.dispatch(await self._next_event())
            self._confirm_port_closed()
        finally:
            await self._cancel_all()
            self._done.set()

    async def dispatch_pending(self) -> int:
        """Dispatch the events already queued, without waiting (tests drive the loop with this)."""
        count = 0
        while not self._events.empty():
            await self.dispatch(self._events.get_nowait())
            count += 1
        return count

    async def _next_event(self) -> Event:
        now = self.os.now()
        waits = [d - now for d in (self.machine.next_deadline(),) if d is not None]
        if self.machine.state is State.STARTING:
            waits.append(min(PROGRESS_SAMPLE_S, LOAD_SAMPLE_S))
        for hook in self.tick_hooks:
            due = hook(now)
            if due is not None:
                waits.append(due)
        timeout = max(0.0, min(waits)) if waits else None
        try:
            return await asyncio.wait_for(self._events.get(), timeout)
        except TimeoutError:
            return Tick()

    async def dispatch(self, event: Event) -> None:
        """Fold one event into the machine and carry out its actions (tests call this directly)."""
        if isinstance(event, Tick):
            self._sample_progress()
        self._sample_load()
        now = self.os.now()
        actions = self.machine.step(event, now)
        for t in self.machine.transitions:
            self._on_transition(t.old, t.new, t.reason, now)
        for action in actions:
            await self._apply(action)

    def _sample_progress(self) -> None:
        child = self._child
        if child is None or self.machine.state is not State.STARTING:
            return
        sample = child.handle.progress_sample()
        if sample is None:
            return
        now = self.os.now()
        cpu, read = sample
        if child.progress is not None:
            then, cpu0, read0 = child.progress
            if now - then < PROGRESS_SAMPLE_S:
                return  # the loop wakes more often while loading (for the load's progress)
            busy = (cpu - cpu0) >= PROGRESS_CPU_SHARE * max(now - then, 1e-3)
            if busy or read - read0 >= PROGRESS_READ_BYTES:
                self.machine.step(Output(child.generation), now)
        child.progress = (now, cpu, read)

    def _sample_load(self) -> None:
        load, now = self._loading(), self.os.now()
        if load is not None and self._child is not None and load.due(now):
            load.observe(self._child.handle.loaded_bytes(), now)

    def _on_transition(self, old: State, new: State, reason: str | None, now: float) -> None:
        fields: dict[str, Any] = {"from": old.value, "to": new.value, "generation": self.machine.generation}
        if new is State.READY and old is State.STARTING and self._child is not None:
            self.load_seconds = now - self._child.spawned_at
            self.ready_since = now
            if self._child.load is not None:
                self.load_times.put(self._child.load.stamp, self.load_seconds)
            fields["load_seconds"] = round(self.load_seconds, 3)
            self._good = _Settings(self.template, self._identity, self.budget)
            trial = self._trial
            if trial is not None and trial.generation == self.machine.generation and not trial.outcome.done():
                trial.outcome.set_result(None)
        elif new is not State.READY and new is not State.UNHEALTHY:
            self.ready_since = None
        level = logging.WARNING if new in (State.FAILED, State.BACKOFF, State.UNHEALTHY) else logging.INFO
        if new is State.STOPPING and self._hang_verdict(reason):
            # The hang's own line, at the moment it is decided (the BACKOFF line follows once it is dead).
            level, fields["cause"] = logging.WARNING, "hang"
            if self.on_hang is not None:
                try:
                    self.on_hang(reason or "", self.machine.generation)
                except Exception:
                    self.log.exception("hang hook failed")
        if new in (State.BACKOFF, State.FAILED) and self.tail:
            fields["child_log_tail"] = "\n".join(self.tail)
        self.log.log(
            level, f"llama-server {new.value}" + (f" ({reason})" if reason else ""), extra={"fields": fields}
        )
        for observer in list(self.observers):
            try:
                observer(old, new, reason)
            except Exception:  # an observer (metrics, notify) must never take the supervisor down
                self.log.exception("state observer failed")

    async def _apply(self, action: Action) -> None:
        child = self._child
        if action is Action.SPAWN:
            await self._spawn()
        elif action is Action.START_LIVENESS and child is not None:
            self._start_task(child, "liveness", self._liveness(child))
        elif action is Action.STOP_PROBES and child is not None:
            for name in ("gate", "liveness"):
                task = child.tasks.pop(name, None)
                if task is not None:
                    task.cancel()
        elif action is Action.TERMINATE and child is not None:
            self.log.info("sending SIGTERM to llama-server", extra={"fields": {"pid": child.handle.pid}})
            child.handle.send_signal(signal.SIGTERM)
        elif action is Action.KILL and child is not None:
            self.log.info("sending SIGKILL to llama-server", extra={"fields": {"pid": child.handle.pid}})
            child.killed_by_us = True
            child.handle.send_signal(signal.SIGKILL)
        elif action is Action.ROLLBACK:
            self._roll_back()

    def _roll_back(self) -> None:
        """The child on trial failed before the gate: the next spawn uses the last good settings."""
        good, trial = self._good, self._trial
        self._proposed = None
        if good is not None:
            self.template, self._identity, self.budget = good.template, good.identity, good.budget
        if trial is not None and not trial.outcome.done():
            trial.outcome.set_result(f"llama-server {self.machine.rejected}")

    # --- one child -----------------------------------------------------------------------------------
    async def _spawn(self) -> None:
        generation = self.machine.generation
        if self._proposed is not None:
            # New settings take effect with the child that runs them, not while the old one serves.
            p, self._proposed = self._proposed, None
            self.template, self._identity, self.budget = p.template, p.identity, p.budget
        if self._trial is not None and self.machine.trial_generation == generation:
            self._trial.generation = generation
        port = self.os.free_port()
        secret = new_secret()
        spec = replace(self.template, port=port)
        spec = await self.before_spawn(spec) if self.before_spawn is not None else spec
        argv = build_argv(spec)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "config").mkdir(exist_ok=True)
        self.tail.clear()
        # argv carries paths and numbers only; the secret is in the environment.
        self.log.info(
            "starting llama-server", extra={"fields": {"generation": generation, "argv": " ".join(argv)}}
        )
        try:
            handle = await self.os.spawn(argv, build_env(secret, self.workdir, spec.llama), self.workdir)
        except OSError as exc:
            self.post(SpawnFailed(generation, f"{argv[0]}: {exc.strerror or exc}"))
            return
        child = _Child(generation, handle, port, secret, spec, spawned_at=self.os.now())
        stamp = self.os.file_stamp(spec.model)
        child.load = LoadProgress(child.spawned_at, stamp, self.load_times.get(stamp))
        self._child = child
        self._last_port = port
        self._start_task(child, "output", self._pump(child))
        self._start_task(child, "exit", self._watch_exit(child))
        self._start_task(child, "gate", self._gate(child))

    def _start_task(self, child: _Child, name: str, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro, name=f"child-{child.generation}-{name}")
        child.tasks[name] = task

    async def _watch_exit(self, child: _Child) -> None:
        rc = await child.handle.wait()
        child.returncode = rc
        # Let the output pump reach EOF first, so the failure carries the child's last words.
        pump = child.tasks.get("output")
        if pump is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(pump), 2.0)
        description = describe_exit(rc, we_killed=child.killed_by_us)
        if rc > 0 and not child.killed_by_us and (said := first_error(self.tail)):
            description = f"{description}: {said}"  # the child's own words say why, not only how
        self.log.log(
            logging.INFO if child.killed_by_us or rc == 0 else logging.WARNING,
            f"llama-server {description}",
            extra={"fields": {"pid": child.handle.pid, "generation": child.generation, "returncode": rc}},
        )
        self.post(Exited(child.generation, description))

    async def _pump(self, child: _Child) -> None:
        pending = b""
        async for chunk in child.handle.output():
            child.output_seen.set()
            if self.machine.state is State.STARTING:
                self.post(Output(child.generation))
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > 65536:  # a runaway line without newline
                lines, pending = [*lines, pending], b""
            for line in lines:
                self._child_line(child, line)
        if pending:
            self._child_line(child, pending)

    def _child_line(self, child: _Child, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").rstrip()
        # llama-server at its default verbosity (extra_args may not raise it) prints no prompt for a
        # request that succeeds; the few failures that echo the request are cut (child.log). The tail
        # is logged on a failure, so it holds only what may be logged.
        line = child.scrub(text) if text else None
        if not line:
            return
        if not is_noise(line, gpu_layers=child.spec.llama.gpu_layers):
            self.tail.append(line)

        # DEBUG noise unless they report an error.
        self.child_log.log(
            logging.WARNING if is_error(line) else logging.DEBUG,
            line,
            extra={"fields": {"pid": child.handle.pid, "generation": child.generation}},
        )

    async def _gate(self, child: _Child) -> None:
        try:
            child.inputs = await readiness_gate(
                self.probes,
                child.base_url,
                child.secret,
                alias=child.spec.alias,
                ctx_per_slot=child.spec.llama.ctx_per_slot,
                wake=child.output_seen,
                # Straight onto the load's record, not through the queue: it is what the snapshot shows,
                # nothing the machine decides on, and this task runs on the same loop.
                on_step=child.load.enter if child.load is not None else None,
            )
        except (ProbeWrongAnswer, ProbeUnreachable) as exc:
            self.post(GateFailed(child.generation, str(exc)))
            return
        except Exception as exc:
            # Unplanned: fail the gate now, not at the stall timeout with the blame on the child.
            self.log.exception("readiness gate error")
            self.post(GateFailed(child.generation, f"{type(exc).__name__}: {exc}"))
            return
        self.post(GatePassed(child.generation))

    async def _liveness(self, child: _Child) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                status = await self.probes.health(child.base_url, self.health_timeout_s)
            except ProbeUnreachable as exc:
                self.post(HealthFailed(child.generation, str(exc)))
                continue
            except Exception as exc:
                # Unplanned: a failed probe all the same; a dead liveness task would leave a hung
                # child READY forever.
                self.log.exception("health probe error")
                self.post(HealthFailed(child.generation, f"{type(exc).__name__}: {exc}"))
                continue
            if status != 200:
                self.post(HealthFailed(child.generation, f"HTTP {status}"))
                continue
            self.post(HealthOk(child.generation))
            await self._probe_loop(child)

    async def _probe_loop(self, child: _Child) -> None:
        """The watchdog's half: /health above proves the process and its HTTP threads; a task through
        the queue proves the server loop turns. The machine holds the deadline (``LoopAsked`` starts it)
        and calls a loop still owing past it hung; this probe only stops asking at the same deadline."""
        deadline_s = self.machine.policy.loop_deadline_s
        self.post(LoopAsked(child.generation))
        try:
            answered = await self.probes.loop(child.base_url, child.secret, deadline_s)
        except Exception:
            # Unplanned: counted as no answer; the machine's deadline decides, as for a held loop.
            self.log.exception("loop probe error")
            return
        if answered:
            self.post(LoopAnswered(child.generation))

    def _confirm_port_closed(self) -> None:
        if self._last_port is None:
            return
        if self.os.port_open(self._last_port):
            self.log.warning(
                "the child's port still accepts connections after it exited (another process?)",
                extra={"fields": {"port": self._last_port}},
            )
        else:
            self.log.info(
                "llama-server stopped; its port is closed", extra={"fields": {"port": self._last_port}}
            )

    async def _cancel_all(self) -> None:
        child = self._child
        if child is None:
            return
        if child.returncode is None:
            # run() is ending with a child still alive (cancelled): never leave it behind.
            child.killed_by_us = True
            child.handle.send_signal(signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(child.handle.wait(), 5.0)
        tasks = list(child.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
