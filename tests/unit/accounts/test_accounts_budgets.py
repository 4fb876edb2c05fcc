"""Budgets with a fake clock: the bound (within any minute, admitted usage is at most the limit plus one
request's tokens), Retry-After, the rate-limit headers, and counts that survive a reload and a restart."""

from __future__ import annotations

import gc
import heapq
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.accounts.budgets import EXPIRY_LAG_S, Budgets, Refusal, Ticket, openai_duration
from proxy.accounts.windows import Window
from proxy.settings import BudgetSettings, TenantSettings

T0 = 1_800_000_000.0
TPM = BudgetSettings(tokens_per_minute=200)


@dataclass
class Done:
    admitted: float
    charged: float
    tokens: int


def simulate(
    seed: int, *, clients: int, reserve: int | None, limit: int = 200, duration_s: float = 900.0
) -> tuple[list[Done], int, int]:
    """Clients that each send one request after another, as fast as the budget lets them: a refused one
    waits its Retry-After; an admitted one runs 0.05-8 s and is charged 1-100 tokens. The answered
    requests, how many refusals, and the most requests that were running at once."""
    rng = random.Random(seed)
    budgets = Budgets({"t": BudgetSettings(tokens_per_minute=limit)})
    events: list[tuple[float, int, int, Ticket | None]] = [
        (T0 + rng.random(), i, 0, None) for i in range(clients)
    ]
    heapq.heapify(events)
    done: list[Done] = []
    started: dict[int, float] = {}
    refusals = running = most = 0
    seq = clients
    while events:
        now, client, _, ticket = heapq.heappop(events)
        if now > T0 + duration_s:
            break
        if ticket is not None:  # a request ends: charged with its real usage
            tokens = rng.randint(1, reserve or 100)
            budgets.charge(ticket, tokens, now)
            done.append(Done(started.pop(client), now, tokens))
            running -= 1
            seq += 1
            heapq.heappush(events, (now + rng.random() * 0.5, client, seq, None))
            continue
        got = budgets.check("t", f"key{client}", now, reserve=reserve)
        seq += 1
        if isinstance(got, Refusal):
            refusals += 1
            assert 0 < got.retry_after_s <= 60
            heapq.heappush(events, (now + got.retry_after_s + rng.random() * 0.2, client, seq, None))
        else:
            started[client] = now
            running += 1
            most = max(most, running)
            heapq.heappush(events, (now + 0.05 + rng.random() * 8, client, seq, got))
    return done, refusals, most


def worst_minute(done: list[Done], when: str) -> tuple[int, int]:
    """The largest token sum of requests whose admission (or charge) falls in one 60 s interval
    [t, t + 60), over every t that starts at one of them; and the largest request in that interval."""
    times = sorted(done, key=lambda d: getattr(d, when))
    worst, biggest = 0, 0
    for i, first in enumerate(times):
        start = getattr(first, when)
        inside = [d.tokens for d in times[i:] if getattr(d, when) < start + 60]
        if sum(inside) > worst:
            worst, biggest = sum(inside), max(inside)
    return worst, biggest


def remaining(ticket: Ticket | Refusal) -> bytes:
    """The remaining-tokens figure an admitted request's answer shows."""
    assert isinstance(ticket, Ticket)
    return dict(ticket.headers)[b"x-ratelimit-remaining-tokens"]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("clients", "reserve"), [(1, None), (4, None), (4, 100), (12, 100)])
def test_within_any_minute_usage_is_at_most_the_limit_plus_one_request(
    seed: int, clients: int, reserve: int | None
) -> None:
    done, refusals, most = simulate(seed, clients=clients, reserve=reserve)
    assert len(done) > 50 and refusals > 0  # the budget was the bottleneck, not the clients
    for when in ("admitted", "charged"):
        worst, biggest = worst_minute(done, when)
        assert worst <= 200 + biggest, (when, worst, biggest)
        assert worst > 200 - 100  # and the windows were used up to the limit, not kept far below it
    if reserve is not None and clients > 1:
        assert most > 1  # with a reserve, requests that fit run side by side


