"""The disk tier's policy against a fake child whose slots are files' contents: what a slot replaces is
saved once (when it ran a turn since), a conversation in no slot is restored into the one chosen for it,
a restore that the turn does not reuse is a miss, and repeated misses stop the restores."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proxy.conversations.slots import SlotMap
from proxy.conversations.tier import MISSES_TO_STOP, DiskTier, SlotActionFailed, SlotResult, Turn
from proxy.source import SlotStates

A, B, C = "a" * 32, "b" * 32, "c" * 32


class FakeChild:
    """Slots holding a string (a conversation's "state"); save writes it to the file, restore reads it."""

    def __init__(self, folder: Path, slots: int) -> None:
        self.folder = folder
        self.slots = [""] * slots
        self.actions: list[tuple[str, int]] = []
        self.refuse_restore = False

    async def save(self, slot: int, filename: str) -> SlotResult:
        self.actions.append(("save", slot))
        data = self.slots[slot].encode()
        (self.folder / filename).write_bytes(data)
        return SlotResult(len(self.slots[slot].split()), len(data), 1.0)

    async def restore(self, slot: int, filename: str) -> SlotResult:
        self.actions.append(("restore", slot))
        if self.refuse_restore:
            self.slots[slot] = ""
            raise SlotActionFailed("slot restore: 400 Unable to restore slot")
        self.slots[slot] = (self.folder / filename).read_text()
        return SlotResult(len(self.slots[slot].split()), len(self.slots[slot]), 1.0)


@pytest.fixture
def states(tmp_path: Path) -> SlotStates:
    (tmp_path / "m-1").mkdir(mode=0o700)  # made by the daemon (``proxy.conversations.root``)
    return SlotStates(str(tmp_path / "m-1"), "id-1", 1 << 20)


async def _turn(
    tier: DiskTier,
    child: FakeChild,
    m: SlotMap,
    states: SlotStates,
    key: str,
    words: int,
    cached: int | None = None,
) -> int:
    """One turn of ``key``: placed, prepared by the tier, "run" (the slot holds ``words`` words of it),
    reported with ``cached`` tokens (by default what the slot held of it before the turn)."""
    pin = m.take(key)
    assert pin.slot is not None
    turn = await tier.before_turn(states, 0, child, pin, key, "t")
    held = child.slots[pin.slot].split()
    reused = len(held) if held and held[0] == key else 0
    child.slots[pin.slot] = " ".join([key] * words)
    tier.after_turn(turn, words, reused if cached is None else cached)
    pin.free()
    return reused


async def test_a_replaced_state_is_saved_once_and_restored_for_its_next_turn(states: SlotStates) -> None:
    tier, m = DiskTier("m"), SlotMap(1)
    child = FakeChild(Path(states.directory), 1)
    await _turn(tier, child, m, states, A, 10)
    assert child.actions == []  # an empty slot: nothing to save, nothing on disk
    await _turn(tier, child, m, states, B, 10)
    assert child.actions == [("save", 0)]  # A leaves the slot: saved
    assert await _turn(tier, child, m, states, A, 20) == 10  # restored: its 10 tokens reused
    assert child.actions == [("save", 0), ("save", 0), ("restore", 0)]
    assert await _turn(tier, child, m, states, A, 30) == 20  # its own slot: nothing moves
    assert len(child.actions) == 3
    stats = tier.stats
    assert stats.saves["t"] == 2 and stats.restores["t"] == 1 and not stats.misses
    # The child's own milliseconds (1 each here): how long its loop, so its other slots, waited.
    assert stats.save_child_seconds["t"] == pytest.approx(0.002)
    assert stats.restore_child_seconds["t"] == pytest.approx(0.001)
    assert stats.prompt_tokens["t", "disk"] == 10 and stats.prompt_tokens["t", "cache"] == 20
    assert tier.folder is not None and tier.folder.files == 2


async def test_a_state_already_on_disk_is_not_saved_again(states: SlotStates) -> None:
    tier, m = DiskTier("m"), SlotMap(1)
    child = FakeChild(Path(states.directory), 1)
    await _turn(tier, child, m, states, A, 10)
    await _turn(tier, child, m, states, B, 10)  # saves A
    pin = m.take(A)  # A restored, then its turn fails (nothing reported): its slot is not A's for sure
    turn = await tier.before_turn(states, 0, child, pin, A, "t")
    tier.after_turn(turn, None, 0)
    pin.free()
    before = list(child.actions)
    await _turn(tier, child, m, states, C, 10)
    assert child.actions[len(before) :] == [], "A's file holds its last state: no save, and C has no file"


async def test_restores_not_reused_are_misses_and_repeated_misses_stop_them(
    states: SlotStates, caplog: pytest.LogCaptureFixture
) -> None:
    tier, m = DiskTier("m"), SlotMap(1)
    child = FakeChild(Path(states.directory), 1)
    await _turn(tier, child, m, states, A, 10)
    for _ in range(MISSES_TO_STOP):
        await _turn(tier, child, m, states, B, 10, cached=0)  # saves A (and restores B after the first)
        await _turn(tier, child, m, states, A, 10, cached=0)  # restored, then not reused
    # One tenant's misses: restores stop for it (the model's other tenants keep theirs).
    assert tier.stats.misses["t"] >= MISSES_TO_STOP and not tier.restores_for("t")
    assert tier.restoring and tier.restores_for("u")
    assert "restores stopped for the tenant" in caplog.text
    restores = child.actions.count(("restore", 0))
    await _turn(tier, child, m, states, B, 10)
    assert child.actions.count(("restore", 0)) == restores, "no restore after the tier stopped them"


async def test_misses_in_a_row_of_several_tenants_stop_restores_for_the_model(
    states: SlotStates, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier("m")
    for tenant in ("t", "u", "t"):
        tier.after_turn(Turn(A, tenant, restored=100), 120, 3)  # restored 100 tokens, 3 reused
    assert not tier.restoring and not tier.restores_for("u")
    assert "restores stopped for the model" in caplog.text
    # A hit between misses starts the count again.
    tier = DiskTier("m")
    for tenant, cached in (("t", 3), ("u", 3), ("u", 100), ("t", 3)):
        tier.after_turn(Turn(A, tenant, restored=100), 120, cached)
    assert tier.restoring and tier.stats.misses == {"t": 2, "u": 1}


async def test_a_restore_the_child_refuses_is_counted_and_the_file_never_offered_again(
    states: SlotStates,
) -> None:
    tier, m = DiskTier("m"), SlotMap(1)
    child = FakeChild(Path(states.directory), 1)
    await _turn(tier, child, m, states, A, 10)
    await _turn(tier, child, m, states, B, 10)
    child.refuse_restore = True
    assert await _turn(tier, child, m, states, A, 12) == 0
    assert tier.stats.refused["t", "failed"] == 1
    assert tier.folder is not None and tier.folder.known(A) is None


async def test_before_a_planned_stop_dirty_idle_slots_are_saved(states: SlotStates) -> None:
    tier, m = DiskTier("m"), SlotMap(2)
    child = FakeChild(Path(states.directory), 2)
    await _turn(tier, child, m, states, A, 10)
    await _turn(tier, child, m, states, B, 10)
    assert await tier.save_slots(states, 0, child, m.held, m.busy) == 2
    assert await tier.save_slots(states, 0, child, m.held, m.busy) == 0  # nothing newer than its file
    # The next child (another generation, same identity) restores them on demand.
    m2 = SlotMap(2, generation=1)
    child2 = FakeChild(Path(states.directory), 2)
    pin = m2.take(B)
    turn = await tier.before_turn(states, 1, child2, pin, B, "t")
    assert turn is not None and turn.restored == 10 and child2.slots[pin.slot or 0].split()[0] == B


@pytest.fixture
def not_a_folder(tmp_path: Path) -> str:
    path = tmp_path / "file"
    path.write_text("not a folder")
    return str(path)


async def test_without_a_folder_or_a_pin_the_tier_does_nothing(
    states: SlotStates, not_a_folder: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier, m = DiskTier("m"), SlotMap(1)
    child = FakeChild(Path(states.directory), 1)
    pin = m.take(A)
    assert await tier.before_turn(None, 0, child, pin, A, "t") is None
    pin.free()
    assert await tier.before_turn(states, 0, child, None, A, "t") is None
    # A folder that cannot be used: logged once, off.
    bad = SlotStates(not_a_folder, "id-1", 100)
    with caplog.at_level(logging.ERROR):
        assert await tier.before_turn(bad, 0, child, m.take(B), B, "t") is None
    assert "cannot be used" in caplog.text and child.actions == []
