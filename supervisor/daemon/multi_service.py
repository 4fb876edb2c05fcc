"""The daemon of a ``models:`` config: one supervised child per model behind one door.

Everything but the children is the single-model ``Daemon`` (door, signals, drain, systemd, metrics
listener); the children are a ``ModelSet`` in its ``supervisor`` seat, and the proxy routes by the
request's ``model`` (``proxy.models.router``). Drain on SIGTERM covers every child: readiness goes
false, in-flight requests of every model drain, then every child is stopped.

SIGHUP compares the served models by name: a model removed is drained and stopped, one added is
verified and (if ``always``) started, one whose settings changed is verified, stopped and started on
the new ones; the others are not touched. Tenants, keys and limits reload as in the one-model daemon.
A reload that cannot be verified or does not fit is not applied at all.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from proxy.app import create_app
from proxy.metrics.llama import ModelsLlamaMetrics
from proxy.models.lane import ModelEntry
from proxy.models.router import ModelRouter
from proxy.settings import KeyEntry
from proxy.source import UpstreamSnapshot
from supervisor.child.driver import ChildSupervisor
from supervisor.child.gate import HttpProbes
from supervisor.child.osseam import ChildOs, Probes
from supervisor.child.restart import Policy
from supervisor.config.load import load_config
from supervisor.config.models import ServedModel, is_multi, served_models
from supervisor.config.proxy_settings import proxy_settings
from supervisor.config.schema import Config
from supervisor.daemon.metrics_collector import ModelView, SupervisorCollector
from supervisor.daemon.model_hosts import ModelHost, ModelSet
from supervisor.daemon.observability import Observability, instance_label
from supervisor.daemon.prepare import Prepared
from supervisor.daemon.prepare_models import PreparedModel, joint_need, prepare_models, usable_bytes
from supervisor.daemon.service import Daemon
from supervisor.errors import ConfigError, Misconfigured
from supervisor.progress import NullProgress

log = logging.getLogger("llamagate.daemon")


class MultiDaemon(Daemon):
    def __init__(
        self,
        cfg: Config,
        models: Sequence[PreparedModel],
        *,
        config_path: Path | None,
        generated_keys: Sequence[KeyEntry] = (),
        child_os: ChildOs | None = None,
        probes: Probes | None = None,
    ) -> None:
        self._models = tuple(models)
        super().__init__(
            cfg,
            self._models[0].prepared,
            config_path=config_path,
            generated_keys=generated_keys,
            child_os=child_os,
            probes=probes,
        )

    def _build(
        self, cfg: Config, prepared: Prepared, child_os: ChildOs | None, probes: Probes | None
    ) -> None:
        from supervisor.child.spawn import RealOs

        self.probes = probes or HttpProbes()
        self.child_os = child_os or RealOs()
        self.models = ModelSet(usable_bytes(self._models))
        for model in self._models:
            self.models.add(self._host(model))
        self.supervisor = self.models  # type: ignore[assignment]  # the Daemon's loop runs the set
        self.observability = Observability(cfg, self.models.primary.sup)
        # llama-server's series from every model's child, each with its model label.
        self.observability.llama = ModelsLlamaMetrics(self._snapshots, instance_label(cfg))
        # The supervisor's series of every model, each with its model label.
        supervisor_series = SupervisorCollector(self._views, clock=self.child_os.now)
        self.observability.collectors = (supervisor_series, self.observability.llama)
        self.app = create_app(
            proxy_settings(cfg, self.generated_keys),
            self.models,
            [self._entry(h) for h in self.models.hosts.values()],
            extra_collectors=self.observability.collectors,
        )
        self.runtime = self.app.state.proxy
        self.router: ModelRouter = self.runtime.router
        self.models.usage = self._usage
        self._build_common()

    def _host(self, model: PreparedModel) -> ModelHost:
        return ModelHost(model, self._supervisor_for, self.models.load)

    def _supervisor_for(self, name: str, prepared: Prepared) -> ChildSupervisor:
        s = self.cfg.supervision
        sup = ChildSupervisor(
            prepared.spec,
            Policy.from_config(s),
            os=self.child_os,
            probes=self.probes,
            workdir=self.workdir / name,  # each child its own config folder
            health_interval_s=s.health_interval_s,
            health_timeout_s=s.health_timeout_s,
            identity=prepared.identity,
            model=name,  # every log record of this child names its model
        )
        sup.budget = prepared.budget.as_dict()
        return sup

    @staticmethod
    def _entry(host: ModelHost) -> ModelEntry:
        served = host.served
        return ModelEntry(served.name, served.aliases, host, served.residency)

    def _snapshots(self) -> dict[str, Callable[[], UpstreamSnapshot]]:
        # By name, not the host object: a model whose settings changed gets a new host of the same name.
        return {name: functools.partial(self._snapshot_of, name) for name in self.models.hosts}

    def _views(self) -> dict[str, ModelView]:
        # Read at every scrape: the set changes on SIGHUP and a host gets a new driver at each load.
        return {
            name: ModelView(host.sup, on_demand=host.served.on_demand, loaded=host.running)
            for name, host in self.models.hosts.items()
        }

    def _snapshot_of(self, name: str) -> UpstreamSnapshot:
        return self.models.hosts[name].snapshot()

    def _usage(self, name: str) -> tuple[bool, float]:
        lane = self.router.lanes.get(name)
        if lane is None:
            return False, 0.0
        return lane.busy, lane.last_used

    # --- SIGHUP --------------------------------------------------------------------------------------
    async def reload(self) -> None:
        if self.config_path is None:
            return
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded:\n" + "\n".join(f"  {p}" for p in exc.problems))
            self.models.last_reload = (
                "reload rejected: the config file does not validate; kept the previous settings"
            )
            return
        if not is_multi(new):
            self._reject("going from models: back to the llama: section needs a daemon restart")
            return
        old = {m.name: m for m in served_models(self.cfg)}
        wanted = {m.name: m for m in served_models(new)}
        removed = [n for n in old if n not in wanted]
        added = [n for n in wanted if n not in old]
        changed = [n for n in wanted if n in old and _differs(old[n], wanted[n])]
        fresh: dict[str, PreparedModel] = {}
        if added or changed:
            try:
                prepared = await asyncio.to_thread(prepare_models, new, progress=NullProgress(), fetch=False)
            except Misconfigured as exc:
                self._reject(str(exc).splitlines()[0])
                log.error(f"SIGHUP: {exc}")
                return
            fresh = {m.served.name: m for m in prepared}
            if joint_need(prepared) > usable_bytes(prepared):
                self._reject("the new set of models does not fit in memory")
                return
        for name in removed:
            await self._retire(name, "removed from the config")
        for name in changed:
            await self._retire(name, "its settings changed", restarting=True)
        for name in [*changed, *added]:
            host = self._host(fresh[name])
            self.models.add(host)
            self.router.add(self._entry(host))
            if not host.served.on_demand:
                host.start()
        keep_generated = not new.keys and new.proxy.anonymous_tenant is None
        self.runtime.reload(proxy_settings(new, self.generated_keys if keep_generated else ()))
        self.cfg = new
        self.models.last_reload = "applied"
        log.info(
            "SIGHUP: configuration reloaded",
            extra={"fields": {"removed": removed, "added": added, "changed": changed}},
        )

    async def _retire(self, name: str, reason: str, *, restarting: bool = False) -> None:
        """No new request reaches the model; those in flight finish (up to the drain timeout); stop.
        ``restarting``: new requests get 503 with Retry-After until its new child's lane is added."""
        lane = self.router.lanes.get(name)
        self.router.remove(name, restarting=restarting)
        if lane is not None:
            await lane.drain(self.cfg.proxy.drain_timeout_s)
        log.warning(f"SIGHUP: stopping model {name!r}: {reason}")
        await self.models.remove(name, reason)


def _differs(a: ServedModel, b: ServedModel) -> bool:
    return (a.cfg.llama, a.residency, a.idle_unload_s, a.aliases) != (
        b.cfg.llama,
        b.residency,
        b.idle_unload_s,
        b.aliases,
    )