def test_one_request_beyond_the_limit_is_allowed_two_are_not() -> None:
    budgets = Budgets({"t": TPM})
    first = budgets.check("t", "k", T0)
    assert isinstance(first, Ticket)
    # A second request while the first (of unknown size) runs could double the overshoot: refused.
    second = budgets.check("t", "k", T0 + 1)
    assert isinstance(second, Refusal) and second.in_flight and second.retry_after_s == 1.0
    budgets.charge(first, 190, T0 + 2)
    third = budgets.check("t", "k", T0 + 3)
    assert isinstance(third, Ticket)  # 190 < 200: room for one more, which may overshoot
    budgets.charge(third, 64, T0 + 4)  # 254 = 200 + at most one request's tokens
    fourth = budgets.check("t", "k", T0 + 5)
    assert isinstance(fourth, Refusal) and not fourth.in_flight and fourth.used == 254


def test_retry_after_is_when_the_window_has_room_and_never_over_a_minute() -> None:
    budgets = Budgets({"t": TPM})
    for at, tokens in ((T0, 120), (T0 + 10, 50), (T0 + 20, 60)):
        ticket = budgets.check("t", "k", at)
        assert isinstance(ticket, Ticket)
        budgets.charge(ticket, tokens, at)
    refused = budgets.check("t", "k", T0 + 30)
    assert isinstance(refused, Refusal)
    # 230 counted; the 120 at T0 leaves at T0 + 60: then 110 < 200.
    assert refused.retry_after_s == pytest.approx(30.0)
    assert isinstance(budgets.check("t", "k", T0 + 59.999), Refusal)
    assert isinstance(budgets.check("t", "k", T0 + 60), Ticket)
    error = refused.error({"x-ratelimit-limit-tokens": "200"})
    assert error.status == 429 and error.headers["retry-after"] == "30"
    assert error.type == "tokens" and error.code == "tokens_per_minute"
    assert error.headers["x-ratelimit-limit-tokens"] == "200"
    assert "tenant 't': its tokens_per_minute budget (200) is spent (230 in the last minute)" in error.message


def test_a_charge_at_the_last_instant_still_retries_within_60_s() -> None:
    budgets = Budgets({"t": TPM})
    ticket = budgets.check("t", "k", T0)
    assert isinstance(ticket, Ticket)
    budgets.charge(ticket, 500, T0 + 5.25)
    refused = budgets.check("t", "k", T0 + 5.25)
    assert isinstance(refused, Refusal) and refused.retry_after_s == 60.0
    assert refused.error().headers["retry-after"] == "60"


def test_requests_per_minute_is_exact() -> None:
    budgets = Budgets({"t": BudgetSettings(requests_per_minute=3)})
    for i in range(3):
        assert isinstance(budgets.check("t", "k", T0 + i), Ticket)
    refused = budgets.check("t", "k", T0 + 10)
    assert isinstance(refused, Refusal) and refused.budget == "requests_per_minute"
    assert refused.retry_after_s == pytest.approx(50.0) and refused.error().type == "requests"
    assert isinstance(budgets.check("t", "k", T0 + 59.99), Refusal)
    assert isinstance(budgets.check("t", "k", T0 + 60), Ticket)


def test_the_day_window_never_forgets_a_charge_early() -> None:
    budgets = Budgets({"t": BudgetSettings(tokens_per_day=1000)})
    ticket = budgets.check("t", "k", T0 + 30)
    assert isinstance(ticket, Ticket)
    budgets.charge(ticket, 1000, T0 + 30)
    assert isinstance(budgets.check("t", "k", T0 + 30 + 86400 - 0.001), Refusal)
    # Counted in its minute's bucket: at most 60 s longer than a day, never shorter.
    refused = budgets.check("t", "k", T0 + 40)
    assert isinstance(refused, Refusal) and 86400 - 40 <= refused.retry_after_s <= 86400 + 60
    assert isinstance(budgets.check("t", "k", T0 + 40 + refused.retry_after_s), Ticket)


