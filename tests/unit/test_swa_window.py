"""Sliding-window models keep their states by default (issue 56, item 4): with the disk tier on, a
model with sliding-window layers gets ``--swa-full`` (a saved state has no context checkpoints, so a
windowed cache's restore is never reused), the budget counts the full cache and no checkpoints, the
states' identity says so, and ``llamagate plan`` shows the choice and its memory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import supervisor.daemon.prepare as prepare_mod
from supervisor.budget.gguf_info import read_shape
from supervisor.budget.plan import MIB
from supervisor.budget.window import WHY_NO_ROOM, WHY_TIER, slides
from supervisor.cli import main
from supervisor.config.schema import Config
from supervisor.daemon.state_disk import plan_disk
from supervisor.errors import Misconfigured
from supervisor.launch.flags import build_argv
from supervisor.progress import NullProgress
from tests.unit.test_budget import full_shape, write_gguf
from tests.unit.test_prepare import config_with_model


def gemma_like(path: Path) -> Path:
    """The Gemma 3 demo's shape (gemma-3-270m): 18 layers, five of every six sliding over 512 tokens,
    one KV head of 256: 1 KiB a cell a layer in f16."""
    return write_gguf(path, "gemma3", layers=18, kv=1, key_length=256, window=512)


def config(tmp_path: Path, model: Path, **llama: object) -> Config:
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    cfg = config_with_model(tmp_path, model, digest)
    # The demo's settings (2 slots x 4096, 8 checkpoints a slot) and a states folder in tmp; the tier's
    # budget explicit so that the free space of the test's disk does not decide it.
    knobs = {"slots": 2, "ctx_per_slot": 4096, "threads": 1, "state_disk_mib": 64, **llama}
    return replace(cfg, llama=replace(cfg.llama, state_dir=tmp_path / "states", **knobs))


def prepared(cfg: Config, tmp_path: Path) -> prepare_mod.Prepared:
    return prepare_mod.prepare(cfg, progress=NullProgress(), cache=tmp_path / "c", fetch=False)


def test_the_demo_shape_slides_and_a_full_attention_model_does_not(tmp_path: Path) -> None:
    assert slides(read_shape(gemma_like(tmp_path / "g.gguf")))
    assert not slides(full_shape())


def test_with_the_tier_on_a_sliding_model_gets_swa_full_and_the_budget_counts_it(tmp_path: Path) -> None:
    p = prepared(config(tmp_path, gemma_like(tmp_path / "g.gguf")), tmp_path)
    assert p.spec.swa_full and build_argv(p.spec).count("--swa-full") == 1
    assert p.window is not None and p.window.added and p.window.why == WHY_TIER
    # Every layer keeps 2 x 4096 cells (18 x 8192 x 1 KiB = 144 MiB) and llama-server makes no
    # checkpoints; windowed it would be 3 full layers + 15 x 1024 cells (54 MiB) + 2 x 8 checkpoints
    # of 15 MiB (240 MiB).
    assert p.budget.kv_bytes == 144 * MIB and p.budget.checkpoint_bytes == 0
    assert (p.window.windowed_kv_bytes, p.window.windowed_checkpoint_bytes) == (54 * MIB, 240 * MIB)
    assert p.window.extra_bytes == -150 * MIB
    assert p.identity["serving"]["swa_full"] is True  # type: ignore[index]


def test_the_states_folder_of_a_full_cache_is_not_the_windowed_ones(tmp_path: Path) -> None:
    model = gemma_like(tmp_path / "g.gguf")
    on = prepared(config(tmp_path, model), tmp_path)
    cfg = config(tmp_path, model)
    windowed = plan_disk(cfg, cfg.llama.model.alias, on.binary.sha256, on.model.sha256)
    assert on.disk.states is not None and windowed.states is not None
    assert on.disk.states.directory != windowed.states.directory


def test_without_the_tier_or_without_a_window_nothing_is_added(tmp_path: Path) -> None:
    off = prepared(config(tmp_path, gemma_like(tmp_path / "g.gguf"), state_disk_mib=0), tmp_path)
    assert not off.spec.swa_full and "--swa-full" not in build_argv(off.spec)
    assert off.budget.checkpoint_bytes == 240 * MIB  # the RAM cache keeps checkpoints: windowed
    dense = prepared(config(tmp_path, write_gguf(tmp_path / "d.gguf")), tmp_path)
    assert not dense.spec.swa_full and dense.window is not None and not dense.window.slides


def test_swa_full_given_in_extra_args_is_not_added_twice(tmp_path: Path) -> None:
    p = prepared(config(tmp_path, gemma_like(tmp_path / "g.gguf"), extra_args=("--swa-full",)), tmp_path)
    assert build_argv(p.spec).count("--swa-full") == 1 and p.budget.checkpoint_bytes == 0
    assert p.window is not None and p.window.full and not p.window.added


def test_a_full_cache_that_does_not_fit_turns_the_tier_off_for_that_model(tmp_path: Path) -> None:
    # A long context against a window of 512: the full cache (18 x 2 x 65536 cells, 2,304 MiB) costs
    # more than the windowed one with its checkpoints (3 full layers, 384 MiB, + 54 MiB + 240 MiB).
    model = gemma_like(tmp_path / "g.gguf")
    cfg = config(tmp_path, model, ctx_per_slot=65536)
    m = prepare_mod.resolve_model(cfg, progress=NullProgress(), fetch=False)
    room = prepare_mod.plan_window(cfg, m, "g", "b", available=1024 * 1024 * MIB)
    assert room.choice.added and room.disk.states is not None
    tight = prepare_mod.plan_window(cfg, m, "g", "b", available=2 * 1024 * MIB)
    assert tight.budget.fits and tight.disk.states is None and not tight.choice.full
    assert tight.choice.why == WHY_NO_ROOM and "does not fit the memory budget" in tight.disk.why


def test_plan_shows_the_choice_and_its_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, gemma_like(tmp_path / "g.gguf"))
    llama = cfg.llama
    raw = {
        "llama": {
            "binary": str(llama.binary),
            "model": {"path": str(llama.model.path), "sha256": llama.model.sha256},
            "threads": 1,
            "slots": 2,
            "ctx_per_slot": 4096,
            "state_dir": str(tmp_path / "states"),
            "state_disk_mib": 64,
        },
        "supervision": {"memory_headroom_mib": 0},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert " --swa-full" in out.splitlines()[1]  # the argv line
    assert (
        "sliding window: --swa-full added (restores from the disk tier need it: a saved state has no context"
        " checkpoints): KV 144 MiB and no checkpoints, against 54 MiB + 240 MiB of checkpoints windowed:"
        " -150 MiB"
    ) in out
    assert main(["plan", "--json", "--config", str(path)]) == 0
    window = json.loads(capsys.readouterr().out)["sliding_window"]
    assert window["swa_full"] and window["added"] and window["extra_bytes"] == -150 * MIB


def test_a_refusal_says_the_full_cache_was_added_for_the_tier(tmp_path: Path) -> None:
    cfg = config(tmp_path, gemma_like(tmp_path / "g.gguf"))
    cfg = replace(cfg, supervision=replace(cfg.supervision, memory_headroom_mib=2**30))
    with pytest.raises(Misconfigured, match="counts --swa-full, added because the disk tier is on"):
        prepared(cfg, tmp_path)
