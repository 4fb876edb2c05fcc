"""The child's private folder: private, and swept up after a daemon that died by SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from supervisor.child.workdir import make_private_dir, sweep_stale


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_private_and_named_after_the_daemon(tmp_path: Path) -> None:
    d = make_private_dir(tmp_path)
    assert d.stat().st_mode & 0o777 == 0o700
    assert d.name.startswith(f"llamagate-child-{os.getpid()}-")


def test_folders_of_gone_daemons_are_removed_others_kept(tmp_path: Path) -> None:
    gone = tmp_path / f"llamagate-child-{dead_pid()}-abc"
    (gone / "config").mkdir(parents=True)
    alive = make_private_dir(tmp_path)  # ours: this process is alive
    unrelated = tmp_path / "llamagate-child-notapid-x"
    unrelated.mkdir()
    assert sweep_stale(tmp_path) == [gone]
    assert not gone.exists() and alive.exists() and unrelated.exists()
