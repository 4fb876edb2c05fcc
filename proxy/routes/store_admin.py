"""The accounts store's admin routes: keys made, listed and revoked while the daemon serves, and the
usage ledger's sums. Admin keys only (the rows' ``access`` in ``proxy.routes.table``).

``POST /admin/keys`` makes a key (the key itself is in this answer only, once; the store keeps its
digest), ``GET /admin/keys`` lists them (never a digest), ``DELETE /admin/keys/{id}`` revokes one,
``GET /admin/usage`` answers what ``llamagate usage --format json`` prints, with the same filters as
query parameters (``tenant``, ``key``, ``since``, ``by``). A change is in force at once: the key view is
read again right after the write (other writers, ``llamagate keys``, are seen within a poll). A write
that was committed is answered as made even if that read fails (a connection the database ended): the
view's poll brings the change within its interval, and a 503 would have the client make it twice.

Every store call runs on a worker thread (``asyncio.to_thread``): a slow disk must not stall the loop
that relays tokens. Without a store these routes answer 404 saying how to configure one.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qs

from starlette.types import Receive, Scope, Send

from proxy.accounts.issue import check_models, check_name, check_tenant, issue_key
from proxy.accounts.records import BUDGET_NAMES, GroupBy, KeyRecord
from proxy.accounts.report import (
    GROUPS,
    check_budget,
    check_key_id,
    check_tenant_name,
    key_row,
    parse_duration,
    parse_when,
    usage_report,
)
from proxy.accounts.service import Accounts
from proxy.accounts.store import StoreError
from proxy.asgi import body as bodies
from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.asgi.responses import send_json
from proxy.auth import Principal
from proxy.errors import BadRequest, NotFound, StoreUnavailable
from proxy.settings import BudgetSettings
from proxy.settings import Scope as KeyScope
from proxy.state import ProxyState

log = logging.getLogger("llamagate.accounts")

_KEY_ID = re.compile(r"[0-9a-f]{12}")
_NEW_FIELDS = frozenset({"tenant", "scopes", "admin", "expires", "models", "name", "budgets"})
_SCOPES: frozenset[KeyScope] = frozenset({"inference", "admin"})
T = TypeVar("T")


def _accounts(state: ProxyState) -> Accounts:
    if state.accounts is None:
        raise NotFound("no accounts store here: add 'store: {}' to the configuration (configuration.md)")
    return state.accounts


def _refresh_after_write(accounts: Accounts) -> None:
    """The key view read again after a committed write; a failure is not the write's (see above)."""
    try:
        accounts.view.refresh()
    except StoreError as exc:
        log.warning("key store: a change was written; it comes into force at the next poll (%s)", exc)


async def _in_thread(call: Any, *args: Any) -> Any:
    try:
        return await asyncio.to_thread(call, *args)
    except StoreError as exc:
        raise StoreUnavailable(f"the store refused the change: {exc}") from None


def _query(scope: Scope) -> dict[str, str]:
    raw = (scope.get("query_string") or b"").decode("latin-1")
    return {k: v[-1] for k, v in parse_qs(raw, keep_blank_values=True).items()}


