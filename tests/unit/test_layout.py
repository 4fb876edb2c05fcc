"""The folders of ``supervisor/`` are layers, and imports only point down (or sideways without a circle).

Read from every module's source with ``ast``, function-local imports included: a lazy import is still an
arrow, and a circle hidden in a function is the kind this test exists to keep out. The order is the one
README's layout block shows; a new module or folder fails here until it is placed in ``LAYERS``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Top to bottom. A unit is a subpackage of supervisor/ or a module directly in it ("supervisor" itself is
# its __init__, which holds __version__). Imports may point down or stay within a layer, never up.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"cli", "__main__"}),  # the entry point: dispatches to a command by name
    frozenset({"commands", "bench"}),  # one module per subcommand; the benchmark client
    frozenset({"daemon"}),  # the running service
    frozenset({"budget", "artifacts", "child", "config"}),  # what the service is made of
    frozenset({"launch"}),  # the llama-server command line: config checks it, the child runs it
    frozenset({"supervisor", "errors", "logs", "progress", "paths", "subproc", "interrupts"}),  # helpers
)


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """Every module this one imports (absolute names), at any depth of the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                # ``from supervisor.x import y``: y may be a submodule or a name in x.
                full = f"{module}.{alias.name}"
                yield full if full in known else module


def _graph(package: str) -> dict[str, set[str]]:
    mods = _modules(package)
    known = set(mods)
    return {
        name: {
            dep
            for dep in _imports(name, path, known)
            if dep != name and (dep == "supervisor" or dep.startswith("supervisor."))
        }
        for name, path in mods.items()
    }


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in ``graph`` (as a path that ends where it starts), or None."""
    colour: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if colour.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in colour and (found := visit(dep)) is not None:
                return found
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if node not in colour and (found := visit(node)) is not None:
            return found
    return None


def _layer_of() -> dict[str, int]:
    return {unit: depth for depth, layer in enumerate(LAYERS) for unit in layer}


def test_every_unit_has_a_layer() -> None:
    units = {_unit(m) for m in _modules("supervisor")}
    layer = _layer_of()
    assert sorted(units - set(layer)) == [], "place these in LAYERS (a folder by role, or a helper)"
    assert sorted(set(layer) - units) == [], "LAYERS names units that do not exist"


def test_no_import_points_up() -> None:
    layer = _layer_of()
    up = [
        f"{mod} -> {dep}"
        for mod, deps in _graph("supervisor").items()
        for dep in sorted(deps)
        if layer.get(_unit(dep), -1) < layer.get(_unit(mod), -1)
    ]
    assert up == []


def test_no_circle_between_modules() -> None:
    assert _cycle(_graph("supervisor")) is None


def test_no_circle_between_folders() -> None:
    units: dict[str, set[str]] = {}
    for mod, deps in _graph("supervisor").items():
        units.setdefault(_unit(mod), set()).update(_unit(d) for d in deps if _unit(d) != _unit(mod))
    assert _cycle(units) is None


def test_proxy_never_imports_supervisor() -> None:
    found = [f"{mod} -> {dep}" for mod, deps in _graph("proxy").items() for dep in sorted(deps)]
    assert found == []


def test_the_checks_see_circles_and_upward_arrows() -> None:
    # The helpers above must be able to fail: a circle of three, and a lazy import inside a function.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    graph = _graph("supervisor")
    assert "supervisor.daemon.startcheck" in graph["supervisor.commands.config"]  # imported in a function
    assert "supervisor.artifacts.cmake" in graph["supervisor.artifacts.build"]  # `from package import module`
