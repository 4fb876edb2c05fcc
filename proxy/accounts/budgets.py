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
starts from the real recent usage; a changed limit keeps the counts. The writer persists changed
window entries with each batch (``take_dirty``); a restart restores them (``restore``).

Thread model: ``check``, ``charge``, ``release`` and ``headers`` are called on the request path (the
event loop); ``take_dirty`` by the writer thread. One lock guards the state; nothing under it blocks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

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

WindowId = tuple[Subject, str, BudgetName]


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted request's claim on the budgets; charge or release it exactly once."""

    tenant: str
    key_id: str
    reserve: int | None
    # (window, True when this request is that window's overshooter, else it holds ``reserve``)
    holds: tuple[tuple[WindowId, bool], ...] = ()
    settled: bool = False


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
    held: int = 0  # reserves of the requests admitted within their bound, not yet charged
    overshooter: Ticket | None = None


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


@dataclass(slots=True)
class _Pick:
    remaining: int
    limit: int
    reset_s: float


@dataclass
class Budgets:
    """Every window and hold. ``tenants``: each tenant's budgets (``configure`` swaps them on reload)."""

    tenants: Mapping[str, BudgetSettings] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _windows: dict[WindowId, Window] = field(default_factory=dict, repr=False)
    _holds: dict[WindowId, _Holds] = field(default_factory=dict, repr=False)
    _dirty: dict[tuple[WindowId, float], None] = field(default_factory=dict, repr=False)  # (window, group)
    _unsaved: dict[tuple[WindowId, float], WindowEntry] = field(default_factory=dict, repr=False)

    def configure(self, tenants: Mapping[str, BudgetSettings]) -> None:
        """New limits (a reload); the windows, their counts and the holds stay."""
        self.tenants = dict(tenants)

    def _window(self, wid: WindowId) -> Window:
        window = self._windows.get(wid)
        if window is None:
            window = self._windows[wid] = Window(*SPANS[wid[2]])
        return window

    def _limits(
        self, tenant: str, key_id: str, key_budgets: BudgetSettings | None
    ) -> list[tuple[WindowId, int]]:
        out: list[tuple[WindowId, int]] = []
        subjects: tuple[tuple[Subject, str, BudgetSettings | None], ...] = (
            ("tenant", tenant, self.tenants.get(tenant)),
            ("key", key_id, key_budgets),
        )
        for subject, name, budgets in subjects:
            if budgets is None:
                continue
            for budget in BUDGET_NAMES:
                limit: int | None = getattr(budgets, budget)
                if limit is not None:
                    out.append(((subject, name, budget), limit))
        return out

    def _charge_all(
        self, tenant: str, key_id: str, budgets: Iterable[BudgetName], amount: int, now: float
    ) -> None:
        for budget in budgets:
            wids: tuple[WindowId, WindowId] = (("tenant", tenant, budget), ("key", key_id, budget))
            for wid in wids:
                group = self._window(wid).add(now, amount)
                self._dirty[(wid, group)] = None

    def check(
        self,
        tenant: str,
        key_id: str,
        now: float,
        *,
        key_budgets: BudgetSettings | None = None,
        reserve: int | None = None,
    ) -> Ticket | Refusal:
        """Admit a request (a ``Ticket``, which counts it against ``requests_per_minute`` now) or refuse
        it (the refusal whose wait is longest, so that a retry then finds room in every budget)."""
        limits = self._limits(tenant, key_id, key_budgets)
        ticket = Ticket(tenant, key_id, reserve)
        with self._lock:
            holds: list[tuple[WindowId, bool]] = []
            refusal: Refusal | None = None
            for wid, limit in limits:
                window = self._window(wid)
                used = window.used(now)
                if wid[2] == "requests_per_minute":
                    if used >= limit:
                        after = window.wait_below(now, limit) or 0.0
                        refusal = _longest(refusal, Refusal(wid[0], wid[1], wid[2], limit, used, after))
                    continue
                h = self._holds.get(wid) or _Holds()
                if reserve is not None and used + h.held + reserve <= limit:
                    holds.append((wid, False))
                elif h.overshooter is None and used + h.held < limit:
                    holds.append((wid, True))
                else:
                    # Room once enough charged tokens expire, given the holds stay; holds alone, or the
                    # overshooter still running: at least the in-flight guess.
                    wait = window.wait_below(now, limit - h.held)
                    after = wait if wait is not None else IN_FLIGHT_RETRY_S
                    if h.overshooter is not None:
                        after = max(after, IN_FLIGHT_RETRY_S)
                    why = Refusal(wid[0], wid[1], wid[2], limit, used, after, in_flight=used < limit)
                    refusal = _longest(refusal, why)
            if refusal is not None:
                return refusal
            for wid, over in holds:
                h = self._holds.setdefault(wid, _Holds())
                if over:
                    h.overshooter = ticket
                else:
                    h.held += reserve or 0
            self._charge_all(tenant, key_id, ("requests_per_minute",), 1, now)
        ticket.holds = tuple(holds)
        return ticket

    def charge(self, ticket: Ticket, tokens: int, now: float) -> None:
        """The request's real usage (prompt plus completion tokens; 0 if it produced none). Frees its
        holds. A second call for the same ticket does nothing."""
        with self._lock:
            if ticket.settled:
                return
            ticket.settled = True
            for wid, over in ticket.holds:
                h = self._holds.get(wid)
                if h is None:
                    continue
                if over:
                    if h.overshooter is ticket:
                        h.overshooter = None
                else:
                    h.held -= ticket.reserve or 0
                if h.held <= 0 and h.overshooter is None:
                    del self._holds[wid]
            if tokens > 0:
                self._charge_all(ticket.tenant, ticket.key_id, _TOKENS, tokens, now)

    def release(self, ticket: Ticket, now: float) -> None:
        """A request that ended with no usage at all (refused later, timed out in the queue)."""
        self.charge(ticket, 0, now)

    def headers(
        self, tenant: str, key_id: str, now: float, *, key_budgets: BudgetSettings | None = None
    ) -> dict[str, str]:
        """OpenAI's rate-limit headers for this tenant and key: of all their token budgets (and of all
        their request budgets) the one with the least room left. Empty without budgets."""
        picks: dict[str, _Pick] = {}
        with self._lock:
            for wid, limit in self._limits(tenant, key_id, key_budgets):
                window = self._window(wid)
                used = window.used(now)
                kind = "requests" if wid[2] == "requests_per_minute" else "tokens"
                held = 0 if kind == "requests" else (h.held if (h := self._holds.get(wid)) else 0)
                pick = _Pick(max(0, limit - used - held), limit, window.reset_in(now))
                best = picks.get(kind)
                if best is None or pick.remaining < best.remaining:
                    picks[kind] = pick
        out: dict[str, str] = {}
        for kind, pick in picks.items():
            out[f"x-ratelimit-limit-{kind}"] = str(pick.limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(pick.remaining)
            out[f"x-ratelimit-reset-{kind}"] = openai_duration(pick.reset_s)
        return out

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

    def take_dirty(self, now: float) -> list[WindowEntry]:
        """The window groups changed since the last call (one row each, with its current amount), and
        those a failed write left; and a sweep of windows left empty (keys and tenants gone quiet)."""
        with self._lock:
            out = dict(self._unsaved)
            self._unsaved.clear()
            for wid, group in self._dirty:
                window = self._windows.get(wid)
                row = window.persisted(group) if window is not None else None
                if row is not None and row[1] > now:
                    out[(wid, group)] = WindowEntry(wid[0], wid[1], wid[2], group, row[0], row[1])
            self._dirty.clear()
            for wid in [w for w, window in self._windows.items() if not window.used(now)]:
                if wid not in self._holds:
                    del self._windows[wid]
            return list(out.values())

    def put_back(self, entries: Iterable[WindowEntry]) -> None:
        """Rows a failed write did not store: written with the next batch (or newer ones instead)."""
        with self._lock:
            for e in entries:
                self._unsaved[((e.subject, e.name, e.budget), e.at)] = e


def _longest(current: Refusal | None, new: Refusal) -> Refusal:
    return new if current is None or new.retry_after_s > current.retry_after_s else current
