"""API keys: format, generation, digests and the request-time check.

A key is ``lg_<12 hex id>_<43 chars base64url secret>`` (32 random bytes of secret). The id is public: it
is what the config stores beside the digest and what logs show, and it makes lookup a dict hit instead of
hashing the presented key against every stored digest. The digest is ``sha256:<hex>`` of the whole key
string; comparison is ``hmac.compare_digest`` of digests, so the time taken does not depend on how much
of a guess was right. A key absent from the config is revoked: reload the config (SIGHUP) to revoke.
Keys made at run time live in the accounts store (``proxy.accounts``); ``KeyTable.authenticate`` asks
its view (``lookup``) for a well-formed key the config does not hold, so every key, wherever it lives,
gets the same checks and the same 401.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from proxy.errors import Forbidden, Unauthorized
from proxy.settings import BudgetSettings, KeyEntry, Scope

# Who may call a route (``proxy.routes.table``): no credentials at all, a key with that scope, or any key
# (inference or admin).
Access = Literal["none", "inference", "admin", "any key"]

KEY_PREFIX = "lg_"
_KEY_RE = re.compile(r"lg_([0-9a-f]{12})_[A-Za-z0-9_-]{43}")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking: logs and metrics carry ``tenant`` and ``key_id``, never the key. A store key may
    also be limited to some of its tenant's models (``models``; () = all of them) and carry budgets of
    its own (``budgets``; None for the config's keys, which have none)."""

    tenant: str
    key_id: str
    scopes: frozenset[Scope]
    models: tuple[str, ...] = ()
    budgets: BudgetSettings | None = None


# A lookup of a well-formed key the config's table does not hold (the accounts store's view), by its id
# and the whole key: the principal, or None for an unknown, revoked or expired key (one 401 for all).
Lookup = Callable[[str, str], "Principal | None"]


def key_digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key(tenant: str, scopes: frozenset[Scope]) -> tuple[str, KeyEntry]:
    """A fresh key (plaintext, shown once) and the entry the config stores for it."""
    key_id = secrets.token_hex(6)
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    return key, KeyEntry(key_id=key_id, digest=key_digest(key), tenant=tenant, scopes=scopes)


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_UNKNOWN = "unknown or revoked API key"


class KeyTable:
    """The request-time check. Immutable once built; a reload builds a new table and swaps it in."""

    def __init__(self, keys: Iterable[KeyEntry], anonymous_tenant: str | None = None) -> None:
        self._by_id: dict[str, KeyEntry] = {k.key_id: k for k in keys}
        # One per key: every request of a key is the same principal.
        self._principals = {k.key_id: Principal(k.tenant, k.key_id, k.scopes) for k in self._by_id.values()}
        self._anonymous = (
            Principal(anonymous_tenant, "anonymous", frozenset({"inference"})) if anonymous_tenant else None
        )

    def __len__(self) -> int:
        return len(self._by_id)

    def authenticate(
        self, authorization: bytes | None, client_host: str | None, lookup: Lookup | None = None
    ) -> Principal:
        if authorization is None:
            if self._anonymous is not None and _is_loopback(client_host):
                return self._anonymous
            raise Unauthorized("missing credentials: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("malformed credentials: expected 'Authorization: Bearer <key>'")
        token = token.strip()
        if self._anonymous is not None and not token.startswith(KEY_PREFIX) and _is_loopback(client_host):
            # The OpenAI and Anthropic SDKs refuse to run without an api_key, so clients of an anonymous
            # local server send a placeholder ("sk-no-key", "EMPTY"...). Anything that is not even
            # shaped like our keys is that placeholder; a malformed llamagate key is still refused below.
            return self._anonymous
        match = _KEY_RE.fullmatch(token)
        if match is None:
            raise Unauthorized("malformed API key")
        entry = self._by_id.get(match.group(1))
        if entry is None and lookup is not None:
            found = lookup(match.group(1), token)
            if found is None:
                raise Unauthorized(_UNKNOWN)
            return found
        # The digest comparison runs even when the id is unknown, so both refusals take the same time.
        expected = entry.digest if entry is not None else "sha256:" + "0" * 64
        if not hmac.compare_digest(key_digest(token), expected) or entry is None:
            raise Unauthorized(_UNKNOWN)
        return self._principals[entry.key_id]


# The caller of a route open to everyone ("none"): not authenticated, no scope, no tenant.
NOBODY = Principal("", "", frozenset())


def require(principal: Principal, access: Access) -> None:
    if access == "any key":
        if not principal.scopes & {"inference", "admin"}:
            raise Forbidden("this key lacks the 'inference' or 'admin' scope required by this route")
    elif access != "none" and access not in principal.scopes:
        raise Forbidden(f"this key lacks the '{access}' scope required by this route")
