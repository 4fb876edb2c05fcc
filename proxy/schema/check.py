"""The one check of a request body against the declared schema: every field known to its route, of its
declared type and range, sent by a key that may send it; then the tenant's rewriting bounds.

Unknown fields (``proxy.unknown_fields``, and ``proxy.admin_unknown_fields`` for admin keys): ``refuse``
(the default: a field llama-server reads that nobody has declared is closed before anyone knows it is
unsafe), ``drop`` (removed, the request goes on), ``pass`` (sent to the child unchecked).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.schema.bounds import bound_generation
from proxy.schema.costs import BUDGET_S
from proxy.schema.fields import Field
from proxy.schema.media import check_inputs
from proxy.schema.programs import check_exclusive
from proxy.schema.routes import SCHEMAS
from proxy.schema.values import Context, FieldError, UnknownField
from proxy.settings import ProxySettings, TenantSettings, UnknownPolicy
from proxy.source import UpstreamSnapshot


def check_body(
    schema: str, payload: dict[str, Any], ctx: Context, unknown: UnknownPolicy, *, generates: bool = False
) -> bool:
    """Refuse ``payload`` (``FieldError``, a 400 naming the field) or accept it, dropping what the
    settings drop and rewriting what the tenant's bounds rewrite. True when the body changed."""
    fields = SCHEMAS[schema]
    rewritten = False
    ctx.spent.clear()
    for name in list(payload):
        value = payload[name]
        field = fields.get(name)
        if field is None:
            if unknown == "refuse":
                raise UnknownField(
                    name, f"is not a field of {_ROUTE_WORDS.get(schema, schema)} requests here"
                )
            if unknown == "drop":
                del payload[name]
                rewritten = True
            continue
        if field.who != "any" and not (field.who == "admin" and ctx.admin):
            if field.who == "admin" and (value is None or value == field.default):
                del payload[name]  # the default anyway: nothing was asked that is not given
                rewritten = True
                continue
            raise FieldError(name, f"is not accepted from {_WHO[field.who]}: {field.why}")
        if value is None:
            if not field.nullable:
                raise FieldError(name, "must not be null")
            continue
        field.value.check(value, name, ctx)
    _within_budget(ctx)
    if generates:
        rewritten = bound_generation(schema == "chat", payload, ctx.tenant, ctx.admin) or rewritten
    return rewritten


def _within_budget(ctx: Context) -> None:
    """Each costly value is within its own bound; together they must fit the budget too (a request with
    DRY breakers, a grammar and a JSON schema each at its bound would hold the loop three times as
    long). Refused naming the costliest."""
    for where, spent in ctx.spent.items():
        total = sum(spent.values())
        if total <= BUDGET_S * (1 + 1e-9):
            continue
        worst = max(spent, key=lambda path: spent[path])
        parts = ", ".join(f"'{path}' {seconds:.2g} s" for path, seconds in spent.items())
        held = "llama-server's server loop" if where == "loop" else "an HTTP thread of llama-server"
        raise FieldError(
            worst,
            f"and the request's other costly values would hold {held} for about {total:.2g} s ({parts});"
            f" the bound of a request is {BUDGET_S:g} s (docs/security.md): send fewer or smaller",
        )


def check_request(
    schema: str,
    payload: dict[str, Any],
    settings: ProxySettings,
    tenant: TenantSettings,
    admin: bool,
    snap: UpstreamSnapshot,
    *,
    generates: bool = False,
) -> bool:
    """``check_body`` for one request: its tenant's bounds, its child's slots and vocabulary, and the
    unknown-field policy of its kind of key; then what the model takes (media parts, ``/infill``). The
    one entry of every route with a body."""
    bounds = Context(tenant, admin, snap.slots, snap.n_vocab)
    unknown = settings.admin_unknown_fields if admin else settings.unknown_fields
    rewritten = check_body(schema, payload, bounds, unknown, generates=generates)
    check_exclusive(schema, payload)
    check_inputs(schema, payload, snap.inputs, snap.model_alias)
    return rewritten


def declared(schema: str) -> Mapping[str, Field]:
    """Every field ``schema`` accepts (for docs/api.md and its test)."""
    return SCHEMAS[schema]


_WHO = {"admin": "inference keys (admin keys only)", "nobody": "any key"}
_ROUTE_WORDS = {
    "chat": "chat completion",
    "completions": "OpenAI completion",
    "completion": "llama.cpp completion",
    "infill": "infill",
    "responses": "Responses",
    "messages": "Anthropic Messages",
    "count_tokens": "Anthropic count_tokens",
    "embeddings": "embedding",
    "rerank": "rerank",
    "tokenize": "tokenize",
    "detokenize": "detokenize",
}