def test_a_key_budget_refuses_that_key_and_not_its_tenant() -> None:
    budgets = Budgets({"t": BudgetSettings(tokens_per_minute=10_000)})
    small = BudgetSettings(tokens_per_minute=100)
    ticket = budgets.check("t", "k1", T0, key_budgets=small)
    assert isinstance(ticket, Ticket)
    budgets.charge(ticket, 150, T0)
    refused = budgets.check("t", "k1", T0 + 1, key_budgets=small)
    assert isinstance(refused, Refusal) and (refused.subject, refused.name) == ("key", "k1")
    assert "key k1: its tokens_per_minute budget (100)" in refused.message()
    assert isinstance(budgets.check("t", "k2", T0 + 1), Ticket)


def test_the_longest_wait_of_every_budget_is_the_refusal() -> None:
    budgets = Budgets({"t": BudgetSettings(tokens_per_minute=100, requests_per_minute=1)})
    ticket = budgets.check("t", "k", T0)
    assert isinstance(ticket, Ticket)
    budgets.charge(ticket, 150, T0 + 20)
    refused = budgets.check("t", "k", T0 + 30)
    assert isinstance(refused, Refusal)
    assert refused.budget == "tokens_per_minute" and refused.retry_after_s == pytest.approx(50.0)


def test_a_released_request_frees_its_hold() -> None:
    budgets = Budgets({"t": TPM})
    ticket = budgets.check("t", "k", T0)
    assert isinstance(ticket, Ticket)
    assert isinstance(budgets.check("t", "k", T0), Refusal)
    budgets.release(ticket, T0 + 1)  # e.g. it timed out in the queue
    budgets.release(ticket, T0 + 1)  # twice: nothing more
    assert isinstance(budgets.check("t", "k", T0 + 1), Ticket)


def test_a_reserve_that_fits_one_budget_and_not_another_holds_it_there_and_overshoots_the_other() -> None:
    """The tenant's budget has room for the reserve, the key's does not (it admits the request as its one
    overshooter): a second request of the key of unknown size is refused while the first runs, another
    key's fits the tenant's room beside the first's reserve, and the first's charge frees both holds."""
    budgets = Budgets({"t": BudgetSettings(tokens_per_minute=1_000)})
    small = BudgetSettings(tokens_per_minute=50)
    first = budgets.check("t", "k1", T0, key_budgets=small, reserve=400)
    assert isinstance(first, Ticket)
    second = budgets.check("t", "k1", T0 + 1, key_budgets=small)
    assert isinstance(second, Refusal) and (second.subject, second.in_flight) == ("key", True)
    assert isinstance(budgets.check("t", "k2", T0 + 1, reserve=600), Ticket)  # 400 + 600 <= 1000
    assert isinstance(budgets.check("t", "k3", T0 + 1, reserve=1), Refusal)  # the tenant's room is held
    budgets.charge(first, 30, T0 + 2)
    third = budgets.check("t", "k1", T0 + 3, key_budgets=small, reserve=10)
    assert isinstance(third, Ticket)  # 30 + 10 <= 50, and the tenant's 400 went back but 30
    assert remaining(third) == b"10"  # the key's: 50 - 30 - 10


