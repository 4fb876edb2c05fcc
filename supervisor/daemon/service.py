"""The daemon: one asyncio loop runs the served models' supervisors and the proxy (``uvicorn.Server``).

One daemon for one model or several: it owns a ``ModelSet`` of ``ModelHost``s (a ``llama:``-only config
is a set of one) and the proxy routes every request to its model's lane (``wiring``).

Signals are ours, not uvicorn's: its handlers are disabled and ``loop.add_signal_handler`` only
enqueues the signal number; one task dispatches them (SIGTERM/SIGINT: stop, SIGHUP: reload). A reload
runs in a task of its own, never builds or downloads, and is cancelled by a stop: a stop never waits
behind a reload.

SIGHUP is one reconcile, model by model (``reload``). Every new or changed model is verified and
budgeted, and the binary parses its new command line while the working children serve (``preflight``);
a refusal there applies nothing. A changed model then runs its new settings on trial (``switch``): side
by side with the old child when memory allows both, else stop, then start; a child that fails before the
readiness gate leaves the model on the last settings that passed it. A removed model is drained and
stopped, an added one started. ``supervision:`` applies to every model, before any child starts on the
new settings; a FAILED model is started again. Tenants, keys and limits apply only when every model's
change did. ``last_reload`` in /readyz says what happened, the daemon's at the top level and each
model's under ``models`` (``reload rejected: ...; kept the previous settings``).

Stop, in order: readiness goes false at once (the snapshot says "draining", so the proxy admits no new
work and /readyz answers 503), in-flight requests drain up to ``proxy.drain_timeout_s`` (a second
SIGTERM/SIGINT cuts that short), the usage ledger writes what the drained requests were charged (so a
SIGTERM loses no row), then every child gets SIGTERM, the grace period, SIGKILL, is reaped and its port
is checked closed; only then does the listener close, and the accounts store last.

The accounts store (``store:``) is opened by ``serve`` (``wiring.open_accounts``), started here at the
start of ``run`` and closed at its end; ``store.*`` takes effect at the next start (a SIGHUP keeps the
open store and says so), while a SIGHUP's new tenant budgets apply at once and keep the windows' counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvicorn

from proxy.listener.guard import FrontDoor, uvicorn_config
from proxy.middleware.forwarded import ForwardedFor
from proxy.settings import KeyEntry
from proxy.source import UpstreamSnapshot
from supervisor.budget.plan import MIB
from supervisor.child.driver import ChildSupervisor
from supervisor.child.gate import HttpProbes
from supervisor.child.loading import LoadTimes
from supervisor.child.machine import State
from supervisor.child.osseam import ChildOs, Probes
from supervisor.child.preflight import refused_arguments
from supervisor.child.restart import Policy
from supervisor.child.workdir import make_private_dir, sweep_stale
from supervisor.config.diff import diff as _diff
from supervisor.config.load import load_config
from supervisor.config.models import ServedModel, served_models
from supervisor.config.proxy_settings import proxy_settings
from supervisor.config.schema import Config, SupervisionConfig
from supervisor.daemon.heap import return_free_heap
from supervisor.daemon.identity import flatten
from supervisor.daemon.listener import _Server
from supervisor.daemon.metrics_collector import ModelView
from supervisor.daemon.model_hosts import ModelHost, ModelSet
from supervisor.daemon.notify import Notifier, SystemdReporter, WatchdogFeeder
from supervisor.daemon.observability import Observability
from supervisor.daemon.prepare import Prepared, prepare
from supervisor.daemon.prepare_models import PreparedModel, joint_budget_lines, joint_need, usable_bytes
from supervisor.daemon.state_disk import Folders
from supervisor.daemon.switch import side_by_side, stop_then_start
from supervisor.daemon.wiring import DaemonAccounts, ProxyWiring
from supervisor.errors import ConfigError, LlamagateError
from supervisor.launch.flags import build_argv, build_env, new_secret
from supervisor.progress import NullProgress

log = logging.getLogger("llamagate.daemon")

# The outcome of a reload as status and /readyz show it (the log has the details).
_KEPT = "kept the previous settings"
_INVALID = "the config file does not validate (see the daemon's log)"
_NOT_VERIFIED = "the new llama settings did not verify or fit (see the daemon's log)"
_NO_ROOM = "the new set of models does not fit in memory (see the daemon's log)"


class Daemon:
    def __init__(
        self,
        cfg: Config,
        models: Sequence[PreparedModel],
        *,
        config_path: Path | None,
        generated_keys: Sequence[KeyEntry] = (),
        child_os: ChildOs | None = None,
        probes: Probes | None = None,
        accounts: DaemonAccounts | None = None,
    ) -> None:
        """``models``: every model ``cfg`` serves, verified and budgeted (``prepare_models``);
        ``accounts``: its store, opened (``wiring.open_accounts``); the daemon closes it."""
        self.cfg = cfg
        self.accounts = accounts or DaemonAccounts(None)
        self.config_path = config_path
        self.generated_keys = tuple(generated_keys)
        # Every model's children start under it; a SIGHUP changes it before any new child starts.
        self.supervision = cfg.supervision
        # One record of load times for every model's supervisors: a host gets a fresh supervisor at
        # each load, and an on_demand model's second load must still know how long its first took.
        self.load_times = LoadTimes()
        sweep_stale()
        self.workdir = make_private_dir()
        try:
            self._build(tuple(models), child_os, probes)
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    def _build(
        self, models: tuple[PreparedModel, ...], child_os: ChildOs | None, probes: Probes | None
    ) -> None:
        from supervisor.child.spawn import RealOs

        self.probes = probes or HttpProbes()
        self.child_os = child_os or RealOs()
        self.models = ModelSet(usable_bytes(models))
        # Before the models: each model's supervisor reports its hangs to it (``_supervisor_for``).
        self.observability = Observability(self.cfg, self._views, self._snapshots, self.child_os.now)
        # The states folders this daemon serves, held for its life (``state_disk.Folders``).
        self.folders = Folders()
        for model in models:
            self.models.add(self._host(model))
        self.proxy = ProxyWiring(
            proxy_settings(self.cfg, self.generated_keys),
            self.models,
            self.models.hosts.values(),
            (*self.observability.collectors, self.folders.collector()),
            self.accounts.accounts,
        )
        self.app = self.proxy.app
        self.observability.telemetry = self.proxy.runtime.telemetry  # None unless ``telemetry:`` is set
        self.folders.forget = self.proxy.states_lost
        self.models.usage = self.proxy.usage
        self.door = FrontDoor(self.proxy.door_settings)
        self.proxy.set_door(self.door)
        self.notifier = Notifier.from_env()
        self.reporter = SystemdReporter(self.notifier)
        self.models.observers.append(self.reporter.on_state_change)
        self.models.observers.append(self._on_state_change)
        self.models.tick_hooks.append(self.folders.tick)  # held folders marked as used hourly
        feeder = WatchdogFeeder.from_env(self.notifier)
        if feeder is not None:
            self.models.tick_hooks.append(lambda now: (feeder.tick(now), feeder.due_in(now))[1])
        self.exit_code = 0
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._hup = asyncio.Event()
        self._reloader: asyncio.Task[None] | None = None
        self._stop_reason = "stop requested"

    # --- the served models ---------------------------------------------------------------------------
    def _host(self, model: PreparedModel) -> ModelHost:
        host = ModelHost(model, self._supervisor_for, self.models.load)
        host.before_stop = lambda snap: self.proxy.save_states(host.name, snap)
        return host

    def _supervisor_for(self, name: str, prepared: Prepared) -> ChildSupervisor:
        s = self.supervision
        sup = ChildSupervisor(
            prepared.spec,
            Policy.from_config(s),
            os=self.child_os,
            probes=self.probes,
            workdir=self.workdir / name,  # each model's children their own config folder
            health_interval_s=s.health_interval_s,
            health_timeout_s=s.health_timeout_s,
            identity=prepared.identity,
            model=name,  # every log record of this child names its model
            load_times=self.load_times,
            n_vocab=prepared.model.shape.n_vocab,
        )
        sup.budget = prepared.budget.as_dict()
        # One attribute, not an observer: a new supervisor for the model gets its own (observers move).
        sup.on_hang = functools.partial(self.observability.child_hung, name)
        sup.before_spawn = functools.partial(self.folders.before_spawn, name)
        return sup

    def _views(self) -> dict[str, ModelView]:
        # Read at every scrape: the set changes on SIGHUP and a host gets a new driver at each load.
        return {
            name: ModelView(host.sup, on_demand=host.served.on_demand, loaded=host.running)
            for name, host in self.models.hosts.items()
        }

    def _snapshots(self) -> dict[str, Callable[[], UpstreamSnapshot]]:
        # By name, not the host object: the name is what a model keeps across a SIGHUP.
        return {name: functools.partial(self._snapshot_of, name) for name in self.models.hosts}

    def _snapshot_of(self, name: str) -> UpstreamSnapshot:
        return self.models.hosts[name].snapshot()

    # --- hooks ---------------------------------------------------------------------------------------
    def _on_state_change(self, old: State, new: State, reason: str | None) -> None:
        if new is State.FAILED and self.supervision.exit_on_failed:
            # The reason names the model that gave up ("model 'x': gave up: ...").
            log.error(
                "llama-server FAILED and supervision.exit_on_failed is set: the daemon exits non-zero",
                extra={"fields": {"reason": reason}},
            )
            self.exit_code = 1
            self.request_stop("llama-server FAILED (exit_on_failed)")

    def request_stop(self, reason: str) -> None:
        if self._stop.is_set():
            self._force.set()
            return
        self._stop_reason = reason
        self._stop.set()
        if self._reloader is not None:
            self._reloader.cancel()  # a stop never waits behind a reload

    # --- the loop ------------------------------------------------------------------------------------
    async def run(self, sock: socket.socket) -> int:
        try:
            self.accounts.start()  # windows restored and keys loaded before the first request
            await self.observability.start(self.proxy.metrics, FrontDoor(self.proxy.door_settings))
        except BaseException:
            await self._close()
            raise
        loop = asyncio.get_running_loop()
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        for sig in handled:
            loop.add_signal_handler(sig, self._signals.put_nowait, sig)
        previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(self.door.exception_handler(previous_handler))
        self.door.guard(sock)
        config = uvicorn_config(
            ForwardedFor(self.app, lambda: self.proxy.door_settings().forwarded_allow_ips),
            self.door,
            log_config=None,
            access_log=False,  # the proxy writes its own access log, without query strings or keys
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        server = _Server(config)
        tasks = {
            "models": asyncio.create_task(self.models.run(), name="models"),
            "server": asyncio.create_task(server.serve(sockets=[sock]), name="proxy"),
            "signals": asyncio.create_task(self._dispatch_signals(), name="signals"),
            "heap": asyncio.create_task(return_free_heap(), name="heap"),
        }
        log.info(
            "llamagate serving",
            extra={
                "fields": {
                    "listen": f"{self.cfg.proxy.host}:{self.cfg.proxy.port}",
                    **flatten({n: h.sup.served_identity for n, h in self.models.hosts.items()}),
                }
            },
        )
        try:
            listening = asyncio.create_task(self._announce_listening(server))
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait(
                [stop, tasks["models"], tasks["server"]], return_when=asyncio.FIRST_COMPLETED
            )
            for t in (stop, listening):
                t.cancel()
            for name in ("models", "server"):
                if tasks[name] in done and not self._stop.is_set():
                    exc = tasks[name].exception()
                    log.error(f"{name} ended unexpectedly: {exc!r}")
                    self.exit_code = 1
            await self._shutdown(server, tasks)
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
            loop.set_exception_handler(previous_handler)
            self.door.close()
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await self._close()
        return self.exit_code

    async def _close(self) -> None:
        await self.accounts.close()
        await self.probes.aclose()
        await self.observability.aclose()
        self.notifier.close()
        self.folders.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    async def _announce_listening(self, server: uvicorn.Server) -> None:
        while not server.started:  # noqa: ASYNC110 - uvicorn only exposes a flag
            await asyncio.sleep(0.02)
        self.reporter.on_proxy_listening()

    async def _shutdown(self, server: uvicorn.Server, tasks: dict[str, asyncio.Task[Any]]) -> None:
        reason = self._stop_reason
        self.reporter.on_shutdown(reason)
        self.models.draining = True
        in_flight = self.proxy.active
        log.info(f"stopping ({reason}): readiness off, draining", extra={"fields": {"in_flight": in_flight}})
        drain = asyncio.create_task(self.proxy.drain(self.cfg.proxy.drain_timeout_s))
        force = asyncio.create_task(self._force.wait())
        await asyncio.wait([drain, force], return_when=asyncio.FIRST_COMPLETED)
        force.cancel()
        if not drain.done():
            drain.cancel()
            log.warning("second stop signal: not waiting for in-flight requests")
        elif not drain.result():
            log.warning(
                "drain deadline passed with requests still in flight",
                extra={
                    "fields": {
                        "in_flight": self.proxy.active,
                        "drain_timeout_s": self.cfg.proxy.drain_timeout_s,
                    }
                },
            )
        await self._flush_ledger()
        if not tasks["models"].done():
            await self.models.stop(reason)
        server.should_exit = True
        with contextlib.suppress(Exception):
            await tasks["server"]
        log.info("llamagate stopped", extra={"fields": {"exit_code": self.exit_code}})

    async def _flush_ledger(self) -> None:
        """The usage of every request the drain let finish, written before the daemon goes on stopping."""
        flushed = await self.accounts.flush(self.cfg.proxy.drain_timeout_s)
        if flushed is None:
            return
        done, stats = flushed
        fields = {"written": stats.written, "pending": stats.pending, "dropped": stats.dropped}
        if done:
            log.info("usage ledger written", extra={"fields": fields})
        else:
            log.error(
                "usage ledger: the store did not take the last records (see the store writer's error); "
                "they are lost when the daemon exits",
                extra={"fields": fields},
            )

    async def _dispatch_signals(self) -> None:
        # Reloads run beside this loop: verifying a new model can take a while, and a SIGTERM meanwhile
        # must stop the daemon at once. SIGHUPs during a reload make one more reload after it.
        self._reloader = asyncio.create_task(self._reload_on_hup(), name="reload")
        try:
            while True:
                sig = await self._signals.get()
                name = signal.Signals(sig).name
                if sig == signal.SIGHUP:
                    self._hup.set()
                else:
                    log.info(f"{name} received")
                    if sig == signal.SIGINT and self.exit_code == 0:
                        self.exit_code = 130  # Ctrl-C: 128 + SIGINT, as every command exits after it
                    self.request_stop(name)
        finally:
            self._reloader.cancel()
            await asyncio.gather(self._reloader, return_exceptions=True)

    async def _reload_on_hup(self) -> None:
        while True:
            await self._hup.wait()
            self._hup.clear()
            # systemd hears when a reload begins and ends (``systemctl reload`` waits for READY=1).
            self.reporter.on_reload()
            try:
                await self.reload()
            except LlamagateError as exc:
                log.error(f"SIGHUP: reload failed, still serving the previous settings: {exc}")
                # /readyz is public: the details (paths, digests) stay in the log.
                self._outcome(f"reload rejected: {_NOT_VERIFIED}; {_KEPT}")
            except Exception:
                # Whatever went wrong, the next SIGHUP must still be served.
                log.exception("SIGHUP: reload failed, still serving the previous settings")
                self._outcome(f"reload failed (see the daemon's log); {_KEPT}")
            finally:
                self.reporter.on_reloaded(self.models.last_reload or "nothing to reload")

    # --- SIGHUP --------------------------------------------------------------------------------------
    async def reload(self) -> None:
        if self.config_path is None:
            log.warning("SIGHUP: running on the embedded default (no config file); nothing to reload")
            return
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded:\n" + "\n".join(f"  {p}" for p in exc.problems))
            self._outcome(f"reload rejected: {_INVALID}; {_KEPT}")
            return
        old, new = self.cfg, _keep_fixed(self.cfg, new)
        hosts = self.models.hosts
        wanted = {m.name: m for m in served_models(new)}
        removed = [n for n in hosts if n not in wanted]
        added = [n for n in wanted if n not in hosts]
        changed = [n for n in wanted if n in hosts and hosts[n].served.cfg.llama != wanted[n].cfg.llama]
        # Verified, budgeted and parsed by the binary first, while the working children serve: a refusal
        # here applies nothing.
        fresh = await self._verify(wanted, [*changed, *added])
        if fresh is None:
            return
        after = tuple(fresh.get(n) or PreparedModel(m, hosts[n].prepared) for n, m in wanted.items())
        if fresh and joint_need(after) > usable_bytes(after):
            log.error(
                "SIGHUP: the models do not fit in memory together:\n  "
                + "\n  ".join(joint_budget_lines(after))
            )
            self._reject(_NO_ROOM)
            return
        for name, model in fresh.items():
            refused = await self._dry_parse(name, model.prepared)
            if refused is not None:
                why = f"llama-server refused its arguments: {refused}"
                self._reject(self.models.named(name, why), {name: why})
                return
        if new.supervision != old.supervision:
            self._apply_supervision(new.supervision)  # before any child starts: its load runs under it
        for name in removed:
            await self._retire(name, "removed from the config")
        rejected: dict[str, str] = {}
        for name in changed:
            failed = await self._switch(hosts[name], fresh[name], after, new.proxy.drain_timeout_s)
            if failed is not None:
                rejected[name] = failed
        for name in added:
            self.models.add(self._host(fresh[name]))
            self._route(hosts[name])
        for name, host in hosts.items():
            if name not in changed and host.running and host.sup.state is State.FAILED:
                # An operator's SIGHUP is the documented way out of FAILED, also when the cause was
                # outside the config (memory, a file since restored): try again on the same settings.
                log.warning(f"SIGHUP: model {name!r} is FAILED: starting llama-server again")
                host.sup.restart("SIGHUP while FAILED")
        if rejected:
            # The rest of the reload applies only with the settings every model actually serves.
            if new.supervision != old.supervision:
                self._apply_supervision(old.supervision)
            self._reject("; ".join(self.models.named(n, why) for n, why in rejected.items()), rejected)
            return
        for name, served in wanted.items():
            host = hosts[name]
            if name not in changed and name not in added and _entry(host.served) != _entry(served):
                host.settle(PreparedModel(served, host.prepared))  # new aliases or residency: same child
                self._route(host)
        keep_generated = not new.keys and new.proxy.anonymous_tenant is None
        self.proxy.reload(proxy_settings(new, self.generated_keys if keep_generated else ()))
        changes = _diff(old, new)
        self.cfg = new
        # Only the outcome: /readyz needs no credentials, and the changes name tenants and keys.
        self._outcome("applied")
        log.info(
            "SIGHUP: configuration reloaded",
            extra={"fields": {"changes": "; ".join(changes) if changes else "none"}},
        )

    async def _verify(
        self, wanted: Mapping[str, ServedModel], names: Sequence[str]
    ) -> dict[str, PreparedModel] | None:
        """``names`` verified and budgeted (never built or downloaded); None, said so, if one fails."""
        # Our children's memory is in use now, and is what the new set will run in.
        ours = self.models.child_rss_bytes()
        fresh: dict[str, PreparedModel] = {}
        for name in names:
            try:
                prepared = await asyncio.to_thread(
                    prepare, wanted[name].cfg, progress=NullProgress(), extra_available=ours, fetch=False
                )
            except LlamagateError as exc:
                log.error(
                    f"SIGHUP: reload failed, still serving the previous settings: model {name!r}: {exc}"
                )
                # /readyz is public: the details (paths, digests) stay in the log.
                self._outcome(f"reload rejected: {_NOT_VERIFIED}; {_KEPT}")
                return None
            fresh[name] = PreparedModel(wanted[name], prepared)
        return fresh

    async def _dry_parse(self, name: str, prepared: Prepared) -> str | None:
        folder = self.workdir / name
        folder.mkdir(exist_ok=True)
        argv = build_argv(prepared.spec)
        return await refused_arguments(
            self.child_os, argv, build_env(new_secret(), folder, prepared.spec.llama), folder
        )

    async def _switch(
        self, host: ModelHost, model: PreparedModel, after: tuple[PreparedModel, ...], drain_timeout_s: float
    ) -> str | None:
        """One model's new llama settings: side by side when it has a READY child and memory holds both
        children at once, else stop, then start. None once they serve; else why not (the model keeps
        the last settings that passed the gate)."""
        name = host.name
        states = host.prepared.spec.slot_states
        changes = "; ".join(_diff(host.served.cfg.llama, model.served.cfg.llama, "llama."))
        log.warning(f"SIGHUP: model {name!r}: llama settings changed, restarting llama-server: {changes}")
        rerouted = _entry(host.served) != _entry(model.served)
        need, usable = joint_need(after) + host.required_bytes, usable_bytes(after)
        if not host.running or host.unloading:
            how = "not loaded: its next load starts on the new settings"
        elif host.sup.state is not State.READY:
            how = f"stop, then start: its child is {host.sup.state.value}, there is nothing to keep serving"
        elif need > usable:
            how = (
                f"stop, then start: both children at once would need {need / MIB:,.0f} MiB,"
                f" {usable / MIB:,.0f} MiB usable"
            )
        else:
            log.info(
                f"SIGHUP: model {name!r}: side by side: the old child serves until the new one passes the"
                " readiness gate"
            )
            rejected = await side_by_side(host, model, lambda: self.proxy.drain_lane(name, drain_timeout_s))
            how = None
        if how is not None:
            log.warning(f"SIGHUP: model {name!r}: {how}")
            rejected = await stop_then_start(host, model, f"llama settings changed: {changes}")
        if rejected is None and rerouted:
            self._route(host)
        if rejected is None:
            self.folders.drop(states, host.prepared.spec.slot_states)  # an identity no longer served
        return rejected

    def _route(self, host: ModelHost) -> None:
        """The model's entry as the proxy routes it (added, or new aliases or residency); started now
        if it is an ``always`` model (a no-op when it runs)."""
        self.proxy.serve(host)
        if not host.served.on_demand:
            host.start()

    async def _retire(self, name: str, reason: str) -> None:
        """No new request reaches the model, those in flight finish (up to the drain timeout), then its
        child is stopped."""
        await self.proxy.retire(name, self.cfg.proxy.drain_timeout_s)
        log.warning(f"SIGHUP: stopping model {name!r}: {reason}")
        host = self.models.hosts.get(name)
        await self.models.remove(name, reason)
        if host is not None:
            self.folders.drop(host.prepared.spec.slot_states, None)  # the model's conversations go with it

    def _apply_supervision(self, s: SupervisionConfig) -> None:
        """Every model's supervisor decides and probes by ``s`` from now on, and new ones start on it."""
        self.supervision = s
        for host in self.models.hosts.values():
            host.sup.govern(Policy.from_config(s), s.health_interval_s, s.health_timeout_s)

    def _outcome(self, text: str, per_model: Mapping[str, str] | None = None) -> None:
        """The reload's outcome in status and /readyz: the daemon's, and each model's (its own, if given)."""
        self.models.last_reload = text
        for name, host in self.models.hosts.items():
            host.sup.last_reload = (per_model or {}).get(name, text)

    def _reject(self, reason: str, per_model: Mapping[str, str] | None = None) -> None:
        """Nothing more of this reload is applied; say so in the log and in status and /readyz."""
        message = f"reload rejected: {reason}; {_KEPT}"
        self._outcome(
            message, {n: f"reload rejected: {why}; {_KEPT}" for n, why in (per_model or {}).items()}
        )
        log.error(f"SIGHUP: {message}")


