"""A tenant's total across every model: ``tenants[].max_concurrency_total``.

Each model has its own admission gate (``proxy.admission.gate``), so a tenant's ``max_concurrency`` and
``max_queue`` hold per model. ``max_concurrency_total`` bounds what one tenant may have inside the door
across all models at once: the slots its requests hold plus those they wait for. A request that would go
over it is refused at once with 429 (``tenant_total``), before it joins any model's queue: waiting on one
model for slots another model's requests hold could only end at the queue deadline.

One ``TenantTotals`` is shared by every model's lane (``proxy.models.router``) and is a step of the
admission pipeline (``proxy.admission.pipeline``); in a one-model daemon it is one more bound beside
``max_concurrency + max_queue``. Counts are by tenant name, so a reload that
changes the limit applies to the next request, and requests in flight keep what they hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from proxy.admission.pipeline import Ask, Grant, Spent
from proxy.errors import Rejected
from proxy.settings import TenantSettings

# Retry-After of a refusal: a slot of another model is usually freed within a request's time.
RETRY_AFTER_S = 1.0


class TenantTotals:
    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        """Slots the tenant's requests hold or wait for, across every model."""
        return self._held.get(tenant, 0)

    async def take(self, ask: Ask, grant: Grant) -> _TotalHold:
        """The pipeline's step: the request's slots counted for its tenant until the hold closes."""
        self._count(ask.tenant, ask.slots)
        return _TotalHold(self, ask.tenant.name, ask.slots)

    @contextmanager
    def hold(self, tenant: TenantSettings, slots: int) -> Iterator[None]:
        """Count ``slots`` for ``tenant`` while the block runs; ``Rejected`` when over its total."""
        self._count(tenant, slots)
        try:
            yield
        finally:
            self._give(tenant.name, slots)

    def _count(self, tenant: TenantSettings, slots: int) -> None:
        limit = tenant.max_concurrency_total
        held = self._held.get(tenant.name, 0)
        if limit is not None and held + slots > limit:
            raise Rejected(
                "tenant_total",
                RETRY_AFTER_S,
                f"tenant '{tenant.name}' is at its total of {limit} slots across all models "
                f"({held} in use or waiting); retry later",
            )
        self._held[tenant.name] = held + slots

    def _give(self, tenant: str, slots: int) -> None:
        left = self._held[tenant] - slots
        if left:
            self._held[tenant] = left
        else:
            del self._held[tenant]


class _TotalHold:
    __slots__ = ("_closed", "_slots", "_tenant", "_totals")

    def __init__(self, totals: TenantTotals, tenant: str, slots: int) -> None:
        self._totals, self._tenant, self._slots = totals, tenant, slots
        self._closed = False

    def close(self, spent: Spent | None) -> None:
        if not self._closed:
            self._closed = True
            self._totals._give(self._tenant, self._slots)