class AdminKeys:
    """``GET /admin/keys`` (the list) and ``POST /admin/keys`` (a new key)."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        accounts = _accounts(self.state)
        if scope["method"] == "POST":
            await self._new(accounts, scope, receive, send)
            return
        keys: list[KeyRecord] = await _in_thread(accounts.store.list_keys)
        now = time.time()
        await send_json(send, 200, {"keys": [key_row(k, now) for k in keys]})

    async def _new(self, accounts: Accounts, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        raw = await bodies.read_body(receive, ctx.content_length, self.state.settings.max_body_bytes)
        body = bodies.parse_object(raw)
        now = time.time()
        key, record = issue_key(
            self._tenant(body),
            _scopes(body),
            now,
            name=_name(body),
            models=self._models(body),
            budgets=_budgets(body.get("budgets")),
            expires=_expires(body.get("expires"), now),
        )

        def add() -> None:
            accounts.store.add_key(record)
            _refresh_after_write(accounts)  # in force for the next request, not the next poll

        await _in_thread(add)
        await send_json(send, 201, {"key": key, **key_row(record, now)})

    def _tenant(self, body: dict[str, Any]) -> str:
        unknown = sorted(set(body) - _NEW_FIELDS)
        if unknown:
            known = ", ".join(sorted(_NEW_FIELDS))
            raise BadRequest(f"unknown field(s) {', '.join(unknown)}; a key takes {known}")
        return _field("tenant", check_tenant, body.get("tenant"), self.state.tenants)

    def _models(self, body: dict[str, Any]) -> tuple[str, ...]:
        models = body.get("models")
        if models is None:
            return ()
        if not isinstance(models, list):
            raise BadRequest("'models' must be a non-empty list of model names (omit it for every model)")
        return _field("models", check_models, models, tuple(self.state.router.lanes))


def _field(name: str, check: Callable[..., T], *args: object) -> T:
    """``check(*args)``, its ``ValueError`` a 400 naming the field."""
    try:
        return check(*args)
    except ValueError as exc:
        raise BadRequest(f"'{name}': {exc}") from None


def _scopes(body: dict[str, Any]) -> frozenset[KeyScope]:
    scopes, admin = body.get("scopes"), body.get("admin")
    if scopes is not None and admin is not None:
        raise BadRequest("give 'scopes' or 'admin', not both")
    if admin is not None:
        if not isinstance(admin, bool):
            raise BadRequest("'admin' must be true or false")
        return _SCOPES if admin else frozenset({"inference"})
    if scopes is None:
        return frozenset({"inference"})
    if not isinstance(scopes, list) or not scopes or any(s not in _SCOPES for s in scopes):
        raise BadRequest("'scopes' must be a non-empty list of 'inference' and 'admin'")
    return frozenset(s for s in _SCOPES if s in scopes)


def _name(body: dict[str, Any]) -> str:
    return _field("name", check_name, body.get("name", ""))


def _expires(value: Any, now: float) -> float | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest('\'expires\' must be a duration from now such as "30d" or "12h" (or null)')
    try:
        return now + parse_duration(value)
    except ValueError as exc:
        raise BadRequest(f"'expires' {value!r}: {exc}") from None


def _budgets(value: Any) -> BudgetSettings:
    if value is None:
        return BudgetSettings()
    if not isinstance(value, dict) or set(value) - set(BUDGET_NAMES):
        raise BadRequest(f"'budgets' must be an object with any of {', '.join(BUDGET_NAMES)}")
    return BudgetSettings(**{name: _field(f"budgets.{name}", check_budget, v) for name, v in value.items()})


class AdminKey:
    """``DELETE /admin/keys/{id}``: revoke the key (again: a no-op); refused within a second, here at
    once."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        accounts = _accounts(self.state)
        key_id = scope.get("path_params", {}).get("id", "")
        if not _KEY_ID.fullmatch(key_id):
            raise NotFound("a key id is 12 lowercase hex digits (the 'id' of GET /admin/keys)")
        now = time.time()

        def revoke() -> KeyRecord | None:
            record = accounts.store.revoke_key(key_id, now)
            _refresh_after_write(accounts)
            return record

        record: KeyRecord | None = await _in_thread(revoke)
        if record is None:
            raise NotFound(f"no key with id {key_id}")
        await send_json(send, 200, key_row(record, now))


class AdminUsage:
    """``GET /admin/usage?tenant=&key=&since=&by=``: the ledger's hourly sums, as ``llamagate usage``."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        accounts = _accounts(self.state)
        query = _query(scope)
        unknown = sorted(set(query) - {"tenant", "key", "since", "by"})
        if unknown:
            raise BadRequest(f"unknown parameter(s) {', '.join(unknown)}; give tenant, key, since or by")
        by = query.get("by", "tenant")
        if by not in GROUPS:
            raise BadRequest(f"'by' must be one of {', '.join(GROUPS)}")
        group: GroupBy = by  # narrowed by the check against the Literal's values above
        since: float | None = None
        if query.get("since"):
            try:
                since = parse_when(query["since"], time.time())
            except ValueError as exc:
                raise BadRequest(f"'since' {query['since'][:40]!r}: {exc}") from None
        tenant = _field("tenant", check_tenant_name, query["tenant"]) if query.get("tenant") else None
        key_id = _field("key", check_key_id, query["key"]) if query.get("key") else None
        rows = await _in_thread(
            lambda: accounts.store.usage(by=group, tenant=tenant, key_id=key_id, since=since)
        )
        await send_json(send, 200, usage_report(rows, group, since))
