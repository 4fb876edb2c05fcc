"""Run a long external command (pip, cmake) with its output streamed line by line.

The command stays in OUR process group on purpose: a signal aimed at the group (Ctrl-C on a terminal,
``timeout``, a CI runner cancelling a job) then reaches cmake, make and every compiler too, even when
this process dies without running any cleanup. When we stop the command ourselves (an exception, or
KeyboardInterrupt from the CLI's SIGTERM handler) the whole tree is killed, compilers included:
otherwise an interrupted build leaves cc1plus processes eating the CPU for minutes.
"""

from __future__ import annotations

import collections
import contextlib
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil


@dataclass(frozen=True)
class RunResult:
    returncode: int
    tail: tuple[str, ...]  # the last lines of combined stdout+stderr


def run_streaming(
    argv: Sequence[str | Path],
    *,
    on_line: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    log_path: Path | None = None,
    tail_lines: int = 40,
    popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
) -> RunResult:
    """``popen``: ``child.spawn.popen_tied`` for one binary the kernel must kill when this process
    dies, even by SIGKILL (llama-quantize). Not for cmake, whose compilers are grandchildren that the
    tie would not reach: they stay in our process group instead (above)."""
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    log_fh = log_path.open("a", encoding="utf-8", buffering=1) if log_path is not None else None
    try:
        with popen(
            [str(a) for a in argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            text=True,
            errors="replace",
            bufsize=1,
        ) as proc:
            try:
                assert proc.stdout is not None
                for raw in proc.stdout:
                    line = raw.rstrip("\r\n")
                    tail.append(line)
                    if log_fh is not None:
                        log_fh.write(line + "\n")
                    if on_line is not None:
                        on_line(line)
                returncode = proc.wait()
            except BaseException:
                kill_tree(proc.pid)
                proc.wait()
                raise
    finally:
        if log_fh is not None:
            log_fh.close()
    return RunResult(returncode=returncode, tail=tuple(tail))


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants, top down: once make is dead it spawns no new compiler."""
    try:
        root = psutil.Process(pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    psutil.wait_procs(victims[1:], timeout=5)
