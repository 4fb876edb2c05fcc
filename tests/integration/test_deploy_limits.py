"""The memory limits shipped in deploy/ are what the budget says for their configurations.

Integration: the budget reads the real demo model's GGUF header (layers, KV heads, sliding window).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from supervisor.budget.gguf_info import read_shape
from supervisor.budget.plan import plan_budget
from supervisor.config.load import parse_config
from supervisor.config.schema import Config
from supervisor.daemon.deploy_hints import ServiceLimits

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "llamagate.service"
K8S = REPO / "deploy" / "kubernetes"

pytestmark = pytest.mark.integration


def limits_for(config: Config, model: Path) -> ServiceLimits:
    llama = config.llama
    budget = plan_budget(
        read_shape(model),
        weights=model.stat().st_size,
        slots=llama.slots,
        ctx_per_slot=llama.ctx_per_slot,
        type_k=llama.cache_type_k,
        type_v=llama.cache_type_v,
        headroom_bytes=config.supervision.memory_headroom_mib * 1024 * 1024,
        prompt_cache_bytes=llama.prompt_cache_mib * 1024 * 1024,
        ctx_checkpoints=llama.ctx_checkpoints,
        # Only the "largest that fits" hints depend on the host; the limits do not.
        available=64 * 1024**3,
    )
    return ServiceLimits.from_budget(budget, llama.threads or 1)


def test_systemd_unit_limits_match_the_default_config(demo_model: Path) -> None:
    dropin = limits_for(Config(), demo_model).systemd_dropin()
    expected = [line for line in dropin.splitlines() if line.startswith("Memory")]
    unit = [line.strip() for line in UNIT.read_text().splitlines()]
    for line in expected:
        assert line in unit, f"{UNIT.name}: expected {line} (llamagate plan --systemd for the default config)"


def test_kubernetes_resources_match_the_configmap(demo_model: Path) -> None:
    docs = {d["kind"]: d for p in K8S.glob("*.yaml") for d in yaml.safe_load_all(p.read_text()) if d}
    secret_env = docs["Secret"]["stringData"]
    config = parse_config(docs["ConfigMap"]["data"]["config.yaml"], env=secret_env)
    assert config.llama.model.path is None, "the shipped manifests serve the demo model"
    (container,) = [
        c for c in docs["Deployment"]["spec"]["template"]["spec"]["containers"] if c["name"] == "llamagate"
    ]
    assert container["resources"] == limits_for(config, demo_model).kubernetes_resources()


@pytest.mark.parametrize("flag", ["--systemd", "--kubernetes"])
def test_plan_prints_the_limits(tmp_path: Path, demo_model: Path, flag: str) -> None:
    from supervisor.artifacts.demo_model import DEFAULT_DEMO

    config = {
        "llama": {"model": {"path": str(demo_model), "sha256": DEFAULT_DEMO.sha256}, "threads": 2},
        "supervision": {"memory_headroom_mib": 0},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "plan", "--config", str(path), flag],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "LLAMAGATE_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr
    limits = limits_for(parse_config(path.read_text()), demo_model)
    if flag == "--systemd":
        assert result.stdout == limits.systemd_dropin()
    else:
        assert yaml.safe_load(result.stdout) == {"resources": limits.kubernetes_resources()}
