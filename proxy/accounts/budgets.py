"""Token and request budgets per tenant and per key: asked at admission, charged after each answer.

Three budgets, each optional, for a tenant (``tenants[].budgets``) and for a store key (its row):
``tokens_per_minute``, ``tokens_per_day`` (prompt plus completion tokens, as the child reports them) and
``requests_per_minute``. Windows slide (``windows``): "the last minute" is any minute, not the clock's.

The bound, and why it holds. For every window of a token budget with limit L, within any span (a minute
for tokens_per_minute) the tokens of the requests admitted sum to at most L plus one request's tokens.
A request's tokens are known only after its answer, so admission keeps, per window, the *holds* of the
requests admitted and not yet charged:

- a request that says how many tokens it can use at most (``reserve``: the caller's upper bound, e.g.
  its slots times the per-slot context, or prompt plus ``max_tokens``) is admitted when the charged
  tokens, the other holds and its reserve together stay within L; it holds its reserve until charged;
- otherwise one request at a time (the window's *overshooter*) is admitted while charged tokens plus
  holds are below L: it is the "one request" of the bound; others wait for it (429, ``Retry-After`` 1 s).

Proof sketch: take the requests charged within some span, and the one of them admitted last, at time a.
Each other one was either charged before a, and then within the span before a (the window counts it,
``windows`` never forgets early), or was in flight at a, and then held its reserve or was the
overshooter. So their sum is at most what admission checked at a, plus the overshooter's actual
tokens: at most L plus one request's. Without a reserve, a tenant with a token budget runs one
request at a time (an unknown request could be of any size), so the request path passes one.

Requests are counted when admitted, so ``requests_per_minute`` holds exactly (no overshoot). Windows
are kept for every tenant and key, budget or not, so a budget added by a reload or an admin change
starts from the real recent usage; a changed limit keeps the counts.

Admission reads a window as it stands (``Window.total``) and drops its expired entries only once they
are ``EXPIRY_LAG_S`` overdue, or at once when the count as it stands would refuse the request: an entry
that has just expired may lower an answer's remaining figure for a moment, never refuse a request,
and no entry that should count is ever missed (the bound holds).

The writer persists the window groups charged since its last batch (``take_dirty``); a restart restores
them (``restore``).

Thread model: ``admit`` (``check``), ``charge``, ``release`` and ``header_lines`` are called on the
request path (the event loop); ``take_dirty`` by the writer thread. One lock guards the state; nothing
under it blocks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from proxy.accounts.records import BUDGET_NAMES, BudgetName, Subject, WindowEntry
from proxy.accounts.windows import Window
from proxy.errors import Rejected
from proxy.settings import BudgetSettings

# (span, bucket width) per budget. The day window sums into one-minute buckets: at most 1440 entries.
SPANS: dict[BudgetName, tuple[float, float]] = {
    "tokens_per_minute": (60.0, 0.0),
    "tokens_per_day": (86400.0, 60.0),
    "requests_per_minute": (60.0, 0.0),
}
_TOKENS: tuple[BudgetName, ...] = ("tokens_per_minute", "tokens_per_day")
# Refused because requests still running hold the window: when they end is unknown; they are answers
# in progress, so a second is a fair guess, and the SDKs retry on their own.
IN_FLIGHT_RETRY_S = 1.0
# How many callers' plans are kept (``Budgets._plan``): a bound, not an eviction policy.
_PLAN_CACHE = 10_000
# A window's expired entries are dropped at admission once they are this overdue (module docstring).
EXPIRY_LAG_S = 1.0

WindowId = tuple[Subject, str, BudgetName]
# OpenAI's rate-limit headers as ASGI header pairs (name, value); empty without budgets.
RateHeaders = list[tuple[bytes, bytes]]


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's claim on the budgets: made by the caller, admitted by ``Budgets.admit``, then
    charged or released exactly once."""

    tenant: str
    key_id: str
    reserve: int | None
    key_budgets: BudgetSettings | None = None
    # Set once admitted: the holds it took (those it holds ``reserve`` of, those whose overshooter it
    # is), OpenAI's rate-limit headers as admission left the windows (this request counted), and the
    # windows it was found to touch (its charge needs no second lookup while they stand).
    held_in: list[_Holds] = field(default_factory=list, init=False)
    over_in: list[_Holds] = field(default_factory=list, init=False)
    headers: RateHeaders = field(default_factory=list, init=False)
    plan: _Plan | None = field(default=None, init=False)
    settled: bool = field(default=False, init=False)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request may not start now, and when it may."""

    subject: Subject
    name: str
    budget: BudgetName
    limit: int
    used: int
    retry_after_s: float
    # True: requests still running hold what is left (their usage is not known yet), not spent usage.
    in_flight: bool = False

    def message(self) -> str:
        who = f"tenant {self.name!r}" if self.subject == "tenant" else f"key {self.name}"
        span = "day" if self.budget == "tokens_per_day" else "minute"
        wait = max(1, math.ceil(self.retry_after_s))
        if self.in_flight:
            return (
                f"{who}: its {self.budget} budget ({self.limit}) is held by requests still running; "
                f"retry in {wait} s"
            )
        return (
            f"{who}: its {self.budget} budget ({self.limit}) is spent ({self.used} in the last {span}); "
            f"retry in {wait} s"
        )

    def error(self, headers: Mapping[str, str] | None = None) -> Rejected:
        """The 429 for this refusal (``Retry-After`` set), with the rate-limit headers given."""
        exc = Rejected(self.budget, self.retry_after_s, self.message())
        # OpenAI's own 429s for these say "tokens" or "requests" in type; code names the budget.
        exc.type = "requests" if self.budget == "requests_per_minute" else "tokens"
        exc.code = self.budget
        exc.headers.update(headers or {})
        return exc


@dataclass(slots=True)
class _Holds:
    """What a token budget's window holds for the requests admitted and not yet charged."""

    held: int = 0  # reserves of the requests admitted within their bound
    overshooter: Ticket | None = None


