"""The admission pipeline (``proxy.admission.pipeline``) with fake steps and a real gate: every hold closed
exactly once, charged or given back, in reverse order; a refusal gives back what came before it; one
request wait shared by every step; a replay takes only the slots again."""

from __future__ import annotations

import logging
import time

import pytest

from proxy.admission.gate import SlotGate
from proxy.admission.pipeline import Ask, Grant, Pipeline, PromptCheck, Slots, Spent
from proxy.asgi.context import RequestContext
from proxy.errors import Rejected
from proxy.settings import TenantSettings

TENANT = TenantSettings("t", max_concurrency=1, max_queue=4, queue_timeout_s=5.0)


class Step:
    def __init__(self, name: str, log: list[str], *, refuse: bool = False, wait_s: float = 0.0) -> None:
        self.name, self.log, self.refuse, self.wait_s = name, log, refuse, wait_s
        self.closed: list[Spent | None] = []

    async def take(self, ask: Ask, grant: Grant) -> Step:
        self.log.append(f"take {self.name}")
        if self.refuse:
            raise Rejected("test", 1.0, f"{self.name} says no")
        grant.waited(self.wait_s)
        return self

    def close(self, spent: Spent | None) -> None:
        self.log.append(f"close {self.name}")
        self.closed.append(spent)


class Broken(Step):
    def close(self, spent: Spent | None) -> None:
        super().close(spent)
        raise RuntimeError("a bug in a step")


def ctx() -> RequestContext:
    return RequestContext("r", time.monotonic())


async def test_holds_are_charged_once_in_reverse_order_and_the_slot_given_back() -> None:
    log: list[str] = []
    budgets, total = Step("budgets", log), Step("total", log)
    gate = SlotGate([TENANT], capacity=1)
    async with Pipeline([budgets, total, Slots()]).admit(Ask(TENANT, "k", "m"), ctx(), gate) as grant:
        assert gate.in_flight == 1
        grant.charge(42)
    assert log == ["take budgets", "take total", "close total", "close budgets"]
    assert [s.tokens for s in budgets.closed if s] == [42] and len(total.closed) == 1
    assert gate.in_flight == 0


async def test_a_refusal_gives_back_what_earlier_steps_took_and_takes_no_slot() -> None:
    log: list[str] = []
    budgets, lease = Step("budgets", log), Step("lease", log, refuse=True)
    gate = SlotGate([TENANT], capacity=1)
    with pytest.raises(Rejected, match="lease says no"):
        async with Pipeline([budgets, lease, Slots()]).admit(Ask(TENANT, "k", "m"), ctx(), gate):
            pytest.fail("admitted")
    assert log == ["take budgets", "take lease", "close budgets"]
    assert budgets.closed == [None] and gate.in_flight == 0


class Check:
    def __init__(self, log: list[str], *, refuse: bool = False) -> None:
        self.log, self.refuse = log, refuse

    async def check(self) -> None:
        self.log.append("check")
        if self.refuse:
            raise Rejected("test", 1.0, "the check says no")


async def test_the_check_runs_after_the_budgets_and_before_any_wait() -> None:
    log: list[str] = []
    gate = SlotGate([TENANT], capacity=1)
    steps = Pipeline([Step("budgets", log), PromptCheck(), Step("lease", log), Slots()])
    async with steps.admit(Ask(TENANT, "k", "m", check=Check(log)), ctx(), gate):
        pass
    assert log[:3] == ["take budgets", "check", "take lease"]


async def test_a_refused_check_gives_the_budgets_back_and_takes_nothing_after_it() -> None:
    log: list[str] = []
    budgets = Step("budgets", log)
    gate = SlotGate([TENANT], capacity=1)
    steps = Pipeline([budgets, PromptCheck(), Step("lease", log), Slots()])
    with pytest.raises(Rejected, match="the check says no"):
        async with steps.admit(Ask(TENANT, "k", "m", check=Check(log, refuse=True)), ctx(), gate):
            pytest.fail("admitted")
    assert log == ["take budgets", "check", "close budgets"]
    assert budgets.closed == [None] and gate.in_flight == 0


async def test_a_hold_that_fails_to_close_does_not_keep_the_others(caplog: pytest.LogCaptureFixture) -> None:
    log: list[str] = []
    budgets, broken = Step("budgets", log), Broken("total", log)
    gate = SlotGate([TENANT], capacity=1)
    with caplog.at_level(logging.ERROR, logger="llamagate.proxy"):
        async with Pipeline([budgets, broken, Slots()]).admit(Ask(TENANT, "k", "m"), ctx(), gate):
            pass
    assert budgets.closed == [None] and gate.in_flight == 0
    assert "closing a hold failed" in caplog.text


async def test_one_wait_for_every_step_and_a_replay_waits_afresh_at_the_front() -> None:
    """A step that waited uses up the request's wait: the gate gets what is left (a request told
    Max-Wait 2 s that waited 1.5 s for a lease waits at most 0.5 s for a slot), which counts as its
    queue time. A replay takes the slots again at the head of its tenant's queue, within a wait of its own."""
    log: list[str] = []
    gate = SlotGate([TENANT], capacity=1)
    blocker = await gate.acquire("t")
    ask = Ask(TENANT, "k", "m", max_wait_s=2.0)
    request = ctx()
    started = time.monotonic()
    with pytest.raises(Rejected) as refused:
        async with Pipeline([Step("lease", log, wait_s=1.5), Slots()]).admit(ask, request, gate):
            pytest.fail("admitted")
    took = time.monotonic() - started
    assert refused.value.reason == "queue_timeout" and 0.4 <= took < 1.5
    assert request.queue_wait_s == 1.5  # the lease's wait is the request's queue time
    blocker.release()
    pipeline = Pipeline([Slots()])
    async with pipeline.admit(Ask(TENANT, "k", "m"), ctx(), gate) as grant:
        assert grant.permit is not None
        grant.permit.release()
        again = await pipeline.retake_slot(grant)
        assert grant.front and grant.waited_s == 0.0 and again is grant.permit
    assert gate.in_flight == 0


def test_the_pipeline_ends_with_the_slots() -> None:
    with pytest.raises(ValueError, match="last step is the model's slots"):
        Pipeline([PromptCheck()])
