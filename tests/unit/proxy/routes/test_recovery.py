"""One request's way through the replay protocol (``proxy.routes.replay.Recovery``), a transition per test:
FIRST, waiting (another crash's replays go first), announced, in turn, passed, poison. The model's child is a
snapshot the test changes as the supervisor would (dead, then the next one READY); the quarantine and the
door's poison memory are the real ones."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from proxy.admission.poison import Poison, PoisonRefusal, PoisonRequest, Quarantine
from proxy.asgi.context import RequestContext
from proxy.errors import NotReady, UpstreamGone, UpstreamTimeout, UpstreamUnreachable
from proxy.routes import replay
from proxy.routes.replay import TRANSITIONS, Recovery, Step
from proxy.settings import PoisonSettings
from proxy.source import UpstreamSnapshot

BODY = b'{"prompt": "hello"}'
CHILD = UpstreamSnapshot(
    state="READY",
    ready=True,
    reason=None,
    base_url="http://127.0.0.1:1",
    secret="s1",
    model_alias="m",
    slots=2,
    ctx_per_slot=512,
    generation=1,
    retry_after_s=None,
)
DEAD = replace(CHILD, state="BACKOFF", ready=False, base_url=None, secret=None, retry_after_s=1.0)
NEXT = replace(CHILD, base_url="http://127.0.0.1:2", secret="s2", generation=2)


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    # How long a hang-up may go unexplained before it counts as a live child's (2 s in the product).
    monkeypatch.setattr(replay, "DEATH_GRACE_S", 0.2)


class Lane:
    """The model's lane as the protocol sees it: its quarantine and its child's snapshot."""

    name = "m"

    def __init__(self) -> None:
        self.quarantine = Quarantine()
        self.snap = CHILD
        self._changed = asyncio.Event()

    def set(self, snap: UpstreamSnapshot) -> None:
        self.snap = snap
        self._changed.set()
        self._changed = asyncio.Event()

    def snapshot(self) -> UpstreamSnapshot:
        return self.snap

    def ready_snapshot(self) -> UpstreamSnapshot:
        if not self.snap.ready:
            raise NotReady("not ready", 1.0)
        return self.snap

    async def watch(self, until: Any, deadline: float) -> UpstreamSnapshot:
        loop = asyncio.get_running_loop()
        while not until(self.snap) and loop.time() < deadline:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._changed.wait()
            except TimeoutError:
                break
        return self.snap


class Permit:
    def __init__(self, n: int) -> None:
        self.n = n
        self.released = False
        self.pin = None

    def release(self, *args: object) -> None:
        self.released = True


class Metrics:
    def __init__(self) -> None:
        self.replays: list[tuple[str, str]] = []
        self.poison: list[tuple[str, str, str]] = []

    def observe_replay(self, model: str, reason: str) -> None:
        self.replays.append((model, reason))

    def observe_poison(self, model: str, tenant: str, key: str) -> None:
        self.poison.append((model, tenant, key))


class Door:
    """The door's state: the pipeline (slots retaken in order), the poison memory, the metrics."""

    def __init__(self, lane: Lane) -> None:
        self.retaken = 0
        self.pipeline = SimpleNamespace(retake_slot=self._retake)
        self.poison = Poison(PoisonSettings(strikes=2, window_s=600, cooldown_s=600))
        self.metrics = Metrics()
        self.router = SimpleNamespace(lanes={lane.name: lane})
        self.draining = False

    async def _retake(self, grant: Any) -> Permit:
        self.retaken += 1
        return Permit(self.retaken)


class Entry:
    def __init__(self) -> None:
        self.queued_times = 0

    def queued(self) -> None:
        self.queued_times += 1