def test_an_expired_charge_counts_in_the_headers_for_a_moment_at_most_and_never_refuses() -> None:
    """Admission reads a window as it stands and expires its entries once they are EXPIRY_LAG_S overdue:
    a charge just past its minute may still lower an answer's remaining figure for that long, but a
    request that only an expired charge would keep out is counted exactly and admitted."""
    budgets = Budgets({"t": BudgetSettings(tokens_per_minute=100)})
    first = budgets.check("t", "k", T0, reserve=60)
    assert isinstance(first, Ticket)
    budgets.charge(first, 60, T0)
    budgets.take_dirty(T0)  # the writer's batch
    soon = budgets.check("t", "k", T0 + 60.5, reserve=30)  # the 60 expired at T0 + 60
    assert isinstance(soon, Ticket)
    assert remaining(soon) == b"10"  # 100 - 60 (as it stands) - 30
    fits = budgets.check("t", "k", T0 + 60.6, reserve=50)  # 60 + 30 + 50 > 100 as it stands; 80 exactly
    assert isinstance(fits, Ticket)
    assert remaining(fits) == b"20"  # counted exactly: 100 - 30 - 50
    again = Budgets({"t": BudgetSettings(tokens_per_minute=100)})
    first = again.check("t", "k", T0, reserve=60)
    assert isinstance(first, Ticket)
    again.charge(first, 60, T0)
    again.take_dirty(T0)
    late = again.check("t", "k", T0 + 60 + EXPIRY_LAG_S, reserve=30)  # the lag is over: expired
    assert isinstance(late, Ticket) and remaining(late) == b"70"


def test_headers_show_the_tightest_budget() -> None:
    budgets = Budgets({"t": BudgetSettings(tokens_per_minute=200, requests_per_minute=10)})
    key = BudgetSettings(tokens_per_minute=100)
    assert budgets.headers("t", "k", T0, key_budgets=key) == {
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "100",
        "x-ratelimit-reset-tokens": "0s",
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "10",
        "x-ratelimit-reset-requests": "0s",
    }
    ticket = budgets.check("t", "k", T0, key_budgets=key, reserve=30)
    assert isinstance(ticket, Ticket)
    during = budgets.headers("t", "k", T0 + 1, key_budgets=key)
    assert during["x-ratelimit-remaining-tokens"] == "70"  # its reserve is held while it runs
    assert during["x-ratelimit-remaining-requests"] == "9" and during["x-ratelimit-reset-requests"] == "59s"
    budgets.charge(ticket, 25, T0 + 1.5)
    after = budgets.headers("t", "k", T0 + 2, key_budgets=key)
    assert after["x-ratelimit-remaining-tokens"] == "75" and after["x-ratelimit-reset-tokens"] == "59.5s"
    assert budgets.headers("other", "k9", T0) == {}


def test_an_admitted_request_carries_the_headers_in_the_order_of_its_budgets() -> None:
    """A ticket's header lines: of the kind of the first budget first (token budgets come first in
    ``BUDGET_NAMES``, so a tenant with only a request budget shows the requests first), each kind's
    limit, remaining and reset."""
    both = Budgets({"t": BudgetSettings(tokens_per_minute=200, requests_per_minute=10)})
    first = both.check("t", "k", T0, reserve=30)
    assert isinstance(first, Ticket)
    assert [name for name, _ in first.headers] == [
        b"x-ratelimit-limit-tokens",
        b"x-ratelimit-remaining-tokens",
        b"x-ratelimit-reset-tokens",
        b"x-ratelimit-limit-requests",
        b"x-ratelimit-remaining-requests",
        b"x-ratelimit-reset-requests",
    ]
    assert remaining(first) == b"170"
    assert dict(first.headers)[b"x-ratelimit-reset-requests"] == b"1m0s"  # this request, just counted
    second = both.check("t", "k", T0, reserve=30)
    assert isinstance(second, Ticket)
    assert remaining(second) == b"140"
    assert second.headers == [  # ASGI header pairs, as every answer to it carries them
        (b"x-ratelimit-limit-tokens", b"200"),
        (b"x-ratelimit-remaining-tokens", b"140"),
        (b"x-ratelimit-reset-tokens", b"0s"),
        (b"x-ratelimit-limit-requests", b"10"),
        (b"x-ratelimit-remaining-requests", b"8"),
        (b"x-ratelimit-reset-requests", b"1m0s"),
    ]
    only_requests = Budgets({"t": BudgetSettings(requests_per_minute=10)})
    ticket = only_requests.check("t", "k", T0)
    assert isinstance(ticket, Ticket)
    assert [name for name, _ in ticket.headers] == [
        b"x-ratelimit-limit-requests",
        b"x-ratelimit-remaining-requests",
        b"x-ratelimit-reset-requests",
    ]
    # The tenant's request budget comes before its key's token budget: requests first.
    mixed = only_requests.check("t", "k", T0, key_budgets=BudgetSettings(tokens_per_minute=100), reserve=5)
    assert isinstance(mixed, Ticket)
    assert [name for name, _ in mixed.headers] == [
        b"x-ratelimit-limit-requests",
        b"x-ratelimit-remaining-requests",
        b"x-ratelimit-reset-requests",
        b"x-ratelimit-limit-tokens",
        b"x-ratelimit-remaining-tokens",
        b"x-ratelimit-reset-tokens",
    ]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.25, "250ms"),
        (1.5, "1.5s"),
        (59.0, "59s"),
        (60, "1m0s"),
        (3725, "1h2m5s"),
        (86460, "24h1m0s"),
    ],
)
def test_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert openai_duration(seconds) == text


