"""A lane's slot map is for one child: a new generation, or a new per-boot secret at the same generation
(an on_demand model loaded again after an unload starts a fresh supervisor, whose first child is
generation 1 again), renews it: no conversation is believed to be in a slot of a child that never saw
it."""

from __future__ import annotations

from proxy.models.lane import Lane, ModelEntry
from proxy.settings import TenantSettings
from tests.fakes.fake_upstream import StaticSource, snapshot_for


async def test_a_new_child_at_the_same_generation_gets_a_new_slot_map() -> None:
    source = StaticSource(snapshot_for("http://127.0.0.1:1", "first-boot", slots=2))
    lane = Lane(ModelEntry("m", (), source), [TenantSettings("t")])
    lane.snapshot()
    permit = await lane.gate.acquire("t", conversation="a" * 32, placeable=True)
    permit.release()
    assert lane.gate.holding("a" * 32) is not None
    lane.snapshot()  # the same child: the map stays
    assert lane.gate.holding("a" * 32) is not None
    source.update(base_url=None, secret=None, ready=False, state="UNLOADED")  # unloaded: nothing asked
    lane.snapshot()
    source.update(base_url="http://127.0.0.1:2", secret="second-boot", ready=True, state="READY")
    lane.snapshot()  # generation 1 again, another child
    assert lane.gate.holding("a" * 32) is None
    assert lane.gate.placed()[0] == ["<empty>", "<empty>"]
