"""The folders of ``supervisor/`` and of ``proxy/`` are layers, and imports only point down (or sideways
without a circle).

Read from every module's source with ``ast``, function-local and ``TYPE_CHECKING`` imports included: a
lazy import or one for a type is still an arrow, and a circle hidden in a function or behind
``TYPE_CHECKING`` is the kind this test exists to keep out. The order is the one README's layout block
shows; a new module or folder fails here until it is placed in its package's layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Top to bottom. A unit is a subpackage of the package or a module directly in it ("supervisor" itself is
# its __init__, which holds __version__). Imports may point down or stay within a layer, never up.
SUPERVISOR: tuple[frozenset[str], ...] = (
    frozenset({"cli", "__main__"}),  # the entry point: dispatches to a command by name
    frozenset({"commands", "bench"}),  # one module per subcommand; the benchmark client
    frozenset({"daemon"}),  # the running service
    frozenset({"budget", "artifacts", "child", "config"}),  # what the service is made of
    frozenset({"launch"}),  # the llama-server command line: config checks it, the child runs it
    frozenset(
        {"supervisor", "errors", "logs", "progress", "paths", "subproc", "interrupts", "checks"}
    ),  # helpers
)
PROXY: tuple[frozenset[str], ...] = (
    frozenset({"app"}),  # create_app: exact-path dispatch, the layer order
    frozenset({"listener", "middleware", "routes"}),  # before the app; around every request; each path
    frozenset({"state"}),  # the door's state: settings, keys, tenants, totals, the router
    frozenset({"models", "metrics", "telemetry"}),  # which child answers; the series; OpenTelemetry
    # slots; the answer's way back; talking to the child; tenants' keys, ledger and budgets (the store);
    # limits shared with the other replicas (Redis)
    frozenset({"admission", "streams", "upstream", "accounts", "cluster", "schema"}),
    frozenset({"conversations"}),  # which conversation a request continues, which slot holds it
    frozenset({"proxy", "asgi", "auth", "errors", "settings", "source"}),  # helpers and the daemon's contract
)
LAYERS = {"supervisor": SUPERVISOR, "proxy": PROXY}
PACKAGES = sorted(LAYERS)


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


def _graph(package: str, within: str | None = None) -> dict[str, set[str]]:
    """``package``'s modules and their imports of ``within``'s modules (by default its own)."""
    within = within or package
    mods = _modules(package)
    known = set(mods) | set(_modules(within))
    return {
        name: {
            dep
            for dep in _imports(name, path, known)
            if dep != name and (dep == within or dep.startswith(within + "."))
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


def _layer_of(package: str) -> dict[str, int]:
    return {unit: depth for depth, layer in enumerate(LAYERS[package]) for unit in layer}


def _upward(package: str, graph: dict[str, set[str]]) -> list[str]:
    layer = _layer_of(package)
    return [
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        for dep in sorted(deps)
        if layer.get(_unit(dep), -1) < layer.get(_unit(mod), -1)
    ]


def _folders(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        units.setdefault(_unit(mod), set()).update(_unit(d) for d in deps if _unit(d) != _unit(mod))
    return units


@pytest.mark.parametrize("package", PACKAGES)
def test_every_unit_has_a_layer(package: str) -> None:
    units = {_unit(m) for m in _modules(package)}
    layer = _layer_of(package)
    assert sorted(units - set(layer)) == [], "place these in the layers (a folder by role, or a helper)"
    assert sorted(set(layer) - units) == [], "the layers name units that do not exist"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_points_up(package: str) -> None:
    assert _upward(package, _graph(package)) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_circle_between_modules(package: str) -> None:
    assert _cycle(_graph(package)) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_circle_between_folders(package: str) -> None:
    assert _cycle(_folders(_graph(package))) is None


def test_proxy_never_imports_supervisor() -> None:
    found = [f"{mod} -> {dep}" for mod, deps in _graph("proxy", "supervisor").items() for dep in sorted(deps)]
    assert found == []


def test_proxys_top_level_holds_few_modules() -> None:
    # Beside its role folders: app, state, source, settings, errors, auth (and the package's __init__).
    top = sorted(p.stem for p in (REPO / "proxy").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 8, top


def test_the_checks_see_circles_and_upward_arrows() -> None:
    # The helpers above must be able to fail: a circle of three, and a lazy import inside a function.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    graph = _graph("supervisor")
    assert "supervisor.daemon.startcheck" in graph["supervisor.commands.config"]  # imported in a function
    assert "supervisor.artifacts.cmake" in graph["supervisor.artifacts.build"]  # `from package import module`
    # An upward arrow planted in proxy/ (a lane importing the door's state, under TYPE_CHECKING as the old
    # runtime <-> router circle did) is seen both as pointing up and as a circle.
    planted = {mod: set(deps) for mod, deps in _graph("proxy").items()}
    planted["proxy.models.lane"].add("proxy.state")
    assert _upward("proxy", planted) == ["proxy.models.lane -> proxy.state"]
    assert _cycle(planted) is not None and _cycle(_folders(planted)) is not None


def test_no_two_test_modules_share_a_basename() -> None:
    """Without __init__.py files pytest imports a test module by its basename: a second file of the same
    name elsewhere under tests/ is a collection error in a fresh checkout (and hidden by a stale cache)."""
    names: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


@pytest.mark.parametrize("package", PACKAGES)
def test_readmes_layout_block_names_every_folder(package: str) -> None:
    """The README's layout block is where a newcomer learns the folders: a folder it leaves out is one
    they meet unexplained (``proxy/cluster/`` was, for a while)."""
    readme = (REPO / "README.md").read_text()
    folders = sorted(p.parent.name for p in (REPO / package).glob("*/__init__.py"))
    assert folders
    missing = [f for f in folders if f"\n  {f}/ " not in readme]
    assert not missing, f"README's layout block does not name {package}/'s folders {missing}"
