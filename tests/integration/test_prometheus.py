"""A real Prometheus scrapes a real daemon (real llama-server, demo model) and sees what operators need.

Prometheus (Debian package ``prometheus``) runs with a private TSDB in tmp_path, on a free loopback port,
scraping the daemon's main listener every 2 s with an admin key, and with the shipped alert rules
loaded (so they must also parse and evaluate cleanly in a real server). Traffic goes through the daemon
with the OpenAI SDK; the test then reads back through Prometheus's HTTP API. The daemon comes from the
shared ``daemon_factory`` (tests/integration/conftest.py).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from supervisor.child.spawn import free_port
from tests.helpers.promtool import check_metrics
from tests.helpers.system import require_tool
from tests.integration.conftest import Daemon, DaemonFactory

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "llamagate.rules.yml"
MODEL = "smollm2-135m-instruct"
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, interval_s: float = 0.25) -> T:
    """Poll ``probe`` until it returns something other than None/False, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            result = probe()
        except (httpx.HTTPError, OSError) as exc:
            result, last = None, exc
        if result:
            return result
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what} (last error: {last!r})")


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]

    def query(self, promql: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5).json()
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[Daemon], Prometheus]]:
    """Start a Prometheus scraping a daemon's main listener every 2 s with its admin key."""
    binary = require_tool("prometheus")
    started: list[subprocess.Popen[bytes]] = []

    def start(daemon: Daemon) -> Prometheus:
        tmp = tmp_path / f"prometheus{len(started)}"
        tmp.mkdir()
        shutil.copy(RULES, tmp / RULES.name)
        (tmp / "admin.key").write_text(daemon.admin_key)
        (tmp / "admin.key").chmod(0o600)
        config = {
            # 2 s rather than 1 s: a scrape must not time out on a host busy with other test runs.
            "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"},
            "rule_files": [RULES.name],
            "scrape_configs": [
                {
                    "job_name": "llamagate",
                    "authorization": {"type": "Bearer", "credentials_file": str(tmp / "admin.key")},
                    "static_configs": [{"targets": [f"127.0.0.1:{daemon.port}"]}],
                }
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        with (tmp / "prometheus.log").open("wb") as log:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp,
            )
        started.append(proc)
        p = Prometheus(f"http://127.0.0.1:{port}", proc)

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(
                    f"prometheus exited {proc.returncode}:\n{(tmp / 'prometheus.log').read_text()[-3000:]}"
                )
            return httpx.get(f"{p.url}/-/ready", timeout=2).status_code == 200

        wait_for("Prometheus to be ready", ready, timeout_s=60)
        return p

    try:
        yield start
    finally:
        for proc in started:
            _stop(proc)


def targets(p: Prometheus) -> list[dict[str, Any]]:
    return list(httpx.get(f"{p.url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"])


def scrape_target(p: Prometheus) -> dict[str, Any] | None:
    found = targets(p)
    return found[0] if found and found[0]["health"] == "up" else None


def scraped_ok(p: Prometheus) -> dict[str, Any]:
    target = wait_for("the llamagate target to be up", lambda: scrape_target(p), timeout_s=60)
    assert target["lastError"] == "", target
    return target


