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

The request path enters no charge into a window's entries: it counts it (``Window.pending``, read by
``used`` like an entry; nothing for a subject without any budget, whose windows nobody reads then) and
queues its time and amount on the caller's plan. ``_settle`` enters the queues in batches, each window's
charges in time order: by the writer (``take_dirty``), and before anything needs the entries themselves
(a plan's build, a status read, a refusal's wait), under the same lock, so counts, resets and waits are
exact all along. The writer persists the window groups charged since its last batch (``take_dirty``); a
restart restores them (``restore``).

Thread model: ``admit`` (``check``), ``charge``, ``release`` and ``header_lines`` are called on the
request path (the event loop); ``take_dirty`` by the writer thread. One lock guards the state; nothing
under it blocks (the writer's settling holds it for a batch's entries: about a microsecond each).
"""

from __future__ import annotations

import math
import threading
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from proxy.accounts.records import BUDGET_NAMES, BudgetName, Subject, WindowEntry
from proxy.accounts.windows import Charges, Window
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
_PLAN_CACHE = 10_000
# Queued charges are entered into their windows' entries (settled) at least this often: every this
# many requests of one plan, and once the oldest is this old. The writer does it with every batch (within
# a second); without a store, admission does. A charge counts while it waits (``Window.pending``) and
# expires once entered, so any wait well inside the shortest span (a minute) keeps every count exact.
_SETTLE_AT = 1024
SETTLE_AFTER_S = 5.0
# A window's entries are expired on the request path once they are this overdue (``Budgets.admit``).
EXPIRY_LAG_S = 1.0
_NO_LINES = b""

WindowId = tuple[Subject, str, BudgetName]
_Pick = tuple[int, int, Window]  # a budget the headers show: (remaining, limit, its window)


class Ticket:
    """One request's claim on the budgets: made by the caller (``proxy.routes.charge.Charge`` is one),
    admitted by ``Budgets.admit``, then charged or released exactly once. (A plain class: one is made
    per request, and a dataclass's generated ``__init__`` costs more.)"""

    __slots__ = (
        "headers",
        "held_in",
        "key_budgets",
        "key_id",
        "over_in",
        "plan",
        "reserve",
        "settled",
        "tenant",
    )

    def __init__(
        self, tenant: str, key_id: str, reserve: int | None, key_budgets: BudgetSettings | None = None
    ) -> None:
        self.tenant = tenant
        self.key_id = key_id
        self.reserve = reserve
        self.key_budgets = key_budgets
        # The holds it took once admitted: those it holds ``reserve`` of (for most requests the plan's
        # own tuple, shared: nothing is built per request), those whose overshooter it is.
        self.held_in: Sequence[_Holds] = ()
        self.over_in: Sequence[_Holds] = ()
        self.settled = False
        # OpenAI's rate-limit headers as admission left the windows (this request's hold counted), for
        # its answer, rendered (``proxy.asgi.head``); empty without budgets.
        self.headers = _NO_LINES
        # The windows admission found for it (None until admitted): its charge needs no second lookup
        # while they stand.
        self.plan: _Plan | None = None


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


_HEADER_NAMES = {
    kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}")
    for kind in ("requests", "tokens")
}
_LinesCache = dict[int, bytes]
_LINES_CACHE = 10_000
_ceil = math.ceil


class _HeaderKind:
    """One kind's three header lines, rendered (``proxy.asgi.head``: fixed names, digits and durations),
    the limit and reset lines made once and handed to every answer that shows the same figure: per limit,
    and per reset by the millisecond (answers a moment apart share their resets). Each table a bound,
    not an eviction policy."""

    __slots__ = ("limit_name", "limits", "remaining_name", "reset_name", "resets")

    def __init__(self, kind: str) -> None:
        self.limit_name, self.remaining_name, self.reset_name = (n.encode() for n in _HEADER_NAMES[kind])
        self.limits: _LinesCache = {}
        self.resets: _LinesCache = {}

    def lines(self, remaining: int, limit: int, window: Window, now: float) -> bytes:
        """The kind's three lines: the limit and reset lines looked up (made once), the remaining made.
        (Every answer's: a width-0 window's ``reset_in`` is written out.)"""
        seconds = window.reset_in(now) if window.width else window.latest + window.span - now
        ms = _ceil(seconds * 1000) if seconds > 0 else 0
        return b"".join(
            (
                self.limits.get(limit) or _line(self.limits, self.limit_name, limit, b"%d" % limit),
                self.remaining_name,
                b": %d\r\n" % remaining if remaining > 0 else b": 0\r\n",  # ``_render``, written out
                self.resets.get(ms) or _line(self.resets, self.reset_name, ms, _duration_text(ms)),
            )
        )


