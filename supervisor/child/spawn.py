"""The real OS side of the seam: spawning llama-server so that it can never outlive the daemon.

Three things keep the child tied to us:
- ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` in the child between fork and exec: when the daemon dies, even
  by SIGKILL, the kernel kills the child. PDEATHSIG fires when the *thread* that forked exits, so
  spawning happens on the event loop's thread (asyncio forks in the calling thread), never in a worker
  thread that could end while the daemon lives. A parent that died before prctl ran is caught by
  comparing getppid() with the pid we expect.
- its own process group: Ctrl-C in a terminal sends SIGINT to the whole foreground group; the child
  must not get it behind the daemon's back (the daemon drains first, then decides how it stops).
- the child is reaped by awaiting it, so its exit is noticed at once, not at the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from supervisor.child.loading import FileStamp

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent(parent: int) -> Callable[[], None]:
    def preexec() -> None:
        # Runs in the forked child before exec: only async-signal-safe work (two syscalls).
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)  # the daemon is already gone

    return preexec


class RealChild:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        try:
            self._ps: psutil.Process | None = psutil.Process(proc.pid)
        except psutil.Error:
            self._ps = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def send_signal(self, sig: int) -> None:
        if self._proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(sig)

    async def wait(self) -> int:
        return await self._proc.wait()

    async def output(self) -> AsyncIterator[bytes]:
        stream = self._proc.stdout
        if stream is None:
            return
        while chunk := await stream.read(65536):
            yield chunk

    def progress_sample(self) -> tuple[float, int] | None:
        if self._ps is None:
            return None
        try:
            with self._ps.oneshot():
                cpu = self._ps.cpu_times()
                io = self._ps.io_counters()
            # Storage reads only (page faults on the mmapped model count): not read_chars, which
            # also counts the HTTP requests our own /health polls make it read.
            return cpu.user + cpu.system, int(io.read_bytes)
        except (psutil.Error, AttributeError):
            return None

    def loaded_bytes(self) -> int | None:
        # Measured with the pinned llama-server loading the demo model (tests/integration/
        # test_load_progress.py): with its default load mode (mmap) read_chars stays at ~12 MiB (the
        # GGUF header and vocabulary, read with read()) and read_bytes counts only reads from storage
        # (0 with the file in the page cache), while the resident file-backed memory (RssFile, statm's
        # "shared") rises from ~10 MiB (the binary) to the file's size as the mapped pages fault in,
        # cached or not. With --load-mode none the child read()s the file instead: read_chars rises to
        # the file's size and RssFile stays flat. The larger of the two follows both. RssFile counts the
        # binary's own pages too (a few % of a small model, nothing of a large one); the exact figure
        # (the model's mapping in /proc/PID/smaps) costs a page-table walk per read that grows with
        # the model (1.5-3 ms for 250 MB, on the event loop), statm and io are O(1).
        if self._ps is None:
            return None
        try:
            with self._ps.oneshot():
                mem = self._ps.memory_info()
                io = self._ps.io_counters()
            return max(int(mem.shared), int(io.read_chars))
        except (psutil.Error, AttributeError):
            return None

    def rss_bytes(self) -> int | None:
        if self._ps is None:
            return None
        try:
            return int(self._ps.memory_info().rss)
        except psutil.Error:
            return None

    def cpu_seconds(self) -> float | None:
        if self._ps is None:
            return None
        try:
            t = self._ps.cpu_times()
            return float(t.user + t.system)
        except psutil.Error:
            return None


async def spawn_tied(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    *,
    stdout: int | IO[bytes] = asyncio.subprocess.PIPE,
    own_group: bool = True,
) -> asyncio.subprocess.Process:
    """Start a child that the kernel kills when this process dies; stderr joins stdout. Every
    llama-server the daemon and verify's smoke test start goes through here; ``bench``'s synchronous
    launches go through ``popen_tied``."""
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=stdout,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(env),
        cwd=cwd,
        preexec_fn=_die_with_parent(os.getpid()),
        process_group=0 if own_group else None,
    )


def popen_tied(argv: Sequence[str | Path], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen`` for a child that the kernel kills when this process dies, even by SIGKILL:
    the bare llama-servers and private daemons ``bench`` starts. ``Popen`` forks in the calling thread
    and PDEATHSIG fires when that thread ends, so only the main thread (which lives as long as the
    process) may call this; any other thread gets a RuntimeError rather than a tie that may break."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("popen_tied must run on the main thread (PDEATHSIG follows the forking thread)")
    return subprocess.Popen([str(a) for a in argv], preexec_fn=_die_with_parent(os.getpid()), **popen)


def stop_popen(
    proc: subprocess.Popen[Any], grace_s: float, first: signal.Signals = signal.SIGTERM
) -> int | None:
    """Ask a ``popen_tied`` child to stop with ``first``, SIGKILL it after ``grace_s``; its exit code."""
    if proc.poll() is None:
        proc.send_signal(first)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


class RealOs:
    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> RealChild:
        return RealChild(await spawn_tied(argv, env, cwd))

    def free_port(self) -> int:
        return free_port()

    def port_open(self, port: int) -> bool:
        return port_open(port)

    def now(self) -> float:
        return time.monotonic()

    def file_stamp(self, path: Path) -> FileStamp | None:
        try:
            resolved = path.resolve()
            st = resolved.stat()
        except OSError:
            return None
        return FileStamp(str(resolved), st.st_size, st.st_mtime_ns)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now. The child binds it a moment later; if someone else wins
    that race, the child exits at once with 'couldn't bind' and the next attempt picks another."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0