def test_a_reload_or_a_budget_change_keeps_the_counts() -> None:
    budgets = Budgets({"t": BudgetSettings()})  # no budget yet: usage is counted all the same
    ticket = budgets.check("t", "k", T0)
    assert isinstance(ticket, Ticket)
    budgets.charge(ticket, 180, T0 + 1)
    budgets.configure({"t": TPM})  # SIGHUP adds a budget
    assert isinstance(budgets.check("t", "k", T0 + 2), Ticket)  # 180 < 200
    budgets.configure({"t": BudgetSettings(tokens_per_minute=150)})
    refused = budgets.check("t", "k", T0 + 3)
    assert isinstance(refused, Refusal) and refused.used == 180
    assert isinstance(
        budgets.check("t", "k", T0 + 3, key_budgets=BudgetSettings(tokens_per_minute=500)), Refusal
    )


def test_a_key_given_a_budget_starts_from_the_usage_it_had_without_one() -> None:
    """A subject without a budget has its charges counted all the same: a budget given to it (here the
    key's, as an admin change) finds all of them counted at once, with no writer having run in between."""
    budgets = Budgets({"t": TPM})
    for i in range(3):
        ticket = budgets.check("t", "k", T0 + i, reserve=10)
        assert isinstance(ticket, Ticket)
        budgets.charge(ticket, 40, T0 + i)
    assert budgets.used("key", "k", "tokens_per_minute", T0 + 3) == 120
    assert budgets.used("key", "k", "requests_per_minute", T0 + 3) == 3
    ticket = budgets.check("t", "k", T0 + 4, reserve=10)
    assert isinstance(ticket, Ticket)
    budgets.charge(ticket, 40, T0 + 4)
    key = BudgetSettings(tokens_per_minute=150, requests_per_minute=5)
    refused = budgets.check("t", "k", T0 + 5, key_budgets=key, reserve=10)
    assert isinstance(refused, Refusal) and refused.subject == "key" and refused.used == 160
    assert budgets.used("key", "k", "requests_per_minute", T0 + 5) == 4
    assert refused.retry_after_s == pytest.approx(55.0)  # the first 40, charged at T0, leave at T0 + 60


def test_a_subject_without_a_budget_counts_every_request_without_a_writer() -> None:
    """Budgets without a store have no writer: a key without a budget still has every request counted
    in its windows, so a budget given to it later starts from its real usage."""
    budgets = Budgets({"t": TPM})
    for i in range(5000):
        ticket = budgets.check("t", "k", T0 + i / 1000, reserve=1)
        assert isinstance(ticket, Ticket)
        budgets.charge(ticket, 0, T0 + i / 1000)
    assert budgets.used("key", "k", "requests_per_minute", T0 + 5) == 5000


