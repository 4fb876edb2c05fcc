"""How a benchmark here runs: ``python -m tests.benchmarks.NAME [options]``, as a ``llamagate`` command does.

Logs go to stderr, SIGTERM is handled as Ctrl-C (the benchmark's ``finally`` blocks stop what it started,
then exit 130), and a ``LlamagateError`` is printed and its exit status returned (2: bad usage).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from supervisor import logs
from supervisor.errors import LlamagateError
from supervisor.interrupts import interruptible

REPO = Path(__file__).resolve().parents[2]

Handler = Callable[[argparse.Namespace], int]


def command_line(name: str) -> str:
    """This run's command as a reader would type it (recorded beside the results)."""
    return shlex.join(["python", "-m", f"tests.benchmarks.{name}", *sys.argv[1:]])


def python_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for ``python -m tests...`` children: this checkout first on the import path, so a
    benchmark started from another folder still finds its own fake and proxy."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO), **(extra or {})}


def run(
    name: str,
    description: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    handle: Handler,
    argv: Sequence[str] | None = None,
) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m tests.benchmarks.{name}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code) if isinstance(exc.code, int) else 2
    logs.setup("text", "INFO")
    try:
        return interruptible(handle)(args)
    except LlamagateError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
