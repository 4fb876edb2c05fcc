"""The ``llamagate`` command. One module per subcommand under ``supervisor.commands``.

Exit codes (documented in the README and docs/operations.md):
  0    ok
  1    a check failed (verification, readiness, build), or a crash
  2    usage or configuration error (also one found at start: a model file missing, a wrong sha256,
       a memory budget that does not fit)
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from supervisor import __version__
from supervisor.errors import LlamagateError

# Each module exposes ``register(subparsers)`` and sets ``func`` (args -> exit status) on its parser.
COMMAND_MODULES = (
    "build",
    "verify",
    "model",
    "config",
    "plan",
    "serve",
    "status",
    "models",
    "requests",
    "keys",
    "usage",
    "bench",
)

Handler = Callable[[argparse.Namespace], int]

log = logging.getLogger("llamagate.cli")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _QuietPipe:
    """stdout that ends quietly when its reader has gone (``llamagate plan --json | head -1``).

    The first write or flush that meets a closed pipe points file descriptor 1 at /dev/null, so what
    follows (and Python's flush at exit) is dropped instead of raising BrokenPipeError. The command
    then finishes and returns its own exit status: ``status | head -1`` still says ready or not.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


# Global options that take a value; needed to find the subcommand's name before parsing.
_VALUED_GLOBALS = frozenset({"--log-format", "--log-level"})


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, if any. Importing only its module keeps start-up
    short: every command module together costs ~0.5 s of imports, which `serve` would pay on each
    (re)start and `status` on each health check."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _VALUED_GLOBALS:
            skip = True
            continue
        if arg.startswith("-"):
            continue
        return arg if arg in COMMAND_MODULES else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamagate",
        description="Supervisor and admission-controlled proxy for a pinned llama.cpp llama-server.",
    )
    parser.add_argument("--version", action="version", version=f"llamagate {__version__}")
    parser.add_argument("--log-format", choices=("text", "json"), default="text", help="log line format")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=None,
        help="log level: DEBUG, INFO (default), WARNING or ERROR; wins over the config's",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (only,) if only else COMMAND_MODULES:
        try:
            module = importlib.import_module(f"supervisor.commands.{name}")
        except ModuleNotFoundError as exc:
            # Only tolerate the command module itself being absent (work in progress), never a
            # missing dependency inside it.
            if exc.name != f"supervisor.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_chosen_command(args_list))
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code) if isinstance(exc.code, int) else 2
    from supervisor import logs

    logs.setup(args.log_format, args.log_level or "INFO")
    func: Handler | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    stdout = sys.stdout
    quiet = _QuietPipe(stdout) if stdout is not None else None  # None: no stdout at all (pythonw)
    if quiet is not None:
        sys.stdout = quiet
    try:
        return func(args)
    except LlamagateError as exc:
        print(f"llamagate: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("llamagate: interrupted", file=sys.stderr)
        return 130
    finally:
        if quiet is not None:
            quiet.flush()  # what is still buffered meets a closed pipe here, not at exit
            sys.stdout = stdout


if __name__ == "__main__":
    raise SystemExit(main())