def test_windows_survive_a_restart_through_the_store(store_path: Path) -> None:
    from proxy.accounts.service import Accounts
    from proxy.accounts.sqlite import open_store

    now = [T0]
    tenants = [TenantSettings("t", budgets=TPM)]
    first = Accounts(open_store(store_path, daemon=True), tenants, clock=lambda: now[0], interval_s=3600)
    first.start()
    from tests.unit.accounts.test_accounts_ledger import record

    for i in range(1, 9):  # 8 answers of 25 tokens (15 prompt + 10 completion), one a second
        now[0] = T0 + i
        got = first.budgets.check("t", "k", now[0])
        assert isinstance(got, Ticket)
        row = record(5, tenant="t", at=now[0])
        first.budgets.charge(got, row.prompt_tokens + row.completion_tokens, row.at)
        first.record(row)
    assert isinstance(first.budgets.check("t", "k", now[0]), Refusal)
    assert first.close()  # the drain writes the windows with the last batch

    now[0] = T0 + 20
    second = Accounts(open_store(store_path, daemon=True), tenants, clock=lambda: now[0], interval_s=3600)
    second.start()
    try:
        assert second.budgets.used("tenant", "t", "tokens_per_minute", now[0]) == 200
        assert second.budgets.used("key", "k", "tokens_per_minute", now[0]) == 200
        assert second.budgets.used("tenant", "t", "requests_per_minute", now[0]) == 8
        refused = second.budgets.check("t", "k", now[0])
        assert isinstance(refused, Refusal) and refused.used == 200
        assert refused.retry_after_s == pytest.approx(41.0)  # the charge at T0 + 1 leaves at T0 + 61
        assert isinstance(second.budgets.check("t", "k", T0 + 61), Ticket)
    finally:
        second.close()


def test_window_bookkeeping() -> None:
    window = Window(60.0)
    assert window.wait_below(T0, 0) is None and window.reset_in(T0) == 0.0
    window.add(T0, 5)
    window.add(T0, 5)  # the same instant: one entry
    assert len(window) == 1 and window.used(T0 + 59.9) == 10 and window.used(T0 + 60) == 0
    window.add(T0 + 70, 1)
    window.add(T0 + 69, 2)  # the clock stepped back: added to the newest entry, not forgotten earlier
    assert window.used(T0 + 129.9) == 3 and window.persisted(T0 + 70) == (3, T0 + 130)
    buckets = Window(86400.0, 60.0)
    assert buckets.add(T0 + 59, 1) == T0 and buckets.add(T0 + 61, 1) == T0 + 60  # the buckets' keys
    assert math.isclose(buckets.reset_in(T0 + 61), 60 + 60 + 86400 - 61)


def test_a_window_of_many_charges_holds_no_object_per_charge() -> None:
    """A width-0 window keeps one entry per request for a minute (about 10^5 on a busy host): as numbers,
    not one tracked object each, which the garbage collector would walk and promote at every pass."""
    window = Window(60.0)
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for i in range(10_000):
            window.add(T0 + i / 1000, 1)
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert window.used(T0 + 10) == 10_000
    assert grown < 100  # the per-second groups (10 here) and little else; not 10 000


def test_a_window_stays_exact_while_its_old_entries_are_dropped() -> None:
    """Against a plain list of the charges: counts, lengths, waits, while the front is dropped in many
    steps (and the arrays compacted several times: 20 000 charges, 3000 in any minute)."""
    window = Window(60.0)
    charges: list[tuple[float, int]] = []
    for i in range(20_000):
        at, amount = T0 + i / 50, i % 7 + 1
        window.add(at, amount)
        charges.append((at, amount))
        if i % 97 == 0 or i > 19_990:
            live = [(t, a) for t, a in charges[-3100:] if t + 60 > at]
            total = sum(a for _, a in live)
            assert window.used(at) == total and len(window) == len(live)
            assert window.reset_in(at) == pytest.approx(live[-1][0] + 60 - at)
            # Room for 10 tokens more than 9 below now: once the oldest entries holding 10 expire.
            need, first = 0, 0
            while need < 10 and first < len(live):
                need += live[first][1]
                first += 1
            expires = live[first - 1][0] + 60 - at
            assert window.wait_below(at, total - 9) == (pytest.approx(expires) if total > 9 else None)
    assert window.used(at + 60) == 0 and len(window) == 0 and window.reset_in(at + 60) == 0.0


