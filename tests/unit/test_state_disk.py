"""Where conversation states go on disk and whether they do: off with 0, on by default only where the
budget fits, one folder per model and identity (the knobs that shape a state change it, the others do
not), passed to the child as --slot-save-path; the daemon holds its folders, ensures each before a spawn (made
again and counted when removed, the tier off for the child when it cannot be made), and sweeps only the
folders nobody holds or used within the grace period."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.conversations.disk import StateDir
from proxy.conversations.root import GRACE_S, LOCK_FILE
from proxy.source import SlotStates
from supervisor.config.schema import Config, LlamaConfig
from supervisor.daemon import state_disk
from supervisor.daemon.state_disk import DEFAULT_MIB, TOUCH_S, Folders, plan_disk, state_identity, sweep
from supervisor.launch.flags import LaunchSpec, build_argv
from supervisor.launch.knobs import KNOBS, LlamaKnobs

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
    knobs = LlamaKnobs()
    base = state_identity("bin", "model", knobs)
    # The record of the hand list it replaced: a folder named before the knob column keeps its name.
    before = {"binary": "bin", "model": "model", "ctx_per_slot": 4096, "cache_type_k": "f16"}
    before |= {"cache_type_v": "f16", "extra_args": []}
    assert base == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    assert {k.name for k in KNOBS if k.row.kv_state} == {
        "ctx_per_slot",
        "cache_type_k",
        "cache_type_v",
        "extra_args",
    }
    for other in (
        state_identity("bin2", "model", knobs),
        state_identity("bin", "model2", knobs),
        state_identity("bin", "model", replace(knobs, ctx_per_slot=8192)),
        state_identity("bin", "model", replace(knobs, cache_type_k="q8_0")),
        state_identity("bin", "model", replace(knobs, extra_args=("-fa", "on"))),
        state_identity("bin", "model", knobs, swa_full=True),  # llamagate's --swa-full (budget/window.py)
    ):
        assert other != base
    same = replace(knobs, threads=3, slots=5, prompt_cache_mib=0, chat_template="chatml")
    assert state_identity("bin", "model", same) == base


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


def test_the_start_sweep_removes_only_unheld_idle_folders_of_the_models_other_identities(
    tmp_path: Path,
) -> None:
    states = plan_disk(_cfg(tmp_path), "m", "b", "x").states
    assert states is not None
    keep = Path(states.directory)
    old, recent, other_model = (
        tmp_path / "states" / n for n in ("m-" + "2" * 16, "m-" + "3" * 16, "n-" + "2" * 16)
    )
    for folder in (keep, old, recent, other_model):
        folder.mkdir(parents=True)
        (folder / "x.state").write_bytes(b"x")
        if folder != recent:
            then = time.time() - 2 * GRACE_S
            os.utime(folder, (then, then))
    assert sweep(states, "m") == [old]
    assert keep.is_dir() and not old.exists() and recent.is_dir() and other_model.is_dir()
    assert state_disk.DiskPlan(None, "off").record() == {"budget_bytes": 0, "why": "off"}


def _spec(states: SlotStates | None) -> LaunchSpec:
    knobs = LlamaKnobs(threads=1, threads_batch=1)
    return LaunchSpec(Path("/bin/llama-server"), Path("/m.gguf"), "m", 1234, knobs, slot_states=states)


def _save(folder: Path, key: str) -> None:
    """A state the tier saved (``StateDir.commit``)."""
    d = StateDir(SlotStates(str(folder), "id", 1 << 20))
    (folder / "saving-x.state").write_bytes(b"x" * 10)
    d.commit("saving-x.state", key, "t", 1)


async def test_every_spawn_finds_its_folder_held_and_a_removed_one_made_again_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "states" / ("m-" + "1" * 16)
    states = SlotStates(str(folder), "id", 1 << 20)
    forgot: list[str] = []
    folders = Folders(forget=lambda model: forgot.append(model) or 1)
    spec = await folders.before_spawn("chat", _spec(states))
    assert spec.slot_states == states and folder.is_dir() and folders.held(states)
    assert folders.lost == {"chat": 0}
    _save(folder, "a" * 32)
    _save(folder, "b" * 32)
    assert await folders.before_spawn("chat", _spec(states)) == _spec(states)  # still there: nothing lost
    assert folders.lost == {"chat": 0} and forgot == []
    shutil.rmtree(folder)  # by hand, under the daemon
    with caplog.at_level(logging.WARNING):
        spec = await folders.before_spawn("chat", _spec(states))
    assert spec.slot_states == states and folder.is_dir() and folders.held(states)
    assert folders.lost == {"chat": 2} and forgot == ["chat"]  # the two states it held: the larger count
    assert "made again" in caplog.text
    # Another daemon's start sweep, past the grace period: the held folder stays.
    then = time.time() - 2 * GRACE_S
    os.utime(folder, (then, then))
    assert sweep(SlotStates(str(folder.with_name("m-" + "2" * 16)), "id2", 1), "m") == []
    collected = list(folders.collector().collect())
    assert [(s.name, s.labels, s.value) for s in collected[0].samples] == [
        ("llamagate_conversation_states_lost_total", {"model": "chat"}, 2.0)
    ]
    folders.close()
    assert not folders.held(states)


async def test_a_folder_that_cannot_be_made_starts_the_child_with_the_tier_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "states").write_bytes(b"not a folder")
    states = SlotStates(str(tmp_path / "states" / ("m-" + "1" * 16)), "id", 1 << 20)
    with caplog.at_level(logging.WARNING):
        spec = await Folders().before_spawn("chat", _spec(states))
    assert spec.slot_states is None and "--slot-save-path" not in build_argv(spec)
    assert "tier off" in caplog.text


async def test_a_reload_drop_lets_the_folder_go_and_sweeps_only_what_is_idle(tmp_path: Path) -> None:
    root = tmp_path / "states"
    old_dir, new_dir = root / ("m-" + "1" * 16), root / ("m-" + "2" * 16)
    old, new = SlotStates(str(old_dir), "id1", 1 << 20), SlotStates(str(new_dir), "id2", 1 << 20)
    folders = Folders()
    await folders.before_spawn("chat", _spec(old))
    folders.drop(old, old)  # the same identity kept: nothing happens
    assert folders.held(old)
    await folders.before_spawn("chat", _spec(new))
    folders.drop(old, new)
    assert not folders.held(old) and old_dir.is_dir()  # released now: its grace begins
    then = time.time() - 2 * GRACE_S
    for path in (old_dir / LOCK_FILE, old_dir):
        os.utime(path, (then, then))
    folders.drop(new, None)  # the model removed: the idle old folder goes, the new one is kept a day
    assert not old_dir.exists() and new_dir.is_dir()
    folders.close()


async def test_a_held_folder_is_marked_as_used_every_hour(tmp_path: Path) -> None:
    folder = tmp_path / ("m-" + "1" * 16)
    states = SlotStates(str(folder), "id", 1 << 20)
    folders = Folders()
    await folders.before_spawn("chat", _spec(states))
    then = time.time() - 2 * GRACE_S
    os.utime(folder / LOCK_FILE, (then, then))
    assert folders.tick(100.0) == TOUCH_S  # touched now, next in an hour
    assert (folder / LOCK_FILE).stat().st_mtime > then + GRACE_S
    os.utime(folder / LOCK_FILE, (then, then))
    assert folders.tick(100.0 + 60) == TOUCH_S - 60  # not yet
    assert (folder / LOCK_FILE).stat().st_mtime == then
    folders.close()
