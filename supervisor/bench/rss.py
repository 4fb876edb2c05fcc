"""A process's resident memory, sampled on a thread while a measured run goes on (its peak under load),
and its CPU time (what a measured piece of work cost it, whatever else the host was running).

Read from ``/proc/PID/status`` (VmRSS, RssAnon, RssFile, RssShmem, in kB), which splits the resident
memory into what the budget's parts become: the mapped model file is file-backed pages (``RssFile``),
the KV cache, compute buffers and the prompt cache are anonymous (``RssAnon``). One read costs a few
microseconds; every 0.2 s is enough for a child whose memory moves with the requests it holds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


@dataclass(frozen=True)
class Resident:
    rss: int
    anon: int
    file: int
    shmem: int

    def to_dict(self) -> dict[str, int]:
        return {
            "rss_bytes": self.rss,
            "anon_bytes": self.anon,
            "file_bytes": self.file,
            "shmem_bytes": self.shmem,
        }


def resident(pid: int) -> Resident | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in _FIELDS:
            found[_FIELDS[key]] = int(value.split()[0]) * 1024
    if "rss" not in found:
        return None  # a zombie has no memory lines
    return Resident(found["rss"], found.get("anon", 0), found.get("file", 0), found.get("shmem", 0))


class PeakSampler:
    """``with PeakSampler(pid) as s: run()``; then ``s.peak`` (the sample with the largest RSS)."""

    def __init__(self, pid: int | None, interval_s: float = 0.2) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak: Resident | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        if self.pid is None:
            return
        now = resident(self.pid)
        if now is None:
            return
        self.samples += 1
        if self.peak is None or now.rss > self.peak.rss:
            self.peak = now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds ``pid`` has used so far (10 ms resolution), None once it is gone."""
    if pid is None:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)
