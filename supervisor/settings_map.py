"""Config -> the proxy's ``ProxySettings``. The proxy validates nothing; this mapping is the handover."""

from __future__ import annotations

from collections.abc import Iterable

from proxy.settings import KeyEntry, Listener, ProxySettings, TenantSettings, Timeouts
from supervisor.config_schema import Config


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
                max_tokens=t.max_tokens,
                check_prompt_size=t.check_prompt_size,
            )
            for t in cfg.tenants
        ),
        keys=keys + tuple(extra_keys),
        anonymous_tenant=p.anonymous_tenant,
        model_aliases=p.model_aliases,
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
        ui=p.ui,
    )
