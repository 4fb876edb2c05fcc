"""README.md's quick start and .ci/run cannot drift apart: CI runs the README's own blocks.

.ci/readme_commands.py takes the blocks marked ``<!-- ci: setup -->``, ``serve`` and ``test`` out of
the README; .ci/run runs the setup block first and the test block last. These tests fail when the
README loses a block, when .ci/run runs anything of its own before the README's setup (a pip upgrade
hid the pip 23 failure once) or lets another python3 than Debian's make the venv (a pyenv 3.11.7 hid
a 3.11.2 failure once), when the setup line stops working for root without sudo or for a user with
sudo, or when the apt-get line misses a package a test needs. Then the ``needs_tool`` marker
(tests/helpers/system.py), run by a tiny test suite of its own: a missing tool skips, naming its
package, and fails under ``CI=true``.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import system
from tests.helpers.system import TOOL_PACKAGES

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
CI_RUN = REPO / ".ci" / "run"
EXTRACTOR = REPO / ".ci" / "readme_commands.py"
DEBIAN_PYTHON = Path("/usr/bin/python3")
SETUP_PREFIX = """$([ "$(id -u)" = 0 ] || echo sudo) sh -c 'apt-get update && apt-get install -y """
QUICK_LOOP = '.venv/bin/python -m pytest -m "not integration"'


def _extractor() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_commands", EXTRACTOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rc = _extractor()


@pytest.fixture(scope="module")
def readme() -> dict[str, list[str]]:
    found: dict[str, list[str]] = rc.blocks((REPO / "README.md").read_text())
    return found


