"""The one seam between the supervisor and the operating system, and between it and the child's HTTP.

The driver (``driver.ChildSupervisor``) only talks to a ``ChildOs`` (spawn, ports, clock) and the
``ChildHandle`` it returns (signal, wait, output, resource figures), and to ``Probes`` for HTTP.
``spawn.RealOs`` / ``gate.HttpProbes`` are the real implementations; unit tests pass fakes and run
the whole supervisor with no process, no socket and no sleep.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from proxy.source import ModelInputs
from supervisor.child.loading import FileStamp
from supervisor.child.probes import ServedModel

__all__ = [
    "ChildHandle",
    "ChildOs",
    "ProbeUnreachable",
    "ProbeWrongAnswer",
    "Probes",
    "ServedModel",
    "describe_exit",
]


class ChildHandle(Protocol):
    @property
    def pid(self) -> int: ...

    def send_signal(self, sig: int) -> None:
        """Signal the child; a child that is already gone is not an error."""
        ...

    async def wait(self) -> int:
        """Return code once the child has exited and been reaped (negative: killed by that signal)."""
        ...

    def output(self) -> AsyncIterator[bytes]:
        """The child's stdout and stderr, merged, as chunks until EOF."""
        ...

    def progress_sample(self) -> tuple[float, int] | None:
        """(CPU seconds, bytes read from storage) so far; None if unknown."""
        ...

    def loaded_bytes(self) -> int | None:
        """Bytes of its model file the child has brought into memory so far (mapped or read); None if
        unknown. Only compared against the file's size while it loads (``loading.LoadProgress``)."""
        ...

    def rss_bytes(self) -> int | None: ...

    def cpu_seconds(self) -> float | None: ...


class ChildOs(Protocol):
    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> ChildHandle: ...

    def free_port(self) -> int: ...

    def port_open(self, port: int) -> bool: ...

    def now(self) -> float: ...

    def file_stamp(self, path: Path) -> FileStamp | None:
        """The model file's resolved path, size and mtime; None when it cannot be read."""
        ...


class Probes(Protocol):
    async def health(self, base_url: str, timeout_s: float) -> int:
        """HTTP status of GET /health; raises OSError-like ``ProbeUnreachable`` when nothing answers."""
        ...

    async def loop(self, base_url: str, secret: str, deadline_s: float) -> bool:
        """Whether llama-server's server loop answered a task through its queue (``GET /slots``) within
        ``deadline_s``; False when it did not (held, or nothing listens). Never raises for a miss."""
        ...

    async def models(self, base_url: str, secret: str) -> list[ServedModel]: ...

    async def one_token(self, base_url: str, secret: str) -> None: ...

    async def inputs(self, base_url: str, secret: str) -> ModelInputs | None:
        """What the loaded model takes beside text (media, FIM); None when the child does not say."""
        ...

    async def aclose(self) -> None: ...


class ProbeUnreachable(Exception):
    """Nothing answered (connection refused, reset, timeout): 'not up yet' or 'hung'."""


class ProbeWrongAnswer(Exception):
    """Something answered, but not what a healthy llama-server answers."""


_WHY = {
    signal.SIGILL: " (illegal instruction: the binary uses CPU instructions this machine does not allow;"
    " a GGML_NATIVE=ON build does that on some VMs)",
    signal.SIGSEGV: " (segmentation fault)",
}


def describe_exit(returncode: int, *, we_killed: bool) -> str:
    """How the child died, in words an operator can act on."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    sig = -returncode
    try:
        known = signal.Signals(sig)
    except ValueError:
        return f"killed by signal {sig}"
    if known is signal.SIGKILL and not we_killed:
        # Nobody in llamagate sent it: the kernel's OOM killer is the usual culprit, or an operator.
        return "killed by SIGKILL from outside (out of memory?)"
    return f"killed by {known.name}{_WHY.get(known, '')}"
