"""The slot map: a conversation goes back to its slot when it is free, empty slots are filled first (the
highest-numbered), otherwise the slot used longest ago; requests the child places make every other slot
unknown; the gate frees a pinned slot only when it counts the slot free (after a linger too)."""

from __future__ import annotations

import asyncio

from proxy.admission.gate import SlotGate
from proxy.conversations.slots import EMPTY, UNKNOWN, SlotMap
from tests.unit.proxy.admission.test_admission import settle, tenant


def test_a_conversation_returns_to_its_free_slot() -> None:
    m = SlotMap(2)
    a = m.take("A")
    assert a.slot == 1  # the highest-numbered empty slot first
    b = m.take("B")
    assert b.slot == 0 and m.held == ["B", "A"]
    a.free()
    b.free()
    for _ in range(3):  # alternating, each goes back to its own slot
        pa, pb = m.take("A"), m.take("B")
        assert (pa.slot, pb.slot) == (1, 0)
        pa.free()
        pb.free()


def test_a_new_conversation_takes_an_empty_slot_before_replacing_one() -> None:
    m = SlotMap(3)
    m.take("A").free()
    assert m.take("B").slot == 1  # slot 0 still empty; A's slot 2 is kept
    assert m.held == [EMPTY, "B", "A"]


def test_without_an_empty_slot_the_least_recently_used_is_replaced() -> None:
    m = SlotMap(2)
    m.take("A").free()  # slot 1
    m.take("B").free()  # slot 0
    m.take("A").free()  # slot 1 again: B's slot 0 is now the older
    c = m.take("C")
    assert c.slot == 0 and m.held == ["C", "A"]


def test_a_busy_slot_is_never_chosen_and_the_turn_does_not_wait() -> None:
    m = SlotMap(2)
    first = m.take("A")  # A's slot is busy with A's own request
    second = m.take("A")
    assert first.slot == 1 and second.slot == 0
    assert m.busy == [True, True]
    first.free()
    first.free()  # idempotent
    assert m.busy == [True, False]


def test_requests_the_child_places_leave_the_map_unknown() -> None:
    m = SlotMap(3)
    a = m.take("A")
    wide = m.take("B", width=2)  # n=2: the child chooses its slots
    assert wide.slot is None and m.anonymous == 2
    during = m.take("C")  # while it runs nobody knows which slots are free: unpinned
    assert during.slot is None and m.anonymous == 3
    embed = m.take(None, placeable=False)
    assert embed.slot is None
    for p in (wide, during, embed):
        p.free()
    assert m.anonymous == 0 and m.held == [UNKNOWN, UNKNOWN, "A"] and m.busy == [False, False, True]
    a.free()
    assert m.take("A").slot == 2


async def test_the_gate_frees_the_slot_when_it_counts_it_free() -> None:
    adm = SlotGate([tenant("a")], capacity=2)
    permit = await adm.acquire("a", conversation="A", placeable=True)  # the gate places it
    assert permit.pin is not None and permit.pin.slot is not None
    settled = asyncio.Event()

    async def confirm() -> None:
        await settled.wait()

    permit.release(0.01, confirm)  # abandoned: the child may still be on it
    await asyncio.sleep(0.05)
    assert adm.placed()[1] == [False, True] and adm.lingering == 1
    settled.set()
    await settle()
    assert adm.placed()[1] == [False, False] and adm.lingering == 0


async def test_a_new_child_gets_a_new_map() -> None:
    adm = SlotGate([tenant("a")], capacity=2)
    permit = await adm.acquire("a", conversation="A" * 32, placeable=True)
    assert adm.holding("A" * 32) is not None and adm.generation == 0
    adm.set_capacity(2, generation=1)  # the child restarted
    assert adm.generation == 1 and adm.placed() == ([EMPTY, EMPTY], [False, False])
    permit.release()  # frees the old child's slot, not the new one's
    assert adm.placed()[1] == [False, False]


def test_a_conversation_running_twice_keeps_its_newest_slot_through_an_anonymous_request() -> None:
    m = SlotMap(3)
    first = m.take("A")  # slot 2
    second = m.take("A")  # A's slot is busy: slot 1, which now holds A's newest state
    first.free()
    wide = m.take("B", width=1, placeable=False)  # the child places it
    wide.free()  # slots 2 and 0 become unknown; slot 1, still running A, keeps it
    assert m.holding("A") == 1 and m.held == [UNKNOWN, "A", UNKNOWN]
    second.free()
    assert m.take("A").slot == 1


def test_many_slots_cost_a_lookup_not_a_scan() -> None:
    m = SlotMap(4096)
    pins = [m.take(f"c{i}") for i in range(4096)]
    assert [p.slot for p in pins[:2]] == [4095, 4094]
    for p in pins:
        p.free()
    assert m.take("c17").slot == pins[17].slot  # found by key among 4,096 free slots
