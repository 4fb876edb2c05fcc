"""Rules that involve more than one field. Run once every field is well-typed; each problem is
``path: message`` like the per-field checks."""

from __future__ import annotations

import importlib.util
from collections import Counter

from supervisor.config.schema import Config, overrides
from supervisor.launch.flags import refused_extra_args


def cross_check(cfg: Config) -> list[str]:
    return [
        *_llama(cfg),
        *_models(cfg),
        *_supervision(cfg),
        *_tenants_and_keys(cfg),
        *_proxy(cfg),
        *_store(cfg),
        *_cluster(cfg),
        *_telemetry(cfg),
    ]


def _models(cfg: Config) -> list[str]:
    """``models:``: names and aliases name one model each; files are verified; tenants name real models."""
    out = []
    owner: dict[str, str] = {}
    for i, m in enumerate(cfg.models):
        where = f"models[{i}]"
        if not m.name:
            out.append(f"{where}.name: required")
        for field, name in [("name", m.name), *((f"aliases[{j}]", a) for j, a in enumerate(m.aliases))]:
            if not name:
                continue
            if name in owner:
                out.append(f"{where}.{field}: {name!r} already names {owner[name]}")
            owner.setdefault(name, where)
        if m.preload and m.residency != "on_demand":
            out.append(
                f"{where}.preload: only for residency on_demand (an 'always' model is loaded at start anyway)"
            )
        if m.path is not None and m.sha256 is None:
            out.append(f"{where}.sha256: required when {where}.path is set (the file is verified)")
        if m.path is None and m.sha256 is not None:
            out.append(f"{where}.sha256: only with {where}.path (the demo model's digest is pinned)")
        for j, flag, reason in refused_extra_args(overrides(m).get("extra_args", ())):
            out.append(f"{where}.extra_args[{j}]: {flag} is not allowed: {reason}")
    if cfg.models and cfg.proxy.model_aliases:
        out.append("proxy.model_aliases: with models:, give each model its own aliases (models[].aliases)")
    names = {m.name for m in cfg.models if m.name} if cfg.models else {cfg.llama.model.alias}
    for i, tenant in enumerate(cfg.tenants):
        for j, name in enumerate(tenant.models):
            if name not in names:
                served = ", ".join(sorted(names))
                out.append(f"tenants[{i}].models[{j}]: {name!r} is not a served model (served: {served})")
    return out


def _llama(cfg: Config) -> list[str]:
    out = []
    llama, model = cfg.llama, cfg.llama.model
    if model.path is not None and model.sha256 is None:
        out.append("llama.model.sha256: required when llama.model.path is set (the file is verified)")
    if model.path is None and model.sha256 is not None:
        out.append("llama.model.sha256: only with llama.model.path (the demo model's digest is pinned)")
    if llama.binary_sha256 is not None and llama.binary is None:
        out.append("llama.binary_sha256: only with llama.binary")
    if llama.binary is not None and llama.lock is not None:
        out.append("llama.lock: set either llama.lock or llama.binary, not both")
    for i, flag, reason in refused_extra_args(llama.extra_args):
        out.append(f"llama.extra_args[{i}]: {flag} is not allowed: {reason}")
    out += _offload("llama", llama.variant, llama.device)
    for i, m in enumerate(cfg.models):
        own = overrides(m)
        if "device" in own or "variant" in own:
            out += _offload(
                f"models[{i}]", own.get("variant", llama.variant), own.get("device", llama.device)
            )
    return out


def _offload(where: str, variant: str, device: str | None) -> list[str]:
    # A CPU build knows no device: llama-server would refuse the name and the child never load.
    if variant == "cpu" and device not in (None, "none"):
        return [
            f"{where}.device: the cpu build has no device to offload to; set {where}.variant (vulkan, cuda)"
        ]
    return []


def _supervision(cfg: Config) -> list[str]:
    s = cfg.supervision
    out = []
    if s.backoff_max_s < s.backoff_initial_s:
        out.append("supervision.backoff_max_s: must be >= supervision.backoff_initial_s")
    if s.stall_timeout_s > s.load_timeout_s:
        out.append("supervision.stall_timeout_s: must be <= supervision.load_timeout_s")
    return out


def _tenants_and_keys(cfg: Config) -> list[str]:
    out = []
    if not cfg.tenants:
        out.append("tenants: at least one tenant is needed")
    first: dict[str, int] = {}
    for i, tenant in enumerate(cfg.tenants):
        if tenant.name in first:
            out.append(
                f"tenants[{i}].name: duplicate tenant {tenant.name!r} (also tenants[{first[tenant.name]}])"
            )
        first.setdefault(tenant.name, i)
    ids = Counter(k.id for k in cfg.keys)
    for i, key in enumerate(cfg.keys):
        if not key.id:
            out.append(f"keys[{i}].id: required")
        elif ids[key.id] > 1:
            out.append(f"keys[{i}].id: duplicate key id {key.id!r}")
        if not key.digest:
            out.append(f"keys[{i}].digest: required")
        if key.tenant not in first:
            out.append(f"keys[{i}].tenant: no tenant named {key.tenant!r}")
        if not key.scopes:
            out.append(f"keys[{i}].scopes: at least one of inference, admin")
    anon = cfg.proxy.anonymous_tenant
    if anon is not None and anon not in first:
        out.append(f"proxy.anonymous_tenant: no tenant named {anon!r}")
    return out


def _store(cfg: Config) -> list[str]:
    if cfg.store is not None and cfg.store.path is not None and cfg.store.url is not None:
        return ["store.url: give store.path (an SQLite file) or store.url (a PostgreSQL database), not both"]
    return []


def _proxy(cfg: Config) -> list[str]:
    out = []
    ml = cfg.proxy.metrics_listener
    if ml is not None and ml.port == cfg.proxy.port:
        out.append("proxy.metrics_listener.port: must differ from proxy.port")
    if ml is not None and not ml.allow:
        out.append("proxy.metrics_listener.allow: must name at least one peer (an address or a CIDR)")
    return out


def _cluster(cfg: Config) -> list[str]:
    """``cluster:`` without the Redis it is about would silently be per-replica limits."""
    if cfg.cluster is not None and not cfg.cluster.redis_url:
        return ["cluster.redis_url: required (redis://host:port/db) when cluster is set; or remove cluster"]
    return []


# What the otel extra installs; ``telemetry:`` without it would fail only when the proxy starts.
_OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")


def _telemetry(cfg: Config) -> list[str]:
    if cfg.telemetry is None or not cfg.telemetry.enabled:
        return []
    try:
        missing = [m for m in _OTEL_MODULES if importlib.util.find_spec(m) is None]
    except ModuleNotFoundError:  # a parent package is missing
        missing = list(_OTEL_MODULES)
    if missing:
        return [
            "telemetry: needs the otel extra (pip install 'llamagate[otel]'): "
            + ", ".join(missing)
            + " not installed; or remove telemetry"
        ]
    return []
