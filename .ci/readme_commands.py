"""Print the commands of one README.md code block, so CI runs exactly what the README shows.

    python3 .ci/readme_commands.py setup|serve|test [--ci]

A block is chosen by the marker line ``<!-- ci: NAME -->`` right above its fence. ``--ci`` skips an
``apt-get install`` line whose packages are all installed already (no package-list download on every
run); everything else is printed verbatim, one command per line, for ``bash -e`` to run. The setup
line needs no rewriting for root: it runs apt-get through ``sudo`` only when not root, so it works as
written where sudo is not even installed (a fresh VM or container image).
tests/unit/test_readme_ci.py fails when README.md and .ci/run stop agreeing. Standard library only:
it runs before the virtual environment exists.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^<!-- ci: (?P<name>[a-z]+) -->\n```(?:sh|bash)\n(?P<body>.*?)^```", re.M | re.S)


def blocks(text: str) -> dict[str, list[str]]:
    """Marker name -> the command lines of its block (comments and blank lines dropped)."""
    out: dict[str, list[str]] = {}
    for m in _BLOCK.finditer(text):
        if m.group("name") in out:
            raise SystemExit(f"README.md: marker ci: {m.group('name')} appears twice")
        lines = [line.strip() for line in m.group("body").splitlines()]
        out[m.group("name")] = [line for line in lines if line and not line.startswith("#")]
    return out


# The words after ``apt-get install`` up to the end of that command (a quote, ``&&``, ``;`` or ``|``).
_APT_INSTALL = re.compile(r"\bapt-get install\s+(?P<words>[^'\"&;|]*)")


def apt_packages(command: str) -> list[str]:
    """The packages of an ``apt-get install`` command (options dropped), or [] for any other command."""
    m = _APT_INSTALL.search(command)
    return [] if m is None else [w for w in shlex.split(m.group("words")) if not w.startswith("-")]


def installed(package: str) -> bool:
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
    )
    return out.returncode == 0 and out.stdout.endswith(" installed")


def for_ci(commands: list[str]) -> list[str]:
    out = []
    for command in commands:
        packages = apt_packages(command)
        if packages and all(installed(p) for p in packages):
            print(f"ci: already installed: {' '.join(packages)}", file=sys.stderr)
            continue
        out.append(command)
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("setup", "serve", "test"):
        print("usage: readme_commands.py setup|serve|test [--ci]", file=sys.stderr)
        return 2
    found = blocks(README.read_text(encoding="utf-8"))
    if argv[0] not in found:
        print(f"README.md has no block marked <!-- ci: {argv[0]} -->", file=sys.stderr)
        return 2
    commands = found[argv[0]]
    if "--ci" in argv[1:]:
        commands = for_ci(commands)
    print("\n".join(commands))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