def test_a_second_of_charges_is_one_row_that_never_expires_early() -> None:
    window = Window(60.0)
    for offset, amount in ((0.1, 5), (0.5, 7), (0.9, 11)):
        assert window.add(T0 + offset, amount) == T0 + offset  # each charge its own entry
    assert window.persisted(T0) == (23, T0 + 60.9)  # one group: counted until its newest charge's expiry
    assert window.changed_groups() == [(T0, 23, T0 + 60.9)]
    restored = Window(60.0)
    restored.restore(T0, 23, T0 + 60.9)
    assert restored.used(T0 + 60.89) == 23 and restored.used(T0 + 60.9) == 0
    assert window.used(T0 + 60.6) == 11  # the original, exact: the restored one only errs long


def test_the_store_gets_one_row_per_second_and_window_not_one_per_request() -> None:
    budgets = Budgets({"t": TPM})
    for i in range(50):
        ticket = budgets.check("t", "k", T0 + i / 100, reserve=1)
        assert isinstance(ticket, Ticket)
        budgets.charge(ticket, 1, T0 + i / 100)
    rows = budgets.take_dirty(T0 + 1)
    # (tenant, key) x (tokens per minute, tokens per day, requests per minute), one group each
    assert len(rows) == 6 and {r.amount for r in rows} == {50}
    assert budgets.take_dirty(T0 + 1) == []
    budgets.put_back(rows)  # a failed write: the same rows come again
    assert sorted(budgets.take_dirty(T0 + 1), key=str) == sorted(rows, key=str)


def test_the_groups_to_write_are_those_charged_since_the_writer_last_read_them() -> None:
    """The writer reads each changed window's groups off its entries: from the group of the newest entry
    it saw last (which a charge in the same second adds to) to the newest; nothing when unchanged."""
    window = Window(60.0)
    assert not window.changed and window.changed_groups() == []
    window.add(T0 + 0.2, 1)
    window.add(T0 + 1.5, 2)
    window.add(T0 + 1.7, 3)
    assert window.changed
    assert window.changed_groups() == [(T0, 1, T0 + 60.2), (T0 + 1, 5, T0 + 61.7)]
    assert not window.changed
    window.add(T0 + 1.9, 4)  # the second last read: written again, with its whole amount
    window.add(T0 + 3.0, 5)
    assert window.changed_groups() == [(T0 + 1, 9, T0 + 61.9), (T0 + 3, 5, T0 + 63.0)]
    assert window.persisted(T0 + 1) == (9, T0 + 61.9) and window.persisted(T0 + 2) is None
    days = Window(86400.0, 60.0)
    days.add(T0 + 10, 1)
    days.add(T0 + 50, 2)
    assert days.changed_groups() == [(T0, 3, T0 + 60 + 86400)]
    days.add(T0 + 59, 4)
    days.add(T0 + 61, 5)
    assert days.changed_groups() == [(T0, 7, T0 + 60 + 86400), (T0 + 60, 5, T0 + 120 + 86400)]
    restored = Window(60.0)
    restored.restore(T0, 23, T0 + 60.9)
    assert not restored.changed and restored.changed_groups() == []  # read from the store: nothing to write
    restored.add(T0 + 0.95, 1)
    assert restored.changed_groups() == [(T0, 24, T0 + 60.95)]


