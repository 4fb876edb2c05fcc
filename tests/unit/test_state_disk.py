"""Where conversation states go on disk and whether they do: off with 0, on by default only where the
budget fits, one folder per model and identity (the knobs that shape a state change it, the others do
not), passed to the child as --slot-save-path, and an identity no longer served is swept."""

from __future__ import annotations

import shutil
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.config.schema import Config, LlamaConfig
from supervisor.daemon import state_disk
from supervisor.daemon.state_disk import DEFAULT_MIB, plan_disk, state_identity, sweep
from supervisor.launch.flags import LaunchSpec, build_argv
from supervisor.launch.knobs import LlamaKnobs

Usage = namedtuple("Usage", "total used free")


def _cfg(tmp_path: Path, **llama: object) -> Config:
    return Config(llama=replace(LlamaConfig(), state_dir=tmp_path / "states", **llama))


def test_zero_is_off_and_null_is_on_only_where_the_default_budget_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert plan_disk(_cfg(tmp_path, state_disk_mib=0), "m", "b", "x").states is None
    on = plan_disk(_cfg(tmp_path), "m", "b", "x")
    assert on.states is not None and on.states.budget_bytes == DEFAULT_MIB * 2**20
    assert Path(on.states.directory).parent == tmp_path / "states"
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * 2**30, 0, 100 * 2**20))
    full = plan_disk(_cfg(tmp_path), "m", "b", "x")
    assert full.states is None and "100 MiB of room" in full.why and "state_disk_mib" in full.why
    explicit = plan_disk(_cfg(tmp_path, state_disk_mib=512), "m", "b", "x")  # asked for: on, with a word
    assert explicit.states is not None and "only 100 MiB of room" in explicit.why


def test_the_write_rate_reaches_the_tier_and_changes_no_folder(tmp_path: Path) -> None:
    unbounded = plan_disk(_cfg(tmp_path), "m", "b", "x")
    bounded = plan_disk(_cfg(tmp_path, state_write_mib_s=64), "m", "b", "x")
    assert unbounded.states is not None and unbounded.states.write_bytes_s is None
    assert bounded.states is not None and bounded.states.write_bytes_s == 64 * 2**20
    assert bounded.states.directory == unbounded.states.directory  # not part of what a state means
    assert "writes at most 64 MiB/s" in bounded.why


def test_the_identity_follows_what_a_state_depends_on_only() -> None:
    base = state_identity("bin", "model", 4096, "f16", "f16", ())
    assert base == state_identity("bin", "model", 4096, "f16", "f16", ())
    for other in (
        state_identity("bin2", "model", 4096, "f16", "f16", ()),
        state_identity("bin", "model2", 4096, "f16", "f16", ()),
        state_identity("bin", "model", 8192, "f16", "f16", ()),
        state_identity("bin", "model", 4096, "q8_0", "f16", ()),
        state_identity("bin", "model", 4096, "f16", "f16", ("-fa", "on")),
    ):
        assert other != base


def test_threads_do_not_change_the_folder_but_the_context_does(tmp_path: Path) -> None:
    one = plan_disk(_cfg(tmp_path, threads=1), "m", "b", "x").states
    two = plan_disk(_cfg(tmp_path, threads=2, slots=4), "m", "b", "x").states
    wide = plan_disk(_cfg(tmp_path, ctx_per_slot=8192), "m", "b", "x").states
    assert one is not None and two is not None and wide is not None
    assert one.directory == two.directory != wide.directory


def test_the_folder_is_the_childs_slot_save_path(tmp_path: Path) -> None:
    states = plan_disk(_cfg(tmp_path), "m", "b", "x").states
    knobs = LlamaKnobs(threads=1, threads_batch=1)
    spec = LaunchSpec(Path("/bin/llama-server"), Path("/m.gguf"), "m", 1234, knobs, slot_states=states)
    argv = build_argv(spec)
    assert states is not None and argv[argv.index("--slot-save-path") + 1] == states.directory
    assert "--slot-save-path" not in build_argv(replace(spec, slot_states=None))


def test_sweep_removes_only_the_models_other_identities(tmp_path: Path) -> None:
    keep = tmp_path / ("m-" + "1" * 16)
    old = tmp_path / ("m-" + "2" * 16)
    other_model = tmp_path / ("n-" + "2" * 16)
    for folder in (keep, old, other_model):
        folder.mkdir()
        (folder / "x.state").write_bytes(b"x")
    sweep(tmp_path, "m", str(keep))
    assert keep.is_dir() and not old.exists() and other_model.is_dir()
    assert state_disk.DiskPlan(None, "off").record() == {"budget_bytes": 0, "why": "off"}
