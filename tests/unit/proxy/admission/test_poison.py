"""The door's memory of poison requests (strikes, cool-downs, refused bodies) and one model's quarantine
(replays one at a time, nothing else meanwhile)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.admission import poison
from proxy.admission.poison import Poison, PoisonRefusal, Quarantine
from proxy.settings import PoisonSettings


def test_a_key_cools_down_after_its_strikes_within_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(poison.time, "monotonic", lambda: now[0])
    p = Poison(PoisonSettings(strikes=2, window_s=60, cooldown_s=300))
    assert not p.strike("k", b"one")
    now[0] += 61  # the first strike left the window
    assert not p.strike("k", b"two")
    p.check("k", b"other")  # one strike in the window: still served
    now[0] += 10
    assert p.strike("k", b"three")
    with pytest.raises(PoisonRefusal) as refused:
        p.check("k", b"anything")
    assert refused.value.code == "key_cooling_down" and refused.value.status == 429
    assert refused.value.headers["retry-after"] == "300"
    p.check("other-key", b"fresh")  # another key is not touched
    now[0] += 301
    p.check("k", b"anything")  # the cool-down is over


def test_a_poison_body_is_refused_from_every_key_for_the_cool_down(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(poison.time, "monotonic", lambda: now[0])
    p = Poison(PoisonSettings(strikes=5, window_s=60, cooldown_s=100))
    p.check("a", b'{"x":1}')
    p.strike("a", b'{"x":1}')
    with pytest.raises(PoisonRefusal) as refused:
        p.check("b", b'{"x":1}')
    assert refused.value.code == "poison_body"
    p.check("b", b'{"x":2}')
    now[0] += 101
    p.check("b", b'{"x":1}')


def test_the_remembered_bodies_are_bounded() -> None:
    p = Poison(PoisonSettings(strikes=10**6, window_s=60, cooldown_s=100))
    for i in range(poison.MAX_BODIES + 10):
        p.strike("k", str(i).encode())
    p.check("x", b"0")  # the oldest were forgotten
    with pytest.raises(PoisonRefusal):
        p.check("x", str(poison.MAX_BODIES + 9).encode())


async def test_replays_go_one_at_a_time_and_fresh_requests_wait_for_them() -> None:
    q = Quarantine()
    q.enter()
    q.enter()
    assert q.active
    first = await q.take_turn()
    second = asyncio.ensure_future(q.take_turn())
    fresh = asyncio.ensure_future(q.cleared())
    await asyncio.sleep(0.01)
    assert not second.done() and not fresh.done()
    first.passed()
    first.passed()  # idempotent
    turn = await asyncio.wait_for(second, 1.0)
    assert not fresh.done()
    turn.passed()
    await asyncio.wait_for(fresh, 1.0)
    assert not q.active


async def test_a_replay_that_never_takes_its_turn_does_not_hold_the_others() -> None:
    q = Quarantine()
    q.enter()
    q.leave()  # announced, then no child came in time
    assert not q.active
    await asyncio.wait_for(q.cleared(), 1.0)
