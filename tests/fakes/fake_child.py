"""Make ``fake_llama_server.py`` runnable as a binary: a tiny shell wrapper that execs it with this
interpreter (the supervisor's scrubbed PATH would not find our venv's Python). ``exec`` keeps the pid,
so signals and PR_SET_PDEATHSIG reach the fake itself."""

from __future__ import annotations

import shlex
import stat
import sys
from pathlib import Path

FAKE = Path(__file__).resolve().parent / "fake_llama_server.py"


def make_fake_binary(folder: Path, *switches: str) -> Path:
    """A 'llama-server' in ``folder`` that is the fake with ``switches`` always on."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llama-server"
    extra = " ".join(shlex.quote(s) for s in switches)
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} "$@" {extra}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path
