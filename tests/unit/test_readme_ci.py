"""README.md's quick start and .ci/run cannot drift apart: CI runs the README's own blocks.

.ci/readme_commands.py takes the blocks marked ``<!-- ci: setup -->``, ``serve`` and ``test`` out of
the README; .ci/run runs the setup block first and the test block last. These tests fail when the
README loses a block, when .ci/run runs anything of its own before the README's setup (a pip upgrade
hid the pip 23 failure once), or when the apt-get line misses a package a test needs.
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
from tests.helpers.system import TOOL_PACKAGES, require_tool

REPO = Path(__file__).resolve().parents[2]
CI_RUN = REPO / ".ci" / "run"
EXTRACTOR = REPO / ".ci" / "readme_commands.py"


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


def test_the_readme_has_the_three_quick_start_blocks(readme: dict[str, list[str]]) -> None:
    assert set(readme) == {"setup", "serve", "test"}
    apt, venv = readme["setup"]
    assert apt.startswith("sudo apt-get update && sudo apt-get install -y ")
    # The venv is made the way a newcomer makes it, with the pip it brings: no upgrade step.
    assert venv == "python3 -m venv .venv && .venv/bin/pip install -e '.[test]'"
    assert readme["serve"] == [".venv/bin/llamagate serve"]
    assert readme["test"] == [".venv/bin/python -m pytest"]


def test_the_apt_line_installs_every_package_a_test_needs(readme: dict[str, list[str]]) -> None:
    packages = set(rc.apt_packages(readme["setup"][0]))
    needed = {"build-essential", "cmake", "python3-venv", *TOOL_PACKAGES.values()}
    assert needed <= packages, f"missing from the README's apt-get line: {sorted(needed - packages)}"


def test_ci_runs_the_readme_setup_first_and_its_test_command_last() -> None:
    lines = _ci_lines()
    run_setup = next(i for i, line in enumerate(lines) if re.search(r'bash .*-c "\$setup"$', line))
    before = lines[:run_setup]
    # Before the README's setup: only the shell's own settings, extracting the blocks, and echoing them.
    allowed = re.compile(
        r'^(set -euo pipefail|cd "\$\(dirname "\$0"\)/\.\."|echo .*|printf .*'
        r"|setup=\$\(python3 \.ci/readme_commands\.py setup --ci\)"
        r"|test_command=\$\(python3 \.ci/readme_commands\.py test --ci\))$"
    )
    assert [line for line in before if not allowed.match(line)] == []
    assert "setup=$(python3 .ci/readme_commands.py setup --ci)" in before
    assert lines[-1] == 'CI=true bash -euo pipefail -c "$test_command"'
    text = CI_RUN.read_text()
    assert not re.search(r"pip[^\n]*(--upgrade|-U)\s+pip", text), "CI must use the pip the venv brings"
    assert "python3 -m venv" not in "\n".join(lines), "the README's setup makes the venv"


def test_the_extractor_prints_the_blocks_verbatim(readme: dict[str, list[str]]) -> None:
    for name in ("setup", "serve", "test"):
        out = subprocess.run(
            [sys.executable, str(EXTRACTOR), name], capture_output=True, text=True, check=True
        )
        assert out.stdout.splitlines() == readme[name]
    bad = subprocess.run([sys.executable, str(EXTRACTOR), "deploy"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_for_ci_drops_sudo_only_as_root_and_skips_apt_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    apt = "sudo apt-get update && sudo apt-get install -y --no-install-recommends cmake nginx"
    venv = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]'"
    have: set[str] = {"cmake"}
    monkeypatch.setattr(rc, "installed", lambda package: package in have)
    assert rc.for_ci([apt, venv], root=True) == [
        "apt-get update && apt-get install -y --no-install-recommends cmake nginx",
        venv,
    ]
    assert rc.for_ci([apt, venv], root=False) == [apt, venv]
    have.add("nginx")
    assert rc.for_ci([apt, venv], root=True) == [venv]
    assert rc.apt_packages(venv) == []


def test_a_missing_tool_skips_with_its_package_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system, "find_tool", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(
        pytest.skip.Exception, match="promtool not found: install the Debian package 'prometheus'"
    ):
        require_tool("promtool")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true, so a missing tool is a failure"):
        require_tool("promtool")


def test_tools_outside_a_users_path_are_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """nginx is in /usr/sbin, which a non-root user's PATH often lacks."""
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (sbin / "nginx").write_text("#!/bin/sh\n")
    (sbin / "nginx").chmod(0o755)
    monkeypatch.setattr(system, "_EXTRA_DIRS", (str(sbin),))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert system.find_tool("nginx") == str(sbin / "nginx")
    assert system.find_tool("no-such-tool") is None
