"""The daemon's metrics parts in one place: the collectors added to the proxy's registry (the
supervisor's series and llama-server's relabeled ones), the optional unauthenticated ``/metrics``
listener (served to the peers of its allow list only), and the children's events for OpenTelemetry
(a hung child's ``llamagate.child.hang`` span, when the ``telemetry:`` section is set).

The daemon creates one ``Observability`` beside its served models (one or several: every series carries
the model's name), passes ``collectors`` to the proxy's app, awaits ``start`` before serving and
``aclose`` when stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

import uvicorn
from prometheus_client.registry import Collector

from proxy.listener.guard import FrontDoor, uvicorn_config
from proxy.metrics.listener import create_metrics_app
from proxy.metrics.llama import ModelsLlamaMetrics, Snapshots
from proxy.metrics.proxy import ProxyMetrics
from proxy.telemetry import Telemetry
from supervisor.config.schema import Config
from supervisor.daemon.listener import _Server, bind_listener
from supervisor.daemon.metrics_collector import SupervisorCollector, Views

log = logging.getLogger("llamagate.daemon")


def instance_label(cfg: Config) -> str:
    """``instance`` of llama-server's series: this daemon, as a Prometheus target would name it."""
    return f"{socket.gethostname()}:{cfg.proxy.port}"


class Observability:
    def __init__(self, cfg: Config, views: Views, snapshots: Snapshots, clock: Callable[[], float]) -> None:
        """``views``, ``snapshots``: every served model by name, read at each scrape (models come and go
        on SIGHUP, and a model gets a new driver when it loads or changes settings). ``clock``: the
        drivers' clock."""
        self.cfg = cfg
        # llama-server's series from every model's child, each with its model label.
        self.llama = ModelsLlamaMetrics(snapshots, instance_label(cfg))
        self.collectors: tuple[Collector, ...] = (SupervisorCollector(views, clock=clock), self.llama)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        # The proxy's OpenTelemetry exporters (set once the proxy is built); None: telemetry is off.
        self.telemetry: Telemetry | None = None

    def child_hung(self, model: str, reason: str, generation: int) -> None:
        """The watchdog found ``model``'s server loop held (``supervisor.child.machine``): a span of its
        own beside the requests' traces (the Prometheus side is ``llamagate_child_failures_total``)."""
        if self.telemetry is None:
            return
        try:
            self.telemetry.child_event(
                "llamagate.child.hang",
                {
                    "llamagate.model": model,
                    "llamagate.child.generation": generation,
                    "llamagate.child.reason": reason,
                },
            )
        except Exception:  # telemetry must never take the supervisor's path down
            log.exception("could not export the hang event")

    async def start(self, metrics: ProxyMetrics, door: FrontDoor | None = None) -> None:
        """Open the loopback listener if configured; raises ``StartupError`` if its port is taken.
        ``door``: its limits (the same as the main listener's, counted apart)."""
        # Same bind (fails fast, names the address) and the same signal-less uvicorn server as the main
        # listener.
        listener = self.cfg.proxy.metrics_listener
        if listener is None:
            return
        sock = bind_listener(listener.host, listener.port)
        app = create_metrics_app(metrics, listener.allow)
        kwargs = {"log_config": None, "access_log": False, "lifespan": "off"}
        if door is not None:
            config = uvicorn_config(app, door, **kwargs)
        else:
            config = uvicorn.Config(app, server_header=False, **kwargs)  # type: ignore[arg-type]
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="metrics-listener")
        log.info(
            "unauthenticated /metrics listener open",
            extra={
                "fields": {"listen": f"{listener.host}:{listener.port}", "allow": ",".join(listener.allow)}
            },
        )

    async def aclose(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        await self.llama.aclose()