def test_two_keys_of_a_tenant_charge_its_window_each_with_its_own_time() -> None:
    """Counts, resets and waits of a window two keys of one tenant share: each charge counts from its
    own time (kb's is the older one, ka's the newer)."""
    budgets = Budgets({"t": BudgetSettings(tokens_per_minute=100)})
    for key, at in (("ka", T0), ("kb", T0 + 0.0625)):  # both keys' plans made, nothing charged
        first = budgets.check("t", key, at, reserve=10)
        assert isinstance(first, Ticket)
        budgets.release(first, at)
    assert budgets.used("tenant", "t", "tokens_per_minute", T0 + 0.0625) == 0  # (and all entered)
    a = budgets.check("t", "ka", T0 + 0.125, reserve=10)
    b = budgets.check("t", "kb", T0 + 0.25, reserve=10)
    assert isinstance(a, Ticket) and isinstance(b, Ticket)
    budgets.charge(b, 30, T0 + 0.375)
    budgets.charge(a, 30, T0 + 0.5)
    c = budgets.check("t", "kb", T0 + 0.75, reserve=10)
    assert isinstance(c, Ticket)
    # 60 charged, c's reserve held; the newest charge (T0 + 0.5) resets the window at T0 + 60.5.
    assert remaining(c) == b"30"
    assert dict(c.headers)[b"x-ratelimit-reset-tokens"] == b"59.75s"
    budgets.charge(c, 40, T0 + 1.0)
    refused = budgets.check("t", "kb", T0 + 2, reserve=20)  # spent: 100
    assert isinstance(refused, Refusal) and refused.used == 100 and not refused.in_flight
    # Room once any leaves: the oldest, kb's at T0 + 0.375, at T0 + 60.375.
    assert refused.retry_after_s == pytest.approx(58.375)
    assert budgets.used("tenant", "t", "tokens_per_minute", T0 + 60.4375) == 70
    assert budgets.used("key", "ka", "tokens_per_minute", T0 + 60.4375) == 30
    assert budgets.used("key", "kb", "tokens_per_minute", T0 + 60.4375) == 40


def test_without_a_writer_queued_charges_still_expire_on_time() -> None:
    """Budgets without a store have no writer: a charge stops counting a minute after it was made,
    however few requests the tenant sends (f33d0c8: charges that waited for a writer counted forever)."""
    budgets = Budgets({"t": BudgetSettings(tokens_per_minute=100, requests_per_minute=2)})
    ticket = budgets.check("t", "k", T0, reserve=10)
    assert isinstance(ticket, Ticket)
    budgets.charge(ticket, 100, T0 + 1)
    refused = budgets.check("t", "k", T0 + 30, reserve=10)
    assert isinstance(refused, Refusal) and refused.retry_after_s == pytest.approx(31.0)
    again = budgets.check("t", "k", T0 + 61, reserve=10)  # the charge of T0 + 1 is gone
    assert isinstance(again, Ticket), again
    assert remaining(again) == b"90"
    assert dict(again.headers)[b"x-ratelimit-remaining-requests"] == b"1"
    assert budgets.header_lines("t", "k", T0 + 200) == [
        (b"x-ratelimit-limit-tokens", b"100"),
        (b"x-ratelimit-remaining-tokens", b"90"),  # the last request's reserve is still held
        (b"x-ratelimit-reset-tokens", b"0s"),
        (b"x-ratelimit-limit-requests", b"2"),
        (b"x-ratelimit-remaining-requests", b"2"),
        (b"x-ratelimit-reset-requests", b"0s"),
    ]


@pytest.mark.parametrize("width", [0.0, 60.0])
def test_an_entry_stops_counting_exactly_when_its_expiry_says_where_rounding_differs(width: float) -> None:
    """Expiry finds the dead prefix by bisection on ``now - (width + span)``, which rounds differently
    from ``key + width + span <= now`` for small keys: at every instant one ulp around each entry's
    expiry the count is that of the exact test."""
    rng = random.Random(3)
    after = width + 60.0
    for _ in range(200):
        keys = sorted({rng.random() * rng.choice((1e-3, 1.0, 10.0)) for _ in range(rng.randint(1, 12))})
        if width:
            keys = sorted({(k // width) * width for k in keys})
        for probe in keys:
            for now in (
                math.nextafter(probe + after, -math.inf),
                probe + after,
                math.nextafter(probe + after, math.inf),
            ):
                window = Window(60.0, width)
                for k in keys:
                    window.add(k, 1)
                assert window.used(now) == sum(1 for k in keys if not k + after <= now), (keys, now)
