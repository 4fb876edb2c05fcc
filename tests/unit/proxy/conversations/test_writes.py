"""What the disk tier writes (issue 56): a state leaving its slot is written when its conversation is
likely to come back (named by the client, a second turn, a tenant whose conversations return), never for
one-shot traffic once its return rate is known, and within the operator's write rate; the memory this
takes stays bounded however many conversations pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.conversations import writes
from proxy.conversations.slots import SlotMap
from proxy.conversations.tier import DiskTier, Turn
from proxy.conversations.writes import SEEN, WRITE_ONE_IN, WritePolicy
from proxy.source import SlotStates
from tests.unit.proxy.conversations.test_tier import FakeChild

# One-shot traffic is written until its return rate, with the prior's one return, falls under the bar.
EXPLORED = writes.FIRST_WRITES  # 20 first-turn states


def _key(i: int) -> str:
    return f"{i:032x}"


class Gateway:
    """One model's tier over a fake child of ``slots`` slots; ``turn`` plays one turn of a conversation."""

    def __init__(self, tmp_path: Path, slots: int = 1, rate: int | None = None) -> None:
        (tmp_path / "m-1").mkdir(mode=0o700)  # made by the daemon (``proxy.conversations.root``)
        self.states = SlotStates(str(tmp_path / "m-1"), "id-1", 1 << 30, rate)
        self.tier, self.map = DiskTier("m"), SlotMap(slots)
        self.child = FakeChild(Path(self.states.directory), slots)

    async def turn(self, key: str, tenant: str = "t", named: bool = False) -> None:
        if named:
            self.tier.named(key)
        pin = self.map.take(key)
        assert pin.slot is not None
        turn = await self.tier.before_turn(self.states, 0, self.child, pin, key, tenant)
        self.child.slots[pin.slot] = " ".join([key] * 10)
        self.tier.after_turn(turn, 10, 0)
        pin.free()

    @property
    def saves(self) -> int:
        return sum(1 for action, _ in self.child.actions if action == "save")


async def test_one_shot_traffic_stops_being_written_once_its_return_rate_is_known(tmp_path: Path) -> None:
    gw = Gateway(tmp_path)
    for i in range(400):
        await gw.turn(_key(i))
    # 399 states left the slot (each request replaces the one before); before issue 56 each was written.
    assert gw.saves == EXPLORED
    assert gw.tier.stats.skipped["t", "one_shot"] == 399 - EXPLORED
    assert gw.tier.writes.return_rates()["t"] < 1 / WRITE_ONE_IN


async def test_a_named_conversation_is_written_even_on_its_first_turn(tmp_path: Path) -> None:
    gw = Gateway(tmp_path)
    for i in range(100):  # the tenant's unnamed traffic never comes back
        await gw.turn(_key(i))
    saves = gw.saves
    await gw.turn(_key(1000), named=True)
    await gw.turn(_key(1001))  # replaces the named one: written
    assert gw.saves == saves + 1
    assert gw.tier.folder is not None and gw.tier.folder.known(_key(1000)) is not None
    await gw.turn(_key(1002))  # replaces an unnamed first turn: not written
    assert gw.saves == saves + 1


async def test_a_conversation_that_had_a_second_turn_is_written(tmp_path: Path) -> None:
    gw = Gateway(tmp_path, slots=2)
    for i in range(100):
        await gw.turn(_key(i))
    saves = gw.saves
    await gw.turn(_key(1000))
    await gw.turn(_key(1000))  # its second turn, on its own slot: nothing leaves
    await gw.turn(_key(1001))
    await gw.turn(_key(1002))  # takes 1000's slot: 1000 came back once, so it is written
    assert gw.saves == saves + 1
    assert gw.tier.folder is not None and gw.tier.folder.known(_key(1000)) is not None
    # ... and restored for its next turn
    await gw.turn(_key(1000))
    assert gw.tier.stats.restores["t"] == 1


