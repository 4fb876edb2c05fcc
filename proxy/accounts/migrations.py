"""The schema as plain SQL files shipped with the package (``migrations/NNNN_name.sql``), applied in order.

Each engine records what it applied in a ``schema_version`` table (one row per migration) and applies the
rest, each migration in its own transaction. A store whose newest applied version is beyond the last
file here was written by a newer llamagate: it is refused rather than guessed at.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

_NAME = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")

# Created by the runner itself, before the first migration, so that "which migrations ran" never
# depends on a migration having run.
SCHEMA_VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_version ("
    "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied DOUBLE PRECISION NOT NULL)"
)


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> tuple[Migration, ...]:
    """Every migration file, in order; numbered 1, 2, 3... without a gap (a gap is a packaging bug)."""
    folder = resources.files("proxy.accounts").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match is not None:
            found.append(Migration(int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    expected = list(range(1, len(found) + 1))
    if [m.version for m in found] != expected:
        raise RuntimeError(f"migration files are not numbered 1..{len(found)}: {[m.name for m in found]}")
    return tuple(found)


def latest() -> int:
    return len(migrations())


def statements(sql: str) -> Iterator[str]:
    """The statements of a migration file, split where SQLite's lexer says a statement is complete (so a
    ';' inside a string or a comment does not split). Only the lexer: the same split serves PostgreSQL."""
    buf = ""
    for piece in sql.split(";"):
        buf += piece + ";"
        if sqlite3.complete_statement(buf):
            text = buf.strip()
            if _strip_comments(text) != ";":
                yield text
            buf = ""
    if _strip_comments(buf[:-1]).strip():
        raise ValueError(f"incomplete SQL statement at the end of a migration: {buf[:60]!r}")


def _strip_comments(text: str) -> str:
    return "".join(line.split("--", 1)[0] for line in text.splitlines()).strip()
