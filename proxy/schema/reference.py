"""docs/api.md's "Request bodies" tables, made from the schema (a unit test holds the doc to them)."""

from __future__ import annotations

from proxy.schema.llama import LLAMA
from proxy.schema.routes import SCHEMAS

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
