"""Making a key for the store: the same format and digest as every llamagate key (``proxy.auth``)."""

from __future__ import annotations

from proxy.accounts.records import KeyRecord
from proxy.auth import new_key
from proxy.settings import BudgetSettings, Scope


def issue_key(
    tenant: str,
    scopes: frozenset[Scope],
    now: float,
    *,
    name: str = "",
    models: tuple[str, ...] = (),
    budgets: BudgetSettings | None = None,
    expires: float | None = None,
) -> tuple[str, KeyRecord]:
    """A new key (the plaintext, to show once) and the record the store keeps (its digest only)."""
    key, entry = new_key(tenant, scopes)
    record = KeyRecord(
        key_id=entry.key_id,
        digest=entry.digest,
        tenant=tenant,
        scopes=scopes,
        created=now,
        name=name,
        models=models,
        budgets=budgets or BudgetSettings(),
        expires=expires,
    )
    return key, record


def successor(old: KeyRecord, now: float) -> tuple[str, KeyRecord]:
    """The key that replaces ``old`` in a rotation: same tenant, scopes, name, models, budgets, expiry."""
    return issue_key(
        old.tenant,
        old.scopes,
        now,
        name=old.name,
        models=old.models,
        budgets=old.budgets,
        expires=old.expires,
    )
