"""Print the commands of one README.md code block, so CI runs exactly what the README shows.

    python3 .ci/readme_commands.py setup|serve|test [--ci]

A block is chosen by the marker line ``<!-- ci: NAME -->`` right above its fence. ``--ci`` skips an
``apt-get install`` line whose packages are all installed already (no package-list download on every
run) and, when run as root (as CI is, where sudo may not even be installed), drops ``sudo ``;
everything else is printed verbatim, one command per line, for ``bash -e`` to run.
tests/unit/test_readme_ci.py fails when README.md and .ci/run stop agreeing. Standard library only:
it runs before the virtual environment exists.
"""

from __future__ import annotations

import os
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


def apt_packages(command: str) -> list[str]:
    """The packages of an ``apt-get install`` command (options dropped), or [] for any other command."""
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:1] == ["sudo"]:
            words = words[1:]
        if words[:2] == ["apt-get", "install"]:
            return [w for w in words[2:] if not w.startswith("-")]
    return []


def installed(package: str) -> bool:
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
    )
    return out.returncode == 0 and out.stdout.endswith(" installed")


def for_ci(commands: list[str], *, root: bool) -> list[str]:
    out = []
    for command in commands:
        packages = apt_packages(command)
        if packages and all(installed(p) for p in packages):
            print(f"ci: already installed: {' '.join(packages)}", file=sys.stderr)
            continue
        out.append(re.sub(r"(^|&&\s*)sudo ", r"\1", command) if root else command)
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
        commands = for_ci(commands, root=os.geteuid() == 0)
    print("\n".join(commands))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
