"""The served models, one supervised child each: ``ModelHost`` is one model (its ``ChildSupervisor``,
started at once or on demand), ``ModelSet`` is all of them (one or several), owned by the daemon.

Each child has its own state machine, port, per-boot secret, readiness gate, liveness, backoff and
FAILED; the hosts share nothing but the memory budget, so one child crashing, hanging or being
restarted never touches another's requests.

``on_demand`` models: the first request that finds one unloaded asks ``ModelSet.load`` (one lock:
concurrent requests for the same cold model share one load, and loads never race for memory), then
waits for READY up to the model's ``load_wait_s`` (a load that fails the child's stall-aware deadline
is retried by its supervisor within that wait; FAILED ends the wait at once). When the load would not
fit the budget, the least recently used idle on_demand model is unloaded first; if that is not
enough the request gets 503 with Retry-After and why. A model whose lane has been idle
``idle_unload_s`` is stopped by ``ModelSet.run``'s loop; a lane holding or awaiting a slot is never
idle (``usage``, read from the proxy's lanes).

``ModelSet`` is also the proxy's main ``UpstreamSource``: ready when every ``always`` model is READY,
and otherwise saying which is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from proxy.errors import Conflict, NotReady
from proxy.source import ModelInputs, UpstreamSnapshot
from supervisor.budget.plan import MIB
from supervisor.child.driver import ChildSupervisor, StateObserver, TickHook
from supervisor.child.machine import State
from supervisor.daemon.prepare import Prepared
from supervisor.daemon.prepare_models import PreparedModel

log = logging.getLogger("llamagate.models")

# Longest wait for a child's slots' states to be saved before a planned stop.
SAVE_STATES_S = 60.0
# Retry-After of a load refused for memory: about when an idle model may have been unloaded.
NO_ROOM_RETRY_S = 30.0

# (busy, last used on the monotonic clock) of a model's lane in the proxy.
Usage = Callable[[str], tuple[bool, float]]


class ModelHost:
    def __init__(
        self,
        model: PreparedModel,
        factory: Callable[[str, Prepared], ChildSupervisor],
        loader: Callable[[ModelHost], Any],
    ) -> None:
        self.served = model.served
        self.prepared = model.prepared
        self.factory = factory
        self._loader = loader
        self.sup = factory(self.name, self.prepared)
        self.task: asyncio.Task[None] | None = None
        self.unloading = False
        self.loads = 0
        self.last_load_s: float | None = None
        self.unloaded_reason = "not loaded: on_demand, loads on its first request"
        # What the model took beside text when it was last loaded: the door checks a request to an
        # unloaded model before loading it (``proxy.schema.media``).
        self.last_inputs: ModelInputs | None = None
        # The set's usable memory and its lock around loads and unloads (``ModelSet.add`` sets both).
        self.usable_bytes: int | None = None
        self.lock: asyncio.Lock | None = None
        self._changed = asyncio.Event()
        # Set (and replaced) at every transition, for any number of waiters (``changed``).
        self._next_change = asyncio.Event()
        self.sup.observers.append(self._on_change)
        # Before its child stops on purpose (unload, reload, stop): the proxy saves the conversation
        # states of its slots to disk (``ProxyWiring.save_states``); set by the daemon.
        self.before_stop: Callable[[UpstreamSnapshot], Awaitable[object]] | None = None
        # Two stops at once (the daemon's and its model loop's) both wait for one save before the child
        # goes: the second finds nothing left to save, never a child stopped under the first's save.
        self._saving = asyncio.Lock()

    @property
    def name(self) -> str:
        return self.served.name

    @property
    def required_bytes(self) -> int:
        return self.prepared.budget.required_bytes

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def _on_change(self, old: State, new: State, reason: str | None) -> None:
        self._changed.set()
        self._next_change.set()
        self._next_change = asyncio.Event()

    def start(self) -> None:
        if self.running:
            return
        if self.task is not None:
            # A stopped machine stays stopped: a new load gets a fresh supervisor (state, backoff).
            observers, hooks = self.sup.observers, self.sup.tick_hooks
            self.sup = self.factory(self.name, self.prepared)
            self.sup.observers.extend(observers)
            self.sup.tick_hooks.extend(hooks)
        self.loads += 1
        self.unloading = False
        self.task = asyncio.create_task(self.sup.run(), name=f"supervisor:{self.name}")

    async def stop(self, reason: str) -> None:
        if self.task is None:
            return
        if self.running:  # an idle unload has marked it unloading already: its child still runs
            await self.save_states()
        self.unloading = True
        if self.running:
            await self.sup.stop(reason)
        with contextlib.suppress(Exception):
            await self.task
        self.unloaded_reason = f"unloaded: {reason}"
        self.unloading = False

    async def save_states(self) -> None:
        """The conversation states of its child's slots to disk, before the child stops on purpose. A
        failure is logged: the stop goes on (the states already on disk stay)."""
        if self.before_stop is None:
            return
        try:
            async with self._saving, asyncio.timeout(SAVE_STATES_S):
                # The child's own snapshot: the host's says UNLOADED as soon as an unload begins.
                await self.before_stop(self.sup.snapshot())
        except Exception as exc:
            log.warning(
                "conversation states not saved before the child stopped",
                extra={"fields": {"model": self.name, "error": str(exc) or type(exc).__name__}},
            )

    def settle(self, model: PreparedModel) -> None:
        """``model``'s entry and settings are the ones served now (a SIGHUP applied them)."""
        self.served, self.prepared = model.served, model.prepared

    def adopt(
        self, sup: ChildSupervisor, task: asyncio.Task[None], model: PreparedModel
    ) -> tuple[ChildSupervisor, asyncio.Task[None] | None]:
        """Serve from ``sup`` (running in ``task``, its child READY on ``model``'s settings) instead of the
        current supervisor, which is returned to be stopped. The observers move: the old one's stop is
        no news to the set or systemd, and they hear where the new one is."""
        old, old_task = self.sup, self.task
        sup.observers.extend(old.observers)
        sup.tick_hooks.extend(old.tick_hooks)
        old.observers.clear()
        old.tick_hooks.clear()
        self.sup, self.task = sup, task
        self.settle(model)
        for observer in list(sup.observers):
            observer(old.state, sup.state, "new llama settings")
        return old, old_task

    # --- UpstreamSource ------------------------------------------------------------------------------
    def snapshot(self) -> UpstreamSnapshot:
        info = {"residency": self.served.residency}
        if self.running and not self.unloading:
            snap = self.sup.snapshot()
            if snap.inputs is not None:
                self.last_inputs = snap.inputs
            return replace(snap, info={**snap.info, **info}, inputs=snap.inputs or self.last_inputs)
        spec = self.prepared.spec
        return UpstreamSnapshot(
            state="UNLOADED",
            ready=False,
            reason="unloading" if self.unloading else self.unloaded_reason,
            base_url=None,
            secret=None,
            model_alias=spec.alias,
            slots=spec.llama.slots,
            ctx_per_slot=spec.llama.ctx_per_slot,
            generation=self.sup.machine.generation,
            retry_after_s=self._load_estimate(),
            embeddings=spec.llama.embeddings,
            reranking=spec.llama.reranking,
            info=info,
            n_vocab=self.prepared.model.shape.n_vocab,
            inputs=self.last_inputs,
        )

    def _load_estimate(self) -> float:
        """Seconds a load from now should take: the supervisor's record of the previous load of the
        same file, else the last wait for a load, else a guess."""
        estimate = self.sup.load_estimate_s()
        if estimate is None:
            estimate = self.last_load_s
        return max(1.0, estimate) if estimate is not None else 5.0

    async def changed(self, timeout_s: float) -> None:
        """``proxy.source.AnnouncesChanges``: at the supervisor's next transition (a new child is a
        transition to STARTING, then READY), or after ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._next_change.wait(), timeout_s)

    def identity(self) -> Mapping[str, object]:
        return {
            **self.sup.identity(),
            "residency": self.served.residency,
            "idle_unload_s": self.served.idle_unload_s,
            "aliases": list(self.served.aliases),
            "loaded": self.running and not self.unloading,
            "loads": self.loads,
            "last_load_s": self.last_load_s,
            "state_disk": self.prepared.disk.record(),
        }

    # --- OperatorControl (proxy.models.lane: /admin/models) ------------------------------------------
    def control_report(self) -> Mapping[str, object]:
        usable = self.usable_bytes
        return {
            "budget_bytes": self.required_bytes,
            "budget_share": round(self.required_bytes / usable, 4) if usable else None,
            "loads": self.loads,
        }

    async def load(self) -> None:
        """An operator's load: an on_demand model as its first request would load it (a refusal for
        memory names what holds it); an ``always`` model is already the supervisor's to keep up."""
        if not self.served.on_demand:
            if self.running:
                return
            raise NotReady(f"the model '{self.name}' is not running: {self.unloaded_reason}", None)
        await self.ensure_loaded()

    async def unload(self, reason: str) -> None:
        if not self.served.on_demand:
            raise Conflict(f"the model '{self.name}' has residency 'always' and cannot be unloaded")
        if self.lock is None:
            await self.stop(reason)
            return
        async with self.lock:  # never beside a load of the set making room
            await self.stop(reason)

    # --- LoadsOnDemand (proxy.model_router) ----------------------------------------------------------
    async def ensure_loaded(self) -> None:
        if not self.served.on_demand:
            return  # an always model is the supervisor's to bring back; the request sees its state
        if self.running and not self.unloading and self.sup.state is State.READY:
            return
        started = time.monotonic()
        # Shielded: a waiting client that leaves cancels its wait, never the load (or the unload of an
        # idle model that makes room for it) half done; other requests may be waiting on the same load.
        loading = asyncio.ensure_future(self._loader(self))
        loading.add_done_callback(_retrieve)  # its refusal reaches the waiter, or nobody if it left
        await asyncio.shield(loading)
        limit = self.served.load_wait_s
        deadline = started + limit
        while True:
            state = self.sup.state
            if state is State.READY:
                break
            if state is State.FAILED or not self.running:
                why = self.sup.machine.reason or self.unloaded_reason
                raise NotReady(f"the model '{self.name}' could not be loaded: {why}", None)
            left = deadline - time.monotonic()
            if left <= 0:
                # The load goes on: retry when the supervisor's estimate says it should be done.
                retry = self.sup.snapshot().retry_after_s
                raise NotReady(
                    f"the model '{self.name}' is still loading after {limit:g} s (models[].load_wait_s)",
                    retry if retry is not None else NO_ROOM_RETRY_S,
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        waited = time.monotonic() - started
        if waited > 0.05:
            self.last_load_s = waited
            log.info(
                "on_demand model loaded for a request",
                extra={"fields": {"model": self.name, "wait_s": round(waited, 3)}},
            )


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB"


class ModelSet:
    """Every served model's host, owned by the daemon: runs them (and the on_demand loads and idle
    unloads), tells ``observers`` (systemd, exit_on_failed) the state of the ``always`` models together,
    and is the door's source. The door's top level speaks as the default model (the first ``always``
    one), whose fields it carries, and names any other model it mentions."""

    def __init__(self, usable_bytes: int) -> None:
        self.hosts: dict[str, ModelHost] = {}
        self.usable_bytes = usable_bytes
        self.usage: Usage = lambda name: (False, time.monotonic())
        self.observers: list[StateObserver] = []
        self.tick_hooks: list[TickHook] = []
        self.last_reload: str | None = None
        self._draining = False
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._aggregate = State.STOPPED  # nothing started yet: systemd then hears STARTING first

    # --- membership ----------------------------------------------------------------------------------
    def add(self, host: ModelHost) -> None:
        self.hosts[host.name] = host
        host.usable_bytes, host.lock = self.usable_bytes, self._lock
        host.sup.draining = self._draining
        host.sup.observers.append(lambda old, new, reason: self._on_change(host, new, reason))

    @property
    def primary(self) -> ModelHost:
        always = [h for h in self.hosts.values() if not h.served.on_demand]
        return (always or list(self.hosts.values()))[0]

    # --- the daemon's view ---------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        for host in self.hosts.values():
            host.sup.draining = value

    def child_rss_bytes(self) -> int:
        return sum(h.sup.child_rss_bytes() or 0 for h in self.hosts.values() if h.running)

    def _on_change(self, host: ModelHost, new: State, reason: str | None) -> None:
        if host.served.on_demand:
            return  # an on_demand model's states are its own; readiness and systemd follow the always set
        not_ready = [
            h for h in self.hosts.values() if not h.served.on_demand and h.sup.state is not State.READY
        ]
        # A model that gave up keeps the whole FAILED until it is back: another model restarting
        # meanwhile must not make systemd's STATUS (or the exit_on_failed hook) read otherwise.
        failed = any(h.sup.state is State.FAILED for h in not_ready)
        aggregate = State.READY if not not_ready else (State.FAILED if failed else not_ready[0].sup.state)
        if aggregate is not self._aggregate or new is State.FAILED:
            old, self._aggregate = self._aggregate, aggregate
            text = f"model '{host.name}': {reason}" if reason else f"model '{host.name}'"
            for observer in self.observers:
                observer(old, aggregate, text)

    async def run(self) -> None:
        for host in self.hosts.values():
            if not host.served.on_demand:
                host.start()
        for host in list(self.hosts.values()):
            if host.served.on_demand and host.served.preload:
                # Loaded as a request would load it: room is made the same way, or it waits unloaded.
                try:
                    await self.load(host)
                except NotReady as exc:
                    log.warning(
                        "preload of an on_demand model refused",
                        extra={"fields": {"model": host.name, "reason": exc.message}},
                    )
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                waits = [await self._unload_idle(now)]
                for hook in self.tick_hooks:
                    due = hook(now)
                    if due is not None:
                        waits.append(due)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), max(0.05, min(waits)))
        finally:
            await self._stop_all("stop requested")

    async def stop(self, reason: str = "stop requested") -> None:
        self._stop.set()
        await self._stop_all(reason)

    async def _stop_all(self, reason: str) -> None:
        await asyncio.gather(*(h.stop(reason) for h in self.hosts.values()), return_exceptions=True)

    async def remove(self, name: str, reason: str) -> None:
        host = self.hosts.pop(name, None)
        if host is not None:
            await host.stop(reason)

    # --- on demand -----------------------------------------------------------------------------------
    async def load(self, host: ModelHost) -> None:
        async with self._lock:
            if self._stop.is_set() or self._draining:
                raise NotReady("the daemon is stopping", None)
            if host.running and not host.unloading:
                return
            await self._make_room(host)
            log.info("loading on_demand model", extra={"fields": {"model": host.name}})
            host.start()

    async def _make_room(self, host: ModelHost) -> None:
        while True:
            loaded = [h for h in self.hosts.values() if h.running and h is not host]
            in_use = sum(h.required_bytes for h in loaded)
            if in_use + host.required_bytes <= self.usable_bytes:
                return
            idle = [h for h in loaded if h.served.on_demand and not self.usage(h.name)[0]]
            if not idle:
                names = ", ".join(f"{h.name} {_mib(h.required_bytes)}" for h in loaded)
                raise NotReady(
                    f"the model '{host.name}' needs {_mib(host.required_bytes)} and does not fit: "
                    f"{_mib(in_use)} of {_mib(self.usable_bytes)} usable is held by loaded models ({names})"
                    " and no on_demand model among them is idle",
                    NO_ROOM_RETRY_S,
                )
            lru = min(idle, key=lambda h: self.usage(h.name)[1])
            log.info(
                "unloading the least recently used idle model to make room",
                extra={"fields": {"model": lru.name, "for": host.name}},
            )
            await lru.stop(f"made room for '{host.name}'")

    async def _unload_idle(self, now: float) -> float:
        """Stop on_demand models idle for their ``idle_unload_s``; seconds until the next check."""
        next_check = 5.0
        for host in list(self.hosts.values()):
            limit = host.served.idle_unload_s
            if limit is None or not host.running or host.unloading:
                continue
            busy, last_used = self.usage(host.name)
            if busy:
                next_check = min(next_check, max(0.2, limit / 4))
                continue
            idle_for = now - last_used
            if idle_for < limit:
                next_check = min(next_check, limit - idle_for)
                continue
            # Checked and marked in one step (no await between): a request arriving now sees the host
            # unloading and loads it again after, through the lock.
            host.unloading = True
            log.info(
                "unloading idle model", extra={"fields": {"model": host.name, "idle_s": round(idle_for, 1)}}
            )
            async with self._lock:
                await host.stop(f"idle for {limit:g} s")
        return next_check

    # --- UpstreamSource (the door's aggregate) -------------------------------------------------------
    def not_ready(self) -> list[ModelHost]:
        return [h for h in self.hosts.values() if not h.served.on_demand and not h.snapshot().ready]

    def named(self, name: str, text: str, form: str = "model '{}': ") -> str:
        """``text`` as the top level says it: the default model's as it is, another model's by name."""
        return text if self.hosts and name == self.primary.name else form.format(name) + text

    def _totals(self) -> dict[str, object]:
        """What the top level of /readyz and /admin/identity says of every model at once: restarts
        summed, each model's last failure (None when no model has failed)."""
        failures = [
            self.named(h.name, h.sup.machine.last_failure, "{}: ")
            for h in self.hosts.values()
            if h.sup.machine.last_failure
        ]
        return {
            "restarts": sum(h.sup.machine.restarts for h in self.hosts.values()),
            "last_failure": "; ".join(failures) or None,
            "last_reload": self.last_reload,
        }

    def snapshot(self) -> UpstreamSnapshot:
        if not self.hosts:  # a SIGHUP that replaces every model, between the old ones and the new
            return UpstreamSnapshot(
                "STOPPED", False, "no model is served yet: reloading", None, None, "", 0, 0, 0, 5.0
            )
        snap = self.primary.snapshot()
        snap = replace(snap, info={**snap.info, **self._totals()})
        waiting = self.not_ready()
        if self._draining:
            return replace(snap, ready=False, reason="draining: the daemon is stopping")
        if not waiting:
            return replace(snap, ready=True, state="READY", reason=None, retry_after_s=0.0)
        if waiting == [self.primary]:
            return replace(snap, ready=False)  # the default model's own state and reason
        first = waiting[0].snapshot()
        names = ", ".join(f"'{h.name}'" for h in waiting)
        why = f"not ready: {names} ({first.state}{': ' + first.reason if first.reason else ''})"
        return replace(snap, ready=False, state=first.state, reason=why, retry_after_s=first.retry_after_s)

    def identity(self) -> Mapping[str, object]:
        """The default model's identity and status (as one model's daemon shows them), with what the
        daemon's ``status`` says of every model at once, and each model's own record under ``models``."""
        snap = self.snapshot()
        default = self.primary.identity() if self.hosts else {}
        own = default.get("status")
        status = {
            **(own if isinstance(own, Mapping) else {}),
            "state": snap.state,
            "ready": snap.ready,
            "reason": snap.reason,
            "not_ready": [h.name for h in self.not_ready()],
            "default_model": self.primary.name if self.hosts else None,
            **self._totals(),
        }
        return {
            **default,
            "status": status,
            "models": {n: h.identity() for n, h in self.hosts.items()},
        }
