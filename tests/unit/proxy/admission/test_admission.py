"""The admission controller, driven directly: pure asyncio, no sockets, no sleeps.

``settle()`` lets every ready task run (a few loop turns); nothing here waits for wall-clock time except
the queue-timeout tests, whose deadline *is* the behaviour under test (tens of milliseconds).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from proxy.admission.gate import Permit, SlotGate
from proxy.errors import Forbidden, Rejected
from proxy.settings import TenantSettings


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def tenant(name: str, **kw: object) -> TenantSettings:
    base: dict[str, object] = {"max_concurrency": 10, "max_queue": 100, "queue_timeout_s": 30.0, "weight": 1}
    base.update(kw)
    return TenantSettings(name, **base)  # type: ignore[arg-type]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def loads(adm: SlotGate) -> dict[str, tuple[int, int]]:
    return {load.name: (load.in_flight, load.queued) for load in adm.loads()}


async def test_grants_at_once_up_to_tenant_limit_then_queues() -> None:
    adm = SlotGate([tenant("a", max_concurrency=2)], capacity=4)
    p1 = await adm.acquire("a")
    p2 = await adm.acquire("a")
    third = asyncio.ensure_future(adm.acquire("a"))
    await settle()
    assert not third.done()
    assert loads(adm) == {"a": (2, 1)}
    p1.release()
    await settle()
    p3 = third.result()
    assert p3.queue_wait_s >= 0
    assert loads(adm) == {"a": (2, 0)}
    for p in (p2, p3):
        p.release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_global_gate_is_the_slot_count() -> None:
    adm = SlotGate([tenant("a"), tenant("b")], capacity=3)
    held = [await adm.acquire("a"), await adm.acquire("b"), await adm.acquire("a")]
    blocked = asyncio.ensure_future(adm.acquire("b"))
    await settle()
    assert not blocked.done() and adm.in_flight == 3
    held[0].release()
    await settle()
    assert blocked.done() and adm.in_flight == 3
    for p in [*held[1:], blocked.result()]:
        p.release()
    assert adm.in_flight == 0


async def test_tenant_limit_holds_while_global_capacity_is_free() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1), tenant("b")], capacity=4)
    pa = await adm.acquire("a")
    waiting_a = asyncio.ensure_future(adm.acquire("a"))
    pb = await adm.acquire("b")  # b is not held up behind a's queue
    await settle()
    assert not waiting_a.done()
    assert loads(adm) == {"a": (1, 1), "b": (1, 0)}
    pa.release()
    await settle()
    waiting_a.result().release()
    pb.release()


async def test_full_queue_is_refused_at_once_with_an_estimate_from_service_times() -> None:
    clock = FakeClock()
    adm = SlotGate([tenant("a", max_concurrency=1, max_queue=2)], capacity=4, clock=clock)
    # Two completed requests of 4 s each teach the controller the service time.
    for _ in range(2):
        p = await adm.acquire("a")
        clock.now += 4.0
        p.release()
    held = await adm.acquire("a")
    queued = [asyncio.ensure_future(adm.acquire("a")) for _ in range(2)]
    await settle()
    with pytest.raises(Rejected) as info:
        await adm.acquire("a")
    assert info.value.reason == "queue_full"
    assert info.value.status == 429
    # One slot of concurrency, 4 s per request: the first queue place frees in about 4 s.
    assert info.value.retry_after_s == pytest.approx(4.0)
    assert info.value.headers["retry-after"] == "4"
    held.release()
    await settle()
    queued[0].result().release()
    await settle()
    queued[1].result().release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_retry_after_grows_with_the_queue_and_the_service_time() -> None:
    clock = FakeClock()
    adm = SlotGate([tenant("a", max_concurrency=2, max_queue=0)], capacity=4, clock=clock)
    p = await adm.acquire("a")
    clock.now += 10.0
    p.release()
    held = [await adm.acquire("a"), await adm.acquire("a")]
    with pytest.raises(Rejected) as info:
        await adm.acquire("a")
    assert info.value.retry_after_s == pytest.approx(5.0)  # 10 s per request over 2 parallel slots
    for p in held:
        p.release()


async def test_retry_after_on_a_queue_timeout_grows_with_the_requests_still_waiting() -> None:
    clock = FakeClock()
    adm = SlotGate(
        [tenant("a", max_concurrency=2, max_queue=10, queue_timeout_s=0.02)], capacity=4, clock=clock
    )
    p = await adm.acquire("a")
    clock.now += 3.0  # one completed request of 3 s: the service time
    p.release()
    held = [await adm.acquire("a"), await adm.acquire("a")]
    waiting = [asyncio.ensure_future(adm.acquire("a")) for _ in range(4)]
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, Rejected) and r.reason == "queue_timeout" for r in results), results
    # Each one, as it leaves, sees k requests still queued behind the same 2 slots of concurrency:
    # 3 s x (k + 1) / 2 for k = 3, 2, 1, 0 (in whatever order the deadlines fire).
    rejected = [r for r in results if isinstance(r, Rejected)]
    assert sorted(r.retry_after_s for r in rejected) == [1.5, 3.0, 4.5, 6.0]
    # Whole seconds, rounded up: "not before this".
    assert sorted(r.headers["retry-after"] for r in rejected) == ["2", "3", "5", "6"]
    for p in held:
        p.release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_retry_after_on_a_full_queue_is_when_the_first_place_frees() -> None:
    clock = FakeClock()
    # 8 allowed but only 2 slots: the estimate divides by what can really run at once.
    adm = SlotGate([tenant("a", max_concurrency=8, max_queue=3)], capacity=2, clock=clock)
    p = await adm.acquire("a")
    clock.now += 3.0
    p.release()
    held = [await adm.acquire("a"), await adm.acquire("a")]
    queued = [asyncio.ensure_future(adm.acquire("a")) for _ in range(3)]
    await settle()
    with pytest.raises(Rejected) as info:
        await adm.acquire("a")
    assert info.value.reason == "queue_full"
    assert info.value.retry_after_s == 1.5  # 3 s / 2 slots: one queue place frees
    assert info.value.headers["retry-after"] == "2"
    for w in queued:
        w.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    for p in held:
        p.release()
    assert adm.in_flight == 0 and adm.queued == 0


@pytest.mark.parametrize(
    ("seconds", "header"),
    [(0.0, "1"), (0.001, "1"), (1.0, "1"), (1.01, "2"), (2.5, "3"), (4.0, "4"), (4.5, "5"), (59.2, "60")],
)
def test_retry_after_header_is_whole_seconds_rounded_up_at_least_1(seconds: float, header: str) -> None:
    assert Rejected("queue_full", seconds, "x").headers == {"retry-after": header}


async def test_wait_deadline_answers_429_and_leaves_the_queue() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1, queue_timeout_s=0.02)], capacity=4)
    held = await adm.acquire("a")
    with pytest.raises(Rejected) as info:
        await adm.acquire("a")
    assert info.value.reason == "queue_timeout"
    assert adm.queued == 0 and adm.in_flight == 1
    held.release()
    assert adm.in_flight == 0


async def test_fifo_within_a_tenant() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1)], capacity=1)
    first = await adm.acquire("a")
    order: list[int] = []

    async def take(i: int) -> None:
        p = await adm.acquire("a")
        order.append(i)
        await asyncio.sleep(0)
        p.release()

    tasks = [asyncio.ensure_future(take(i)) for i in range(5)]
    await settle()
    first.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]


async def test_turns_alternate_between_equal_tenants_so_a_burst_cannot_starve_another() -> None:
    adm = SlotGate([tenant("burst"), tenant("calm")], capacity=1)
    held = await adm.acquire("burst")
    grants: list[str] = []

    async def take(name: str) -> None:
        p = await adm.acquire(name)
        grants.append(name)
        await asyncio.sleep(0)
        p.release()

    burst = [asyncio.ensure_future(take("burst")) for _ in range(20)]
    await settle()
    calm = [asyncio.ensure_future(take("calm")) for _ in range(3)]  # arrives after 20 queued requests
    await settle()
    held.release()
    await asyncio.gather(*burst, *calm)
    # calm gets every other turn while both are backlogged, not the 21st.
    assert grants[:6] == ["calm", "burst", "calm", "burst", "calm", "burst"] or grants[:6] == [
        "burst",
        "calm",
        "burst",
        "calm",
        "burst",
        "calm",
    ]
    assert grants.count("calm") == 3 and grants.index("calm") <= 1


async def test_weights_share_freed_slots_proportionally() -> None:
    adm = SlotGate([tenant("heavy", weight=3), tenant("light", weight=1)], capacity=1)
    gate = await adm.acquire("light")
    grants: list[str] = []

    async def take(name: str) -> None:
        p = await adm.acquire(name)
        grants.append(name)
        await asyncio.sleep(0)
        p.release()

    tasks = [asyncio.ensure_future(take(n)) for n in ["heavy"] * 40 + ["light"] * 40]
    await settle()
    gate.release()
    await asyncio.gather(*tasks)
    window = grants[:40]  # while both are backlogged
    # 3:1 up to one turn of phase (stride scheduling's bound).
    assert abs(window.count("heavy") - 30) <= 1
    # ... and at every point, never more than one turn away from the ideal share.
    for n in range(4, 41, 4):
        assert abs(grants[:n].count("light") - n / 4) <= 1


async def test_idle_tenant_earns_no_credit() -> None:
    adm = SlotGate([tenant("a"), tenant("b")], capacity=1)
    # a is served alone for a long while (fast path), b idles.
    for _ in range(50):
        (await adm.acquire("a")).release()
    gate = await adm.acquire("a")
    grants: list[str] = []

    async def take(name: str) -> None:
        p = await adm.acquire(name)
        grants.append(name)
        await asyncio.sleep(0)
        p.release()

    tasks = [asyncio.ensure_future(take(n)) for n in ["b"] * 10 + ["a"] * 10]
    await settle()
    gate.release()
    await asyncio.gather(*tasks)
    # b does not get 50 turns in a row for having idled: within one turn of alternating from the start.
    runs = "".join(grants[:20]).replace("a", " a ").split()
    assert max(len(run) for run in runs if run.startswith("b")) <= 2
    assert grants[:6].count("a") >= 2


async def test_cancelled_waiter_leaves_the_queue_and_takes_nothing() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1)], capacity=1)
    held = await adm.acquire("a")
    waiter = asyncio.ensure_future(adm.acquire("a"))
    await settle()
    assert adm.queued == 1
    waiter.cancel()
    await settle()
    assert adm.queued == 0
    held.release()
    assert adm.in_flight == 0


async def test_permit_granted_in_the_same_turn_as_a_cancel_is_given_back() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1)], capacity=1)
    held = await adm.acquire("a")
    waiter = asyncio.ensure_future(adm.acquire("a"))
    await settle()
    held.release()  # grants the permit to the waiter's future ...
    waiter.cancel()  # ... and the waiter is cancelled before it could run
    await settle()
    assert waiter.cancelled()
    assert adm.in_flight == 0 and adm.queued == 0
    (await adm.acquire("a")).release()


async def test_release_is_idempotent() -> None:
    adm = SlotGate([tenant("a")], capacity=2)
    p = await adm.acquire("a")
    p.release()
    p.release()
    assert adm.in_flight == 0
    assert isinstance(await adm.acquire("a"), Permit)


async def test_capacity_follows_the_child_and_shrinking_revokes_nothing() -> None:
    adm = SlotGate([tenant("a")], capacity=0)
    waiting = [asyncio.ensure_future(adm.acquire("a")) for _ in range(3)]
    await settle()
    assert adm.queued == 3
    adm.set_capacity(2)
    await settle()
    assert sum(t.done() for t in waiting) == 2
    adm.set_capacity(1)
    assert adm.in_flight == 2  # nobody is thrown out
    for t in waiting[:2]:
        t.result().release()
    await settle()
    assert waiting[2].done() and adm.in_flight == 1
    waiting[2].result().release()


async def test_reload_raises_a_limit_and_admits_waiters() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1)], capacity=4)
    held = await adm.acquire("a")
    waiting = asyncio.ensure_future(adm.acquire("a"))
    await settle()
    adm.reconfigure([tenant("a", max_concurrency=2)])
    await settle()
    assert waiting.done()
    held.release()
    waiting.result().release()
    assert adm.in_flight == 0


async def test_reload_that_removes_a_tenant_keeps_its_permits_consistent() -> None:
    adm = SlotGate([tenant("gone", max_concurrency=1), tenant("stays")], capacity=2)
    held = await adm.acquire("gone")
    queued = asyncio.ensure_future(adm.acquire("gone"))
    await settle()
    adm.reconfigure([tenant("stays")])
    with pytest.raises(Forbidden):
        await adm.acquire("gone")
    assert "gone" in loads(adm)  # still holds a permit and a waiter
    held.release()
    await settle()
    queued.result().release()
    assert "gone" not in loads(adm)
    assert adm.in_flight == 0 and adm.queued == 0
    # Re-adding the tenant later starts clean.
    adm.reconfigure([tenant("stays"), tenant("gone", max_concurrency=1)])
    (await adm.acquire("gone")).release()


async def test_unknown_tenant_is_forbidden() -> None:
    adm = SlotGate([tenant("a")], capacity=1)
    with pytest.raises(Forbidden):
        await adm.acquire("b")


async def test_wait_idle() -> None:
    adm = SlotGate([tenant("a")], capacity=1)
    assert await adm.wait_idle(0.0)
    p = await adm.acquire("a")
    idle = asyncio.ensure_future(adm.wait_idle(5.0))
    await settle()
    assert not idle.done()
    p.release()
    assert await idle
    p2 = await adm.acquire("a")
    assert not await adm.wait_idle(0.01)
    p2.release()


async def test_storm_of_cancellations_and_timeouts_leaves_nothing_behind() -> None:
    rng = random.Random(7)
    adm = SlotGate(
        [
            tenant("a", max_concurrency=2, max_queue=20, queue_timeout_s=0.05, weight=2),
            tenant("b", max_concurrency=3, max_queue=5, queue_timeout_s=0.05),
            tenant("c", max_concurrency=1, max_queue=50, queue_timeout_s=0.05),
        ],
        capacity=4,
    )
    outcomes: dict[str, int] = {"ok": 0, "rejected": 0, "cancelled": 0}
    concurrent = {"a": 0, "b": 0, "c": 0}
    most = {"a": 0, "b": 0, "c": 0}  # highest concurrency each tenant reached
    most_total = 0
    limits = {"a": 2, "b": 3, "c": 1}

    async def client(name: str) -> None:
        nonlocal most_total
        try:
            permit = await adm.acquire(name)
        except Rejected:
            outcomes["rejected"] += 1
            return
        concurrent[name] += 1
        most[name] = max(most[name], concurrent[name])
        most_total = max(most_total, adm.in_flight)
        try:
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            outcomes["ok"] += 1
        finally:
            concurrent[name] -= 1
            permit.release()

    tasks = [asyncio.ensure_future(client(rng.choice("abc"))) for _ in range(400)]
    for _ in range(60):
        await asyncio.sleep(0)
        for t in rng.sample(tasks, 8):
            t.cancel()
        if rng.random() < 0.2:
            adm.reconfigure(
                [
                    tenant(
                        "a", max_concurrency=2, max_queue=20, queue_timeout_s=0.05, weight=rng.randint(1, 3)
                    ),
                    tenant("b", max_concurrency=3, max_queue=5, queue_timeout_s=0.05),
                    tenant("c", max_concurrency=1, max_queue=50, queue_timeout_s=0.05),
                ]
            )
    results = await asyncio.gather(*tasks, return_exceptions=True)
    # Every task ended normally or by our cancel: anything else (an AssertionError, a stray exception
    # from the controller) would otherwise be swallowed by return_exceptions.
    unexpected = [r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)]
    assert not unexpected, unexpected[:3]
    outcomes["cancelled"] = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert outcomes["ok"] > 0 and outcomes["cancelled"] > 0 and outcomes["rejected"] > 0
    # No tenant ever passed its limit, and the storm is heavy enough to push against them.
    assert all(most[name] <= limits[name] for name in limits), most
    assert most["a"] == limits["a"] and most["c"] == limits["c"], most
    assert most_total == 4  # the global gate, reached and held
    assert adm.in_flight == 0
    assert adm.queued == 0
    assert all(v == (0, 0) for v in loads(adm).values())


async def test_lingering_slot_is_held_after_an_abandoned_request() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1), tenant("b")], capacity=1)
    p = await adm.acquire("a")
    p.release(linger_s=0.05)  # the child is still busy with the abandoned request
    assert adm.lingering == 1 and adm.in_flight == 0
    assert loads(adm)["a"] == (0, 0)  # the tenant's share is back at once
    waiting = asyncio.ensure_future(adm.acquire("b"))
    await settle()
    assert not waiting.done()  # but the slot is not handed out yet
    (await waiting).release()  # granted once the linger ends
    assert adm.lingering == 0 and adm.in_flight == 0


# --- a replay takes its place back at the head of its tenant's queue (proxy.routes.replay) -------------
async def test_front_goes_ahead_of_its_tenants_queue() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1)], capacity=4)
    held = await adm.acquire("a")
    behind = asyncio.ensure_future(adm.acquire("a"))
    await settle()
    replay = asyncio.ensure_future(adm.acquire("a", front=True))
    await settle()
    assert loads(adm) == {"a": (1, 2)}
    held.release()
    await settle()
    assert replay.done() and not behind.done()  # the replay came back first
    replay.result().release()
    await settle()
    behind.result().release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_front_is_granted_at_once_past_its_own_queue_when_a_slot_is_free() -> None:
    # The tenant's head needs two slots and one is free: the replay (one slot) takes it at once.
    adm = SlotGate([tenant("a", max_concurrency=3), tenant("b")], capacity=3)
    others = [await adm.acquire("b"), await adm.acquire("b")]
    wide = asyncio.ensure_future(adm.acquire("a", 2))
    await settle()
    assert not wide.done()
    replay = await asyncio.wait_for(adm.acquire("a", front=True), 1.0)
    assert loads(adm) == {"a": (1, 1), "b": (2, 0)} and not wide.done()
    for p in (*others, replay):
        p.release()
    await settle()
    wide.result().release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_front_is_not_refused_by_a_full_queue() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1, max_queue=1)], capacity=4)
    held = await adm.acquire("a")
    queued = asyncio.ensure_future(adm.acquire("a"))
    await settle()
    with pytest.raises(Rejected):
        await adm.acquire("a")  # a new request: the queue is full
    replay = asyncio.ensure_future(adm.acquire("a", front=True))
    await settle()
    assert loads(adm) == {"a": (1, 2)}
    held.release()
    await settle()
    replay.result().release()
    await settle()
    queued.result().release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_front_takes_no_other_tenants_turn() -> None:
    # b has waited its turn; a's replay goes ahead of a's own queue only, not of b.
    adm = SlotGate([tenant("a"), tenant("b")], capacity=1)
    held = await adm.acquire("a")
    b_waiting = asyncio.ensure_future(adm.acquire("b"))
    await settle()
    replay = asyncio.ensure_future(adm.acquire("a", front=True))
    await settle()
    assert not replay.done()
    held.release()  # a just had a grant: b's pass is lower
    await settle()
    assert b_waiting.done() and not replay.done()
    b_waiting.result().release()
    await settle()
    replay.result().release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_a_cancelled_front_waiter_leaves_nothing() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1)], capacity=4)
    held = await adm.acquire("a")
    replay = asyncio.ensure_future(adm.acquire("a", front=True))
    await settle()
    replay.cancel()
    await settle()
    assert loads(adm) == {"a": (1, 0)}
    held.release()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_replays_of_one_tenant_keep_their_order_at_the_head() -> None:
    adm = SlotGate([tenant("a", max_concurrency=1)], capacity=4)
    held = await adm.acquire("a")
    new = asyncio.ensure_future(adm.acquire("a"))
    await settle()
    first = asyncio.ensure_future(adm.acquire("a", front=True))
    await settle()
    second = asyncio.ensure_future(adm.acquire("a", front=True))
    await settle()
    order = []
    permit = held
    for _ in range(3):
        permit.release()
        await settle()
        done = next(f for f in (first, second, new) if f.done() and f not in order)
        order.append(done)
        permit = done.result()
    permit.release()
    assert order == [first, second, new]
    assert adm.in_flight == 0 and adm.queued == 0
