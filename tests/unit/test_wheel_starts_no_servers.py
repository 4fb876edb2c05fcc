"""Test servers belong to ``tests/``, not to the wheel: nothing under ``supervisor/`` or ``proxy/`` starts
a redis-server or a PostgreSQL (``llamagate bench scaleout --compare limits`` takes the operator's, by
``--redis-url`` and ``--store-url``; the launchers the tests use are tests/helpers/redis_server.py and
postgres_server.py), and nothing there imports from ``tests/``.

Read from every module's source with ``ast``: a string that is one of the servers' programs, or a path
ending in one, is how a module would name what it runs (an argv, a lookup on PATH, ``bindir /
"postgres"``); prose (docstrings, and messages that merely mention them) does not count.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("supervisor", "proxy")
# The programs that start (or set up) a Redis or a PostgreSQL server.
SERVER_PROGRAMS = frozenset(
    {
        "redis-server",
        "redis-stack-server",
        "postgres",
        "postmaster",
        "initdb",
        "pg_ctl",
        "pg_ctlcluster",
        "pg_createcluster",
    }
)


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def server_programs(source: str) -> Iterator[tuple[int, str]]:
    """(line, string) for each string in ``source`` that names a server program, a docstring excepted."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in prose:
            continue
        if node.value.strip().rsplit("/", 1)[-1] in SERVER_PROGRAMS:
            yield node.lineno, node.value


def imports_of_tests(source: str) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        yield from ((node.lineno, n) for n in names if n == "tests" or n.startswith("tests."))


def _found(package: str, check: Callable[[str], Iterable[tuple[int, str]]]) -> list[str]:
    """``check``'s findings in every module of ``package``, as ``path:line: value``."""
    return [
        f"{path.relative_to(REPO)}:{line}: {value!r}"
        for path in sorted((REPO / package).rglob("*.py"))
        for line, value in check(path.read_text(encoding="utf-8"))
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_starts_a_redis_or_a_postgresql(package: str) -> None:
    assert _found(package, server_programs) == [], "test servers belong to tests/helpers/, not to the wheel"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_from_tests(package: str) -> None:
    assert _found(package, imports_of_tests) == [], "tests/ is not in the wheel"


def test_the_checks_see_a_launcher() -> None:
    # What the old supervisor/bench/redis.py and postgres.py did, in the forms they did it.
    planted = '''
"""Starts a redis-server: a docstring may say so."""
import subprocess
from pathlib import Path
from tests.helpers.system import require_tool
import tests.helpers.redis_server

def start(bindir: Path) -> None:
    """initdb, then postgres."""
    subprocess.Popen(["redis-server", "--port", "0"])
    argv = [bindir / "initdb", "-D", "data"]
    other = ["/usr/lib/postgresql/15/bin/postgres", "-p", "5432"]
    raise RuntimeError("postgres exited")  # a message that mentions it runs nothing
'''
    assert [value for _, value in sorted(server_programs(planted))] == [
        "redis-server",
        "initdb",
        "/usr/lib/postgresql/15/bin/postgres",
    ]
    assert [name for _, name in sorted(imports_of_tests(planted))] == [
        "tests.helpers.system",
        "tests.helpers.redis_server",
    ]
