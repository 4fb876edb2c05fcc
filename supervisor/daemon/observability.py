"""The daemon's metrics parts in one place: the collectors added to the proxy's registry (the
supervisor's series and llama-server's relabeled ones) and the optional loopback ``/metrics`` listener.

The daemon creates one ``Observability`` beside the driver, passes ``collectors`` to ``create_app``,
awaits ``start`` before serving and ``aclose`` when stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from prometheus_client.registry import Collector

from proxy.listener.guard import FrontDoor, uvicorn_config
from proxy.metrics.listener import create_metrics_app
from proxy.metrics.llama import ModelsLlamaMetrics
from proxy.metrics.proxy import ProxyMetrics
from supervisor.child.driver import ChildSupervisor
from supervisor.config.schema import Config
from supervisor.daemon.listener import _Server, bind_listener
from supervisor.daemon.metrics_collector import SupervisorCollector

log = logging.getLogger("llamagate.daemon")


def instance_label(cfg: Config) -> str:
    """``instance`` of llama-server's series: this daemon, as a Prometheus target would name it."""
    return f"{socket.gethostname()}:{cfg.proxy.port}"


class Observability:
    def __init__(self, cfg: Config, supervisor: ChildSupervisor) -> None:
        self.cfg = cfg
        self.llama = ModelsLlamaMetrics.single(supervisor.snapshot, instance_label(cfg))
        supervisor_series = SupervisorCollector.single(
            supervisor, lambda: supervisor.template.alias, clock=supervisor.os.now
        )
        self.collectors: tuple[Collector, ...] = (supervisor_series, self.llama)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, metrics: ProxyMetrics, door: FrontDoor | None = None) -> None:
        """Open the loopback listener if configured; raises ``StartupError`` if its port is taken.
        ``door``: its limits (the same as the main listener's, counted apart)."""
        # Same bind (fails fast, names the address) and the same signal-less uvicorn server as the main
        # listener.
        listener = self.cfg.proxy.metrics_listener
        if listener is None:
            return
        sock = bind_listener(listener.host, listener.port)
        app = create_metrics_app(metrics)
        kwargs = {"log_config": None, "access_log": False, "lifespan": "off"}
        if door is not None:
            config = uvicorn_config(app, door, **kwargs)
        else:
            config = uvicorn.Config(app, server_header=False, **kwargs)  # type: ignore[arg-type]
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="metrics-listener")
        log.info(
            "unauthenticated /metrics listener open",
            extra={"fields": {"listen": f"{listener.host}:{listener.port}"}},
        )

    async def aclose(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        await self.llama.aclose()