class _Limit(NamedTuple):
    """One budget a caller is checked against."""

    subject: Subject
    name: str  # the tenant's name or the key's id
    budget: BudgetName
    limit: int
    window: Window
    holds: _Holds | None  # None for requests_per_minute, which holds nothing

    @property
    def kind(self) -> str:
        """What the rate-limit headers call it: ``tokens`` or ``requests``."""
        return "requests" if self.holds is None else "tokens"

    def refusal(self, used: int, retry_after_s: float, in_flight: bool = False) -> Refusal:
        return Refusal(self.subject, self.name, self.budget, self.limit, used, retry_after_s, in_flight)


class _Room(NamedTuple):
    """A budget's yes to a request: what it has left once the request is admitted (the headers'
    remaining figure), and whether a token budget admits it as its overshooter (not for its reserve)."""

    left: int
    overshoots: bool = False


@dataclass(eq=False, slots=True)
class _Plan:
    """What one (tenant, key, key's budgets) touches, looked up once: the budgets it is checked against,
    and the windows it is charged into (every tenant's and key's, budget or not). Valid while the
    windows it holds are the ones in ``Budgets._windows`` (``generation``)."""

    generation: int
    key_budgets: BudgetSettings | None
    limits: tuple[_Limit, ...]
    requests: tuple[Window, ...]  # charged one per admitted request
    tokens: tuple[Window, ...]  # charged a finished request's tokens


