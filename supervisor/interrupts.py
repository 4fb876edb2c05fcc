"""SIGTERM handled like Ctrl-C by commands that run for long and own other processes.

A ``timeout`` around a command, a CI runner cancelling a job, or ``kill PID`` sends SIGTERM; Python's
default for it is to die at once, skipping every ``finally``: the llama-servers, daemons or compilers
the command started are then ended only by their parent-death signal, and their folders stay behind.
Raised as KeyboardInterrupt instead, the command unwinds exactly as after Ctrl-C (each launcher's
``finally`` stops what it started) and the CLI exits 130, as after Ctrl-C.
"""

from __future__ import annotations

import argparse
import functools
import signal
from collections.abc import Callable
from types import FrameType

Handler = Callable[[argparse.Namespace], int]


def _raise(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def sigterm_as_interrupt() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread (call it from there)."""
    signal.signal(signal.SIGTERM, _raise)


def interruptible(command: Handler) -> Handler:
    """``command`` with SIGTERM raising KeyboardInterrupt while it runs; the previous handler after."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        previous = signal.signal(signal.SIGTERM, _raise)
        try:
            return command(args)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return run
