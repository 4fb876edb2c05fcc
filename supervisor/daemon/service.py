"""The daemon: one asyncio loop runs the child's supervisor and the proxy (``uvicorn.Server``) together.

Signals are ours, not uvicorn's: its handlers are disabled and ``loop.add_signal_handler`` only
enqueues the signal number; one task dispatches them (SIGTERM/SIGINT: stop, SIGHUP: reload). A reload
runs in a task of its own, never builds or downloads, and is cancelled (not applied) by a stop: a stop
never waits behind a reload, and a reload applies whole or not at all.

New llama settings must earn their place: the binary first parses the new command line while the
working child still serves (``preflight``), then a child on them must pass the readiness gate; if it
fails before that, the driver rolls back to the last settings that passed it, and the rest of the
reload (tenants, keys, limits) is not applied either. Either way ``last_reload`` in status and
/readyz says what happened (``reload rejected: ...; kept the previous settings``).

Stop, in order: readiness goes false at once (the snapshot says "draining", so the proxy admits no new
work and /readyz answers 503), in-flight requests drain up to ``proxy.drain_timeout_s`` (a second
SIGTERM/SIGINT cuts that short), then the child gets SIGTERM, the grace period, SIGKILL, is reaped
and its port is checked closed; only then does the listener close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import socket
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvicorn

from proxy.app import create_app
from proxy.listener.guard import FrontDoor, uvicorn_config
from proxy.middleware.forwarded import ForwardedFor
from proxy.models.lane import ModelEntry
from proxy.settings import KeyEntry
from supervisor.child.driver import ChildSupervisor
from supervisor.child.gate import HttpProbes
from supervisor.child.machine import State
from supervisor.child.osseam import ChildOs, Probes
from supervisor.child.preflight import refused_arguments
from supervisor.child.restart import Policy
from supervisor.child.workdir import make_private_dir, sweep_stale
from supervisor.config.diff import diff as _diff
from supervisor.config.load import load_config
from supervisor.config.proxy_settings import proxy_settings
from supervisor.config.schema import Config
from supervisor.daemon.identity import flatten
from supervisor.daemon.listener import _Server
from supervisor.daemon.notify import Notifier, SystemdReporter, WatchdogFeeder
from supervisor.daemon.observability import Observability
from supervisor.daemon.prepare import Prepared, prepare
from supervisor.errors import ConfigError, LlamagateError
from supervisor.launch.flags import build_argv, build_env, new_secret
from supervisor.progress import NullProgress

log = logging.getLogger("llamagate.daemon")

# The outcome of a reload as status and /readyz show it (the log has the details).
_KEPT = "kept the previous settings"
_INVALID = "the config file does not validate (see the daemon's log)"
_NOT_VERIFIED = "the new llama settings did not verify or fit (see the daemon's log)"


class Daemon:
    def __init__(
        self,
        cfg: Config,
        prepared: Prepared,
        *,
        config_path: Path | None,
        generated_keys: Sequence[KeyEntry] = (),
        child_os: ChildOs | None = None,
        probes: Probes | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.generated_keys = tuple(generated_keys)
        sweep_stale()
        self.workdir = make_private_dir()
        try:
            self._build(cfg, prepared, child_os, probes)
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    def _build(
        self, cfg: Config, prepared: Prepared, child_os: ChildOs | None, probes: Probes | None
    ) -> None:
        from supervisor.child.spawn import RealOs

        self.probes = probes or HttpProbes()
        s = cfg.supervision
        self.supervisor = ChildSupervisor(
            prepared.spec,
            Policy.from_config(s),
            os=child_os or RealOs(),
            probes=self.probes,
            workdir=self.workdir,
            health_interval_s=s.health_interval_s,
            health_timeout_s=s.health_timeout_s,
            identity=prepared.identity,
        )
        self.supervisor.budget = prepared.budget.as_dict()
        self.observability = Observability(cfg, self.supervisor)
        self.app = create_app(
            proxy_settings(cfg, self.generated_keys),
            self.supervisor,
            [self._model_entry(cfg)],
            extra_collectors=self.observability.collectors,
        )
        self.runtime: Any = self.app.state.proxy
        self._build_common()

    def _model_entry(self, cfg: Config) -> ModelEntry:
        """The one served model, as the proxy routes to it."""
        return ModelEntry(cfg.llama.model.alias, cfg.proxy.model_aliases, self.supervisor)

    def _build_common(self) -> None:
        """What every daemon has beside its children: the door, systemd, signals."""
        self.door = FrontDoor(lambda: self.runtime.settings.door)
        self.runtime.door = self.door
        self.notifier = Notifier.from_env()
        self.reporter = SystemdReporter(self.notifier)
        self.supervisor.observers.append(self.reporter.on_state_change)
        self.supervisor.observers.append(self._on_state_change)
        feeder = WatchdogFeeder.from_env(self.notifier)
        if feeder is not None:
            self.supervisor.tick_hooks.append(lambda now: (feeder.tick(now), feeder.due_in(now))[1])
        self.exit_code = 0
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._hup = asyncio.Event()
        self._reloader: asyncio.Task[None] | None = None
        self._stop_reason = "stop requested"

    # --- hooks ---------------------------------------------------------------------------------------
    def _on_state_change(self, old: State, new: State, reason: str | None) -> None:
        if new is State.FAILED and self.cfg.supervision.exit_on_failed:
            # With several models the reason names the model that gave up ("model 'x': gave up: ...").
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
            self._reloader.cancel()  # a reload half done is not applied: whole or nothing

    # --- the loop ------------------------------------------------------------------------------------
    async def run(self, sock: socket.socket) -> int:
        try:
            await self.observability.start(
                self.runtime.metrics, FrontDoor(lambda: self.runtime.settings.door)
            )
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
            ForwardedFor(self.app, lambda: self.runtime.settings.door.forwarded_allow_ips),
            self.door,
            log_config=None,
            access_log=False,  # the proxy writes its own access log, without query strings or keys
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        server = _Server(config)
        tasks = {
            "supervisor": asyncio.create_task(self.supervisor.run(), name="supervisor"),
            "server": asyncio.create_task(server.serve(sockets=[sock]), name="proxy"),
            "signals": asyncio.create_task(self._dispatch_signals(), name="signals"),
        }
        log.info(
            "llamagate serving",
            extra={
                "fields": {
                    "listen": f"{self.cfg.proxy.host}:{self.cfg.proxy.port}",
                    **flatten(self.supervisor.served_identity),
                }
            },
        )
        try:
            listening = asyncio.create_task(self._announce_listening(server))
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait(
                [stop, tasks["supervisor"], tasks["server"]], return_when=asyncio.FIRST_COMPLETED
            )
            for t in (stop, listening):
                t.cancel()
            for name in ("supervisor", "server"):
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
        await self.probes.aclose()
        await self.observability.aclose()
        self.notifier.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    async def _announce_listening(self, server: uvicorn.Server) -> None:
        while not server.started:  # noqa: ASYNC110 - uvicorn only exposes a flag
            await asyncio.sleep(0.02)
        self.reporter.on_proxy_listening()

    async def _shutdown(self, server: uvicorn.Server, tasks: dict[str, asyncio.Task[Any]]) -> None:
        reason = self._stop_reason
        self.reporter.on_shutdown(reason)
        self.supervisor.draining = True
        in_flight = self.runtime.active
        log.info(f"stopping ({reason}): readiness off, draining", extra={"fields": {"in_flight": in_flight}})
        drain = asyncio.create_task(self.runtime.drain(self.cfg.proxy.drain_timeout_s))
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
                        "in_flight": self.runtime.active,
                        "drain_timeout_s": self.cfg.proxy.drain_timeout_s,
                    }
                },
            )
        if not tasks["supervisor"].done():
            await self.supervisor.stop(reason)
        server.should_exit = True
        with contextlib.suppress(Exception):
            await tasks["server"]
        log.info("llamagate stopped", extra={"fields": {"exit_code": self.exit_code}})

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
            try:
                await self.reload()
            except LlamagateError as exc:
                log.error(f"SIGHUP: reload failed, still serving the previous settings: {exc}")
                # /readyz is public: the details (paths, digests) stay in the log.
                self.supervisor.last_reload = f"reload rejected: {_NOT_VERIFIED}; {_KEPT}"
            except Exception:
                # Whatever went wrong, the next SIGHUP must still be served.
                log.exception("SIGHUP: reload failed, still serving the previous settings")
                self.supervisor.last_reload = f"reload failed (see the daemon's log); {_KEPT}"

    # --- SIGHUP --------------------------------------------------------------------------------------
    async def reload(self) -> None:
        if self.config_path is None:
            log.warning("SIGHUP: running on the embedded default (no config file); nothing to reload")
            return
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded:\n" + "\n".join(f"  {p}" for p in exc.problems))
            self.supervisor.last_reload = f"reload rejected: {_INVALID}; {_KEPT}"
            return
        old = self.cfg
        prepared = None
        if new.llama != old.llama:
            # Verify and budget first: a reload that cannot be applied whole is not applied at all.
            # The running child's memory is in use now but is freed before the new one starts.
            rss = self.supervisor.child_rss_bytes() or 0
            prepared = await asyncio.to_thread(
                prepare, new, progress=NullProgress(), extra_available=rss, fetch=False
            )
            # Then let the binary parse the new command line, while the working child still serves.
            refused = await refused_arguments(
                self.supervisor.os,
                build_argv(prepared.spec),
                build_env(new_secret(), self.workdir),
                self.workdir,
            )
            if refused is not None:
                self._reject(f"llama-server refused its arguments: {refused}")
                return
        fixed = []
        if (old.proxy.host, old.proxy.port, old.proxy.metrics_listener) != (
            new.proxy.host,
            new.proxy.port,
            new.proxy.metrics_listener,
        ):
            fixed.append("proxy.host/port/metrics_listener")
        if (old.logging.format, old.logging.level) != (new.logging.format, new.logging.level):
            fixed.append("logging.format/level")
        if fixed:
            log.warning(
                f"SIGHUP: {', '.join(fixed)} take effect at the next daemon start; keeping the current ones"
            )
            new = replace(
                new,
                proxy=replace(
                    new.proxy,
                    host=old.proxy.host,
                    port=old.proxy.port,
                    metrics_listener=old.proxy.metrics_listener,
                ),
                logging=replace(new.logging, format=old.logging.format, level=old.logging.level),
            )
        changes = _diff(old, new)
        if new.supervision != old.supervision:
            self._apply_supervision(new)  # before the new child starts: its load runs under them
        if prepared is not None:
            llama_changes = "; ".join(_diff(old.llama, new.llama, "llama."))
            log.warning(f"SIGHUP: llama settings changed, restarting llama-server: {llama_changes}")
            # The rest of the reload waits for the new child: applied with it, or not at all.
            rejected = await self.supervisor.try_settings(
                prepared.spec,
                prepared.identity,
                prepared.budget.as_dict(),
                f"llama settings changed: {llama_changes}",
            )
            if rejected is not None:
                if new.supervision != old.supervision:
                    self._apply_supervision(old)
                self._reject(rejected)
                return
        elif self.supervisor.state is State.FAILED:
            # An operator's SIGHUP is the documented way out of FAILED, also when the cause was
            # outside the config (memory, a file since restored): try again on the same settings.
            log.warning("SIGHUP while FAILED: starting llama-server again")
            self.supervisor.restart("SIGHUP while FAILED")
        keep_generated = not new.keys and new.proxy.anonymous_tenant is None
        self.runtime.reload(proxy_settings(new, self.generated_keys if keep_generated else ()))
        # The model's names as they are now (the lane, its gate and its requests stay).
        if new.llama.model.alias != old.llama.model.alias:
            self.runtime.router.remove(old.llama.model.alias)
        self.runtime.router.add(self._model_entry(new))
        # Only the outcome: /readyz needs no credentials, and the changes name tenants and keys.
        self.supervisor.last_reload = "applied"
        self.cfg = new
        log.info(
            "SIGHUP: configuration reloaded",
            extra={"fields": {"changes": "; ".join(changes) if changes else "none"}},
        )

    def _reject(self, reason: str) -> None:
        """Nothing of this reload is applied; say so in the log and in status and /readyz."""
        message = f"reload rejected: {reason}; {_KEPT}"
        self.supervisor.last_reload = message
        log.error(f"SIGHUP: {message}")

    def _apply_supervision(self, new: Config) -> None:
        s = new.supervision
        policy = Policy.from_config(s)
        machine = self.supervisor.machine
        machine.policy = policy
        machine.window.window_s = policy.restart_window_s
        machine.window.max_restarts = policy.max_restarts
        self.supervisor.health_interval_s = s.health_interval_s
        self.supervisor.health_timeout_s = s.health_timeout_s
