"""Permits for several slots at once: all or nothing, counted against the tenant and the gate, queued
fairly (a wide request is not starved by narrow ones), and released or abandoned whole."""

from __future__ import annotations

import asyncio

from proxy.admission.gate import SlotGate
from tests.unit.proxy.admission.test_admission import loads, settle, tenant


async def test_a_wide_permit_counts_every_slot() -> None:
    adm = SlotGate([tenant("a", max_concurrency=2), tenant("b")], capacity=3)
    wide = await adm.acquire("a", 2)
    assert wide.slots == 2 and adm.in_flight == 2 and loads(adm)["a"] == (2, 0)
    one = await adm.acquire("b")
    blocked = asyncio.ensure_future(adm.acquire("b"))
    await settle()
    assert not blocked.done() and adm.in_flight == 3
    wide.release()
    await settle()
    assert blocked.done() and adm.in_flight == 2
    for p in (one, blocked.result()):
        p.release()
    assert adm.in_flight == 0


async def test_all_or_nothing_never_takes_part_of_a_request() -> None:
    adm = SlotGate([tenant("a"), tenant("b")], capacity=2)
    held = await adm.acquire("a")
    wide = asyncio.ensure_future(adm.acquire("b", 2))
    await settle()
    assert not wide.done() and adm.in_flight == 1  # nothing taken while one slot is still busy
    held.release()
    await settle()
    assert wide.done() and wide.result().slots == 2 and adm.in_flight == 2
    wide.result().release()
    assert adm.in_flight == 0


async def test_a_wide_request_is_not_starved_by_narrow_ones() -> None:
    adm = SlotGate([tenant("a"), tenant("b")], capacity=2)
    first = await adm.acquire("a")
    wide = asyncio.ensure_future(adm.acquire("b", 2))
    await settle()
    # One slot is free, but the wide request waits for it: a newcomer may not take it first.
    late = asyncio.ensure_future(adm.acquire("a"))
    await settle()
    assert not wide.done() and not late.done() and adm.in_flight == 1
    first.release()
    await settle()
    assert wide.done() and not late.done()
    wide.result().release()
    await settle()
    assert late.done()
    late.result().release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_cancelled_wide_waiter_lets_the_others_through() -> None:
    adm = SlotGate([tenant("a"), tenant("b")], capacity=2)
    first = await adm.acquire("a")
    wide = asyncio.ensure_future(adm.acquire("b", 2))
    await settle()
    late = asyncio.ensure_future(adm.acquire("a"))
    await settle()
    assert not late.done()
    wide.cancel()
    await settle()
    assert late.done() and adm.in_flight == 2
    for p in (first, late.result()):
        p.release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_tenant_limit_counts_slots() -> None:
    adm = SlotGate([tenant("a", max_concurrency=2)], capacity=4)
    one = await adm.acquire("a")
    wide = asyncio.ensure_future(adm.acquire("a", 2))
    await settle()
    assert not wide.done() and loads(adm)["a"] == (1, 1)  # 1 + 2 > 2, though the gate has room
    one.release()
    await settle()
    assert wide.done() and loads(adm)["a"] == (2, 0)
    wide.result().release()


async def test_a_request_wider_than_a_shrunk_gate_blocks_nobody() -> None:
    adm = SlotGate([tenant("a"), tenant("b")], capacity=2)
    held = await adm.acquire("a")
    wide = asyncio.ensure_future(adm.acquire("b", 2))
    await settle()
    adm.set_capacity(1)  # the child restarted with fewer slots
    held.release()
    await settle()
    assert not wide.done()
    other = await asyncio.wait_for(adm.acquire("a"), 1)
    other.release()
    wide.cancel()
    await settle()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_lingering_wide_permit_keeps_all_its_slots() -> None:
    adm = SlotGate([tenant("a"), tenant("b")], capacity=2)
    wide = await adm.acquire("a", 2)
    wide.release(linger_s=0.05)
    assert adm.in_flight == 0 and adm.lingering == 2 and loads(adm)["a"] == (0, 0)
    nxt = asyncio.ensure_future(adm.acquire("b"))
    await settle()
    assert not nxt.done()
    permit = await asyncio.wait_for(nxt, 5)
    assert adm.lingering == 0
    permit.release()
    assert await adm.wait_idle(5)


async def test_a_confirmed_linger_holds_until_the_confirmation() -> None:
    adm = SlotGate([tenant("a"), tenant("b")], capacity=1)
    permit = await adm.acquire("a")
    settled = asyncio.Event()
    permit.release(0.01, settled.wait)
    nxt = asyncio.ensure_future(adm.acquire("b"))
    await asyncio.sleep(0.05)  # well past linger_s: only the confirmation may end it now
    assert not nxt.done() and adm.lingering == 1 and adm.held == 1
    settled.set()
    (await asyncio.wait_for(nxt, 5)).release()
    assert adm.lingering == 0 and adm.held == 0


async def test_a_failing_confirmation_still_ends_the_linger() -> None:
    adm = SlotGate([tenant("a")], capacity=1)

    async def broken() -> None:
        raise RuntimeError("the child went away")

    (await adm.acquire("a")).release(0.01, broken)
    assert adm.lingering == 1
    (await asyncio.wait_for(adm.acquire("a"), 5)).release()
    assert adm.lingering == 0 and adm.held == 0
