"""docs/api.md's "Request bodies" tables, made from the schema (a unit test holds the doc to them), and
the walk over every route's values that finds each size bound (``sizes``: the names a tenant's
``field_bounds`` may set, docs/security.md's table, and the test that no value is unbounded)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from proxy.schema.llama import LLAMA
from proxy.schema.routes import SCHEMAS
from proxy.schema.values import Bool, Int, Num, Size, Str, Value

_WHO = {"any": "any key", "admin": "admin keys", "nobody": "no key"}


def _row(name: str, schema: str) -> str:
    f = SCHEMAS[schema][name]
    why = f" ({f.why})" if f.why else ""
    cells = (f"`{name}`", f.value.describe(), f"{_WHO[f.who]}{why}", f.doc)
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def tables() -> str:
    """The pinned server's fields once, then each route's own fields."""
    out = [
        "Fields of the pinned llama-server's own schema (`server-schema.cpp`), accepted on every generation"
        " route (chat completions, completions, `/completion`, `/infill`, Responses, Messages):",
        "",
        "| field | value | who may send it | what it does |",
        "|---|---|---|---|",
        *(_row(name, "completion") for name in LLAMA),
        "",
        "Each route's own fields, beside those above where the route generates:",
        "",
        "| body | field | value | who may send it | what it does |",
        "|---|---|---|---|---|",
    ]
    for schema, fields in SCHEMAS.items():
        for name in fields:
            if name in LLAMA and fields[name] is LLAMA[name]:
                continue
            out.append(f"| `{schema}` " + _row(name, schema))
    return "\n".join(out) + "\n"


def advisories_table() -> str:
    """docs/security.md's advisories table."""
    from proxy.schema.advisories import ADVISORIES

    out = [
        "| advisory | what request input (or flag) reaches | the pinned source (0c1e570) | what closes it |",
        "|---|---|---|---|",
    ]
    for a in ADVISORIES:
        cells = (a.id, a.reaches, a.pinned, a.closed_by)
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


@dataclass(frozen=True, slots=True)
class Found:
    """One value of a route's schema: its ``path`` (the bound's name), its kind, and its ``size``
    (None: a variable-size value without a bound, which the schema's test refuses)."""

    schema: str
    path: str
    kind: Value
    size: Size | None


def walk(kind: Value, path: str, schema: str = "") -> Iterator[Found]:
    """Every value inside ``kind`` at ``path``, read from its dataclass fields: a ``Size`` bounds the
    value (or each element, ``Size.each``); a Value is the same value through a wrapper (a grammar's
    text, a JSON schema's shape: bounded by it), tuples of Values are parts at the same path (``Either``'s
    kinds, a prompt's shapes), ``item`` an element (``path[]``), a mapping of Values an object's members
    (``path.key``). A kind with no ``Size`` of its own is reported unbounded, unless it is a scalar or
    one of several kinds (``Either``), each judged on its own."""
    if isinstance(kind, Int | Num | Bool) or (isinstance(kind, Str) and kind.choices):
        return
    bounded = False  # a Size of its own, or (``Either``) only parts that are each bounded
    for f in dataclasses.fields(kind):  # type: ignore[arg-type]
        value = getattr(kind, f.name)
        if isinstance(value, Size):
            bounded = True
            yield Found(schema, f"{path}[]" if value.each else path, kind, value)
        elif f.name == "item" and _is_value(value):
            yield from walk(value, f"{path}[]", schema)
        elif _is_value(value):
            bounded = True  # a wrapper (``proxy.schema.programs``): the same value, its part's bound
            yield from walk(value, path, schema)
        elif isinstance(value, tuple) and value and all(_is_value(v) for v in value):
            bounded = True  # the value is one of these, each walked (and judged) here
            for part in value:
                yield from walk(part, path, schema)
        elif isinstance(value, Mapping) and all(_is_value(v) for v in value.values()):
            for key, part in value.items():
                yield from walk(part, f"{path}.{key}", schema)
    if not bounded:
        yield Found(schema, path, kind, None)


def _is_value(x: object) -> bool:
    return callable(getattr(x, "check", None)) and callable(getattr(x, "describe", None))


def sizes() -> Iterator[Found]:
    """Every value of every route's schema."""
    for schema, fields in SCHEMAS.items():
        for name, field in fields.items():
            yield from walk(field.value, name, schema)


def bound_names() -> frozenset[str]:
    """The names a tenant's ``field_bounds`` may set."""
    return frozenset(f.path for f in sizes() if f.size is not None)


def costs_table() -> str:
    """docs/security.md's table of the costly values: each entry of the cost table, the bounds computed
    from it on the demo model and with Gemma 3's 262,144 tokens, and the values it bounds."""
    from proxy.schema.costs import COSTS, REFERENCE_VOCAB, cost_limit

    where: dict[str, list[str]] = {}
    for found in sizes():
        if found.size is not None and found.size.cost is not None:
            paths = where.setdefault(found.size.cost, [])
            if found.path not in paths:
                paths.append(found.path)
    out = [
        "| cost entry | bounds | held | measured cost | bound, demo model | bound, 262,144 tokens"
        " | measured |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for name, c in COSTS.items():
        most = max(f.size.most for f in sizes() if f.size is not None and f.size.cost == name)
        demo, _ = cost_limit(name, most, REFERENCE_VOCAB)
        large, _ = cost_limit(name, most, 262_144)
        held = "server loop" if c.where == "loop" else "HTTP thread"
        per = f"{c.seconds * 1e3:.3g} ms per {c.unit}" + (
            f" at {REFERENCE_VOCAB:,} tokens (x vocabulary)" if c.per_vocab else ""
        )
        names = ", ".join(f"`{p}`" for p in where.get(name, []))
        cells = (f"`{name}`", names, held, per, f"{demo:,}", f"{large:,}", c.source)
        out.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    return "\n".join(out) + "\n"
