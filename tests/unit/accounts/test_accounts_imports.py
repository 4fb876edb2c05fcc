"""``proxy/accounts`` is the proxy's state, usable by the supervisor's commands: it imports only the
standard library, itself, and the proxy's top-level ``settings``, ``auth`` and ``errors``; and psycopg,
the PostgreSQL engine's driver (``postgres.py``, imported only when ``store.url`` names a database)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[3] / "proxy" / "accounts"
ALLOWED = ("proxy.settings", "proxy.auth", "proxy.errors", "proxy.accounts", "psycopg")


def imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            out.append(node.module or "")
    return out


def allowed(name: str) -> bool:
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top == "__future__":
        return True
    return any(name == a or name.startswith(a + ".") for a in ALLOWED)


def test_accounts_imports_nothing_else() -> None:
    found = {f"{p.name}: {name}" for p in FOLDER.glob("*.py") for name in imports(p) if not allowed(name)}
    assert found == set()


def test_the_check_sees_a_forbidden_import() -> None:
    assert not allowed("proxy.inference") and not allowed("supervisor.paths") and not allowed("yaml")
    assert allowed("sqlite3") and allowed("proxy.auth") and allowed("proxy.accounts.store")
    assert "proxy.auth" in imports(FOLDER / "keyview.py")
