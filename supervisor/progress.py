"""Progress for long steps (download, compile): a live line on a terminal, sparse lines otherwise.

A 5-minute build must never be silent. On a TTY the line is rewritten in place; in CI or under
systemd (no TTY) a line is printed each time the percentage crosses a 10% step, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO


class Progress(Protocol):
    def update(self, stage: str, fraction: float | None, detail: str = "") -> None: ...
    def done(self, stage: str, detail: str = "") -> None: ...


class NullProgress:
    def update(self, stage: str, fraction: float | None, detail: str = "") -> None:
        return None

    def done(self, stage: str, detail: str = "") -> None:
        return None


class ConsoleProgress:
    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty() if tty is None else tty
        self._last_step: dict[str, int] = {}
        self._last_tty_write = 0.0

    def update(self, stage: str, fraction: float | None, detail: str = "") -> None:
        pct = "" if fraction is None else f"{max(0.0, min(1.0, fraction)) * 100:5.1f}% "
        line = f"{stage}: {pct}{detail}".rstrip()
        if self._tty:
            now = time.monotonic()
            # Rewriting the line more than ~10 times a second only burns CPU.
            if now - self._last_tty_write < 0.1:
                return
            self._last_tty_write = now
            self._stream.write("\r\x1b[2K" + line[:200])
            self._stream.flush()
            return
        step = -1 if fraction is None else int(fraction * 10)
        if self._last_step.get(stage) == step:
            return
        self._last_step[stage] = step
        self._stream.write(line + "\n")
        self._stream.flush()

    def done(self, stage: str, detail: str = "") -> None:
        line = f"{stage}: done {detail}".rstrip()
        self._stream.write(("\r\x1b[2K" if self._tty else "") + line + "\n")
        self._stream.flush()
        self._last_step.pop(stage, None)
