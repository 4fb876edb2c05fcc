"""Priorities with aging in the admission gate, on its fake clock: strict order when slots are scarce,
the fair share within a priority, and the documented bound on how long newcomers of a higher priority
may overtake a waiting request."""

from __future__ import annotations

import asyncio

import pytest

from proxy.admission.gate import AGING_S_PER_LEVEL, Permit, PriorityLoad, SlotGate
from proxy.errors import Rejected
from proxy.settings import PRIORITY_LEVELS, parse_priority
from tests.unit.proxy.admission.test_admission import FakeClock, settle, tenant

INTERACTIVE, DEFAULT, BATCH = (PRIORITY_LEVELS[n] for n in ("interactive", "default", "batch"))
# How long interactive newcomers may overtake a waiting batch request (module docstring, configuration.md).
BOUND_S = (INTERACTIVE - BATCH) * AGING_S_PER_LEVEL


def test_the_documented_bound_is_ten_seconds_for_batch_behind_interactive() -> None:
    assert BOUND_S == 10.0


async def test_interactive_request_goes_before_a_batch_tenants_queue() -> None:
    clock = FakeClock()
    adm = SlotGate(
        [tenant("batch", max_concurrency=1, priority=BATCH), tenant("chat", priority=INTERACTIVE)],
        capacity=1,
        clock=clock,
    )
    # The chat tenant was served a while ago: by the fair share alone it would now wait its turn.
    for _ in range(3):
        (await adm.acquire("chat")).release()
    running = await adm.acquire("batch")
    queued = [asyncio.ensure_future(adm.acquire("batch")) for _ in range(4)]
    await settle()
    chat = asyncio.ensure_future(adm.acquire("chat"))
    await settle()
    assert not chat.done() and adm.queued == 5
    running.release()
    await settle()
    assert chat.done() and not any(q.done() for q in queued)  # the interactive one is admitted next
    assert chat.result().priority == INTERACTIVE
    chat.result().release()
    for q in queued:
        await settle()
        q.result().release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_batch_request_gets_its_turn_within_the_bound_while_interactive_ones_keep_coming() -> None:
    clock = FakeClock()
    step = 0.5  # service time of every request
    adm = SlotGate(
        [tenant("batch", max_concurrency=1, priority=BATCH), tenant("chat", priority=INTERACTIVE)],
        capacity=1,
        clock=clock,
    )
    arrived: dict[asyncio.Future[Permit], tuple[str, float]] = {}

    def send(name: str) -> asyncio.Future[Permit]:
        fut = asyncio.ensure_future(adm.acquire(name))
        arrived[fut] = (name, clock.now)
        return fut

    start = clock.now
    running = await adm.acquire("chat")
    batch = [send("batch") for _ in range(4)]
    chat = [send("chat")]
    await settle()
    grants: list[tuple[str, float, float]] = []  # (tenant, arrived, granted)
    for _ in range(80):
        clock.now += step
        chat.append(send("chat"))  # interactive work never stops arriving
        await settle()
        running.release()
        await settle()
        done = [f for f in [*batch, *chat] if f.done()]
        assert len(done) == 1
        fut = done[0]
        name, at = arrived.pop(fut)
        grants.append((name, at, clock.now))
        running = fut.result()
        if name == "batch":
            batch.remove(fut)
            batch.append(send("batch"))  # the batch tenant keeps 4 queued
            await settle()  # queued now, at the time it is recorded as arrived
        else:
            chat.remove(fut)
    first_batch = next(g for g in grants if g[0] == "batch")
    # Strict while the batch requests are young, and their turn comes once the bound has passed: the
    # first one waited at most the bound plus the one request in service when it was reached.
    assert grants[0][0] == "chat"
    assert first_batch[2] - start <= BOUND_S + step
    assert sum(name == "batch" for name, _, _ in grants) >= 10
    # The bound, exactly: no interactive request that arrived BOUND_S or more after a batch request
    # was admitted before it.
    for name, at, granted in grants:
        if name != "chat":
            continue
        passed = [b_at for b_name, b_at, b_granted in grants if b_name == "batch" and b_granted > granted]
        passed += [arrived[f][1] for f in batch]  # still waiting at the end
        assert all(at - b_at < BOUND_S for b_at in passed if b_at <= at), (at, passed)
    running.release()
    for f in [*batch, *chat]:
        f.cancel()
    await asyncio.gather(*batch, *chat, return_exceptions=True)
    assert adm.in_flight == 0 and adm.queued == 0


