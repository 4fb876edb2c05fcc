"""An attempt's turn through its model's disk tier as one ``async with`` (``proxy.routes.tier_turn``): the
tier's before and after around the attempt, the usage tap the tier reads when no account does, and the
child's reported counts handed back however the attempt ended."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from proxy.conversations.tier import Turn
from proxy.routes.tier_turn import TierTurn
from proxy.source import UpstreamSnapshot
from proxy.streams.formats import OPENAI
from proxy.streams.usage import UsageTap

SNAP = UpstreamSnapshot(
    state="READY",
    ready=True,
    reason=None,
    base_url="http://127.0.0.1:1",
    secret="s",
    model_alias="m",
    slots=2,
    ctx_per_slot=512,
    generation=7,
    retry_after_s=None,
)
PIN = SimpleNamespace(slot=1, replaced=None)
ANSWER = b'{"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 30}}}'


class Tier:
    """The model's disk tier as the turn sees it: what it was asked before and told after."""

    def __init__(self, places: bool) -> None:
        self.places = places
        self.before: list[tuple[Any, ...]] = []
        self.after: list[tuple[Turn | None, int | None, int]] = []

    async def before_turn(self, *args: Any) -> Turn | None:
        self.before.append(args)
        return Turn("conv", "t") if self.places else None

    def after_turn(self, turn: Turn | None, prompt: int | None, cached: int) -> None:
        self.after.append((turn, prompt, cached))


def turn(tier: Tier, tap: UsageTap | None = None) -> TierTurn:
    return TierTurn(
        tier,  # type: ignore[arg-type]
        SimpleNamespace(),  # type: ignore[arg-type]
        SNAP,
        PIN,  # type: ignore[arg-type]
        key="conv",
        tenant="t",
        request_id="req-1",
        tap=tap,
        fmt=OPENAI,
    )


def answered(tap: UsageTap | None) -> SimpleNamespace:
    """The relay after a whole answer: its tap read the usage; no stream meter."""
    if tap is not None:
        tap.whole(ANSWER)
    return SimpleNamespace(usage=tap, meter=None)


async def test_a_placed_turn_gets_a_tap_of_its_own_and_hears_the_childs_counts() -> None:
    tier = Tier(places=True)
    async with turn(tier) as t:
        assert t.tap is not None  # no account reads usage: the tier's own tap
        t.relay = answered(t.tap)  # type: ignore[assignment]
    states, generation, child, pin, key, tenant = tier.before[0]
    assert (states, generation, pin, key, tenant) == (None, 7, PIN, "conv", "t")
    assert type(child).__name__ == "ChildSlots"  # the child's slot actions, for this snapshot
    assert tier.after == [(Turn("conv", "t"), 40, 30)]


async def test_the_accounts_tap_is_the_relays_and_no_tap_is_made_for_an_unplaced_turn() -> None:
    account = UsageTap(OPENAI.usage)
    async with turn(Tier(places=True), account) as t:
        assert t.tap is account
    async with turn(Tier(places=False)) as t:
        assert t.tap is None  # the tier has nothing to read: the relay parses no usage for it


async def test_an_attempt_that_fails_still_tells_the_tier_what_was_reported() -> None:
    tier = Tier(places=True)
    with pytest.raises(RuntimeError):
        async with turn(tier) as t:
            t.relay = answered(None)  # type: ignore[assignment]
            raise RuntimeError("the child went away")
    # Nothing reported: the slot's state is not known to be the conversation's (never saved as it).
    assert tier.after == [(Turn("conv", "t"), None, 0)]


async def test_an_attempt_that_never_built_its_relay_reports_nothing() -> None:
    tier = Tier(places=True)
    with pytest.raises(RuntimeError):
        async with turn(tier):
            raise RuntimeError("before the relay")
    assert tier.after == [(Turn("conv", "t"), None, 0)]
