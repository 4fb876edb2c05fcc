"""The states folder: only files this program recorded, unchanged, of the same identity and tenant are
offered for a restore; the folder is private; saves are atomic renames; the budget holds with tenants
sharing it fairly."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from proxy.conversations.disk import StateDir, StateDirError
from proxy.conversations.root import make_private
from proxy.source import SlotStates

KEY_A = "a" * 32
KEY_B = "b" * 32


def _dir(path: Path, budget: int = 10_000, identity: str = "id-1") -> StateDir:
    make_private(path)  # the root makes folders (``proxy.conversations.root``), the index never does
    return StateDir(SlotStates(str(path), identity, budget))


def _save(d: StateDir, key: str, tenant: str, size: int = 100, fill: bytes = b"x", tokens: int = 10) -> None:
    temp = d.temp_name()
    (d.path / temp).write_bytes(fill * size)  # what the child writes
    d.commit(temp, key, tenant, tokens)


def test_the_folder_is_made_private_and_a_link_a_loose_or_a_missing_folder_is_refused(tmp_path: Path) -> None:
    d = _dir(tmp_path / "states" / "m-1")
    assert stat.S_IMODE(os.lstat(d.path).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(tmp_path / "states").st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    StateDir(SlotStates(str(loose), "id-1", 100))
    assert stat.S_IMODE(os.lstat(loose).st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(loose)
    with pytest.raises(StateDirError):
        make_private(link)
    with pytest.raises(FileNotFoundError):
        StateDir(SlotStates(str(tmp_path / "missing"), "id-1", 100))
    assert not (tmp_path / "missing").exists()  # the index never makes its folder


def test_a_saved_state_is_restorable_by_its_tenant_only(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    _save(d, KEY_A, "alpha", tokens=42)
    entry, why = d.check(KEY_A, "alpha")
    assert why == "" and entry is not None and entry.tokens == 42 and entry.size == 100
    assert entry.file.startswith(KEY_A + ".") and (d.path / entry.file).is_file()
    assert not [p for p in d.path.iterdir() if p.name.startswith("saving-")]  # renamed, nothing left over
    assert stat.S_IMODE((d.path / entry.file).stat().st_mode) == 0o600
    # Another tenant asking for the same key (only a forged record could make it happen): refused.
    assert d.check(KEY_A, "beta") == (None, "tenant")
    assert d.check(KEY_B, "alpha") == (None, "none")
    assert d.check("../../etc/passwd", "alpha") == (None, "none")


def test_a_file_with_one_byte_changed_is_never_restored_and_is_removed(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    _save(d, KEY_A, "alpha")
    entry, _ = d.check(KEY_A, "alpha")
    assert entry is not None
    data = bytearray((d.path / entry.file).read_bytes())
    data[50] ^= 1
    (d.path / entry.file).write_bytes(bytes(data))
    assert d.check(KEY_A, "alpha") == (None, "changed")
    assert not (d.path / entry.file).exists() and d.files == 0


def test_a_file_put_in_place_of_a_state_by_a_link_is_never_read(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    _save(d, KEY_A, "alpha")
    entry, _ = d.check(KEY_A, "alpha")
    assert entry is not None
    outside = tmp_path / "outside"
    outside.write_bytes((d.path / entry.file).read_bytes())
    (d.path / entry.file).unlink()
    (d.path / entry.file).symlink_to(outside)
    assert d.check(KEY_A, "alpha") == (None, "unsafe")


def test_a_record_of_another_identity_is_not_ours(tmp_path: Path) -> None:
    d = _dir(tmp_path, identity="id-1")
    _save(d, KEY_A, "alpha")
    other = _dir(tmp_path, identity="id-2")  # another model or context size: the same folder, by mistake
    assert other.files == 0 and other.check(KEY_A, "alpha") == (None, "none")
    # A record edited to point at another file is refused too (the name must be KEY.SHA16.state).
    meta = d.path / (KEY_A + ".meta")
    record = json.loads(meta.read_text())
    record["file"] = "elsewhere.state"
    meta.write_text(json.dumps(record))
    assert d.check(KEY_A, "alpha") == (None, "none")


def test_a_new_save_replaces_the_old_file_and_a_restart_finds_the_states(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    _save(d, KEY_A, "alpha", fill=b"1")
    first, _ = d.check(KEY_A, "alpha")
    _save(d, KEY_A, "alpha", fill=b"2", size=120)
    second, _ = d.check(KEY_A, "alpha")
    assert first is not None and second is not None and first.file != second.file
    assert not (d.path / first.file).exists() and d.bytes == 120
    again = _dir(tmp_path)  # the next daemon reads the records
    assert again.check(KEY_A, "alpha")[0] == second


def test_the_budget_holds_and_the_largest_tenant_loses_its_oldest_first(tmp_path: Path) -> None:
    now = [0.0]
    d = StateDir(SlotStates(str(tmp_path), "id-1", 1000), clock=lambda: now[0])
    keys = [f"{i:032x}" for i in range(12)]
    _save(d, keys[0], "small", size=200)
    now[0] += 1
    for i, key in enumerate(keys[1:9]):  # one tenant saving much more than its share
        now[0] += 1
        _save(d, key, "greedy", size=200, fill=bytes([i]))
        assert d.bytes <= 1000
    assert d.check(keys[0], "small")[0] is not None, "the greedy tenant evicted only its own states"
    held = d.tenant_bytes()
    assert held == {"small": 200, "greedy": 800}
    assert d.check(keys[1], "greedy")[1] == "none"  # its oldest went first
    assert d.check(keys[8], "greedy")[0] is not None
    files = [p for p in d.path.iterdir() if p.suffix == ".state"]
    assert sum(p.stat().st_size for p in files) <= 1000
    # A state larger than the whole budget does not stay.
    _save(d, keys[10], "small", size=5000)
    assert d.bytes <= 1000 and d.check(keys[10], "small")[1] == "none"
