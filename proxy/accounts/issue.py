"""Making a key for the store: the same format and digest as every llamagate key (``proxy.auth``), and
the rules a new key's fields must follow, one set for ``POST /admin/keys`` and ``llamagate keys new``:
each check raises ``ValueError`` saying what to give instead, and its caller names the field (the
route's JSON field, the command's flag), as ``proxy.accounts.report`` does for times and budgets."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from proxy.accounts.records import KeyRecord
from proxy.auth import new_key
from proxy.settings import BudgetSettings, Scope

MAX_NAME = 200


def check_tenant(tenant: object, configured: Collection[str]) -> str:
    if not isinstance(tenant, str) or tenant not in configured:
        raise ValueError(f"must name a configured tenant ({', '.join(sorted(configured))})")
    return tenant


def check_models(models: Sequence[object], served: Collection[str]) -> tuple[str, ...]:
    """Names of models the daemon serves (a key may not name one it does not: it could never use it)."""
    if not models or not all(isinstance(m, str) for m in models):
        raise ValueError("give a non-empty list of model names (or none for every model)")
    unknown = [m for m in models if m not in served]
    if unknown:
        names = ", ".join(repr(m) for m in unknown)
        raise ValueError(f"{names} not served here (served: {', '.join(served)})")
    return tuple(dict.fromkeys(m for m in models if isinstance(m, str)))


def check_name(name: object) -> str:
    if not isinstance(name, str) or len(name) > MAX_NAME or any(c < " " for c in name):
        raise ValueError(f"give text of at most {MAX_NAME} characters, on one line")
    return name


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
