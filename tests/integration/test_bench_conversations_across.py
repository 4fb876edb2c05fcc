"""``llamagate bench conversations --across``: an event between two turns of every conversation, the turn
after it recorded on its own. With the disk tier the turn after a stop and start of the daemon reuses
its whole history; without it, only what the fresh RAM cache shares (the system prompt)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_benchmarks_e2e import config  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


def test_the_turn_after_a_restart_keeps_its_history_with_the_disk_tier(
    tmp_path: Path,
    config: Path,  # noqa: F811
) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "supervisor", "bench", "conversations", "--config", str(config)]
    argv += ["--conversations", "4", "--turns", "3", "--concurrency", "2", "--system-tokens", "60"]
    argv += ["--user-tokens", "30", "--answer-tokens", "4", "--out", str(out)]
    argv += ["--targets", "llamagate,llamagate-nodisk", "--across", "restart", "--event-after", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    targets = {t["target"]: t for t in json.loads((out / "conversations.json").read_text())["targets"]}
    disk, nodisk = targets["llamagate"], targets["llamagate-nodisk"]
    assert disk["event"] == "restart" and disk["after_event_turns"] == 4
    assert disk["after_event_of_reusable"] >= 0.95, disk
    assert nodisk["after_event_of_reusable"] < 0.6, nodisk
    assert "| llamagate | restart |" in (out / "conversations.md").read_text()
