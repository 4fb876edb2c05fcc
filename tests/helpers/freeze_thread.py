"""Freeze one thread of another process, leaving its other threads running: ``python -m
tests.helpers.freeze_thread TID [MAX_S]``.

SIGSTOP stops every thread of a process; a held server loop is one thread stopped while llama-server's
HTTP threads keep answering ``/health``. ptrace stops just the thread it is given: ``PTRACE_SEIZE``
attaches to that thread alone (no stop, no signal), ``PTRACE_INTERRUPT`` stops it. This process is the
tracer: it prints ``frozen`` once the thread is stopped, then waits for the thread to end (the
supervisor's SIGKILL ends the whole process, stopped threads included) so that its exit reaches its
real parent (a traced thread's exit is reported to the tracer first). After ``MAX_S`` (default 300) it
lets the thread go (``PTRACE_DETACH``), so a failed test leaves nothing frozen. Linux only; needs the
right to ptrace the target (root, or Yama's ``ptrace_scope`` 0 and the same user)."""

from __future__ import annotations

import ctypes
import os
import sys
import time

PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
_WALL = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(request: int, tid: int) -> None:
    if _libc.ptrace(request, tid, None, None) == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, f"ptrace({request:#x}, {tid}): {os.strerror(errno)}")


def main(argv: list[str]) -> int:
    tid = int(argv[1])
    max_s = float(argv[2]) if len(argv) > 2 else 300.0
    _ptrace(PTRACE_SEIZE, tid)
    _ptrace(PTRACE_INTERRUPT, tid)
    os.waitpid(tid, _WALL)  # the interrupt's stop
    print("frozen", flush=True)
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        try:
            pid, status = os.waitpid(tid, _WALL | os.WNOHANG)
        except ChildProcessError:
            return 0  # gone and reaped
        if pid and (os.WIFEXITED(status) or os.WIFSIGNALED(status)):
            return 0
        time.sleep(0.05)  # still stopped (a signal for it waits: the thread is not resumed)
    _ptrace(PTRACE_DETACH, tid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