def recovery(
    door: Door, lane: Lane, *, deadline_s: float = 5.0, replayable: bool = True, key: str = "k1"
) -> tuple[Recovery, RequestContext, Entry]:
    ctx = RequestContext(f"req-{key}", 0.0)
    grant = SimpleNamespace(ask=SimpleNamespace(key_id=key, tenant=SimpleNamespace(name="t")))
    entry = Entry()
    deadline = asyncio.get_running_loop().time() + deadline_s
    r = Recovery(
        door,  # type: ignore[arg-type]
        lane,  # type: ignore[arg-type]
        ctx,
        grant,  # type: ignore[arg-type]
        BODY,
        deadline,
        replayable=replayable,
        entry=entry,  # type: ignore[arg-type]
    )
    return r, ctx, entry


async def announced(door: Door, lane: Lane, **kw: Any) -> tuple[Recovery, RequestContext, Entry]:
    r, ctx, entry = recovery(door, lane, **kw)
    await r.failed(UpstreamGone("hung up"), CHILD)
    return r, ctx, entry


async def in_turn(door: Door, lane: Lane, **kw: Any) -> tuple[Recovery, RequestContext, Permit]:
    r, ctx, _ = await announced(door, lane, **kw)
    lane.set(DEAD)
    lane.set(NEXT)
    permit = await r.before_attempt(Permit(0))
    return r, ctx, permit


# --- FIRST ----------------------------------------------------------------------------------------------
async def test_first_with_no_quarantine_keeps_its_permit() -> None:
    lane = Lane()
    door = Door(lane)
    r, _, _ = recovery(door, lane)
    permit = Permit(0)
    assert await r.before_attempt(permit) is permit
    assert r.step is Step.FIRST and not permit.released and door.retaken == 0


async def test_first_waits_out_another_crashs_replays_without_its_slot() -> None:
    lane = Lane()
    door = Door(lane)
    lane.quarantine.enter()  # another request's replay is announced
    r, _, _ = recovery(door, lane)
    permit = Permit(0)
    attempt = asyncio.ensure_future(r.before_attempt(permit))
    await asyncio.sleep(0.05)
    assert r.step is Step.WAITING and permit.released and not attempt.done()
    lane.quarantine.leave()  # the replays are done
    retaken = await asyncio.wait_for(attempt, 1.0)
    assert r.step is Step.FIRST and retaken is not permit and door.retaken == 1


async def test_waiting_that_runs_out_of_time_is_a_503_and_leaves_nothing_behind() -> None:
    lane = Lane()
    door = Door(lane)
    lane.quarantine.enter()
    r, _, _ = recovery(door, lane, deadline_s=0.05)
    with pytest.raises(NotReady) as refused:
        await r.before_attempt(Permit(0))
    assert refused.value.status == 503 and "a crash's replays" in str(refused.value)
    assert r.step is Step.WAITING
    r.close()
    assert lane.quarantine.active  # the other request's announcement is still there, untouched


@pytest.mark.parametrize(
    ("exc", "started", "replayable"),
    [
        (UpstreamTimeout("deadline"), False, True),  # not the child going away
        (UpstreamGone("hung up"), True, True),  # part of the answer is out
        (UpstreamGone("hung up"), False, False),  # a route that is never replayed
    ],
)
async def test_first_failure_that_may_not_be_replayed_is_raised_as_it_is(
    exc: Exception, started: bool, replayable: bool
) -> None:
    lane = Lane()
    door = Door(lane)
    r, ctx, entry = recovery(door, lane, replayable=replayable)
    ctx.response_started = started
    with pytest.raises(type(exc)) as raised:
        await r.failed(exc, CHILD)  # type: ignore[arg-type]
    assert raised.value is exc
    assert r.step is Step.FIRST and not lane.quarantine.active and entry.queued_times == 0


# --- FIRST -> ANNOUNCED -> ... ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "reason"), [(UpstreamGone("x"), "closed"), (UpstreamUnreachable("x"), "refused")]
)
async def test_a_child_going_away_announces_the_replay_at_once(exc: Exception, reason: str) -> None:
    lane = Lane()
    door = Door(lane)
    r, ctx, entry = recovery(door, lane)
    await r.failed(exc, CHILD)  # type: ignore[arg-type]
    assert r.step is Step.ANNOUNCED
    assert lane.quarantine.active  # before the next child is READY: nothing new reaches it
    assert [why for why, _ in ctx.replays] == [reason] and entry.queued_times == 1


