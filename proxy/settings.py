"""The proxy's own settings: plain frozen values. The supervisor's config loader builds them.

Validation of user input happens in the supervisor's config loader (it reports every bad field by
its path); these classes only hold values that are already valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

Scope = Literal["inference", "admin"]

# Priority levels by name (``tenants[].priority``); any integer in [MIN_PRIORITY, MAX_PRIORITY] works too.
# Higher goes first when slots are scarce; waiting raises a request's priority (``proxy.admission``).
PRIORITY_LEVELS: Mapping[str, int] = MappingProxyType({"interactive": 10, "default": 5, "batch": 0})
DEFAULT_PRIORITY = PRIORITY_LEVELS["default"]
MIN_PRIORITY, MAX_PRIORITY = 0, 100


def parse_priority(raw: object) -> int:
    """A priority from a level name or an integer (or its decimal text, e.g. a header); ValueError
    naming the choices otherwise. Shared by the config loader and the request path."""
    value: object = raw
    if isinstance(raw, str):
        text = raw.strip()
        value = PRIORITY_LEVELS.get(text.lower(), text)
        if isinstance(value, str) and value.lstrip("-").isdigit():
            value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and MIN_PRIORITY <= value <= MAX_PRIORITY:
        return value
    names = ", ".join(f"{name} ({level})" for name, level in PRIORITY_LEVELS.items())
    raise ValueError(f"must be {names} or an integer {MIN_PRIORITY}-{MAX_PRIORITY} (got {raw!r})")


@dataclass(frozen=True)
class KeyEntry:
    """One API key, stored only as a digest. ``key_id`` is the public part embedded in the key itself
    (so lookup is a dict hit, not a hash against every key) and is what logs show."""

    key_id: str
    digest: str  # "sha256:<hex>" of the whole key string
    tenant: str
    scopes: frozenset[Scope] = frozenset({"inference"})


@dataclass(frozen=True)
class BudgetSettings:
    """Token and request budgets of a tenant or of one store key (``proxy.accounts.budgets``); None: no
    limit. Tokens are prompt plus completion tokens, as the child reports them after each answer."""

    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    requests_per_minute: int | None = None


@dataclass(frozen=True)
class StoreSettings:
    """The accounts store (``proxy.accounts``): keys made at run time, the usage ledger, budget windows."""

    path: str  # the SQLite file, already resolved (the config loader picks the default); unused with url
    # Per-request usage rows older than this are deleted; the hourly rollup keeps its own retention.
    usage_retention_days: int = 31
    rollup_retention_days: int = 400
    # postgresql://...: the store is that database, shared by every replica (``proxy.accounts.postgres``).
    url: str | None = None


ClusterFallback = Literal["local", "refuse"]


@dataclass(frozen=True)
class TelemetrySettings:
    """OpenTelemetry traces and metrics over OTLP/HTTP (``proxy.telemetry``; the ``otel`` extra).
    A None field leaves the SDK's own default, or its ``OTEL_*`` environment variable, in force."""

    # Base URL of the collector's OTLP/HTTP receiver; /v1/traces and /v1/metrics are appended.
    endpoint: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    service_name: str | None = None
    sampling_ratio: float | None = None
    resource_attributes: tuple[tuple[str, str], ...] = ()
    metrics_interval_s: float | None = None


@dataclass(frozen=True)
class ClusterSettings:
    """Limits shared by the replicas of one service through Redis (``proxy.cluster``)."""

    redis_url: str
    # How many replicas share the limits: with Redis unreachable and ``local``, each replica allows a
    # tenant max(1, its limit // replicas).
    replicas: int = 1
    on_redis_error: ClusterFallback = "local"
    # A lease not renewed for this long is free: the longest a dead replica's leases stay counted.
    lease_ttl_s: float = 5.0
    # Longest wait for one Redis answer (connect or reply), so a dead or hung Redis never hangs a request.
    socket_timeout_s: float = 1.0
    # How often each replica asks Redis whether it answers, traffic or not (``proxy.cluster.limiter``): the
    # longest an idle replica takes to notice an outage (a hung Redis: plus one call's timeout), and how
    # often a degraded one asks whether it is back.
    probe_interval_s: float = 1.0


@dataclass(frozen=True)
class TenantSettings:
    name: str
    max_concurrency: int = 2
    max_queue: int = 8
    queue_timeout_s: float = 30.0
    # Share of freed slots when several tenants wait (weighted fair turn-taking).
    weight: int = 1
    # Goes before the weights when slots are scarce (higher first, with aging: ``proxy.admission``).
    priority: int = DEFAULT_PRIORITY
    # Optional cap applied to max_tokens / max_completion_tokens (None: no cap).
    max_tokens: int | None = None
    # Refuse prompts that cannot fit the per-slot context before they take a slot.
    check_prompt_size: bool = False
    # Completions per prompt a request may ask for ("n" / "n_cmpl"); each runs in its own slot.
    max_n: int = 4
    # Elements of a prompt array ("prompt", "input", "documents"); each is its own task in the child.
    max_prompts: int = 16
    # Bound of "n_probs", "logprobs" and "top_logprobs" (OpenAI's own limit for top_logprobs is 20).
    max_logprobs: int = 20
    # Show prompt-cache hit details (cached_tokens, timings) to this tenant's inference keys; admin keys
    # always see them. Off: a tenant cannot tell from them what other tenants asked recently.
    show_cache_details: bool = False
    # False forces "cache_prompt": false on every request of this tenant (strict isolation: it never
    # reuses a cached prefix, so its time to first token says nothing about other tenants' prompts).
    cache_prompt: bool = True
    # Names of the models this tenant may use (several-model daemons); empty: every model.
    models: tuple[str, ...] = ()
    # Slots held or awaited across every model at once (``proxy.admission.totals``); None: no total.
    max_concurrency_total: int | None = None
    # Tokens and requests per minute and per day (``proxy.accounts.budgets``); all None: no budget.
    budgets: BudgetSettings = field(default_factory=BudgetSettings)
    # The request schema's size bounds this tenant has its own value of (``proxy.schema.values.Size``):
    # a bound's name (the value's path without indices: ``dry_sequence_breakers``, ``stop[]``) -> its
    # most; the others keep the door's default. Not part of the hash (a mapping is not hashable).
    field_bounds: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}), hash=False)


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    first_token_s: float = 120.0
    total_s: float = 900.0