async def test_equal_priorities_keep_the_fair_share_between_other_priorities() -> None:
    clock = FakeClock()
    adm = SlotGate(
        [
            tenant("a", priority=INTERACTIVE),
            tenant("b", priority=INTERACTIVE),
            tenant("bulk", priority=BATCH),
        ],
        capacity=1,
        clock=clock,
    )
    gate = await adm.acquire("bulk")
    grants: list[str] = []

    async def take(name: str) -> None:
        p = await adm.acquire(name)
        grants.append(name)
        await asyncio.sleep(0)
        p.release()

    tasks = [asyncio.ensure_future(take(n)) for n in ["bulk"] * 3 + ["a"] * 6 + ["b"] * 3]
    await settle()
    gate.release()
    await asyncio.gather(*tasks)
    # a and b alternate (equal weights) until b runs out; bulk only after them (the clock stood still).
    assert grants[:6] == ["a", "b", "a", "b", "a", "b"]
    assert grants[6:] == ["a", "a", "a", "bulk", "bulk", "bulk"]


async def test_a_request_may_lower_its_priority_but_never_raise_it() -> None:
    clock = FakeClock()
    adm = SlotGate(
        [
            tenant("bulk", priority=BATCH),
            tenant("plain", priority=DEFAULT),
            tenant("chat", priority=INTERACTIVE),
        ],
        capacity=1,
        clock=clock,
    )
    gate = await adm.acquire("plain")
    # Asked for above its tenant's: clamped to batch. Asked for batch by an interactive tenant: batch.
    raised = asyncio.ensure_future(adm.acquire("bulk", priority=100))
    lowered = asyncio.ensure_future(adm.acquire("chat", priority=BATCH))
    await settle()
    plain = asyncio.ensure_future(adm.acquire("plain"))
    await settle()
    assert [load for load in adm.priority_loads() if load.queued] == [
        PriorityLoad(DEFAULT, 1, 1),
        PriorityLoad(BATCH, 0, 2),
    ]
    gate.release()
    await settle()
    assert plain.done() and not raised.done() and not lowered.done()
    plain.result().release()
    await settle()
    assert raised.done() and raised.result().priority == BATCH  # arrived first, among equals
    raised.result().release()
    await settle()
    assert lowered.result().priority == BATCH
    lowered.result().release()
    assert adm.in_flight == 0


