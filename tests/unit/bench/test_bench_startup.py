"""The startup benchmark's verdicts are computed from the measurements, not asserted."""

from __future__ import annotations

from pathlib import Path

import yaml

from supervisor.config.load import load_config
from supervisor.daemon.identity import host_identity, served_identity
from tests.benchmarks.startup import _config, _markdown, _summarize

IDENTITY = served_identity(
    binary=Path("/b/llama-server"),
    binary_sha256="b" * 64,
    build={"commit": "0c1e570"},
    model=Path("/m/model.gguf"),
    model_size=1,
    model_sha256="a" * 64,
    alias="m",
    serving={"threads": 2, "threads_batch": 2, "slots": 2, "ctx_per_slot": 4096},
    host=host_identity(),
)


def test_targets_pass_and_fail_on_the_numbers() -> None:
    serve = [{"total_s": t, "to_spawn_s": 0.3, "load_s": t - 0.3} for t in (1.9, 2.0, 2.1)]
    kills = [{"kill_to_ready_s": 2.5, "load_s": 1.7}, {"kill_to_ready_s": 2.2, "load_s": 1.6}]
    good = _summarize([1.6, 1.7, 1.8], serve, kills, IDENTITY)
    assert round(good["targets"]["serve_over_bare"]["median_s"], 3) == 0.3
    assert good["targets"]["serve_over_bare"]["pass"]
    assert round(good["targets"]["kill_to_ready"]["max_over_load_s"], 3) == 0.8
    assert good["targets"]["kill_to_ready"]["pass"]
    slow = _summarize([1.0, 1.0, 1.0], serve, [{"kill_to_ready_s": 4.0, "load_s": 1.5}], IDENTITY)
    assert not slow["targets"]["serve_over_bare"]["pass"]
    assert not slow["targets"]["kill_to_ready"]["pass"]
    text = _markdown(slow)
    assert "**FAIL**" in text and "a" * 64 in text and "b" * 64 in text


def test_kill_daemon_allows_every_deliberate_kill() -> None:
    """Ten kills in a row must not read as a crash loop (FAILED after max_restarts in the window)."""
    written, key = _config(load_config(None), kills=10)
    assert key not in yaml.safe_dump(written)  # the daemon's config holds the key's digest only
    assert written["supervision"]["max_restarts"] >= 11
    assert written["supervision"]["stable_after_s"] == 1.0