async def test_a_return_counts_before_the_state_its_restore_overwrites_is_decided(tmp_path: Path) -> None:
    # A chat application's first conversations, all opened before any comes back: the first
    # FIRST_WRITES are written on the prior, the next ones are not (nothing has come back yet).
    gw = Gateway(tmp_path)
    opened = EXPLORED + 10
    for i in range(opened):
        await gw.turn(_key(i))
    assert gw.saves == EXPLORED
    # The first one comes back: its state is restored over the last one opened, which the RAM cache
    # never received (a restore replaces a slot before any request does). The return is counted
    # first, so the tenant's rate is over the bar again and that state is written, not lost.
    await gw.turn(_key(0))
    assert gw.tier.stats.restores["t"] == 1
    assert gw.saves == EXPLORED + 1
    assert gw.tier.folder is not None and gw.tier.folder.known(_key(opened - 1)) is not None


async def test_a_tenant_whose_conversations_come_back_keeps_every_first_turn_written(tmp_path: Path) -> None:
    gw = Gateway(tmp_path)
    for i in range(100):  # another tenant's one-shot traffic: its rate is its own
        await gw.turn(_key(i), tenant="batch")
    for c in range(200, 300, 4):  # a chat application: 4 open at once, each comes back
        for _ in range(2):
            for k in range(c, c + 4):
                await gw.turn(_key(k), tenant="chat")
    assert gw.tier.stats.skipped["chat", "one_shot"] == 0
    assert gw.tier.writes.return_rates()["chat"] == pytest.approx(1.0)
    # 100 conversations x 2 turns, each turn but the first replacing another conversation's state (the
    # first replaced the other tenant's): every one written.
    assert gw.tier.stats.saves["chat"] == 199


def test_the_return_rate_is_a_share_with_a_prior_and_forgets_old_traffic() -> None:
    policy = WritePolicy()
    for i in range(3):
        policy.turn(_key(i), "t")
    assert policy.reason(_key(0), "t") == (True, "tenant")  # nothing known: the prior, 1
    for i in range(3):
        policy.turn(_key(i), "t")  # all three came back
    assert policy.return_rates()["t"] == 1.0
    assert policy.reason(_key(0), "t") == (True, "returned")
    # Halved at the window: the rate follows the traffic as it changes, in two floats.
    for i in range(10, 10 + writes.RATE_WINDOW * 4):
        policy.turn(_key(i), "t")
        policy.reason(_key(i), "t")
    assert policy.return_rates()["t"] < 0.01


def test_the_write_rate_bound_holds_on_average_and_refills() -> None:
    now = [0.0]
    policy = WritePolicy(rate_bytes_s=1000, clock=lambda: now[0])
    written = 0
    while policy.may_write():
        policy.wrote(300)
        written += 300
    assert written == 2100  # the bucket (2 s of the rate) and the state that emptied it
    now[0] += 0.05
    assert policy.may_write() is False  # 50 bytes back: still short of the 100 owed
    now[0] += 0.1
    assert policy.may_write() is True
    now[0] += 3600
    policy.may_write()
    policy.wrote(2000)
    assert policy.may_write() is False, "an hour idle refills the bucket, not more"
    with pytest.raises(ValueError, match="positive"):
        policy.limit(0)


async def test_states_over_the_write_rate_are_not_written_and_counted(tmp_path: Path) -> None:
    gw = Gateway(tmp_path, rate=1)  # one byte a second: the first write empties the bucket
    for i in range(5):
        await gw.turn(_key(i), named=True)
    assert gw.saves == 1
    assert gw.tier.stats.skipped["t", "rate"] == 3


async def test_the_tier_reads_its_rate_from_the_folder_settings(tmp_path: Path) -> None:
    gw = Gateway(tmp_path, rate=5 << 20)
    await gw.turn(_key(1))
    assert gw.tier.writes.rate_bytes_s == 5 << 20
    gw.tier.configure(None, 0)
    assert gw.tier.writes.rate_bytes_s is None


def test_memory_stays_bounded_however_many_conversations_pass() -> None:
    policy = WritePolicy()
    for i in range(SEEN + 500):
        if i % 2:
            policy.named(_key(i))
        policy.turn(_key(i), "t")
        policy.reason(_key(i), "t")
    assert len(policy._seen) == SEEN
    assert policy.reason(_key(1), "t") == (False, "one_shot"), "forgotten: counted as new, never named"
    # A conversation whose slot the child gave to another request (an anonymous one) is never replaced
    # by us: its mark that the slot holds a newer state than its file must not stay forever.
    tier = DiskTier("m")
    for i in range(SEEN + 10):
        tier.after_turn(Turn(_key(i), "t"), 10, 0)
    assert len(tier._dirty) == SEEN
