"""A non-editable install (`pip install .`) carries every subpackage and the page's static files, and no test
fake: built as pip builds it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_contains_every_static_file(tmp_path: Path) -> None:
    # Build from a copy, so the checkout gets no build/ or egg-info folder; offline, like an air-gapped host.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "llama-build.lock"):
        shutil.copy2(REPO / name, src / name)
    for package in ("proxy", "supervisor"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = out.glob("llamagate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    static = sorted(p.name for p in (REPO / "proxy" / "routes" / "static").iterdir() if p.is_file())
    assert {"index.html", "app.js", "style.css"} <= set(static)
    missing = [n for n in static if f"proxy/routes/static/{n}" not in names]
    assert missing == [], f"not in the wheel: {missing}"
    assert "proxy/routes/ui.py" in names
    # Every module of every subpackage (supervisor/ is folders by role): a folder setuptools did not find
    # would install a `llamagate` that fails on its first import.
    modules = sorted(
        p.relative_to(REPO).as_posix()
        for package in ("proxy", "supervisor")
        for p in (REPO / package).rglob("*.py")
        if "__pycache__" not in p.parts
    )
    assert "supervisor/child/machine.py" in modules
    assert [m for m in modules if m not in names] == []
    assert "supervisor/data/llama-build.lock" in names
    # The accounts store's schema is plain SQL files beside the code: without them no store opens.
    sql = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "proxy/accounts/migrations").glob("*.sql"))
    assert "proxy/accounts/migrations/0001_accounts.sql" in sql
    assert [m for m in sql if m not in names] == []
    # Fakes with test switches (a fake llama-server that fails on request) live in tests/fakes only.
    assert [n for n in names if "fake" in n.lower() or n.startswith("tests/")] == []


def _tests_named(tree: ast.AST) -> list[str]:
    """Modules of tests/ that ``tree`` imports, or names as a string (``python -m tests.fakes.x``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value.strip())
    return [n for n in out if n == "tests" or n.startswith(("tests.", "tests/"))]


def test_no_product_module_uses_the_tests() -> None:
    """The product never reaches into tests/ (for a fake or a benchmark): the wheel does not have them."""
    found = [
        f"{path.relative_to(REPO)}: {name}"
        for package in ("proxy", "supervisor")
        for path in sorted((REPO / package).rglob("*.py"))
        for name in _tests_named(ast.parse(path.read_text(), str(path)))
    ]
    assert found == []
    # The check can fail: an import and a module started by name are both seen.
    tree = ast.parse('import tests.fakes.x\nfrom tests.fakes import y\nargv = ["-m", "tests.fakes.z"]')
    assert _tests_named(tree) == ["tests.fakes.x", "tests.fakes", "tests.fakes.z"]
