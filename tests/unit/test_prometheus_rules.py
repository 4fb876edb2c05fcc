"""The shipped Prometheus files pass promtool: the scrape config, the alert rules, and the rules' unit
tests (deploy/prometheus/tests/*.yml: crash loop, not ready, TTFT, restart rate, rejection ratio, slot
saturation, memory, upstream metrics missing, daemon down)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers import promtool

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROM / "llamagate.rules.yml"
REQUIRED_TESTED_ALERTS = {"LlamagateCrashLoop", "LlamagateChildNotReady", "LlamagateTTFTHigh"}


@pytest.mark.needs_tool("promtool")
def test_promtool_check_rules() -> None:
    result = promtool.run("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 10 rules found" in result.stdout


@pytest.mark.needs_tool("promtool")
def test_promtool_test_rules() -> None:
    tests = sorted((PROM / "tests").glob("*.yml"))
    assert tests
    result = promtool.run("test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    fired = set()
    for path in (PROM / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])
    assert fired >= REQUIRED_TESTED_ALERTS
    assert fired == alerts, f"alerts without a firing test: {sorted(alerts - fired)}"


@pytest.mark.needs_tool("promtool")
def test_promtool_check_scrape_config(tmp_path: Path) -> None:
    # promtool insists the credentials file exists; point it at a private one, keep everything else.
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "llamagate"  # the rules and the dashboard select on it
    key = tmp_path / "admin.key"
    key.write_text("lg_000000000000_" + "x" * 43)
    job["authorization"]["credentials_file"] = str(key)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(RULES, tmp_path / RULES.name)
    result = promtool.run("check", "config", tmp_path / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