async def test_announced_and_never_sent_leaves_the_quarantine() -> None:
    lane = Lane()
    door = Door(lane)
    r, _, _ = await announced(door, lane)
    r.close()
    r.close()  # idempotent
    assert r.step is Step.PASSED and not lane.quarantine.active


async def test_announced_whose_child_is_alive_is_not_replayed() -> None:
    lane = Lane()
    door = Door(lane)
    r, ctx, _ = await announced(door, lane)
    # The child stays READY as it was: it hung up on its own (a 502, as before the protocol).
    with pytest.raises(UpstreamGone):
        await r.before_attempt(Permit(0))
    assert r.step is Step.ANNOUNCED and ctx.attempt == 1 and door.metrics.replays == []
    r.close()
    assert not lane.quarantine.active


async def test_announced_takes_its_turn_on_the_next_child() -> None:
    lane = Lane()
    door = Door(lane)
    r, ctx, _ = await announced(door, lane)
    attempt = asyncio.ensure_future(r.before_attempt(Permit(0)))
    await asyncio.sleep(0.05)
    assert not attempt.done() and r.step is Step.ANNOUNCED
    lane.set(DEAD)
    lane.set(NEXT)
    permit = await asyncio.wait_for(attempt, 1.0)
    assert r.step is Step.IN_TURN and permit.n == 1
    assert ctx.attempt == 2 and door.metrics.replays == [("m", "closed")]
    assert ctx.queue_wait_s is not None and ctx.queue_wait_s > 0


async def test_announced_that_runs_out_of_time_for_its_turn_is_a_503_and_leaves() -> None:
    lane = Lane()
    door = Door(lane)
    other, _, _ = await in_turn(door, lane, key="other")  # holds the turn
    r, _, _ = recovery(door, lane, deadline_s=0.3)
    lane.set(replace(NEXT, generation=3, base_url="http://127.0.0.1:3"))
    await r.failed(UpstreamGone("x"), NEXT)
    with pytest.raises(NotReady) as refused:
        await r.before_attempt(Permit(0))
    assert "its turn after a crash" in str(refused.value)
    r.close()
    assert r.step is Step.PASSED
    other.close()
    assert not lane.quarantine.active


# --- IN_TURN -> PASSED | POISON --------------------------------------------------------------------------
async def test_in_turn_that_ends_passes_the_turn_to_the_next_replay() -> None:
    lane = Lane()
    door = Door(lane)
    first, _, _ = await in_turn(door, lane, key="a")
    second, _, _ = recovery(door, lane, key="b")
    await second.failed(UpstreamGone("x"), CHILD)  # in flight at the same death
    fresh, _, _ = recovery(door, lane, key="c")  # arrived after it
    behind = asyncio.ensure_future(second.before_attempt(Permit(0)))
    waiting = asyncio.ensure_future(fresh.before_attempt(Permit(0)))
    await asyncio.sleep(0.05)
    assert not behind.done() and not waiting.done() and fresh.step is Step.WAITING
    first.close()  # its replay answered
    assert first.step is Step.PASSED
    await asyncio.wait_for(behind, 1.0)
    assert second.step is Step.IN_TURN and not waiting.done()
    second.close()
    await asyncio.wait_for(waiting, 1.0)
    assert fresh.step is Step.FIRST and not lane.quarantine.active


async def test_in_turn_whose_child_dies_is_poison(caplog: pytest.LogCaptureFixture) -> None:
    lane = Lane()
    door = Door(lane)
    r, ctx, _ = await in_turn(door, lane)
    lane.set(replace(NEXT, state="BACKOFF", ready=False, base_url=None, secret=None))
    gone = UpstreamGone("hung up")
    with caplog.at_level(logging.WARNING, "llamagate.proxy"), pytest.raises(PoisonRequest) as verdict:
        await r.failed(gone, NEXT)
    assert verdict.value.__cause__ is gone and verdict.value.status == 502
    assert r.step is Step.POISON
    # The verdict's strike, metric and log are the protocol's.
    assert door.metrics.poison == [("m", "t", "k1")]
    with pytest.raises(PoisonRefusal) as refused:
        door.poison.check("another-key", BODY)
    assert refused.value.code == "poison_body"
    [record] = [rec for rec in caplog.records if "two deaths" in rec.getMessage()]
    assert record.fields == {  # type: ignore[attr-defined]
        "request_id": ctx.request_id,
        "model": "m",
        "tenant": "t",
        "key_id": "k1",
        "key_cools_down": False,
    }
    assert lane.quarantine.active  # until it closes: then the others go on
    r.close()
    assert r.step is Step.POISON and not lane.quarantine.active


