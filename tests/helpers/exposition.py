"""The complete ``/metrics`` exposition of a daemon, built from the real parts without a child process:
the proxy app (real ``create_app``), llama-server's series from the captured exposition (MockTransport),
and the supervisor's collector over a READY state machine with a live process standing in for the child.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.accounts.service import Accounts
from proxy.accounts.sqlite import open_store
from proxy.app import create_app
from proxy.auth import new_key
from proxy.metrics.llama import ModelsLlamaMetrics
from proxy.models.lane import ModelEntry
from proxy.settings import ProxySettings, TenantSettings
from proxy.source import UpstreamSnapshot
from supervisor.child.machine import GatePassed, Machine, Start
from supervisor.child.restart import Policy
from supervisor.daemon.metrics_collector import SupervisorCollector
from supervisor.daemon.state_disk import Folders

CAPTURED = (Path(__file__).parent.parent / "unit" / "fixtures" / "llama_server_metrics.txt").read_text()
SNAPSHOT = UpstreamSnapshot(
    state="READY",
    ready=True,
    reason=None,
    base_url="http://127.0.0.1:9",
    secret="boot-secret",
    model_alias="gemma-3-270m",
    slots=2,
    ctx_per_slot=4096,
    generation=1,
    retry_after_s=0.0,
)


class FakeDriver:
    """The driver's read side (``SupervisorView`` and ``UpstreamSource``) with this process as the child."""

    def __init__(self) -> None:
        self.machine = Machine(Policy())
        self.machine.step(Start(), 0.0)
        self.machine.step(GatePassed(1), 1.0)
        self.child_pid: int | None = os.getpid()
        self.load_seconds: float | None = 1.0
        self.ready_since: float | None = 1.0
        self.budget: Mapping[str, object] | None = {
            "weights_bytes": 246_415_360,
            "kv_bytes": 56_623_104,
            "runtime_bytes": 146_800_640,
            "headroom_bytes": 1 << 30,
        }

    def child_rss_bytes(self) -> int | None:
        return 1 << 28

    def child_cpu_seconds(self) -> float | None:
        return 1.5

    def snapshot(self) -> UpstreamSnapshot:
        return SNAPSHOT

    def identity(self) -> Mapping[str, object]:
        return {"model": {"alias": "gemma-3-270m"}, "serving": {"slots": 2, "ctx_per_slot": 4096}}


def _llama_server(request: httpx.Request) -> httpx.Response:
    assert request.url.path == "/metrics"
    return httpx.Response(200, text=CAPTURED)


async def full_exposition() -> str:
    with tempfile.TemporaryDirectory(prefix="llamagate-exposition-") as folder:
        accounts = Accounts(open_store(Path(folder) / "llamagate.db"), (TenantSettings("ops"),))
        try:
            return await _exposition(accounts)
        finally:
            accounts.close()


async def _exposition(accounts: Accounts) -> str:
    """With an accounts store (its ledger's series exist only then), not started: nothing is written."""
    driver = FakeDriver()
    folders = Folders()  # the daemon's states folders: one model, nothing lost
    folders.lost["gemma-3-270m"] = 0
    admin_key, admin = new_key("ops", frozenset({"admin", "inference"}))
    llama = ModelsLlamaMetrics.single(
        driver.snapshot, "gate:8080", transport=httpx.MockTransport(_llama_server)
    )
    app = create_app(
        ProxySettings(tenants=(TenantSettings("ops"),), keys=(admin,)),
        driver,
        [ModelEntry("gemma-3-270m", (), driver)],
        extra_collectors=[
            SupervisorCollector.single(driver, lambda: "gemma-3-270m", clock=lambda: 2.0),
            llama,
            folders.collector(),
        ],
        accounts=accounts,
    )
    headers = {"authorization": f"Bearer {admin_key}"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gate") as client:
            # A refused request and a first scrape fill the request and rejection families.
            await client.post("/v1/chat/completions", json={})
            await client.get("/metrics", headers=headers)
            response = await client.get("/metrics", headers=headers)
            response.raise_for_status()
            return response.text
    finally:
        await llama.aclose()
        await app.state.proxy.aclose()


def exported_series(exposition: str) -> dict[str, set[str] | None]:
    """Every series name a query may use (histograms: ``_bucket``, ``_count``, ``_sum``), with its label
    names, or None where the family has no sample yet (a labelled family before its first observation
    has only its HELP and TYPE lines, so its labels cannot be read)."""
    out: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(exposition):
        suffixes = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",)}.get(
            family.type, ("",)
        )
        labels = {label for sample in family.samples for label in sample.labels} if family.samples else None
        for suffix in suffixes:
            out[family.name + suffix] = labels
    return out


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample with exactly these labels (prometheus-client sorts them), or None."""
    rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(rendered)}\}} (\S+)$", text, re.M)
    return float(found[1]) if found else None