def _ci_lines() -> list[str]:
    lines = [line.strip() for line in CI_RUN.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _ci_prelude() -> str:
    """.ci/run up to the README's setup: the shell's settings and the choice of python3."""
    text = CI_RUN.read_text()
    return text[: text.index("setup=$(")]


def test_the_readme_has_the_three_quick_start_blocks(readme: dict[str, list[str]]) -> None:
    assert set(readme) == {"setup", "serve", "test"}
    apt, venv = readme["setup"]
    assert apt.startswith(SETUP_PREFIX) and apt.endswith("'")
    # The venv is made the way a newcomer makes it, with the pip it brings: no upgrade step.
    assert venv == "python3 -m venv .venv && .venv/bin/pip install -e '.[test]'"
    assert readme["serve"] == [".venv/bin/llamagate serve"]
    # What CI runs is the whole suite; the quick loop is shown beside it, for contributors.
    assert readme["test"] == [".venv/bin/python -m pytest"]
    text = (REPO / "README.md").read_text()
    assert f"```sh\n{QUICK_LOOP}\n```" in text
    assert "`/usr/bin/python3`" in text, "the README says which python3 it means"


def _declared_tools() -> set[str]:
    """Every tool a ``needs_tool`` marker in tests/ names (string literals; not this file's tiny suite)."""
    names: set[str] = set()
    for path in (REPO / "tests").rglob("*.py"):
        if path == Path(__file__).resolve():
            continue
        for args in re.findall(r"mark\.needs_tool\(([^)]*)\)", path.read_text()):
            names.update(re.findall(r"""["']([^"']+)["']""", args))
    return names


def test_the_apt_line_installs_every_package_a_test_needs(readme: dict[str, list[str]]) -> None:
    packages = set(rc.apt_packages(readme["setup"][0]))
    declared = _declared_tools()
    # The scan does see the markers (and each tool is in the table, so its package is known).
    assert {"nginx", "promtool", "prometheus", "chromium", "chromedriver", "systemd-analyze"} <= declared
    assert declared <= set(TOOL_PACKAGES), sorted(declared - set(TOOL_PACKAGES))
    needed = {"build-essential", "cmake", "python3-venv", *(TOOL_PACKAGES[t] for t in declared)}
    assert needed <= packages, f"missing from the README's apt-get line: {sorted(needed - packages)}"


def test_no_test_finds_a_system_tool_by_hand() -> None:
    """The needs_tool marker is the one way: no skipif on a tool, no shutil.which outside the helper."""
    tools = "|".join(re.escape(t) for t in TOOL_PACKAGES)
    # A tool's name as a word: "patch" is a tool, "monkeypatch" is not.
    by_hand = re.compile(rf"skipif\((?:(?!\n\n).)*?(?<![\w-])(?:{tools})(?![\w-])|shutil\.which\(", re.S)
    found = [
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("*.py")
        if path != Path(system.__file__).resolve() and by_hand.search(path.read_text())
    ]
    assert found == []


def test_ci_runs_the_readme_setup_first_and_its_test_command_last() -> None:
    lines = _ci_lines()
    run_setup = next(i for i, line in enumerate(lines) if re.search(r'bash .*-c "\$setup"$', line))
    before = lines[:run_setup]
    # Before the README's setup: only the shell's own settings, Debian's PATH and the check that it makes
    # python3 /usr/bin/python3, extracting the blocks, and echoing them.
    allowed = re.compile(
        r'^(set -euo pipefail|cd "\$\(dirname "\$0"\)/\.\."|echo .*|printf .*'
        r"|export PATH=/usr/sbin:/usr/bin:/sbin:/bin"
        r"|python3=\$\(command -v python3 \|\| true\)"
        r'|if \[ "\$python3" != /usr/bin/python3 \]; then|exit 1|fi'
        r"|setup=\$\(python3 \.ci/readme_commands\.py setup --ci\)"
        r"|test_command=\$\(python3 \.ci/readme_commands\.py test --ci\))$"
    )
    assert [line for line in before if not allowed.match(line)] == []
    assert "setup=$(python3 .ci/readme_commands.py setup --ci)" in before
    assert lines[-1] == 'CI=true bash -euo pipefail -c "$test_command"'
    text = CI_RUN.read_text()
    assert not re.search(r"pip[^\n]*(--upgrade|-U)\s+pip", text), "CI must use the pip the venv brings"
    assert "python3 -m venv" not in "\n".join(lines), "the README's setup makes the venv"
    # The log says which Python the venv has.
    after = lines[run_setup + 1 : run_setup + 3]
    assert any(".venv/bin/python -c" in line and "sys.version" in line for line in after), after


def _stub(folder: Path, name: str, body: str) -> None:
    (folder / name).write_text("#!/bin/sh\n" + body)
    (folder / name).chmod(0o755)


@pytest.mark.skipif(not DEBIAN_PYTHON.is_file(), reason="not a Debian machine: no /usr/bin/python3")
def test_ci_makes_the_readmes_python3_debians_even_behind_another_one(tmp_path: Path) -> None:
    """A pyenv python3 first on PATH (as on this host) is not the one the README's commands get."""
    other = tmp_path / "pyenv-shims"
    other.mkdir()
    _stub(other, "python3", 'echo "Python 3.99.0 (not Debian\'s)"\n')
    debian = subprocess.run([DEBIAN_PYTHON, "--version"], capture_output=True, text=True, check=True)
    run = subprocess.run(
        ["/bin/bash", "-c", _ci_prelude() + "\ncommand -v python3\n", str(CI_RUN)],
        env={"PATH": f"{other}:/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        f"ci: python3 is /usr/bin/python3 ({debian.stdout.strip()})",
        "/usr/bin/python3",
    ]


@pytest.mark.parametrize("shell", ["/bin/bash", "/bin/sh"])
@pytest.mark.parametrize("who", ["root without sudo", "a user with sudo"])
def test_the_setup_line_works_as_written_for_root_and_for_a_user_with_sudo(
    readme: dict[str, list[str]], tmp_path: Path, shell: str, who: str
) -> None:
    """The README's apt-get line, pasted: apt-get as root directly, through sudo otherwise.

    On a fresh Debian 12 VM or container you are root and sudo is not installed, and
    ``sudo apt-get ...`` failed there. The line runs here with nothing on PATH but stubs that record
    their calls: ``id`` (root or not), ``apt-get``, ``sudo`` (only for the user) and ``sh``.
    """
    line = readme["setup"][0]
    packages = " ".join(rc.apt_packages(line))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    root = who.startswith("root")
    _stub(bin_dir, "id", f'[ "$1" = -u ] && echo {0 if root else 1000}\n')
    _stub(bin_dir, "apt-get", f'echo "apt-get $*" >> {calls}\n')
    if not root:
        _stub(bin_dir, "sudo", f'echo "sudo $*" >> {calls}\nexec "$@"\n')
    (bin_dir / "sh").symlink_to("/bin/sh")
    run = subprocess.run(
        [shell, "-eu", "-c", line], env={"PATH": str(bin_dir)}, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    apt_calls = ["apt-get update", f"apt-get install -y --no-install-recommends {packages}"]
    inner = line.split("sh -c ", 1)[1].strip("'")  # what sudo gets: sh -c 'apt-get ...'
    expected = apt_calls if root else [f"sudo sh -c {inner}", *apt_calls]
    assert calls.read_text().splitlines() == expected


def test_the_extractor_prints_the_blocks_verbatim(readme: dict[str, list[str]]) -> None:
    for name in ("setup", "serve", "test"):
        out = subprocess.run(
            [sys.executable, str(EXTRACTOR), name], capture_output=True, text=True, check=True
        )
        assert out.stdout.splitlines() == readme[name]
    bad = subprocess.run([sys.executable, str(EXTRACTOR), "deploy"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_for_ci_runs_the_setup_line_as_written_and_skips_apt_when_installed(
    monkeypatch: pytest.MonkeyPatch, readme: dict[str, list[str]]
) -> None:
    apt, venv = readme["setup"]
    have: set[str] = set()
    monkeypatch.setattr(rc, "installed", lambda package: package in have)
    assert rc.for_ci([apt, venv]) == [apt, venv]
    have.update(rc.apt_packages(apt)[:-1])
    assert rc.for_ci([apt, venv]) == [apt, venv]
    have.update(rc.apt_packages(apt))
    assert rc.for_ci([apt, venv]) == [venv]
    assert rc.apt_packages(venv) == []
    assert rc.apt_packages("sudo apt-get update && sudo apt-get install -y --no-install-recommends a b") == [
        "a",
        "b",
    ]
    assert "chromium-driver" in rc.apt_packages(apt) and "sh" not in rc.apt_packages(apt)


# --- the needs_tool marker (tests/helpers/system.py), run by a tiny suite with tests/conftest.py's wiring

MISSING, PRESENT = "llamagate-no-such-tool", "llamagate-test-tool"
TINY_SUITE = f"""
import pytest

from tests.helpers.system import require_tool


@pytest.fixture
def started():
    raise AssertionError("a fixture ran before the tool check")


@pytest.mark.needs_tool({MISSING!r})
def test_missing(started):
    pass


@pytest.mark.needs_tool({PRESENT!r})
def test_present():
    assert require_tool({PRESENT!r}).endswith("/{PRESENT}")


def test_undeclared():
    require_tool({PRESENT!r})


@pytest.mark.needs_tool("llamagate-" + "unknown")
def test_unknown():
    pass
"""


@pytest.fixture
def tiny_suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.Pytester:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, PRESENT, "exit 0\n")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(system, "_EXTRA_DIRS", ())
    monkeypatch.setattr(system, "_POSTGRESQL_LIB", tmp_path / "no-postgresql")
    monkeypatch.setitem(TOOL_PACKAGES, MISSING, "llamagate-missing-package")
    monkeypatch.setitem(TOOL_PACKAGES, PRESENT, "llamagate-present-package")
    # The suite's own conftest.py is tests/conftest.py, so the marker runs as wired there.
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    needs_tool: needs a system tool\n"
    )
    pytester.makepyfile(test_tiny=TINY_SUITE)
    return pytester


def test_a_missing_tool_skips_naming_its_package(
    tiny_suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    result = tiny_suite.runpytest("-rA")
    result.assert_outcomes(passed=1, skipped=1, failed=1, errors=1)
    for lines in (
        [f"SKIPPED * {MISSING} not found: install the Debian package 'llamagate-missing-package'*"],
        ["PASSED test_tiny.py::test_present"],
        ["*ERROR at setup of test_unknown*", "needs_tool('llamagate-unknown'): unknown tool; add it*"],
        ["*_ test_undeclared _*", f"this test runs {PRESENT} without declaring it: mark it*"],
    ):
        result.stdout.fnmatch_lines(lines)
    result.stdout.no_fnmatch_line("*a fixture ran before the tool check*")


def test_a_missing_tool_fails_under_ci(tiny_suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    result = tiny_suite.runpytest("-rA")
    result.assert_outcomes(passed=1, failed=1, errors=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_missing*",
            f"{MISSING} not found*; CI=true, so a missing tool is a failure*",
        ]
    )
    result.stdout.no_fnmatch_line("*a fixture ran before the tool check*")


def test_tools_outside_a_users_path_are_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """nginx is in /usr/sbin, which a non-root user's PATH often lacks; PostgreSQL's are on no PATH."""
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    _stub(sbin, "nginx", "")
    lib = tmp_path / "postgresql"
    for version in ("9.6", "15", "13"):
        (lib / version / "bin").mkdir(parents=True)
        _stub(lib / version / "bin", "initdb", "")
    (lib / "15" / "bin" / "pg_ctl").write_text("not executable")
    monkeypatch.setattr(system, "_EXTRA_DIRS", (str(sbin),))
    monkeypatch.setattr(system, "_POSTGRESQL_LIB", lib)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert system.find_tool("nginx") == str(sbin / "nginx")
    assert system.find_tool("initdb") == str(lib / "15" / "bin" / "initdb")  # the newest version
    assert system.find_tool("pg_ctl") is None
    assert system.find_tool("no-such-tool") is None


@pytest.mark.parametrize("tool", ["redis-server", "initdb", "postgres", "pg_ctl"])
def test_the_tools_of_the_next_tests_have_their_packages(tool: str) -> None:
    assert TOOL_PACKAGES[tool] == {"redis-server": "redis-server"}.get(tool, "postgresql")