def samples_of(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


@pytest.mark.needs_tool("prometheus", "promtool")
def test_prometheus_scrapes_proxy_llama_and_supervisor_series(
    daemon_factory: DaemonFactory, prometheus: Callable[[Daemon], Prometheus]
) -> None:
    # A long backoff keeps the child down for a while after the kill (the delay is jittered: 0 to 30 s).
    daemon = daemon_factory({"supervision": {"backoff_initial_s": 30}})
    prom = prometheus(daemon)
    assert scraped_ok(prom)["labels"]["job"] == "llamagate"
    before = wait_for(
        "llama-server's relabeled series in Prometheus",
        lambda: prom.value(f'llamacpp_tokens_predicted_total{{model="{MODEL}"}}'),
        timeout_s=30,
    )

    client = OpenAI(
        base_url=f"{daemon.base_url}/v1", api_key=daemon.inference_key, max_retries=0, timeout=120
    )
    for i in range(3):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=16,
            stream=True,
        )
        assert any(chunk.choices and chunk.choices[0].delta.content for chunk in stream)

    wait_for(
        "the three requests in the tenant's TTFT histogram",
        lambda: (prom.value('llamagate_time_to_first_token_seconds_count{tenant="default"}') or 0) >= 3,
        timeout_s=30,
    )
    buckets = prom.query('llamagate_time_to_first_token_seconds_bucket{tenant="default"}')
    assert {b["metric"]["le"] for b in buckets} >= {"0.5", "1.0", "+Inf"}
    p95 = prom.value(
        "histogram_quantile(0.95, sum by (le) "
        '(llamagate_time_to_first_token_seconds_bucket{tenant="default"}))'
    )
    assert p95 is not None and p95 > 0

    after = wait_for(
        "llamacpp_tokens_predicted_total to grow",
        lambda: (v := prom.value(f'llamacpp_tokens_predicted_total{{model="{MODEL}"}}')) and v > before and v,
        timeout_s=30,
    )
    assert after >= before + 3  # three streams of at least one token each
    (series,) = prom.query(f'llamacpp_tokens_predicted_total{{model="{MODEL}"}}')
    # Our instance label is kept by Prometheus as exported_instance (the target's instance wins).
    assert series["metric"]["exported_instance"].endswith(f":{daemon.port}")

    assert prom.value(f'llamagate_child_state{{model="{MODEL}", state="READY"}}') == 1, daemon.log_text()[
        -3000:
    ]
    assert prom.value('llamagate_child_state{state="FAILED"}') == 0
    assert prom.value(f'llamagate_served_info{{model="{MODEL}", slots="2", ctx_per_slot="4096"}}') == 1
    assert prom.value('up{job="llamagate"}') == 1, targets(prom)
    assert prom.value("llamagate_upstream_scrape_ok") == 1
    scraped_ok(prom)
    rules = httpx.get(f"{prom.url}/api/v1/rules", timeout=5).json()["data"]["groups"]
    evaluated = [r for g in rules for r in g["rules"]]
    shipped = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len(evaluated) == len(shipped) >= 9  # every shipped rule loaded (9 before the cluster alert)
    assert all(r["health"] == "ok" for r in evaluated), [(r["name"], r.get("lastError")) for r in evaluated]

    # The child killed: /metrics still answers 200 with the proxy's and the supervisor's series.
    child = psutil.Process(daemon.child_pid)
    child.kill()
    child.wait(10)
    daemon.wait_for(lambda code, body: body.get("state") != "READY", "the daemon to notice the kill", 30)
    response = httpx.get(
        f"{daemon.base_url}/metrics", headers={"authorization": f"Bearer {daemon.admin_key}"}
    )
    assert response.status_code == 200
    samples = samples_of(response.text)
    assert samples[("llamagate_child_state", (("model", MODEL), ("state", "READY")))] == 0
    assert samples[("llamagate_child_failures_total", (("cause", "exit"), ("model", MODEL)))] == 1
    assert samples[("llamagate_upstream_scrape_ok", (("model", MODEL),))] == 0
    assert not [name for name, _ in samples if name.startswith("llamacpp_")]
    assert (
        samples[("llamagate_time_to_first_token_seconds_count", (("model", MODEL), ("tenant", "default")))]
        == 3
    )
    assert check_metrics(response.content).returncode == 0
    wait_for(
        "Prometheus to record the child's failure",
        lambda: prom.value('llamagate_child_failures_total{cause="exit"}') == 1,
        timeout_s=30,
    )
    scraped_ok(prom)


@pytest.mark.needs_tool("promtool")
def test_promtool_accepts_the_daemon_metrics_on_both_listeners(daemon_factory: DaemonFactory) -> None:
    metrics_port = free_port()
    daemon = daemon_factory({"proxy": {"metrics_listener": {"host": "127.0.0.1", "port": metrics_port}}})
    main = httpx.get(f"{daemon.base_url}/metrics", headers={"authorization": f"Bearer {daemon.admin_key}"})
    local = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics")
    for response in (main, local):
        assert response.status_code == 200
        assert samples_of(response.text)[("llamagate_upstream_scrape_ok", (("model", MODEL),))] == 1
        result = check_metrics(response.content)
        assert result.returncode == 0, result.stdout + result.stderr
    # Same registry: the relabeled upstream series and the proxy's own.
    assert {k[0] for k in samples_of(main.text)} == {k[0] for k in samples_of(local.text)}
    # The main listener's /metrics is for admin keys only; the loopback one serves nothing else.
    refused = httpx.get(
        f"{daemon.base_url}/metrics", headers={"authorization": f"Bearer {daemon.inference_key}"}
    )
    assert refused.status_code == 403
    assert httpx.get(f"http://127.0.0.1:{metrics_port}/readyz").status_code == 404
