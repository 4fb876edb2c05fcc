"""The supervisor's exception tree; the CLI maps it to exit codes at one boundary (``cli.main``).

    LlamagateError                 exit 2 unless a subclass says otherwise
    ├── UsageError                 exit 2  bad command line
    ├── ConfigError                exit 2  bad config file; carries every problem found, by path
    ├── LockError                  exit 2  malformed llama-build.lock; names the field
    ├── Misconfigured              exit 2  a valid config naming what this host lacks or cannot hold
    ├── ToolMissing                exit 1  compiler / cmake / pip not installed; says what to install
    ├── CheckFailed                exit 1  a verification failed; says expected versus found
    │   ├── DigestMismatch                 sha256 of a file is not the pinned one
    │   └── NotAGguf                       a model file without the GGUF magic
    ├── FetchError                 exit 1  no source could be fetched
    ├── BuildError                 exit 1  cmake failed; carries the tail of its log
    └── StartupError               exit 1  the child could not be brought to READY

Library code raises; only ``cli.main`` turns an error into a message and an exit status.
"""

from __future__ import annotations

from collections.abc import Sequence


class LlamagateError(Exception):
    exit_code: int = 2


class UsageError(LlamagateError):
    exit_code = 2


class ConfigError(LlamagateError):
    """A configuration that does not validate. ``problems`` holds one ``path: message`` per bad field."""

    exit_code = 2

    def __init__(self, problems: Sequence[str], source: str = "config") -> None:
        self.problems = tuple(problems)
        self.source = source
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


class LockError(LlamagateError):
    exit_code = 2


class Misconfigured(LlamagateError):
    """The configuration parses, but names what is not there or does not fit: a model file missing,
    not a GGUF or with another sha256, a binary missing, a memory budget that does not fit. Found at
    start, before anything runs; retrying cannot help, so it exits 2 (the systemd unit's
    ``RestartPreventExitStatus=2`` then stops retrying) where a crash exits 1."""

    exit_code = 2


class ToolMissing(LlamagateError):
    exit_code = 1


class CheckFailed(LlamagateError):
    exit_code = 1


class DigestMismatch(CheckFailed):
    def __init__(self, what: str, expected: str, found: str) -> None:
        self.what = what
        self.expected = expected
        self.found = found
        super().__init__(f"{what}: sha256 mismatch: expected {expected}, found {found}")


class NotAGguf(CheckFailed):
    pass


class FetchError(LlamagateError):
    exit_code = 1


class BuildError(LlamagateError):
    exit_code = 1


class StartupError(LlamagateError):
    exit_code = 1