def _entry(served: ServedModel) -> tuple[object, ...]:
    """What the proxy and the model set know of a model beside its child's settings."""
    return (served.aliases, served.residency, served.idle_unload_s, served.load_wait_s)


def _keep_fixed(old: Config, new: Config) -> Config:
    """``new`` with what a reload cannot change (the listeners, logging, the store, the cluster, the
    telemetry) as it is now, and a warning."""
    fixed = []
    if (old.proxy.host, old.proxy.port, old.proxy.metrics_listener) != (
        new.proxy.host,
        new.proxy.port,
        new.proxy.metrics_listener,
    ):
        fixed.append("proxy.host/port/metrics_listener")
    if (old.logging.format, old.logging.level) != (new.logging.format, new.logging.level):
        fixed.append("logging.format/level")
    if old.store != new.store:
        fixed.append("store")
    if old.cluster != new.cluster:
        fixed.append("cluster")  # the Redis connection is made once (``proxy.cluster``)
    if old.telemetry != new.telemetry:
        fixed.append("telemetry")  # the exporters are made once (``proxy.telemetry``)
    if not fixed:
        return new
    log.warning(f"SIGHUP: {', '.join(fixed)} take effect at the next daemon start; keeping the current ones")
    return replace(
        new,
        store=old.store,
        cluster=old.cluster,
        telemetry=old.telemetry,
        proxy=replace(
            new.proxy, host=old.proxy.host, port=old.proxy.port, metrics_listener=old.proxy.metrics_listener
        ),
        logging=replace(new.logging, format=old.logging.format, level=old.logging.level),
    )
