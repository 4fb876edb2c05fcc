"""deploy/kubernetes/: schema-valid for a pinned Kubernetes, and consistent with the code it runs."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, validate
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.models.lane import ModelEntry
from proxy.settings import ProxySettings
from proxy.source import UpstreamSnapshot
from supervisor.config.load import parse_config
from supervisor.config.schema import Config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
# A recent release most clusters run or will soon; bump deliberately (kubernetes-validate ships schemas).
KUBERNETES_VERSION = "1.34.0"
# Custom resources have no schema in kubernetes-validate; they are checked field by field below.
CRD_GROUPS = ("monitoring.coreos.com/",)
KEY_PATTERN = re.compile(r"lg_[0-9a-f]{12}_[A-Za-z0-9_-]{43}")


def manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for _, d in manifests() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(deployment: Mapping[str, Any], name: str = "llamagate") -> dict[str, Any]:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def deployed_config() -> Config:
    """The ConfigMap's config through the real loader, with the Secret's values as the environment."""
    secret = one("Secret", "llamagate-keys")
    config_map = one("ConfigMap", "llamagate-config")
    return parse_config(config_map["data"]["config.yaml"], source="configmap", env=secret["stringData"])


class _Upstream:
    def snapshot(self) -> UpstreamSnapshot:
        return UpstreamSnapshot("STARTING", False, "loading", None, None, "m", 1, 256, 0, 1.0)

    def identity(self) -> Mapping[str, object]:
        return {}


def proxy_routes() -> set[str]:
    app = create_app(ProxySettings(), _Upstream(), [ModelEntry("m", (), _Upstream())])
    return {route.path for route in app.routes}  # type: ignore[attr-defined]


def exported_metric_families() -> dict[str, str]:
    """name -> type of every series family the proxy's /metrics exposes."""
    registry = CollectorRegistry(auto_describe=True)
    create_app(ProxySettings(), _Upstream(), [ModelEntry("m", (), _Upstream())], registry=registry)
    text = generate_latest(registry).decode()
    return {family.name: family.type for family in text_string_to_metric_families(text)}


# Custom resources (the PodMonitor) have no schema in kubernetes-validate; test_podmonitor_matches_the_pod
# checks that one against the pod instead.
@pytest.mark.parametrize(
    ("path", "doc"),
    [(p, d) for p, d in manifests() if not d["apiVersion"].startswith(CRD_GROUPS)],
    ids=lambda v: v.name if isinstance(v, Path) else "",
)
def test_manifest_validates_strictly(path: Path, doc: dict[str, Any]) -> None:
    try:
        validate(doc, KUBERNETES_VERSION, strict=True)
    except (ValidationError, SchemaNotFoundError) as exc:
        pytest.fail(f"{path.relative_to(REPO)}: {doc['kind']}/{doc['metadata']['name']}: {exc}")


def test_strict_validation_rejects_an_unknown_field() -> None:
    deployment = one("Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(ValidationError):
        validate(broken, KUBERNETES_VERSION, strict=True)


def test_configmap_config_loads_with_the_real_loader() -> None:
    config = deployed_config()
    assert config.proxy.host == "0.0.0.0"
    assert config.supervision.exit_on_failed
    tenants = {t.name for t in config.tenants}
    assert {k.tenant for k in config.keys} <= tenants
    assert any("admin" in k.scopes for k in config.keys), "Prometheus needs an admin key for /metrics"


def test_secret_holds_digests_only_and_no_manifest_holds_a_key() -> None:
    secret = one("Secret", "llamagate-keys")
    assert "data" not in secret
    for name, value in secret["stringData"].items():
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", value), f"{name} is not a key digest"
    # Every digest the config references comes from the Secret, and every one is used.
    text = one("ConfigMap")["data"]["config.yaml"]
    assert set(re.findall(r"\$\{(\w+)\}", text)) == set(secret["stringData"])
    for path in K8S.rglob("*.yaml"):
        assert not KEY_PATTERN.search(path.read_text()), f"{path} contains an API key"


def test_probes_and_ports_match_the_proxy() -> None:
    config = deployed_config()
    deployment = one("Deployment")
    c = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == config.proxy.port
    routes = proxy_routes()
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"]["path"] == "/readyz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == "/healthz"
    for probe in probes.values():
        assert probe["path"] in routes
        assert probe["port"] in ports or probe["port"] == config.proxy.port
    service = one("Service")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports) | set(ports.values())
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert (
        service["spec"]["selector"]
        == selector
        == one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    )
    assert c["args"][:2] == ["serve", "--config"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert c["args"][2].startswith(mounts["config"] + "/")


def test_startup_budget_and_shutdown_timeline() -> None:
    config = deployed_config()
    pod = one("Deployment")["spec"]["template"]["spec"]
    c = container(one("Deployment"))
    startup = c["startupProbe"]
    # The startup probe must outlast the supervisor's own load timeout, or Kubernetes kills a
    # pod that is still legitimately loading its model.
    assert startup["periodSeconds"] * startup["failureThreshold"] > config.supervision.load_timeout_s
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # preStop sleep, then SIGTERM: drain, then the child's SIGTERM->SIGKILL grace, all inside the grace.
    needed = int(pre_stop[1]) + config.proxy.drain_timeout_s + config.supervision.stop_grace_s
    assert pod["terminationGracePeriodSeconds"] > needed


def test_cpu_resources_follow_the_threads() -> None:
    config = deployed_config()
    resources = container(one("Deployment"))["resources"]
    assert resources["requests"] == resources["limits"], "QoS class Guaranteed"
    assert config.llama.threads is not None
    assert int(resources["limits"]["cpu"]) == config.llama.threads + 1


def test_podmonitor_matches_the_pod() -> None:
    monitor = one("PodMonitor")
    deployment = one("Deployment")
    assert monitor["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container(deployment)["ports"]}
    assert endpoint["path"] in proxy_routes()
    # /metrics needs an admin key; the scraper must send one.
    assert endpoint["authorization"]["type"] == "Bearer"


def _metric_names(text: str) -> set[str]:
    # Not an nginx variable ($llamagate_conversation, docs/deploy.md's scale-out).
    return set(re.findall(r"(?<![$\w])llamagate_[a-z_]+[a-z]", text))


def test_autoscaling_metrics_exist_in_the_proxy() -> None:
    families = exported_metric_families()
    hpa = one("HorizontalPodAutoscaler")
    used = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    text = DEPLOY_DOC.read_text() + (K8S / "optional" / "hpa.yaml").read_text()
    names = used | _metric_names(text)
    assert names, "no llamagate_* metric referenced"
    for name in sorted(names):
        if name.endswith("_per_second"):
            # A rate the metrics adapter derives from a counter.
            base = name.removesuffix("_per_second")
            assert families.get(base) == "counter", f"{name}: no counter {base}_total in proxy/metrics.py"
            continue
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert name in families or base in families, f"{name} is not exported by the proxy"
    # Only overload rejections should scale the service, not bad keys or bad requests.
    reasons = set(re.findall(r'reason=~"([^"]+)"', text))
    assert reasons, "the rejection-rate rule must filter by reason"
    proxy_source = "\n".join(p.read_text() for p in (REPO / "proxy").rglob("*.py"))
    for alternatives in reasons:
        for reason in alternatives.split("|"):
            assert f'"{reason}"' in proxy_source, f"rejection reason {reason} does not exist in proxy/"
