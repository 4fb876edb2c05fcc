"""The child's private folder: its HOME and its empty XDG_CONFIG_HOME (so no user config.ini is read).

``mkdtemp`` makes it 0700 with an unpredictable name, so nobody can plant a ``llama.cpp/config.ini``
in it first. The daemon removes it when it stops; a daemon killed by SIGKILL cannot, so the name
carries its pid and the next daemon removes folders whose daemon is gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import psutil

log = logging.getLogger("llamagate.daemon")
PREFIX = "llamagate-child-"


def make_private_dir(parent: Path | None = None) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))


def sweep_stale(parent: Path | None = None) -> list[Path]:
    """Remove the private folders of daemons that no longer run (ours only: same owner). A pid that
    is alive again (reused) keeps its folder: better a leftover than another daemon's folder gone."""
    folder = Path(parent or tempfile.gettempdir())
    removed = []
    for path in folder.glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        try:
            mine = path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if not (mine and pid.isdigit()) or psutil.pid_exists(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info(
            "removed private folders of daemons that are gone", extra={"fields": {"count": len(removed)}}
        )
    return removed
