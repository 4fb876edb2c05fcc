"""An API key as one entry of the config's ``keys:`` list: the inverse of reading it (``proxy_settings``).

Benchmarks and tests that write a config for a daemon they start make their keys here, so the shape of
an entry (id, digest, tenant, sorted scopes; never the key itself) is spelled once.
"""

from __future__ import annotations

from typing import Any

from proxy.auth import new_key
from proxy.settings import KeyEntry, Scope

ADMIN: frozenset[Scope] = frozenset({"inference", "admin"})
INFERENCE: frozenset[Scope] = frozenset({"inference"})


def key_config(entry: KeyEntry) -> dict[str, Any]:
    """The ``keys:`` entry for ``entry``: its digest only, so the written file never holds the key."""
    scopes = sorted(entry.scopes)
    return {"id": entry.key_id, "digest": entry.digest, "tenant": entry.tenant, "scopes": scopes}


def new_key_config(tenant: str, scopes: frozenset[Scope] = INFERENCE) -> tuple[str, dict[str, Any]]:
    """A fresh key (plaintext, for the client) and its ``keys:`` entry (for the config)."""
    key, entry = new_key(tenant, scopes)
    return key, key_config(entry)