def openai_duration(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``250ms``, ``1.5s``, ``6m0s``."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return out + f"{secs}s"


def rate_limit_headers(kind: str, limit: int, remaining: int, reset_s: float) -> RateHeaders:
    """OpenAI's three ``x-ratelimit-*`` headers of one kind (``tokens`` or ``requests``)."""
    return [
        (f"x-ratelimit-limit-{kind}".encode(), b"%d" % limit),
        (f"x-ratelimit-remaining-{kind}".encode(), b"%d" % max(0, remaining)),
        (f"x-ratelimit-reset-{kind}".encode(), openai_duration(reset_s).encode()),
    ]


def _headers(figures: Iterable[tuple[_Limit, int]], now: float) -> RateHeaders:
    """The rate-limit headers of (budget, what it has left) pairs: of each kind, the budget with the
    least left (the first of equals), the kind of the first budget first."""
    least: dict[str, tuple[_Limit, int]] = {}
    for limit, left in figures:
        shown = least.get(limit.kind)
        if shown is None or left < shown[1]:
            least[limit.kind] = (limit, left)
    return [
        header
        for kind, (limit, left) in least.items()
        for header in rate_limit_headers(kind, limit.limit, left, limit.window.reset_in(now))
    ]


def _counted(window: Window, now: float, most: int) -> int:
    """What admission counts in ``window``: as it stands (module docstring), or exactly when its expired
    entries are ``EXPIRY_LAG_S`` overdue or the count as it stands is above ``most``, the highest count
    at which the request fits."""
    used = window.total
    if used > most or now >= window.horizon + EXPIRY_LAG_S:
        used = window.used(now)
    return used


@dataclass
class Budgets:
    """Every window and hold. ``tenants``: each tenant's budgets (``configure`` swaps them on reload)."""

    tenants: Mapping[str, BudgetSettings] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _windows: dict[WindowId, Window] = field(default_factory=dict, repr=False)
    _holds: dict[WindowId, _Holds] = field(default_factory=dict, repr=False)
    _unsaved: dict[tuple[WindowId, float], WindowEntry] = field(default_factory=dict, repr=False)
    # Every request asks for its caller's windows: found once per caller, not per request. A sweep that
    # drops windows, a restore and a reload make them be found again (``_generation``).
    _plans: dict[tuple[str, str], _Plan] = field(default_factory=dict, repr=False)
    _generation: int = 0

    def configure(self, tenants: Mapping[str, BudgetSettings]) -> None:
        """New limits (a reload); the windows, their counts and the holds stay."""
        with self._lock:
            self.tenants = dict(tenants)
            self._generation += 1

    def _window(self, wid: WindowId) -> Window:
        window = self._windows.get(wid)
        if window is None:
            window = self._windows[wid] = Window(*SPANS[wid[2]])
        return window

    def _holds_of(self, wid: WindowId) -> _Holds:
        holds = self._holds.get(wid)
        if holds is None:
            holds = self._holds[wid] = _Holds()
        return holds

    def _plan(self, tenant: str, key_id: str, key_budgets: BudgetSettings | None) -> _Plan:
        """Under the lock."""
        plan = self._plans.get((tenant, key_id))
        # ``is`` first: the key view hands the same budgets object for a key until it changes.
        if (
            plan is not None
            and plan.generation == self._generation
            and (plan.key_budgets is key_budgets or plan.key_budgets == key_budgets)
        ):
            return plan
        subjects: tuple[tuple[Subject, str, BudgetSettings | None], ...] = (
            ("tenant", tenant, self.tenants.get(tenant)),
            ("key", key_id, key_budgets),
        )
        limits: list[_Limit] = []
        for subject, name, budgets in subjects:
            for budget in BUDGET_NAMES:
                limit: int | None = getattr(budgets, budget) if budgets is not None else None
                if limit is not None:
                    wid: WindowId = (subject, name, budget)
                    holds = None if budget == "requests_per_minute" else self._holds_of(wid)
                    limits.append(_Limit(subject, name, budget, limit, self._window(wid), holds))

        def windows(budgets: Iterable[BudgetName]) -> tuple[Window, ...]:
            return tuple(self._window((s, n, b)) for b in budgets for s, n, _ in subjects)

        plan = _Plan(
            self._generation,
            key_budgets,
            tuple(limits),
            requests=windows(("requests_per_minute",)),
            tokens=windows(_TOKENS),
        )
        if len(self._plans) >= _PLAN_CACHE:
            self._plans = {}
        self._plans[(tenant, key_id)] = plan
        return plan

    def check(
        self,
        tenant: str,
        key_id: str,
        now: float,
        *,
        key_budgets: BudgetSettings | None = None,
        reserve: int | None = None,
    ) -> Ticket | Refusal:
        """``admit`` a new ticket of this tenant and key."""
        return self.admit(Ticket(tenant, key_id, reserve, key_budgets), now)

    def admit(self, ticket: Ticket, now: float) -> Ticket | Refusal:
        """Admit a request (its ``ticket``, now counted against ``requests_per_minute`` and holding its
        part of the token budgets) or refuse it (the refusal whose wait is longest, so that a retry then
        finds room in every budget)."""
        with self._lock:
            plan = self._plan(ticket.tenant, ticket.key_id, ticket.key_budgets)
            rooms: list[tuple[_Limit, _Room]] = []
            refusal: Refusal | None = None
            for limit in plan.limits:
                answer = self._ask(limit, ticket, now)
                if isinstance(answer, _Room):
                    rooms.append((limit, answer))
                elif refusal is None or answer.retry_after_s > refusal.retry_after_s:
                    refusal = answer
            if refusal is not None:
                return refusal
            for limit, room in rooms:
                self._hold(limit, room, ticket)
            for window in plan.requests:
                window.add(now, 1)
            ticket.headers = _headers(((limit, room.left) for limit, room in rooms), now)
            ticket.plan = plan
        return ticket

    def _ask(self, limit: _Limit, ticket: Ticket, now: float) -> _Room | Refusal:
        """Under the lock: one budget's answer to a request (the rules of the module docstring)."""
        window, holds, reserve = limit.window, limit.holds, ticket.reserve
        if holds is None:  # requests_per_minute
            used = _counted(window, now, most=limit.limit - 1)
            if used < limit.limit:
                return _Room(limit.limit - used - 1)
            return limit.refusal(used, window.wait_below(now, limit.limit) or 0.0)
        held = holds.held
        # It fits with its reserve, or as the overshooter with one token of room.
        used = _counted(window, now, most=limit.limit - held - (reserve or 1))
        if reserve is not None and used + held + reserve <= limit.limit:
            return _Room(limit.limit - used - held - reserve)
        if holds.overshooter is None and used + held < limit.limit:
            # Its own worst case does not fit (that is why it overshoots): the headers show nothing left.
            return _Room(0, overshoots=True)
        # Room once enough charged tokens expire, given the holds stay; holds alone, or the overshooter
        # still running: at least the in-flight guess.
        wait = window.wait_below(now, limit.limit - held)
        after = IN_FLIGHT_RETRY_S if wait is None else wait
        if holds.overshooter is not None:
            after = max(after, IN_FLIGHT_RETRY_S)
        return limit.refusal(used, after, in_flight=used < limit.limit)

    @staticmethod
    def _hold(limit: _Limit, room: _Room, ticket: Ticket) -> None:
        """Under the lock: what an admitted request holds in a token budget (nothing in a request one)."""
        holds = limit.holds
        if holds is None:
            return
        if room.overshoots:
            holds.overshooter = ticket
            ticket.over_in.append(holds)
        else:
            holds.held += ticket.reserve or 0  # admitted for its reserve: it has one
            ticket.held_in.append(holds)

    def charge(self, ticket: Ticket, tokens: int, now: float) -> None:
        """The request's real usage (prompt plus completion tokens; 0 if it produced none). Frees its
        holds. A second call for the same ticket does nothing."""
        with self._lock:
            if ticket.settled:
                return
            ticket.settled = True
            for holds in ticket.held_in:
                holds.held -= ticket.reserve or 0
            for holds in ticket.over_in:
                if holds.overshooter is ticket:
                    holds.overshooter = None
            if tokens > 0:
                plan = ticket.plan
                if plan is None or plan.generation != self._generation:
                    plan = self._plan(ticket.tenant, ticket.key_id, ticket.key_budgets)
                for window in plan.tokens:
                    window.add(now, tokens)

    def release(self, ticket: Ticket, now: float) -> None:
        """A request that ended with no usage at all (refused later, timed out in the queue)."""
        self.charge(ticket, 0, now)

    def headers(
        self, tenant: str, key_id: str, now: float, *, key_budgets: BudgetSettings | None = None
    ) -> dict[str, str]:
        """OpenAI's rate-limit headers for this tenant and key: of all their token budgets (and of all
        their request budgets) the one with the least room left. Empty without budgets."""
        pairs = self.header_lines(tenant, key_id, now, key_budgets)
        return {name.decode(): value.decode() for name, value in pairs}

    def header_lines(
        self, tenant: str, key_id: str, now: float, key_budgets: BudgetSettings | None = None
    ) -> RateHeaders:
        """The same headers, as an answer carries them (ASGI header pairs)."""
        with self._lock:
            limits = self._plan(tenant, key_id, key_budgets).limits
            return _headers(((limit, self._left(limit, now)) for limit in limits), now)

    @staticmethod
    def _left(limit: _Limit, now: float) -> int:
        """Under the lock: what a budget has left now, its holds taken off."""
        held = limit.holds.held if limit.holds is not None else 0
        return limit.limit - limit.window.used(now) - held

    def used(self, subject: Subject, name: str, budget: BudgetName, now: float) -> int:
        """What a window counts now (the status page, tests)."""
        with self._lock:
            window = self._windows.get((subject, name, budget))
            return window.used(now) if window is not None else 0

    # -- persistence (the writer thread) -------------------------------------------------------------

    def restore(self, entries: Iterable[WindowEntry]) -> None:
        """Windows read back from the store at start (oldest first)."""
        with self._lock:
            for e in entries:
                if e.budget in SPANS:
                    self._window((e.subject, e.name, e.budget)).restore(e.at, e.amount, e.expires)
            self._generation += 1

    def take_dirty(self, now: float) -> list[WindowEntry]:
        """The window groups changed since the last call (one row each, with its current amount), and
        those a failed write left; and a sweep of windows left empty (keys and tenants gone quiet)."""
        with self._lock:
            out = dict(self._unsaved)
            self._unsaved.clear()
            for wid, window in self._windows.items():
                if window.changed:
                    for group, amount, expires in window.changed_groups():
                        if expires > now:
                            out[(wid, group)] = WindowEntry(wid[0], wid[1], wid[2], group, amount, expires)
            for wid in [w for w, window in self._windows.items() if not window.used(now)]:
                h = self._holds.get(wid)
                if h is None or (h.held <= 0 and h.overshooter is None):
                    del self._windows[wid]
                    self._holds.pop(wid, None)
                    self._generation += 1  # plans holding it find their windows again
            return list(out.values())

    def put_back(self, entries: Iterable[WindowEntry]) -> None:
        """Rows a failed write did not store: written with the next batch (or newer ones instead)."""
        with self._lock:
            for e in entries:
                self._unsaved[((e.subject, e.name, e.budget), e.at)] = e
