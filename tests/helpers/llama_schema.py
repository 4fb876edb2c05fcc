"""The pinned llama-server's request schema, read from the locked source rather than copied into tests.

``tools/server/server-schema.cpp`` (``make_llama_cmpl_schema``) declares each body field a completion
task reads: ``field_num``, ``field_bool``, ``field_str``, ``field_json`` and ``field_nested`` (whose
``add_subfield`` entries live inside an object), each with its ``add_alias`` names. Fields under
``#if 0`` and in ``//`` comments are not compiled, so they are not part of it.

The source comes from the tarball ``llamagate build`` fetched for the lock (``fetch_source``: a cache
hit once the binary is built, else a download from the package registry), so the list is always the
pinned one and a new pin changes it without anyone editing a table.
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from supervisor.artifacts.fetch import fetch_source
from supervisor.artifacts.lock import load_lock
from supervisor.paths import cache_root
from supervisor.progress import ConsoleProgress

SCHEMA_FILE = "tools/server/server-schema.cpp"

_FIELD = re.compile(r'new\s+field_(num|bool|str|json|nested)\s*\(\s*"([^"]+)"')
_ALIAS = re.compile(r'->\s*add_alias\s*\(\s*"([^"]+)"\s*\)')
# A declaration that is the argument of add_subfield: "->add_subfield((new field_bool(..." .
_SUBFIELD_OPEN = re.compile(r"add_subfield\s*\(\s*\(\s*$")
_DISABLED = re.compile(r"^\s*#\s*if\s+0\b.*?^\s*#\s*endif\b[^\n]*", re.S | re.M)


@dataclass(frozen=True)
class SchemaField:
    """One declared field: its ``kind`` (num/bool/str/json/nested), its names (the first is the field's
    own, the rest aliases), and ``parent``, the nested field holding it (``stream_options``), if any."""

    kind: str
    names: tuple[str, ...]
    parent: str | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def aliases(self) -> tuple[str, ...]:
        return self.names[1:]

    def paths(self) -> tuple[str, ...]:
        """Every name a body may carry it under, nested ones as ``parent.name``."""
        prefix = f"{self.parent}." if self.parent else ""
        return tuple(prefix + n for n in self.names)


def _strip_comments(text: str) -> str:
    # Line comments only outside string literals: a description may hold "//" (a URL).
    out = []
    for line in text.splitlines():
        in_string = False
        cut = len(line)
        i = 0
        while i < len(line):
            ch = line[i]
            if ch == "\\" and in_string:
                i += 2
                continue
            if ch == '"':
                in_string = not in_string
            elif not in_string and line.startswith("//", i):
                cut = i
                break
            i += 1
        out.append(line[:cut])
    return "\n".join(out)


def parse_server_schema(source: str) -> list[SchemaField]:
    """The fields ``make_llama_cmpl_schema`` declares, in order. Raises ``ValueError`` when the function
    is not there (a new pin moved it: the tests must be told, not pass on an empty list)."""
    start = source.find("make_llama_cmpl_schema(")
    if start < 0:
        raise ValueError(f"{SCHEMA_FILE}: no make_llama_cmpl_schema")
    # The function ends where the next top-level definition (its evaluator) begins.
    end = source.find("\ntask_params eval_llama_cmpl_schema", start)
    body = source[start : end if end > 0 else len(source)]
    body = _strip_comments(_DISABLED.sub("", body))
    fields: list[SchemaField] = []
    nested: str | None = None  # the latest field_nested, which add_subfield attaches to
    matches = list(_FIELD.finditer(body))
    for i, m in enumerate(matches):
        kind, name = m.group(1), m.group(2)
        # Its aliases: the add_alias calls before the next declaration.
        tail = body[m.end() : matches[i + 1].start() if i + 1 < len(matches) else len(body)]
        parent = nested if _SUBFIELD_OPEN.search(body[: m.start()]) else None
        fields.append(SchemaField(kind, (name, *_ALIAS.findall(tail)), parent))
        if kind == "nested":
            nested = name
    if not fields:
        raise ValueError(f"{SCHEMA_FILE}: make_llama_cmpl_schema declares no fields")
    return fields


def read_pinned_file(relative: str, lock_path: Path) -> str:
    """A file of the pinned llama.cpp tree (``relative`` to its top folder), read out of the lock's
    source tarball without unpacking the rest."""
    lock = load_lock(lock_path)
    fetched = fetch_source(lock, root=cache_root(), progress=ConsoleProgress())
    wanted = f"{fetched.source.subdir.strip('/')}/{relative}"
    with tarfile.open(fetched.tarball) as tar:
        # Iterating stops at the member instead of indexing all of the 76 MB archive first.
        for member in tar:
            if member.name.lstrip("./") == wanted or member.name.endswith("/" + wanted):
                fh = tar.extractfile(member)
                if fh is None:
                    break
                return fh.read().decode("utf-8")
    raise FileNotFoundError(f"{fetched.tarball}: no {wanted}")


def pinned_server_schema(lock_path: Path) -> list[SchemaField]:
    return parse_server_schema(read_pinned_file(SCHEMA_FILE, lock_path))
