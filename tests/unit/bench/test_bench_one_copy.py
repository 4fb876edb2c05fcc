"""One of each, for the jobs the bench and its tests used to do several ways: one percentile, one
``free_port``, one ``deep_merge``, one key-to-config entry, one reader of a streamed answer, one launcher
of a private ``llamagate serve``. Read from every source file (``ast``), so a second copy written later
fails here and names where it is."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ONE = {
    "percentile": "proxy/metrics/percentile.py",
    "free_port": "supervisor/child/spawn.py",
    "deep_merge": "supervisor/bench/launcher.py",
    "key_config": "supervisor/config/keys.py",
}
KEY_FIELDS = {"id", "digest", "tenant", "scopes"}


def _sources() -> dict[str, ast.Module]:
    return {
        path.relative_to(REPO).as_posix(): ast.parse(path.read_text(), str(path))
        for folder in ("supervisor", "proxy", "tests")
        for path in sorted((REPO / folder).rglob("*.py"))
    }


def _functions(tree: ast.Module) -> set[str]:
    """Functions defined at a module's top level, private ones by their public name (a fake's method of
    the same name is the seam it fakes, not a copy)."""
    return {
        node.name.lstrip("_")
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _key_entries(tree: ast.Module) -> int:
    """Dict literals shaped like a ``keys:`` entry of the config."""
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        and {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        >= KEY_FIELDS
    )


def test_each_job_has_one_definition() -> None:
    sources = _sources()
    found = {name: sorted(path for path, tree in sources.items() if name in _functions(tree)) for name in ONE}
    assert found == {name: [path] for name, path in ONE.items()}
    entries = {path: n for path, tree in sources.items() if (n := _key_entries(tree))}
    assert entries == {"supervisor/config/keys.py": 1}


def _strings(tree: ast.Module) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _reads_sse(tree: ast.Module) -> bool:
    """Whether the module looks for SSE ``data:`` lines itself (as text or bytes)."""
    return any(
        isinstance(n, ast.Constant)
        and isinstance(n.value, str | bytes)
        and n.value[:5] in ("data:", b"data:")
        for n in ast.walk(tree)
    )


def _serve_argv(tree: ast.Module) -> int:
    """List literals that start ``python -m supervisor ... serve``."""
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.List)
        and {"supervisor", "serve"} <= _strings(ast.Module([ast.Expr(node)], []))
    )


def test_one_stream_reader_and_one_daemon_launcher() -> None:
    bench = {
        path: tree
        for path, tree in _sources().items()
        if path.startswith(("supervisor/bench/", "tests/benchmarks/"))
        or path == "tests/integration/conftest.py"
    }
    # An SSE body is read line by line ("data: ...") in client.py alone: every TTFT is measured one way.
    assert sorted(p for p, tree in bench.items() if _reads_sse(tree)) == ["supervisor/bench/client.py"]
    assert {p: n for p, tree in bench.items() if (n := _serve_argv(tree))} == {
        "supervisor/bench/launcher.py": 1
    }


def test_the_check_sees_a_copy() -> None:
    copy = ast.parse(
        "def _percentile(v, q):\n    return v[0]\n"
        "class FakeOs:\n    def free_port(self):\n        return 1\n"
        "entry = {'id': 'a', 'digest': 'b', 'tenant': 'c', 'scopes': []}\n"
        "argv = [sys.executable, '-m', 'supervisor', 'serve', '--config', path]\n"
        "done = line == 'data: [DONE]'\n"
    )
    assert _functions(copy) == {"percentile"} and _key_entries(copy) == 1 and _serve_argv(copy) == 1
    assert _reads_sse(copy)
