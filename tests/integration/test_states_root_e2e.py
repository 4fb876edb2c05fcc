"""Two llamagate daemons on one host share one ``XDG_STATE_HOME`` (the default states root), one model, two
identities (B serves ``ctx_per_slot: 2048``): B's start, B's restart and a ``llamagate bench`` run
sharing the root never take A's folder away, so when A's child is SIGKILLed it is READY again, its
folder and states intact, its conversations restored from disk (at ``170544d`` B's start removed A's
live folder and A's next child failed six starts on ``--slot-save-path: not a directory``: FAILED for
good). And A's folder removed by hand under it: its next child starts all the same, on the folder made
again, the states lost counted, the tier saving and restoring new states. Real daemons, real child."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import Daemon, DaemonFactory, wait_until
from tests.integration.test_disk_tier_e2e import MODEL, ONE_SLOT, Chat, cached, folder, metric, states

pytestmark = pytest.mark.integration

# A start failure counts toward FAILED (``child.machine``): none of them may happen here.
START_FAILURES = ("spawn", "load_exit", "load_timeout", "load_stalled", "gate")


def _shared(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of every daemon of the test (one XDG_STATE_HOME) and the states root in it."""
    xdg = tmp_path / "xdg-state"
    return {"XDG_STATE_HOME": str(xdg)}, xdg / "llamagate" / "conversations"


def _daemon_a(daemon_factory: DaemonFactory, env: dict[str, str]) -> Daemon:
    # ``state_dir: null``: the default root under XDG_STATE_HOME, as an operator's two daemons would.
    return daemon_factory({**ONE_SLOT, "llama": {**ONE_SLOT["llama"], "state_dir": None}}, env=env)


def _daemon_b(daemon_factory: DaemonFactory, env: dict[str, str]) -> Daemon:
    # The same model and alias, another identity (another context per slot): another folder.
    return daemon_factory({"llama": {"state_dir": None, "ctx_per_slot": 2048}}, env=env)


def _bench_b(tmp_path: Path, root: Path, a: Daemon, env: dict[str, str]) -> None:
    """The shortest ``llamagate bench`` that starts a daemon: one conversation of one turn against a
    llamagate target, its config naming the shared states root and another identity."""
    llama: dict[str, Any] = {k: a.config["llama"][k] for k in ("binary", "model", "threads")}
    llama.update(slots=1, ctx_per_slot=2048, state_dir=str(root))
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({"llama": llama, "supervision": {"memory_headroom_mib": 256}}))
    argv = [sys.executable, "-m", "supervisor", "bench", "conversations", "--config", str(config)]
    argv += ["--targets", "llamagate", "--conversations", "1", "--turns", "1", "--concurrency", "1"]
    argv += ["--system-tokens", "20", "--user-tokens", "10", "--answer-tokens", "2"]
    argv += ["--out", str(tmp_path / "bench-out")]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, check=False, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _kill_child(d: Daemon) -> None:
    """SIGKILL the child; wait until a new one is READY (the restart policy's backoff, then a load)."""
    generation = d.readyz()[1]["generation"]
    pid = d.child_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    d.wait_for(lambda code, body: code == 200 and body.get("generation", 0) > generation, "a new child")


def _no_failed_start(d: Daemon) -> None:
    for cause in START_FAILURES:
        assert metric(d, "llamagate_child_failures_total", cause=cause) == 0, cause
    assert d.readyz()[1]["state"] == "READY"


@pytest.mark.parametrize("neighbour", ["daemon", "daemon-restarted", "bench"])
def test_another_daemon_on_the_root_never_takes_a_live_folder(
    daemon_factory: DaemonFactory, tmp_path: Path, neighbour: str
) -> None:
    env, root = _shared(tmp_path)
    a = _daemon_a(daemon_factory, env)
    alpha, beta = Chat(a, "alpha"), Chat(a, "beta")
    alpha.turn()
    beta.turn()  # one slot: alpha's state saved to A's folder
    mine = folder(a)
    assert mine.parent == root
    saved = {p.name for p in states(mine)}
    inode = mine.stat().st_ino
    assert len(saved) == 1
    if neighbour == "bench":
        _bench_b(tmp_path, root, a, env)
    else:
        b = _daemon_b(daemon_factory, env)
        theirs = folder(b)
        assert theirs.parent == root and theirs != mine
        if neighbour == "daemon-restarted":
            assert b.stop() == 0
            b = _daemon_b(daemon_factory, env)  # its start sweeps the root again
        assert folder(b) == theirs
    assert mine.stat().st_ino == inode and {p.name for p in states(mine)} == saved
    _kill_child(a)
    assert mine.stat().st_ino == inode and {p.name for p in states(mine)} >= saved
    answer = alpha.turn()  # its history comes back from A's folder
    assert cached(answer) >= 0.95 * answer["reusable"], answer["usage"]
    assert metric(a, "llamagate_conversation_state_restores_total", tenant="default") >= 1
    assert metric(a, "llamagate_conversation_states_lost_total") == 0
    _no_failed_start(a)


def test_a_folder_removed_by_hand_is_made_again_at_the_next_start(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    env, _ = _shared(tmp_path)
    a = _daemon_a(daemon_factory, env)
    alpha, beta = Chat(a, "alpha"), Chat(a, "beta")
    alpha.turn()
    beta.turn()  # alpha's state saved
    mine = folder(a)
    assert len(states(mine)) == 1
    shutil.rmtree(mine)  # by hand, under the running daemon
    _kill_child(a)
    assert "--slot-save-path" in a.log_text() and mine.is_dir()
    wait_until(lambda: metric(a, "llamagate_conversation_states_lost_total") == 1, "the loss counted")
    assert "made again" in a.log_text()
    _no_failed_start(a)
    # The tier works on the new folder: alpha's history is gone (computed), then saved and restored anew.
    restores = metric(a, "llamagate_conversation_state_restores_total", tenant="default")
    answer = alpha.turn()
    assert cached(answer) < 0.5 * answer["reusable"], answer["usage"]
    beta.turn()  # alpha's new state saved to the new folder
    answer = alpha.turn()
    assert cached(answer) >= 0.95 * answer["reusable"], answer["usage"]
    assert metric(a, "llamagate_conversation_state_restores_total", tenant="default") == restores + 1
    assert len(states(mine)) >= 1
    assert MODEL in a.log_text()
