"""The values the store holds and hands back: plain frozen records, the same for every engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from proxy.settings import BudgetSettings, Scope

BudgetName = Literal["tokens_per_minute", "tokens_per_day", "requests_per_minute"]
BUDGET_NAMES: tuple[BudgetName, ...] = ("tokens_per_minute", "tokens_per_day", "requests_per_minute")
Subject = Literal["tenant", "key"]
GroupBy = Literal["tenant", "hour", "day", "model", "key"]
KeyStatus = Literal["active", "expired", "revoked"]


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key of the store. ``digest`` is ``sha256:<hex>`` of the whole key (``proxy.auth.key_digest``);
    the key itself is never stored. Times are seconds since the epoch."""

    key_id: str
    digest: str
    tenant: str
    scopes: frozenset[Scope]
    created: float
    name: str = ""
    # Models this key may ask for; () = every model its tenant may use.
    models: tuple[str, ...] = ()
    budgets: BudgetSettings = field(default_factory=BudgetSettings)
    expires: float | None = None
    revoked: float | None = None
    last_used: float | None = None

    def status(self, now: float) -> KeyStatus:
        if self.revoked is not None:
            return "revoked"
        if self.expires is not None and now >= self.expires:
            return "expired"
        return "active"


class UsageRecord(NamedTuple):
    """What one finished request used, as the child reported it (a stream: its final usage; a client
    that left: what was generated until it stopped). ``at`` is when it finished. Its fields are the
    ledger table's columns in order: the request path hands one to the ledger (``LedgerRow``), the
    writer writes it as it is, the readers hand them back."""

    tenant: str
    key_id: str
    model: str
    kind: str  # the route's cost kind: chat, completion, embeddings, ...
    prompt_tokens: int
    cached_tokens: int  # part of prompt_tokens served from the prompt cache
    completion_tokens: int
    status: int  # the HTTP status the client got
    duration_s: float
    at: float
    request_id: str = ""
    # Where the prompt's figure came from (``proxy.routes.charge``): reported, counted, estimated,
    # undelivered (nothing charged).
    usage_source: str = "reported"


# One finished request's row of the usage ledger, as the request path makes it.
LedgerRow = UsageRecord


@dataclass(frozen=True, slots=True)
class WindowEntry:
    """One row of a budget window: ``amount`` charged in the second (or the bucket) starting at ``at``,
    counted until ``expires`` (the expiry of the newest charge in it)."""

    subject: Subject
    name: str  # the tenant's name or the key's id
    budget: BudgetName
    at: float
    amount: int
    expires: float


@dataclass(frozen=True, slots=True)
class Batch:
    """What the writer writes in one transaction: nothing of it is committed unless all of it is."""

    usage: tuple[LedgerRow, ...] = ()
    windows: tuple[WindowEntry, ...] = ()
    last_used: tuple[tuple[str, float], ...] = ()  # (key id, time)

    def __bool__(self) -> bool:
        return bool(self.usage or self.windows or self.last_used)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One line of a usage report: sums over the hourly rollup. The group's fields that do not apply to
    the grouping are None (``key_id`` only by key, ``model`` only by model, ``period`` by hour or day)."""

    tenant: str
    key_id: str | None
    model: str | None
    period: int | None  # start of the hour or UTC day, seconds since the epoch
    requests: int
    errors: int  # requests answered with a status >= 400
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
