"""How far a child's model load has come and how long it should take, for its snapshot (/readyz, the page).

One load (spawn to READY) goes from 0 to 1 and never back:

    0 .. READ_SHARE   while /health answers 503: the share of the model file the child has brought in
                      (``ChildHandle.loaded_bytes()`` against the file's size; spawn.py says which
                      signal that is and why)
    READ_SHARE        /health answered 200: the model is loaded; the gate checks /v1/models
    DECODE_AT         /v1/models is right; the gate decodes one token
    1.0               READY

The time a load takes is remembered per model file (path, size and mtime: a replaced or rewritten file
is a new file) in ``LoadTimes``, so the next load of the same file has an estimate: its remaining time
is ``max(estimate - elapsed, estimate * (1 - progress))``, the larger of "as long as last time" and "the
share still to do", so a load slower than last time never shows 0 s while it is not done.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger("llamagate.supervisor")

# Measured with the pinned llama-server and the demo model (250 MB, 2 cores): the file is mapped by
# ~0.85 s after spawn, /health answers 200 at ~0.95 s and the gate's two checks take tens of ms; the
# reading is most of a load, the rest is small and has no signal of its own.
READ_SHARE = 0.9
DECODE_AT = 0.95
# While loading, how often the child's figures are read (two small /proc files).
LOAD_SAMPLE_S = 0.25
# Files remembered on disk; older entries are dropped first.
MAX_REMEMBERED = 64

Step = Literal["health", "models", "decode"]


@dataclass(frozen=True)
class FileStamp:
    """A model file as the estimate knows it: the same path, size and mtime is the same file."""

    path: str
    size: int
    mtime_ns: int


@dataclass
class LoadProgress:
    """One load of one child. ``observe`` and ``enter`` only ever move it forward."""

    started_at: float
    stamp: FileStamp | None
    estimate_s: float | None
    step: Step = "health"
    last_sample_at: float | None = None
    read_share: float = 0.0  # the highest share of the file seen, 0..1

    def observe(self, loaded_bytes: int | None, now: float) -> None:
        """A sample of the child's loaded bytes. Pages of a mapped file can be evicted and counted
        again, so a sample lower than an earlier one is ignored: progress never goes back."""
        self.last_sample_at = now
        size = self.stamp.size if self.stamp is not None else 0
        if loaded_bytes is None or size <= 0 or self.step != "health":
            return
        self.read_share = max(self.read_share, min(1.0, loaded_bytes / size))

    def due(self, now: float) -> bool:
        return self.last_sample_at is None or now - self.last_sample_at >= LOAD_SAMPLE_S

    def enter(self, step: Step) -> None:
        """The readiness gate reached ``step``; past "health" the file is loaded, whatever was sampled."""
        order: tuple[Step, ...] = ("health", "models", "decode")
        if order.index(step) > order.index(self.step):
            self.step = step
            self.read_share = 1.0

    @property
    def fraction(self) -> float:
        if self.step == "decode":
            return DECODE_AT
        if self.step == "models":
            return READ_SHARE
        return READ_SHARE * self.read_share

    def eta_s(self, now: float) -> float | None:
        """Seconds until READY, from the previous load of the same file; None without one."""
        if self.estimate_s is None:
            return None
        elapsed = max(0.0, now - self.started_at)
        return max(self.estimate_s - elapsed, self.estimate_s * (1.0 - self.fraction))


class LoadTimes:
    """Seconds from spawn to READY of the last load of each model file, in memory and, with ``path``,
    in a small JSON file (a daemon restart keeps its estimates). Writing it is an optimisation: a
    read-only or full disk is logged once and otherwise ignored."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._entries: dict[str, dict[str, int | float]] | None = None
        self._warned = False

    def get(self, stamp: FileStamp | None) -> float | None:
        if stamp is None:
            return None
        entry = self._load().get(stamp.path)
        if entry is None or (entry.get("size"), entry.get("mtime_ns")) != (stamp.size, stamp.mtime_ns):
            return None
        seconds = entry.get("load_s")
        return float(seconds) if isinstance(seconds, int | float) and seconds >= 0 else None

    def put(self, stamp: FileStamp | None, seconds: float) -> None:
        if stamp is None:
            return
        entries = self._load()
        entries.pop(stamp.path, None)  # re-inserted last: the newest
        entries[stamp.path] = {"size": stamp.size, "mtime_ns": stamp.mtime_ns, "load_s": round(seconds, 3)}
        while len(entries) > MAX_REMEMBERED:
            del entries[next(iter(entries))]
        self._save(entries)

    def _load(self) -> dict[str, dict[str, int | float]]:
        if self._entries is None:
            self._entries = {}
            if self.path is not None:
                try:
                    data = json.loads(self.path.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    data = {}
                if isinstance(data, dict):
                    self._entries = {k: v for k, v in data.items() if isinstance(v, dict)}
        return self._entries

    def _save(self, entries: dict[str, dict[str, int | float]]) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(entries, fh, indent=1, sort_keys=True)
                Path(tmp).replace(self.path)  # readers see the old file or the new one, never half of one
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot remember load times on disk; estimates last until the daemon stops",
                    extra={"fields": {"path": str(self.path), "error": str(exc)}},
                )
