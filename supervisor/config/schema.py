"""The configuration's shape: frozen dataclasses, one per YAML section, with defaults in one place.

Every field carries its documentation and its range check in ``metadata`` (see ``setting``), so the
loader (``load.py``) validates generically and ``docs/configuration.md`` is checked against the
same source. The defaults are the embedded default: a daemon started with no config file at all.
Keep ``docs/configuration.md`` in sync with this file (a unit test fails when a key is missing from the
reference).
"""

# ruff: noqa: RUF009 - setting()/section() return dataclasses.field(...), which ruff cannot see through
from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NewType, TypeVar, dataclass_transform

from proxy.settings import DEFAULT_PRIORITY
from supervisor.checks import Check, at_least, matches, multiple_of_256, positive
from supervisor.launch.knobs import KNOBS, CacheType, LlamaKnobs, NameOrPath

__all__ = ["CacheType", "Check", "NameOrPath", "at_least", "multiple_of_256", "positive"]

# A priority level by name or number, held as its number (``proxy.settings.parse_priority``).
Priority = NewType("Priority", int)

Scope = Literal["inference", "admin"]
Residency = Literal["always", "on_demand"]
LogFormat = Literal["text", "json"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


def setting(default: Any, doc: str, check: Check | None = None) -> Any:
    """A dataclass field with its reference text and an optional check returning a problem or None."""
    meta = {"doc": doc, "check": check}
    if isinstance(default, list | dict):
        raise TypeError("use a tuple default")  # frozen configs hold no mutable defaults
    return field(default=default, metadata=meta)


def section(factory: Callable[[], Any], doc: str) -> Any:
    return field(default_factory=factory, metadata={"doc": doc, "check": None})


def port_number(v: Any) -> str | None:
    return None if 1 <= v <= 65535 else "must be a port number (1-65535)"


def ip_or_network(v: Any) -> str | None:
    for item in v:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            return f"{item!r} is not an IP address or network (CIDR)"
    return None


def known_field_bounds(v: Mapping[str, int]) -> str | None:
    """Every name is a bound of the request schema (``proxy.schema.reference.bound_names``), every
    value at least 1."""
    from proxy.schema.reference import bound_names

    names = bound_names()
    for name, most in v.items():
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            return f"{name!r} is not a bound of the request schema{hint}; docs/security.md lists them"
        if most < 1:
            return f"{name!r} must be at least 1 (got {most})"
    return None


SHA256 = matches(r"[0-9a-f]{64}", "64 lowercase hex digits (a sha256)")
NAME = matches(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", "a name of letters, digits, '.', '_' or '-' (max 64)")


@dataclass(frozen=True)
class TimeoutsConfig:
    connect_s: float = setting(5.0, "connect to llama-server", positive)
    first_token_s: float = setting(
        120.0,
        "from admission to the first generated token of a stream (admin passthrough routes: to the answer)",
        positive,
    )
    total_s: float = setting(900.0, "whole request, streaming included", positive)


@dataclass(frozen=True)
class ListenerConfig:
    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(9464, "TCP port", port_number)
    allow: tuple[str, ...] = setting(
        ("127.0.0.0/8", "::1/128"),
        "peers (addresses or CIDRs) served; any other gets 403 (the listener has no other auth)",
        ip_or_network,
    )


def origins(v: Any) -> str | None:
    # An origin as a browser sends it: scheme://host[:port], no path; or "*" for any origin.
    rx = re.compile(r"\*|https?://[A-Za-z0-9.\-\[\]:]+")
    bad = [o for o in v if not rx.fullmatch(o)]
    if not bad:
        return None
    return f"must be '*' or origins like 'https://app.example:8443' (no path), not {bad[0]!r}"


@dataclass(frozen=True)
class CorsConfig:
    allowed_origins: tuple[str, ...] = setting(
        (), "origins browsers may call from ('*' = any); empty = CORS off", origins
    )
    allowed_headers: tuple[str, ...] = setting(
        (
            "authorization",
            "content-type",
            "x-api-key",
            "anthropic-version",
            "x-request-id",
            "x-llamagate-priority",
            "x-llamagate-max-wait",
        ),
        "request headers a preflight allows ('*' = whatever the preflight asks for)",
    )
    allowed_methods: tuple[str, ...] = setting(("GET", "POST"), "methods a preflight allows")
    max_age_s: int = setting(600, "how long a browser may cache a preflight answer", at_least(0))


@dataclass(frozen=True)
class CountingConfig:
    rate_per_s: float = setting(
        20.0, "counting/templating requests per second per tenant (they take no slot)", positive
    )
    burst: int = setting(40, "counting/templating requests a tenant may send at once", at_least(1))


UnknownFields = Literal["refuse", "drop", "pass"]


@dataclass(frozen=True)
class PoisonConfig:
    strikes: int = setting(
        2,
        "a key whose requests were each in flight at two deaths of their model's llama-server this many"
        " times within window_s is refused for cooldown_s",
        at_least(1),
    )
    window_s: float = setting(600.0, "how far back a key's poison requests count", positive)
    cooldown_s: float = setting(600.0, "how long such a key is refused (429 key_cooling_down)", positive)


@dataclass(frozen=True)
class ProxyConfig:
    host: str = setting("127.0.0.1", "address the proxy listens on (the only public door)")
    port: int = setting(8080, "TCP port of the proxy", port_number)
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest request body accepted", at_least(1024))
    model_aliases: tuple[str, ...] = setting((), "other names accepted in a request's model field")
    anonymous_tenant: str | None = setting(
        None,
        "tenant for credential-less requests from loopback clients only (a bearer token not starting"
        " with lg_, an SDK placeholder, counts as none); null = off",
    )
    drain_timeout_s: float = setting(30.0, "on stop, how long in-flight requests may finish", at_least(0))
    timeouts: TimeoutsConfig = section(TimeoutsConfig, "upstream deadlines")
    metrics_listener: ListenerConfig | None = setting(
        None, "separate unauthenticated /metrics listener, open to the peers of its allow list; null = off"
    )
    forwarded_allow_ips: tuple[str, ...] = setting(
        (), "peers (addresses or CIDRs) whose X-Forwarded-For is believed; [] = nobody", ip_or_network
    )
    max_request_line_bytes: int = setting(8190, "longest request line; longer: 414", at_least(256))
    max_head_bytes: int = setting(
        32768, "largest request head (request line + headers); larger: 431", at_least(1024)
    )
    max_headers: int = setting(100, "most header lines in a request; more: 431", at_least(8))
    head_timeout_s: float = setting(
        10.0, "from a request head's first byte to its end; then 408 and close", positive
    )
    keep_alive_timeout_s: float = setting(
        5.0, "an idle connection (new or between requests) is closed after this", positive
    )
    max_connections: int = setting(
        1000, "open client connections; one more gets 503 and is closed", at_least(1)
    )
    cors: CorsConfig = section(CorsConfig, "browser access (CORS), off by default")
    counting: CountingConfig = section(CountingConfig, "rate bound of the routes that count tokens")
    ui: bool = setting(True, "serve the status page and playground at /ui/ (data needs a key); false = 404")
    unknown_fields: UnknownFields = setting(
        "refuse",
        "a body field no route declares (docs/api.md), from an inference key: refuse (400 naming it),"
        " drop (removed), pass (sent to llama-server unchecked)",
    )
    admin_unknown_fields: UnknownFields = setting(
        "refuse", "the same for admin keys: pass opens undeclared fields to them, explicitly"
    )
    poison: PoisonConfig = section(PoisonConfig, "requests that keep killing their llama-server")


@dataclass(frozen=True)
class ModelConfig:
    path: Path | None = setting(None, "GGUF file; null = the demo model, fetched into the cache")
    sha256: str | None = setting(None, "expected sha256 of the file; required when path is set", SHA256)
    alias: str = setting("smollm2-135m-instruct", "model id served to clients (llama-server --alias)", NAME)


@dataclass(frozen=True)
class LlamaConfig(LlamaKnobs):
    """The ``llama:`` section: llama-server's knobs (``launch/knobs.py``, one field each) and what the
    child runs: the binary (built from the lock, or named) and the model."""

    lock: Path | None = setting(
        None, "llama-build.lock to build from; null = the checkout's or packaged lock"
    )
    binary: Path | None = setting(None, "explicit llama-server binary; null = the one built from the lock")
    binary_sha256: str | None = setting(None, "expected sha256 of binary (only with binary)", SHA256)
    model: ModelConfig = section(ModelConfig, "the served model")
    state_dir: Path | None = setting(
        None,
        "folder of the conversations' states on disk (llama.state_disk_mib), one private folder per model"
        " and identity inside; null = $STATE_DIRECTORY/conversations under systemd, else"
        " $XDG_STATE_HOME/llamagate/conversations",
    )


_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def _with_overrides(cls: type[_T]) -> type[_T]:
    """A frozen dataclass of ``cls``'s fields plus one per knob a ``models[]`` entry may set
    (``Row.per_model``): that model's value, null meaning the ``llama:`` section's. The type checker
    sees only the fields written in ``cls``; code reads the overrides through ``overrides()``."""
    for k in KNOBS:
        if k.per_model:
            cls.__annotations__[k.name] = k.type | None
            setattr(
                cls, k.name, setting(None, f"this model's llama.{k.name}; null = llama.{k.name}", k.check)
            )
    return dataclass(frozen=True)(cls)


@_with_overrides
class ServedModelConfig:
    """One entry of ``models:``. Unset (null) llama settings come from the ``llama:`` section, which
    also names the binary every child runs."""

    name: str = setting("", "model id clients send in 'model' (the child's --alias); required", NAME)
    aliases: tuple[str, ...] = setting((), "other names accepted for this model")
    path: Path | None = setting(None, "GGUF file; null = the demo model, fetched into the cache")
    sha256: str | None = setting(None, "expected sha256 of the file; required when path is set", SHA256)
    residency: Residency = setting(
        "always", "always: loaded at start, counted in readiness; on_demand: loaded by its first request"
    )
    idle_unload_s: float = setting(
        300.0, "on_demand: stopped after this long without a request holding or awaiting a slot", positive
    )
    load_wait_s: float = setting(
        300.0,
        "on_demand: longest a request waits for the model to load and pass its gate; then 503",
        positive,
    )
    preload: bool = setting(
        False, "on_demand: also loaded when the daemon starts (then unloaded when idle, or by an operator)"
    )


def overrides(entry: ServedModelConfig) -> dict[str, Any]:
    """The knobs a ``models[]`` entry sets (not null), by name."""
    values = {k.name: getattr(entry, k.name) for k in KNOBS if k.per_model}
    return {name: v for name, v in values.items() if v is not None}


@dataclass(frozen=True)
class SupervisionConfig:
    load_timeout_s: float = setting(300.0, "hard cap on model load, however busy the log", positive)
    stall_timeout_s: float = setting(30.0, "load fails when the child's log is silent this long", positive)
    health_interval_s: float = setting(2.0, "seconds between /health probes once READY", positive)
    health_timeout_s: float = setting(2.0, "timeout of one /health probe", positive)
    health_failures: int = setting(3, "consecutive failed probes that make a READY child dead", at_least(1))
    loop_deadline_s: float = setting(
        10.0,
        "seconds llama-server's server loop may take to answer the liveness task (GET /slots) before the"
        " child counts as hung and is replaced",
        positive,
    )
    backoff_initial_s: float = setting(
        1.0, "upper bound of the first restart delay (full jitter)", at_least(0)
    )
    backoff_max_s: float = setting(
        30.0, "upper bound of any restart delay (after a failed start or a ready child's crash)", at_least(0)
    )
    stable_after_s: float = setting(60.0, "READY this long resets both backoffs", at_least(0))
    max_restarts: int = setting(
        5, "failed starts allowed within restart_window_s before FAILED (crashes never count)", at_least(0)
    )
    restart_window_s: float = setting(300.0, "sliding window of the failed starts for max_restarts", positive)
    exit_on_failed: bool = setting(False, "exit the daemon non-zero on FAILED (for systemd/Kubernetes)")
    stop_grace_s: float = setting(10.0, "SIGTERM to SIGKILL grace when stopping the child", at_least(0))
    memory_headroom_mib: int = setting(1024, "memory left free for the OS and other work", at_least(0))


@dataclass(frozen=True)
class BudgetsConfig:
    tokens_per_minute: int | None = setting(
        None, "prompt plus completion tokens in any 60 s; null = no limit", at_least(1)
    )
    tokens_per_day: int | None = setting(
        None, "prompt plus completion tokens in any 24 h; null = no limit", at_least(1)
    )
    requests_per_minute: int | None = setting(
        None, "requests admitted in any 60 s; null = no limit", at_least(1)
    )


@dataclass(frozen=True)
class TenantConfig:
    name: str = setting("default", "tenant name (keys refer to it)", NAME)
    max_concurrency: int = setting(2, "requests of this tenant running at once", at_least(1))
    max_queue: int = setting(8, "requests of this tenant waiting for a slot", at_least(0))
    queue_timeout_s: float = setting(30.0, "longest wait for a slot before 429", positive)
    weight: int = setting(1, "share of freed slots when several tenants wait", at_least(1))
    priority: Priority = setting(
        Priority(DEFAULT_PRIORITY),
        "interactive (10), default (5), batch (0) or an integer 0-100: higher priorities are admitted"
        " first when slots are scarce; waiting raises a request's priority by 1 per second",
    )
    max_tokens: int | None = setting(None, "cap on max_tokens of a request; null = no cap", at_least(1))
    check_prompt_size: bool = setting(False, "refuse prompts longer than the per-slot context up front")
    max_n: int = setting(4, "completions per prompt a request may ask for (n, n_cmpl)", at_least(1))
    max_prompts: int = setting(16, "elements of a prompt array (prompt, input, documents)", at_least(1))
    max_logprobs: int = setting(20, "bound of n_probs, logprobs and top_logprobs", at_least(0))
    show_cache_details: bool = setting(
        False, "show prompt-cache hits (cached_tokens, timings) to this tenant's inference keys"
    )
    cache_prompt: bool = setting(True, "false: force cache_prompt false (strict cache isolation)")
    models: tuple[str, ...] = setting((), "names of models (models[].name) this tenant may use; [] = all")
    max_concurrency_total: int | None = setting(
        None, "slots this tenant may hold or wait for across all models at once; null = no total", at_least(1)
    )
    budgets: BudgetsConfig = section(BudgetsConfig, "tokens and requests per minute and per day")
    field_bounds: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType({}),
        metadata={
            "doc": "the request schema's size bounds this tenant has its own value of: a bound's name (a"
            " body field's path, e.g. dry_sequence_breakers, stop, logit_bias) -> its most",
            "check": known_field_bounds,
        },
    )


@dataclass(frozen=True)
class KeyConfig:
    id: str = setting(
        "",
        "12 lowercase hex: the public part of the key",
        matches(r"[0-9a-f]{12}", "12 lowercase hex digits"),
    )
    digest: str = setting(
        "", "sha256 of the whole key string", matches(r"sha256:[0-9a-f]{64}", "'sha256:' + 64 hex")
    )
    tenant: str = setting("default", "tenant the key belongs to")
    scopes: tuple[Scope, ...] = setting(("inference",), "inference and/or admin")


@dataclass(frozen=True)
class StoreConfig:
    path: Path | None = setting(
        None,
        "the SQLite file; null = $STATE_DIRECTORY/llamagate.db under systemd, else"
        " $XDG_STATE_HOME/llamagate/llamagate.db (~/.local/state/llamagate/llamagate.db)",
    )
    url: str | None = setting(
        None,
        "postgresql://user@host:port/db: the store is that PostgreSQL database, shared by replicas"
        " (instead of path); the password from ${VAR}, PGPASSWORD or ~/.pgpass",
        matches(r"postgres(ql)?://\S*", "a postgresql:// URL"),
    )
    usage_retention_days: int = setting(31, "days a per-request usage row is kept", at_least(1))
    rollup_retention_days: int = setting(400, "days an hourly usage sum is kept", at_least(1))


ClusterFallback = Literal["local", "refuse"]


@dataclass(frozen=True)
class ClusterConfig:
    redis_url: str = setting(
        "",
        "redis://[user:password@]host:port/db (rediss:// for TLS, unix:///path.sock): where the replicas"
        " keep their tenants' leases",
        matches(r"(rediss?://|unix://)\S+", "a redis://, rediss:// or unix:// URL"),
    )
    replicas: int = setting(
        1,
        "replicas sharing the limits: with Redis down and local, each allows limit // replicas",
        at_least(1),
    )
    on_redis_error: ClusterFallback = setting(
        "local", "local: per-replica limits while Redis is unreachable; refuse: 503 with Retry-After"
    )
    lease_ttl_s: float = setting(
        5.0, "a lease not renewed this long is free (a dead replica's leases free within it)", at_least(1)
    )
    socket_timeout_s: float = setting(1.0, "longest wait for one Redis connect or answer", positive)
    probe_interval_s: float = setting(
        1.0,
        "how often each replica pings Redis, with or without traffic: an outage is noticed (mode switched,"
        " logged) within it, and so is Redis's return",
        positive,
    )


def name_value_pairs(v: Any) -> str | None:
    bad = [item for item in v if "=" not in item or not item.partition("=")[0].strip()]
    return f"each item must be 'name=value', not {bad[0]!r}" if bad else None


@dataclass(frozen=True)
class TelemetryConfig:
    enabled: bool = setting(
        True, "export traces and metrics (needs the otel extra: pip install 'llamagate[otel]')"
    )
    endpoint: str | None = setting(
        None,
        "the collector's OTLP/HTTP base URL (/v1/traces, /v1/metrics appended); null ="
        " OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318",
        matches(r"https?://\S+", "an http:// or https:// URL"),
    )
    headers: tuple[str, ...] = setting(
        (),
        "'name=value' headers of every export (a collector's key: use ${VAR});"
        " also OTEL_EXPORTER_OTLP_HEADERS",
        name_value_pairs,
    )
    service_name: str | None = setting(None, "service.name; null = OTEL_SERVICE_NAME, else llamagate")
    sampling_ratio: float | None = setting(
        None,
        "share of new traces sampled (0-1; a request with a traceparent follows its caller's decision);"
        " null = OTEL_TRACES_SAMPLER, else every trace",
        lambda v: None if v is None or 0.0 <= v <= 1.0 else "must be between 0 and 1",
    )
    resource_attributes: tuple[str, ...] = setting(
        (), "'name=value' resource attributes (beside OTEL_RESOURCE_ATTRIBUTES)", name_value_pairs
    )
    metrics_interval_s: float | None = setting(
        None, "seconds between metric exports; null = OTEL_METRIC_EXPORT_INTERVAL, else 60", positive
    )


@dataclass(frozen=True)
class LoggingConfig:
    format: LogFormat = setting("text", "text or json (JSON lines); --log-format on the command line wins")
    level: LogLevel = setting("INFO", "DEBUG shows the child's log lines; --log-level wins")
    access_log: bool = setting(True, "one line per request (never a prompt, a completion or a key)")


def _default_tenants() -> tuple[TenantConfig, ...]:
    return (TenantConfig(),)


@dataclass(frozen=True)
class Config:
    proxy: ProxyConfig = section(ProxyConfig, "the public listener and request limits")
    llama: LlamaConfig = section(LlamaConfig, "the llama-server child")
    models: tuple[ServedModelConfig, ...] = setting(
        (), "several models, one child each; [] = the one model of the llama section"
    )
    supervision: SupervisionConfig = section(SupervisionConfig, "timings of load, liveness, restarts, stop")
    tenants: tuple[TenantConfig, ...] = section(_default_tenants, "who may use the service, and how much")
    keys: tuple[KeyConfig, ...] = setting(
        (), "API keys as digests (llamagate keys new); none = one fresh key printed at start"
    )
    logging: LoggingConfig = section(LoggingConfig, "log format and level")
    store: StoreConfig | None = setting(
        None,
        "keys made at run time, the usage ledger, budget windows (SQLite or PostgreSQL); null = no store",
    )
    cluster: ClusterConfig | None = setting(
        None, "tenant concurrency shared by replicas through Redis; null = each replica its own"
    )
    telemetry: TelemetryConfig | None = setting(
        None, "OpenTelemetry traces and metrics over OTLP/HTTP (the otel extra); null = off"
    )
