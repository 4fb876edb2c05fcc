"""System tools some tests drive (Debian packages the README's setup line installs), and the marker for them.

A test that needs one says so with ``@pytest.mark.needs_tool("nginx", ...)`` (on the test, or in its
module's ``pytestmark``) and gets the tool's path from ``require_tool("nginx")``. The marker is checked
before any of the test's fixtures is set up (``pytest_runtest_setup`` below, wired in by tests/conftest.py),
so a fixture that would start the tool never runs without it:

- a missing tool skips the test with the Debian package to install, so a newcomer who has not run the
  README's apt-get line sees why;
- under ``CI=true`` (``.ci/run``) a missing tool is a failure instead: CI installs every one of them, and
  a skipped check there would pass while proving nothing.

``require_tool`` refuses a tool the running test did not declare, so the marker stays the one place that
says what a test needs (and tests/unit/test_readme_ci.py checks that the README's apt-get line installs
the package of every tool a marker names).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

# tool -> the Debian package that brings it. A marker may name only these, so that every skip names the
# right package.
TOOL_PACKAGES: dict[str, str] = {
    "promtool": "prometheus",
    "prometheus": "prometheus",
    "systemd-analyze": "systemd",
    "nginx": "nginx",
    # nginx's JavaScript module (njs), which the shipped nginx file's conversation hash needs: a file.
    "nginx-js": "libnginx-mod-http-js",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
    "redis-server": "redis-server",
    # PostgreSQL's own programs; Debian keeps them in /usr/lib/postgresql/VERSION/bin, off every PATH.
    "initdb": "postgresql",
    "postgres": "postgresql",
    "pg_ctl": "postgresql",
    "pg_isready": "postgresql",
    "psql": "postgresql",
    # The build applies a lock's source patches with it; build-essential brings it (through dpkg-dev).
    "patch": "build-essential",
}

# nginx lives in /usr/sbin, which a non-root user's PATH often lacks.
_EXTRA_DIRS: tuple[str, ...] = ("/usr/sbin", "/sbin")
_POSTGRESQL_LIB = Path("/usr/lib/postgresql")

# The tools the running test declared; set before its fixtures (see pytest_runtest_setup).
_declared: frozenset[str] = frozenset()


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _postgresql_dirs() -> list[str]:
    """/usr/lib/postgresql/VERSION/bin, newest version first (Debian installs one per major version)."""
    if not _POSTGRESQL_LIB.is_dir():
        return []
    versions = [p for p in _POSTGRESQL_LIB.iterdir() if re.fullmatch(r"\d+(\.\d+)?", p.name)]
    versions.sort(key=lambda p: tuple(int(x) for x in p.name.split(".")), reverse=True)
    return [str(p / "bin") for p in versions if (p / "bin").is_dir()]


# Tools that are files rather than programs, where Debian installs them.
_FILES = {"nginx-js": Path("/usr/lib/nginx/modules/ngx_http_js_module.so")}


def find_tool(name: str) -> str | None:
    """The tool's path on PATH, else where Debian puts it off a user's PATH; None when it is missing."""
    if name in _FILES:
        return str(_FILES[name]) if _FILES[name].exists() else None
    path = os.environ.get("PATH", "")
    return shutil.which(name, path=os.pathsep.join([path, *_EXTRA_DIRS, *_postgresql_dirs()]))


def check_tool(name: str) -> str:
    """The tool's path; skips the test when it is missing (fails it under CI=true)."""
    if name not in TOOL_PACKAGES:
        pytest.fail(
            f"needs_tool({name!r}): unknown tool; add it with its Debian package to TOOL_PACKAGES "
            "in tests/helpers/system.py (and the package to the README's apt-get line)",
            pytrace=False,
        )
    found = find_tool(name)
    if found is not None:
        return found
    package = TOOL_PACKAGES[name]
    message = f"{name} not found: install the Debian package '{package}' (the README's setup line does)"
    if in_ci():
        pytest.fail(f"{message}; CI=true, so a missing tool is a failure, not a skip", pytrace=False)
    pytest.skip(message)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.needs_tool("nginx", ...)``: checked before the test's fixtures are set up."""
    global _declared
    names = [name for marker in item.iter_markers("needs_tool") for name in marker.args]
    _declared = frozenset(names)
    for name in names:
        check_tool(name)


def require_tool(name: str) -> str:
    """The path of a tool the running test declared with ``needs_tool``."""
    if name not in _declared:
        pytest.fail(
            f"this test runs {name} without declaring it: mark it @pytest.mark.needs_tool({name!r}) "
            "(on the test or in the module's pytestmark), so that a missing tool skips it locally "
            "and fails it under CI=true",
            pytrace=False,
        )
    return check_tool(name)
