"""Config -> the proxy's ``ProxySettings``. The proxy validates nothing; this mapping is the handover."""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType

from proxy.settings import (
    BudgetSettings,
    ClusterSettings,
    CorsSettings,
    DoorSettings,
    KeyEntry,
    Listener,
    PoisonSettings,
    ProxySettings,
    StoreSettings,
    TelemetrySettings,
    TenantSettings,
    Timeouts,
)
from supervisor.config.schema import ClusterConfig, Config, StoreConfig, TelemetryConfig
from supervisor.paths import default_store_path


def store_settings(store: StoreConfig | None) -> StoreSettings | None:
    if store is None:
        return None
    return StoreSettings(
        path=str(store.path if store.path is not None else default_store_path()),
        usage_retention_days=store.usage_retention_days,
        rollup_retention_days=store.rollup_retention_days,
        url=store.url,
    )


def cluster_settings(cluster: ClusterConfig | None) -> ClusterSettings | None:
    if cluster is None:
        return None
    return ClusterSettings(
        redis_url=cluster.redis_url,
        replicas=cluster.replicas,
        on_redis_error=cluster.on_redis_error,
        lease_ttl_s=cluster.lease_ttl_s,
        socket_timeout_s=cluster.socket_timeout_s,
        probe_interval_s=cluster.probe_interval_s,
    )


def _pairs(items: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``("name=value", ...)`` as pairs (the schema checked each has its ``=``)."""
    return tuple((name.strip(), value.strip()) for name, _, value in (i.partition("=") for i in items))


def telemetry_settings(telemetry: TelemetryConfig | None) -> TelemetrySettings | None:
    if telemetry is None or not telemetry.enabled:
        return None
    return TelemetrySettings(
        endpoint=telemetry.endpoint,
        headers=_pairs(telemetry.headers),
        service_name=telemetry.service_name,
        sampling_ratio=telemetry.sampling_ratio,
        resource_attributes=_pairs(telemetry.resource_attributes),
        metrics_interval_s=telemetry.metrics_interval_s,
    )


def proxy_settings(cfg: Config, extra_keys: Iterable[KeyEntry] = ()) -> ProxySettings:
    p = cfg.proxy
    keys = tuple(
        KeyEntry(key_id=k.id, digest=k.digest, tenant=k.tenant, scopes=frozenset(k.scopes)) for k in cfg.keys
    )
    return ProxySettings(
        listen=Listener(host=p.host, port=p.port),
        tenants=tuple(
            TenantSettings(
                name=t.name,
                max_concurrency=t.max_concurrency,
                max_queue=t.max_queue,
                queue_timeout_s=t.queue_timeout_s,
                weight=t.weight,
                priority=t.priority,
                max_tokens=t.max_tokens,
                check_prompt_size=t.check_prompt_size,
                max_n=t.max_n,
                max_prompts=t.max_prompts,
                max_logprobs=t.max_logprobs,
                show_cache_details=t.show_cache_details,
                cache_prompt=t.cache_prompt,
                models=t.models,
                max_concurrency_total=t.max_concurrency_total,
                budgets=BudgetSettings(
                    tokens_per_minute=t.budgets.tokens_per_minute,
                    tokens_per_day=t.budgets.tokens_per_day,
                    requests_per_minute=t.budgets.requests_per_minute,
                ),
                field_bounds=MappingProxyType(dict(t.field_bounds)),
            )
            for t in cfg.tenants
        ),
        keys=keys + tuple(extra_keys),
        anonymous_tenant=p.anonymous_tenant,
        max_body_bytes=p.max_body_bytes,
        timeouts=Timeouts(
            connect_s=p.timeouts.connect_s,
            first_token_s=p.timeouts.first_token_s,
            total_s=p.timeouts.total_s,
        ),
        metrics_listener=(
            Listener(host=p.metrics_listener.host, port=p.metrics_listener.port)
            if p.metrics_listener
            else None
        ),
        drain_timeout_s=p.drain_timeout_s,
        access_log=cfg.logging.access_log,
        door=DoorSettings(
            max_request_line_bytes=p.max_request_line_bytes,
            max_head_bytes=p.max_head_bytes,
            max_headers=p.max_headers,
            head_timeout_s=p.head_timeout_s,
            keep_alive_timeout_s=p.keep_alive_timeout_s,
            max_connections=p.max_connections,
            forwarded_allow_ips=p.forwarded_allow_ips,
        ),
        cors=CorsSettings(
            allowed_origins=p.cors.allowed_origins,
            allowed_headers=p.cors.allowed_headers,
            allowed_methods=p.cors.allowed_methods,
            max_age_s=p.cors.max_age_s,
        ),
        count_rate_per_s=p.counting.rate_per_s,
        count_burst=p.counting.burst,
        ui=p.ui,
        store=store_settings(cfg.store),
        cluster=cluster_settings(cfg.cluster),
        telemetry=telemetry_settings(cfg.telemetry),
        unknown_fields=p.unknown_fields,
        admin_unknown_fields=p.admin_unknown_fields,
        poison=PoisonSettings(
            strikes=p.poison.strikes, window_s=p.poison.window_s, cooldown_s=p.poison.cooldown_s
        ),
    )
