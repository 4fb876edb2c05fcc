"""The proxy's own settings: plain frozen values. The supervisor's config loader builds them.

Validation of user input happens in the supervisor's config loader (it reports every bad field by
its path); these classes only hold values that are already valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Scope = Literal["inference", "admin"]


@dataclass(frozen=True)
class KeyEntry:
    """One API key, stored only as a digest. ``key_id`` is the public part embedded in the key itself
    (so lookup is a dict hit, not a hash against every key) and is what logs show."""

    key_id: str
    digest: str  # "sha256:<hex>" of the whole key string
    tenant: str
    scopes: frozenset[Scope] = frozenset({"inference"})


@dataclass(frozen=True)
class TenantSettings:
    name: str
    max_concurrency: int = 2
    max_queue: int = 8
    queue_timeout_s: float = 30.0
    # Share of freed slots when several tenants wait (weighted fair turn-taking).
    weight: int = 1
    # Optional cap applied to max_tokens / max_completion_tokens (None: no cap).
    max_tokens: int | None = None
    # Refuse prompts that cannot fit the per-slot context before they take a slot.
    check_prompt_size: bool = False


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
class ProxySettings:
    listen: Listener = field(default_factory=Listener)
    tenants: tuple[TenantSettings, ...] = ()
    keys: tuple[KeyEntry, ...] = ()
    # Tenant used for requests without credentials, from loopback clients only. Off (None) by default.
    anonymous_tenant: str | None = None
    # Other names accepted in a request's "model" field besides the served alias.
    model_aliases: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 1024 * 1024
    timeouts: Timeouts = field(default_factory=Timeouts)
    # Optional unauthenticated /metrics listener, loopback only (for a local Prometheus agent).
    metrics_listener: Listener | None = None
    # Max seconds a queued request may wait for a drain to finish before the daemon stops it.
    drain_timeout_s: float = 30.0
    # One line per request on the ``llamagate.access`` logger (config: logging.access_log).
    access_log: bool = True
    # The status page and playground at /ui/ (static files; their data needs a key). Off: 404.
    ui: bool = True