async def test_a_tenants_lowered_request_lets_its_other_requests_pass() -> None:
    adm = SlotGate([tenant("chat", max_concurrency=1, priority=INTERACTIVE)], capacity=4, clock=FakeClock())
    held = await adm.acquire("chat")
    background = asyncio.ensure_future(adm.acquire("chat", priority=BATCH))
    await settle()
    urgent = asyncio.ensure_future(adm.acquire("chat"))
    await settle()
    held.release()
    await settle()
    assert urgent.done() and not background.done()
    urgent.result().release()
    await settle()
    background.result().release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_higher_priority_takes_a_slot_a_wide_lower_one_waits_for_until_that_one_has_aged() -> None:
    clock = FakeClock()
    adm = SlotGate(
        [tenant("bulk", priority=BATCH), tenant("chat", priority=INTERACTIVE)], capacity=2, clock=clock
    )
    held = await adm.acquire("chat")
    wide = asyncio.ensure_future(adm.acquire("bulk", 2))  # needs both slots; one is free
    await settle()
    quick = asyncio.ensure_future(adm.acquire("chat"))
    await settle()
    assert quick.done() and not wide.done()  # at once: it is ahead of the young batch request
    quick.result().release()
    await settle()
    clock.now += BOUND_S  # the wide batch request has now waited the bound
    late = asyncio.ensure_future(adm.acquire("chat"))
    await settle()
    assert not late.done()  # head-of-line again: the free slot is kept for the aged wide request
    held.release()
    await settle()
    assert wide.done() and not late.done()
    wide.result().release()
    await settle()
    late.result().release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_priority_loads_count_slots_in_flight_and_requests_queued_per_priority() -> None:
    adm = SlotGate(
        [tenant("bulk", priority=BATCH), tenant("chat", priority=INTERACTIVE)], capacity=3, clock=FakeClock()
    )
    assert adm.priority_loads() == [PriorityLoad(INTERACTIVE, 0, 0), PriorityLoad(BATCH, 0, 0)]
    wide = await adm.acquire("chat", 2)
    low = await adm.acquire("chat", priority=3)
    waiting = asyncio.ensure_future(adm.acquire("bulk"))
    await settle()
    assert adm.priority_loads() == [
        PriorityLoad(INTERACTIVE, 2, 0),
        PriorityLoad(3, 1, 0),
        PriorityLoad(BATCH, 0, 1),
    ]
    wide.release(linger_s=60.0)  # lingering slots are the child's, no longer a priority's
    await settle()
    low.release()
    await settle()
    assert adm.priority_loads() == [PriorityLoad(INTERACTIVE, 0, 0), PriorityLoad(BATCH, 1, 0)]
    waiting.result().release()


async def test_a_requests_own_maximum_wait_is_capped_by_its_tenants_queue_timeout() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1, queue_timeout_s=30.0)], capacity=1)
    held = await adm.acquire("a")
    with pytest.raises(Rejected) as info:
        await asyncio.wait_for(adm.acquire("a", max_wait_s=0.02), 5.0)
    assert info.value.reason == "queue_timeout"
    assert "waited 0.02 s" in str(info.value) and "the request's own maximum wait" in str(info.value)
    with pytest.raises(Rejected) as info:
        await adm.acquire("a", max_wait_s=0)  # now or never
    assert info.value.reason == "queue_timeout" and adm.queued == 0
    short = SlotGate([tenant("a", max_concurrency=1, queue_timeout_s=0.02)], capacity=1)
    other = await short.acquire("a")
    with pytest.raises(Rejected) as info:
        # Asking for longer than the tenant allows gets the tenant's limit, not an hour.
        await asyncio.wait_for(short.acquire("a", max_wait_s=3600.0), 5.0)
    assert "waited 0.02 s" in str(info.value) and "own maximum" not in str(info.value)
    held.release()
    other.release()
    assert (await adm.acquire("a", max_wait_s=0)).slots == 1  # free: granted, no wait needed
    assert adm.queued == 0 and short.queued == 0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
async def test_a_bad_maximum_wait_is_a_clear_error(bad: float) -> None:
    adm = SlotGate([tenant("a")], capacity=1)
    with pytest.raises(ValueError, match="max_wait_s must be a finite number >= 0"):
        await adm.acquire("a", max_wait_s=bad)
    assert adm.in_flight == 0 and adm.queued == 0


@pytest.mark.parametrize(
    ("raw", "value"),
    [("interactive", 10), ("default", 5), ("batch", 0), ("Batch", 0), (7, 7), ("42", 42), (0, 0), (100, 100)],
)
def test_priorities_by_name_or_number(raw: object, value: int) -> None:
    assert parse_priority(raw) == value


@pytest.mark.parametrize("raw", ["urgent", -1, 101, "1.5", 2.0, True, None, ""])
def test_a_bad_priority_names_the_choices(raw: object) -> None:
    with pytest.raises(
        ValueError, match=r"must be interactive \(10\), default \(5\), batch \(0\) or an integer 0-100"
    ):
        parse_priority(raw)