_TOKEN, _REQUEST = _HeaderKind("tokens"), _HeaderKind("requests")


def _line(cache: _LinesCache, name: bytes, value: int, text: bytes) -> bytes:
    if len(cache) >= _LINES_CACHE:
        cache.clear()
    rendered = cache[value] = _render(name, text)
    return rendered


def _render(name: bytes, value: bytes) -> bytes:
    """A header line as an answer's head holds it (``proxy.asgi.head``): the name and value are the
    budgets' own (fixed names, digits, durations), never a client's or the child's bytes."""
    return name + b": " + value + b"\r\n"


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


@dataclass(eq=False, slots=True)
class _Plan:
    """What one (tenant, key, key's budgets) touches, looked up once: the windows its limits check, and
    the windows it is charged into (every tenant and key has windows, budget or not). Valid while the
    windows it holds are the ones in ``Budgets._windows`` (``generation``)."""

    generation: int
    key_budgets: BudgetSettings | None
    # (window id, window, limit, its holds: None for requests_per_minute, which holds nothing)
    limits: tuple[tuple[WindowId, Window, int, _Holds | None], ...]
    # The windows charged: a request's at admission, its tokens at the end, of the subjects that have a
    # budget. The request path only counts a charge in them (``Window.pending``, ``Window.latest``) and
    # queues it here; ``Budgets._settle`` enters the queue into their entries in batches (by the
    # writer, before anything needs the entries themselves, under the same lock), so ``used`` is exact
    # all along.
    requests: tuple[Window, ...]
    tokens: tuple[Window, ...]
    # The headers name the kind of the first budget in ``limits`` first.
    tokens_first: bool = True
    # ``limits`` by kind, in order, for ``Budgets.admit``'s common case: (window, limit, holds) of the
    # token budgets, (window, limit) of the request budgets; and the token budgets' holds, what a request
    # admitted for its reserve in each of them holds (``Ticket.held_in``).
    token_limits: tuple[tuple[Window, int, _Holds], ...] = ()
    request_limits: tuple[tuple[Window, int], ...] = ()
    token_holds: tuple[_Holds, ...] = ()
    # The windows of a subject without any budget, kept so that a budget it is given later starts from
    # its real recent usage: nothing reads them on the request path, so their charges are only queued.
    later_requests: tuple[Window, ...] = ()
    later_tokens: tuple[Window, ...] = ()
    queued_requests: array[float] = field(default_factory=lambda: array("d"))
    queued_at: array[float] = field(default_factory=lambda: array("d"))
    queued_tokens: array[float] = field(default_factory=lambda: array("d"))
    queued: bool = False  # in ``Budgets._queued``

    def take_queue(self, into: dict[Window, list[Charges]]) -> None:
        """Under the lock: what is queued, per window it goes into (``Budgets._settle``): the queue's
        arrays themselves (the plan starts new ones); the counted windows' ``pending`` gives it back."""
        requests, at, tokens = self.queued_requests, self.queued_at, self.queued_tokens
        if requests:
            self.queued_requests = array("d")
            ones: Charges = (requests, None)
            for window in self.requests:
                window.pending -= len(requests)
                into.setdefault(window, []).append(ones)
            for window in self.later_requests:
                into.setdefault(window, []).append(ones)
        if at:
            self.queued_at, self.queued_tokens = array("d"), array("d")
            charges: Charges = (at, tokens)
            total = int(sum(tokens))
            for window in self.tokens:
                window.pending -= total
                into.setdefault(window, []).append(charges)
            for window in self.later_tokens:
                into.setdefault(window, []).append(charges)
        self.queued = False


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
    # Plans with charges queued (``_Plan.queued_*``), and when the oldest of them must be entered at the
    # latest: a counted charge expires only once entered, and a daemon without a store has no writer.
    _queued: list[_Plan] = field(default_factory=list, repr=False)
    _settle_by: float = math.inf

    def _settle(self) -> None:
        """Under the lock: every queued charge into its window. Before anything reads those windows (a
        plan is built, ``used``, the writer's ``take_dirty``), and when a queue grows long (a daemon
        without a store has no writer)."""
        self._settle_by = math.inf
        if not self._queued:
            return
        into: dict[Window, list[Charges]] = {}
        for plan in self._queued:
            plan.take_queue(into)
        self._queued.clear()
        # A window shared by several plans (a tenant's, by its keys') gets their charges in time order,
        # each with its own time: the entries stay exact (``Window.extend``).
        for window, sources in into.items():
            window.extend(sources)

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
        self._settle()  # a budget given now counts what was queued for its windows too
        limits: list[tuple[WindowId, Window, int, _Holds | None]] = []
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
                    wid: WindowId = (subject, name, budget)
                    holds = None if budget == "requests_per_minute" else self._holds_of(wid)
                    limits.append((wid, self._window(wid), limit, holds))

        limited = {wid[:2] for wid, _, _, _ in limits}  # the subjects with a budget

        def windows(budgets: Iterable[BudgetName], now: bool) -> tuple[Window, ...]:
            subjects: tuple[tuple[Subject, str], ...] = (("tenant", tenant), ("key", key_id))
            return tuple(
                self._window((s, n, b)) for b in budgets for s, n in subjects if ((s, n) in limited) == now
            )

        plan = _Plan(
            self._generation,
            key_budgets,
            tuple(limits),
            windows(("requests_per_minute",), True),
            windows(_TOKENS, True),
            tokens_first=bool(limits) and limits[0][3] is not None,
            token_limits=tuple((w, limit, h) for _, w, limit, h in limits if h is not None),
            request_limits=tuple((w, limit) for _, w, limit, h in limits if h is None),
            token_holds=tuple(h for _, _, _, h in limits if h is not None),
            later_requests=windows(("requests_per_minute",), False),
            later_tokens=windows(_TOKENS, False),
        )
        if len(self._plans) >= _PLAN_CACHE:
            self._plans = {}  # keys come and go: a bound, not an eviction policy
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
        finds room in every budget).

        Runs for every request, so a window's count is read as it stands (``total + pending``), its
        entries expired only once they are ``EXPIRY_LAG_S`` overdue (the writer's batches expire them
        sooner) or when the count as it stands would refuse: an entry that has just expired may still
        count for a moment, never one that should count (the bound holds), and no request is refused
        for an expired one. The common case, a request with a reserve that every budget has room for as
        it stands, is checked first; anything else is decided by ``_admit_exactly``."""
        reserve = ticket.reserve
        with self._lock:
            if now >= self._settle_by:
                self._settle()
            plan = self._plan(ticket.tenant, ticket.key_id, ticket.key_budgets)
            if not plan.limits:  # no budget at all: counted, nothing to check
                self._queue_request(plan, now)
                ticket.plan = plan
                return ticket
            # The headers' figures as admitting it leaves them: of each kind, the budget with the least
            # room left (remaining, limit, window), in locals.
            t_window: Window | None = None
            r_window: Window | None = None
            t_left = t_limit = r_left = r_limit = 0
            fits = reserve is not None
            overshoots = False  # some token budget admits it as its overshooter, not for its reserve
            if reserve is not None:
                for window, limit, h in plan.token_limits:
                    used = window.total + window.pending
                    if now >= window.horizon + EXPIRY_LAG_S:
                        used = window.used(now)
                    left = limit - used - h.held - reserve
                    if left < 0:
                        fits = False
                        break
                    if t_window is None or left < t_left:
                        t_left, t_limit, t_window = left, limit, window
                if fits:
                    for window, limit in plan.request_limits:
                        used = window.total + window.pending
                        if now >= window.horizon + EXPIRY_LAG_S:
                            used = window.used(now)
                        left = limit - used - 1
                        if left < 0:
                            fits = False
                            break
                        if r_window is None or left < r_left:
                            r_left, r_limit, r_window = left, limit, window
            if not fits:
                decided = self._admit_exactly(ticket, plan, now)
                if isinstance(decided, Refusal):
                    return decided
                overshoots, t_left, t_limit, t_window, r_left, r_limit, r_window = decided
            if overshoots:
                self._hold_each(ticket, plan, now)
            elif plan.token_holds:  # every token budget admitted it for its reserve (so it has one)
                amount = reserve or 0
                for h in plan.token_holds:
                    h.held += amount
                ticket.held_in = plan.token_holds
            for window in plan.requests:
                window.pending += 1
                if now > window.latest:
                    window.latest = now
            self._queue_request(plan, now)
            ticket.headers = _lines(
                plan.tokens_first,
                None if t_window is None else (t_left, t_limit, t_window),
                None if r_window is None else (r_left, r_limit, r_window),
                now,
            )
            ticket.plan = plan
        return ticket

    def _admit_exactly(
        self, ticket: Ticket, plan: _Plan, now: float
    ) -> Refusal | tuple[bool, int, int, Window | None, int, int, Window | None]:
        """Under the lock, for a request ``admit``'s common case did not decide: every budget of its plan
        in order, on exact counts where the count as it stands would not do. Its refusal, or whether
        some token budget admits it as its overshooter and the headers' figures (tokens, then requests:
        remaining, limit, window); ``admit`` takes the holds."""
        reserve = ticket.reserve
        refusal: Refusal | None = None
        overshoots = False  # some token budget admits it as its overshooter, not for its reserve
        t_window: Window | None = None
        r_window: Window | None = None
        t_left = t_limit = r_left = r_limit = 0
        for wid, window, limit, h in plan.limits:
            used = window.used(now) if now >= window.horizon + EXPIRY_LAG_S else window.total + window.pending
            if h is None:  # requests_per_minute
                if used >= limit and now >= window.horizon:
                    used = window.used(now)  # as it stands it would refuse: count exactly
                if used < limit:
                    if r_window is None or limit - used - 1 < r_left:
                        r_left, r_limit, r_window = limit - used - 1, limit, window
                    continue
                self._settle()  # the wait is read off the entries: all of them in
                after = window.wait_below(now, limit) or 0.0
                refusal = _longest(refusal, Refusal(wid[0], wid[1], wid[2], limit, used, after))
                continue
            held = h.held
            if used + held + (reserve or 1) > limit and now >= window.horizon:
                used = window.used(now)  # as it stands it would not fit: count exactly
            if reserve is not None and used + held + reserve <= limit:
                left = limit - used - held - reserve
            elif h.overshooter is None and used + held < limit:
                overshoots = True
                left = limit - used - held
            else:
                # Room once enough charged tokens expire, given the holds stay; holds alone, or the
                # overshooter still running: at least the in-flight guess.
                self._settle()  # the wait is read off the entries: all of them in
                wait = window.wait_below(now, limit - held)
                after = wait if wait is not None else IN_FLIGHT_RETRY_S
                if h.overshooter is not None:
                    after = max(after, IN_FLIGHT_RETRY_S)
                why = Refusal(wid[0], wid[1], wid[2], limit, used, after, in_flight=used < limit)
                refusal = _longest(refusal, why)
                continue
            if t_window is None or left < t_left:
                t_left, t_limit, t_window = left, limit, window
        if refusal is not None:
            return refusal
        return overshoots, t_left, t_limit, t_window, r_left, r_limit, r_window

    def _hold_each(self, ticket: Ticket, plan: _Plan, now: float) -> None:
        """Under the lock, for a ticket ``admit`` found room for: its reserve in the token budgets that
        have room for it, the overshooter's place in the others (the same tests ``admit`` made, on the
        same windows: nothing changed them in between)."""
        reserve = ticket.reserve
        held_in: list[_Holds] = []
        over_in: list[_Holds] = []
        for _, window, limit, h in plan.limits:
            if h is None:
                continue
            if reserve is not None and window.used(now) + h.held + reserve <= limit:
                h.held += reserve
                held_in.append(h)
            else:
                h.overshooter = ticket
                over_in.append(h)
        ticket.held_in, ticket.over_in = held_in, over_in

    def _queue_request(self, plan: _Plan, now: float) -> None:
        """Under the lock: an admitted request, queued for its requests_per_minute windows."""
        queue = plan.queued_requests
        queue.append(now)
        if not plan.queued:
            self._enqueue(plan, now)
        elif len(queue) >= _SETTLE_AT:
            self._settle()

    def _enqueue(self, plan: _Plan, now: float) -> None:
        """Under the lock: ``plan`` has charges queued now; they are entered within ``SETTLE_AFTER_S``."""
        plan.queued = True
        self._queued.append(plan)
        if now + SETTLE_AFTER_S < self._settle_by:
            self._settle_by = now + SETTLE_AFTER_S

    def charge(self, ticket: Ticket, tokens: int, now: float) -> None:
        """The request's real usage (prompt plus completion tokens; 0 if it produced none). Frees its
        holds. A second call for the same ticket does nothing."""
        with self._lock:
            if ticket.settled:
                return
            ticket.settled = True
            if ticket.held_in:
                reserve = ticket.reserve or 0
                for h in ticket.held_in:
                    h.held -= reserve
            for h in ticket.over_in:
                if h.overshooter is ticket:
                    h.overshooter = None
            if tokens > 0:
                plan = ticket.plan
                if plan is None or plan.generation != self._generation:
                    plan = self._plan(ticket.tenant, ticket.key_id, ticket.key_budgets)
                for window in plan.tokens:
                    window.pending += tokens
                    if now > window.latest:
                        window.latest = now
                plan.queued_at.append(now)
                plan.queued_tokens.append(tokens)
                if not plan.queued:
                    self._enqueue(plan, now)

    def release(self, ticket: Ticket, now: float) -> None:
        """A request that ended with no usage at all (refused later, timed out in the queue)."""
        self.charge(ticket, 0, now)

    def headers(
        self, tenant: str, key_id: str, now: float, *, key_budgets: BudgetSettings | None = None
    ) -> dict[str, str]:
        """OpenAI's rate-limit headers for this tenant and key: of all their token budgets (and of all
        their request budgets) the one with the least room left. Empty without budgets."""
        lines = self.header_lines(tenant, key_id, now, key_budgets).decode()
        return dict(text.split(": ", 1) for text in lines.split("\r\n") if text)

    def header_lines(
        self, tenant: str, key_id: str, now: float, key_budgets: BudgetSettings | None = None
    ) -> bytes:
        """The same headers, rendered (``proxy.asgi.head``)."""
        with self._lock:
            if now >= self._settle_by:
                self._settle()
            limits = self._plan(tenant, key_id, key_budgets).limits
            return self._headers(limits, now) if limits else _NO_LINES

    def _headers(self, limits: tuple[tuple[WindowId, Window, int, _Holds | None], ...], now: float) -> bytes:
        """Under the lock."""
        requests: _Pick | None = None
        tokens: _Pick | None = None
        for _, window, limit, h in limits:
            if h is None:
                remaining = limit - window.used(now)
                if requests is None or remaining < requests[0]:
                    requests = (remaining, limit, window)
            else:
                remaining = limit - window.used(now) - h.held
                if tokens is None or remaining < tokens[0]:
                    tokens = (remaining, limit, window)
        return _lines(limits[0][3] is not None, tokens, requests, now)

    def used(self, subject: Subject, name: str, budget: BudgetName, now: float) -> int:
        """What a window counts now (the status page, tests)."""
        with self._lock:
            self._settle()
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
            self._settle()
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


def _lines(tokens_first: bool, tokens: _Pick | None, requests: _Pick | None, now: float) -> bytes:
    """The header lines of the picked budgets, of the kind whose budget comes first first."""
    t = _NO_LINES if tokens is None else _TOKEN.lines(*tokens, now)
    r = _NO_LINES if requests is None else _REQUEST.lines(*requests, now)
    return t + r if tokens_first else r + t


def _duration_text(ms: int) -> bytes:
    return openai_duration(ms / 1000).encode()


def _longest(current: Refusal | None, new: Refusal) -> Refusal:
    return new if current is None or new.retry_after_s > current.retry_after_s else current