@dataclass(frozen=True)
class Listener:
    host: str = "127.0.0.1"
    port: int = 8080


@dataclass(frozen=True)
class DoorSettings:
    """Limits of the listener itself, enforced before a request reaches the app (``proxy.listener``)."""

    # Request line (method, target, version) longer than this: 414.
    max_request_line_bytes: int = 8190
    # Request line plus all header lines longer than this: 431.
    max_head_bytes: int = 32768
    # More header lines than this: 431.
    max_headers: int = 100
    # From the first byte of a request head to its end; then the connection is closed (408).
    head_timeout_s: float = 10.0
    # Idle connection (new, or between keep-alive requests) with no byte: closed after this.
    keep_alive_timeout_s: float = 5.0
    # Open client connections; one more is answered 503 and closed.
    max_connections: int = 1000
    # Peers whose X-Forwarded-For / X-Forwarded-Proto are believed (addresses or CIDRs); () = nobody.
    forwarded_allow_ips: tuple[str, ...] = ()


@dataclass(frozen=True)
class CorsSettings:
    """Browser access (``proxy.cors``); no allowed origin (the default) means CORS is off."""

    allowed_origins: tuple[str, ...] = ()
    allowed_headers: tuple[str, ...] = (
        "authorization",
        "content-type",
        "x-api-key",
        "anthropic-version",
        "x-request-id",
        # A browser client may lower its own priority or wait (``proxy.admission.asks``).
        "x-llamagate-priority",
        "x-llamagate-max-wait",
    )
    allowed_methods: tuple[str, ...] = ("GET", "POST")
    max_age_s: int = 600


# What the door does with a body field its request schema does not declare (``proxy.schema``).
UnknownPolicy = Literal["refuse", "drop", "pass"]


@dataclass(frozen=True)
class PoisonSettings:
    """Requests that keep killing their child (``proxy.routes.poison``): a request in flight at two deaths of
    its model's child is not sent again; a key with ``strikes`` such requests within ``window_s`` is refused
    for ``cooldown_s``."""

    strikes: int = 2
    window_s: float = 600.0
    cooldown_s: float = 600.0


@dataclass(frozen=True)
class ProxySettings:
    listen: Listener = field(default_factory=Listener)
    tenants: tuple[TenantSettings, ...] = ()
    keys: tuple[KeyEntry, ...] = ()
    # Tenant used for requests without credentials, from loopback clients only. Off (None) by default.
    anonymous_tenant: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    timeouts: Timeouts = field(default_factory=Timeouts)
    # Optional unauthenticated /metrics listener, loopback only (for a local Prometheus agent).
    metrics_listener: Listener | None = None
    # Max seconds a queued request may wait for a drain to finish before the daemon stops it.
    drain_timeout_s: float = 30.0
    # One line per request on the ``llamagate.access`` logger (config: logging.access_log).
    access_log: bool = True
    # Largest non-streamed answer the proxy holds before sending it (the request fails with 502 beyond).
    max_response_bytes: int = 32 * 1024 * 1024
    # Limits of the listener itself (request head, deadlines, connections, trusted forwarders).
    door: DoorSettings = field(default_factory=DoorSettings)
    # Browser access; off unless origins are listed (proxy.cors).
    cors: CorsSettings = field(default_factory=CorsSettings)
    # Counting/templating routes take no slot; each tenant gets this token bucket instead (proxy.counting).
    count_rate_per_s: float = 20.0
    count_burst: int = 40
    # The status page and playground at /ui/ (static files; their data needs a key). Off: 404.
    ui: bool = True
    # Keys made at run time, the usage ledger and budget windows (``proxy.accounts``); None: no store.
    store: StoreSettings | None = None
    # Tenant concurrency shared across replicas through Redis (``proxy.cluster``); None: per replica.
    cluster: ClusterSettings | None = None
    # OpenTelemetry export (``proxy.telemetry``); None: off, and nothing of OpenTelemetry is imported.
    telemetry: TelemetrySettings | None = None
    # Body fields no route declares: from inference keys, and from admin keys (``proxy.schema``).
    unknown_fields: UnknownPolicy = "refuse"
    admin_unknown_fields: UnknownPolicy = "refuse"
    poison: PoisonSettings = field(default_factory=PoisonSettings)