async def test_in_turn_whose_child_lives_on_is_its_failure_not_poison() -> None:
    lane = Lane()
    door = Door(lane)
    r, _, _ = await in_turn(door, lane)
    gone = UpstreamGone("hung up")
    with pytest.raises(UpstreamGone) as raised:
        await r.failed(gone, NEXT)  # the child stays READY: it hung up on its own
    assert raised.value is gone and r.step is Step.IN_TURN and door.metrics.poison == []
    r.close()
    assert r.step is Step.PASSED and not lane.quarantine.active


async def test_in_turn_failing_otherwise_is_its_failure_not_poison() -> None:
    lane = Lane()
    door = Door(lane)
    r, ctx, _ = await in_turn(door, lane)
    timeout = UpstreamTimeout("total deadline")
    with pytest.raises(UpstreamTimeout):
        await r.failed(timeout, NEXT)
    started = UpstreamGone("hung up mid-stream")
    ctx.response_started = True
    lane.set(DEAD)
    with pytest.raises(UpstreamGone):
        await r.failed(started, NEXT)  # part of the answer was out: never a verdict
    assert r.step is Step.IN_TURN and door.metrics.poison == []
    r.close()
    assert r.step is Step.PASSED


async def test_in_turn_whose_child_died_before_its_attempt_passes_the_turn() -> None:
    lane = Lane()
    door = Door(lane)
    other, _, _ = await in_turn(door, lane, key="other")  # holds the turn
    r, _, _ = recovery(door, lane, deadline_s=0.5)
    await r.failed(UpstreamGone("x"), CHILD)  # in flight at the same death
    taking = asyncio.ensure_future(r.before_attempt(Permit(0)))
    await asyncio.sleep(0.05)
    assert r.step is Step.ANNOUNCED and not taking.done()
    # The new child dies while the other replay has the turn: this one gets its turn, then no child.
    lane.set(replace(NEXT, state="BACKOFF", ready=False, base_url=None, secret=None))
    other.close()
    with pytest.raises(NotReady):
        await asyncio.wait_for(taking, 2.0)
    assert r.step is Step.IN_TURN
    r.close()
    assert r.step is Step.PASSED and not lane.quarantine.active


# --- the table ------------------------------------------------------------------------------------------
def test_the_transitions_are_the_issues_and_passed_and_poison_are_final() -> None:
    assert [s.value for s in Step] == ["first", "waiting", "announced", "in turn", "passed", "poison"]
    edges = {(a.name, b.name) for a, nexts in TRANSITIONS.items() for b in nexts}
    assert edges == {
        ("FIRST", "WAITING"),
        ("WAITING", "FIRST"),
        ("FIRST", "ANNOUNCED"),
        ("ANNOUNCED", "IN_TURN"),
        ("ANNOUNCED", "PASSED"),
        ("IN_TURN", "PASSED"),
        ("IN_TURN", "POISON"),
    }


async def test_no_attempt_after_the_protocol_ended() -> None:
    lane = Lane()
    door = Door(lane)
    r, _, _ = await in_turn(door, lane)
    with pytest.raises(RuntimeError, match="no attempt after 'in turn'"):
        await r.before_attempt(Permit(0))  # one replay only: a second attempt in turn is a caller's bug
    r.close()
    with pytest.raises(RuntimeError, match="no attempt after 'passed'"):
        await r.before_attempt(Permit(0))
    assert not lane.quarantine.active
