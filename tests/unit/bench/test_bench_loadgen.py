"""Offered load: closed loop keeps exactly N in flight; open loop follows seeded Poisson arrivals."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from supervisor.bench.loadgen import MAX_SUBMISSIONS_PER_BUDGET, LoadSpec, Plan, Sent, generate


class Recorder:
    def __init__(self, service_s: float = 0.0) -> None:
        self.plans: list[Plan] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.service_s = service_s

    async def __call__(self, plan: Plan) -> Sent:
        self.plans.append(plan)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.service_s)
        self.in_flight -= 1
        return Sent()


async def test_closed_loop_sends_count_at_concurrency() -> None:
    rec = Recorder(service_s=0.005)
    n = await generate(LoadSpec("concurrency", 3, requests=10), rec)
    assert n == 10
    assert sorted(p.seq for p in rec.plans) == list(range(10))
    assert rec.max_in_flight == 3
    assert not any(p.warmup for p in rec.plans)


async def test_warmup_comes_first_and_is_flagged() -> None:
    rec = Recorder(service_s=0.001)
    n = await generate(LoadSpec("concurrency", 2, requests=4, warmup=3), rec)
    assert n == 7
    assert [p.warmup for p in sorted(rec.plans, key=lambda p: p.seq)] == [True] * 3 + [False] * 4
    # Every warm-up ends before the first measured request starts.
    first_measured = min(p.t_submit for p in rec.plans if not p.warmup)
    assert all(p.t_submit < first_measured for p in rec.plans if p.warmup)


async def test_closed_loop_duration_stops_submitting() -> None:
    # A clock that only the requests move (each takes 0.25 s of it), so the count does not depend on
    # how busy the machine is: 2 s of closed loop is exactly 8 requests, whatever the concurrency.
    now = 100.0
    plans: list[Plan] = []

    async def send(plan: Plan) -> Sent:
        nonlocal now
        plans.append(plan)
        now += 0.25
        await asyncio.sleep(0)  # let the other user run in between
        return Sent()

    n = await generate(LoadSpec("concurrency", 2, duration_s=2.0), send, clock=lambda: now)
    assert n == len(plans) == 8
    assert [p.t_submit for p in sorted(plans, key=lambda p: p.seq)] == [100.0 + 0.25 * i for i in range(8)]


async def test_open_loop_arrivals_are_seeded_and_do_not_wait_for_answers() -> None:
    async def arrivals(seed: int) -> list[float]:
        rec = Recorder(service_s=0.2)  # slower than the arrival gaps: open loop must overlap them
        await generate(LoadSpec("rate", 200.0, requests=20, seed=seed), rec)
        start = min(p.t_submit for p in rec.plans)
        assert rec.max_in_flight > 1
        return [round(p.t_submit - start, 9) for p in sorted(rec.plans, key=lambda p: p.seq)]

    a, b, c = await arrivals(1), await arrivals(1), await arrivals(2)
    assert a == b
    assert a != c
    assert a == sorted(a)


async def test_open_loop_mean_rate_is_roughly_the_requested_rate() -> None:
    rec = Recorder()
    await generate(LoadSpec("rate", 1000.0, requests=400, seed=3), rec)
    times = sorted(p.t_submit for p in rec.plans)
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert 700 < rate < 1400


async def test_open_loop_duration_bounds_arrivals() -> None:
    rec = Recorder()
    n = await generate(LoadSpec("rate", 500.0, duration_s=0.05, seed=1), rec)
    assert n == len(rec.plans) > 0
    start = min(p.t_submit for p in rec.plans)
    assert max(p.t_submit for p in rec.plans) - start <= 0.05 + 0.01


async def test_closed_loop_user_pauses_when_told() -> None:
    plans: list[Plan] = []

    async def rejecting(plan: Plan) -> Sent:
        plans.append(plan)
        return Sent(rejected=len(plans) % 2 == 1, pause_s=0.05)

    await generate(LoadSpec("concurrency", 1, requests=2), rejecting)
    gaps = [b.t_submit - a.t_submit for a, b in itertools.pairwise(plans)]
    assert gaps and all(gap >= 0.045 for gap in gaps)


async def test_closed_loop_budget_counts_admitted_requests() -> None:
    # Every other request is turned away: 6 admitted take 12 submissions, all of them sent.
    plans: list[Plan] = []

    async def half(plan: Plan) -> Sent:
        plans.append(plan)
        await asyncio.sleep(0.001)
        return Sent(rejected=plan.seq % 2 == 0)

    n = await generate(LoadSpec("concurrency", 2, requests=6), half)
    admitted = [p for p in plans if p.seq % 2 == 1]
    assert len(admitted) == 6
    assert n == len(plans) >= 12
    assert sorted(p.seq for p in plans) == list(range(n))


async def test_closed_loop_gives_up_on_a_server_that_rejects_everything() -> None:
    plans: list[Plan] = []

    async def never(plan: Plan) -> Sent:
        plans.append(plan)
        return Sent(rejected=True)

    n = await asyncio.wait_for(generate(LoadSpec("concurrency", 3, requests=4), never), 10)
    assert n == len(plans) == MAX_SUBMISSIONS_PER_BUDGET * 4


async def test_open_loop_ignores_pause_and_counts_arrivals() -> None:
    async def rejecting(plan: Plan) -> Sent:
        return Sent(rejected=True, pause_s=10.0)

    # 20 arrivals at 1000/s finish long before a single 10 s pause could.
    n = await asyncio.wait_for(generate(LoadSpec("rate", 1000.0, requests=20), rejecting), 5)
    assert n == 20


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "concurrency", "value": 0, "requests": 1}, "concurrency"),
        ({"mode": "concurrency", "value": 1.5, "requests": 1}, "whole"),
        ({"mode": "rate", "value": 0, "requests": 1}, "rate"),
        ({"mode": "rate", "value": 1}, "exactly one"),
        ({"mode": "rate", "value": 1, "requests": 1, "duration_s": 1}, "exactly one"),
        ({"mode": "rate", "value": 1, "requests": 0}, "count"),
        ({"mode": "rate", "value": 1, "duration_s": -1}, "duration"),
        ({"mode": "rate", "value": 1, "requests": 1, "warmup": -1}, "warm-up"),
    ],
)
def test_load_spec_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadSpec(**kwargs)  # type: ignore[arg-type]


def test_labels() -> None:
    assert LoadSpec("concurrency", 4, requests=1).label == "c=4"
    assert LoadSpec("rate", 0.5, requests=1).label == "r=0.5/s"
