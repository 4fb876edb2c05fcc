"""One generation request's account: its budgets asked at admission, its usage charged at the end.

``Inference`` opens a charge around each request (``open_charge``: without a store, ``NO_CHARGE``, whose
every step does nothing) and calls it at two points, each a line in ``proxy.routes.inference``:

- ``admit(sequences, ctx_per_slot)``, once the request's cost is known and before it takes a slot or
  joins a queue: the tenant's and the key's budgets (``proxy.accounts.budgets``) admit it or refuse it
  with the 429 of the spent budget (``Retry-After``: when the window has room). Its reserve is an upper
  bound of what it can use: every sequence at most fills its slot's context (llama-server stops a
  sequence there: context shift is off), so a budget smaller than that runs one such request at a time;
- with ``cluster.redis_url``, ``await admit_shared()``, called by the cluster limiter before it waits
  for a lease: the same budgets as the replicas count them together in Redis (``proxy.cluster.budgets``;
  charged the same usage at the end, off the request's path);
- ``relay`` is set to the request's ``Relay`` (built with ``tap(...)``, which reads the usage a whole
  or assembled answer reports; a stream's is in its meter's report chunks: ``proxy.streams.usage``);
  after a replay, the last attempt's relay, whose tap and meter
  hold only that attempt's usage (a child that died before the client saw a byte is not charged).

At the end (``__exit__``): a request that reached the child is charged the usage the child reported (a
client that left: the completion tokens the meter counted until then, and the prompt if it was
reported) to the budgets and the ledger (a ``LedgerRow``: never a prompt or a completion), and the
``llamagate_usage_tokens`` series; one that never reached it (refused later, timed out in the queue, the
client left while it waited) only gives its budget hold back.

A budgeted caller's rate-limit headers (``x-ratelimit-*``, as admission left its windows) are put on the
request (``RequestContext.extra_headers``): the one layer that starts every answer adds them, to a 200
as to any error, a 429 of the budgets included.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from proxy.accounts.budgets import Refusal, Ticket
from proxy.accounts.records import LedgerRow
from proxy.accounts.service import Accounts, MemoryBudgets
from proxy.asgi.context import RequestContext
from proxy.asgi.disconnect import ClientGone
from proxy.auth import Principal
from proxy.cluster.budgets import SharedBudgets, SharedTicket
from proxy.errors import ProxyError
from proxy.metrics.proxy import ProxyMetrics
from proxy.state import ProxyState
from proxy.streams.formats import StreamFormat
from proxy.streams.relay import Relay
from proxy.streams.usage import Usage, UsageTap

# What a relay without a usage tap reports: nothing (read only, never changed).
_UNREPORTED = Usage()


class Charge(Ticket):
    """The request's own claim on the budgets (a ``Ticket``: admitted, then charged or released once),
    with what its charge at the end needs."""

    __slots__ = (
        "_accounts",
        "_ctx",
        "_kind",
        "_metrics",
        "_model",
        "_shared",
        "_shared_ticket",
        "relay",
    )

    def __init__(
        self,
        accounts: Accounts | MemoryBudgets,
        metrics: ProxyMetrics,
        ctx: RequestContext,
        who: Principal,
        model: str,
        kind: str,
        shared: SharedBudgets | None = None,
    ) -> None:
        super().__init__(who.tenant, who.key_id, None, who.budgets)
        self._accounts = accounts
        self._shared = shared
        self._shared_ticket: SharedTicket | None = None
        self._metrics = metrics
        self._ctx = ctx
        self._model = model
        self._kind = kind
        self.relay: Relay | None = None

    def __enter__(self) -> Charge:
        return self

    # -- at admission -------------------------------------------------------------------------------
    def admit(self, sequences: int, ctx_per_slot: int) -> None:
        """Ask the budgets; raise the 429 of a spent one (with the rate-limit headers)."""
        self.reserve = max(1, sequences) * ctx_per_slot if ctx_per_slot > 0 else None
        now = time.time()
        # The budgets themselves, not ``Accounts.admit`` (which only forwards): one call less per request.
        got = self._accounts.budgets.admit(self, now)
        if isinstance(got, Refusal):
            # Its rate-limit headers ride on the answer like those of any other (``extra_headers``).
            lines = self._accounts.header_lines(self.tenant, self.key_id, now, key_budgets=self.key_budgets)
            self._ctx.extra_headers = lines
            raise got.error()
        self._ctx.extra_headers = self.headers  # every answer to it carries them, errors too

    async def admit_shared(self) -> None:
        """With ``cluster.redis_url``: the same budgets as the replicas count them together in Redis
        (``proxy.cluster.budgets``), asked by the cluster limiter before it waits for a lease (so still
        before any slot or queue); raise the 429 of a spent one and give this replica's hold back."""
        if self._shared is None or self.plan is None:
            return
        tenant_budgets = self._accounts.budgets.tenants.get(self.tenant)
        got = await self._shared.check(
            self.tenant, tenant_budgets, self.key_id, self.key_budgets, self.reserve
        )
        if isinstance(got, SharedTicket):
            self._shared_ticket = got
        elif isinstance(got, Refusal):
            self._accounts.budgets.release(self, time.time())  # settled: nothing is charged at the end
            raise got.error()

    def tap(self, fmt: StreamFormat) -> UsageTap:
        return UsageTap(fmt.usage)

    # -- at the end ---------------------------------------------------------------------------------
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.plan is None or self.settled:
            return  # refused by the budgets, or before them, or given back: nothing held
        relay = self.relay
        now = time.time()
        if relay is None or not relay.exchange.sent:
            self._accounts.budgets.release(self, now)
            self._charge_shared(0)
            return
        meter, tap = relay.meter, relay.usage
        usage = tap.result(meter.reports if meter is not None else ()) if tap is not None else _UNREPORTED
        prompt, cached, completion = usage.prompt, usage.cached, usage.completion
        if not usage.reported and meter is not None:
            completion = max(completion, meter.tokens)  # cut short: what was generated until then
        ctx = self._ctx
        row: LedgerRow = (
            self.tenant,
            self.key_id,
            self._model,
            self._kind,
            prompt,
            cached,
            completion,
            _status(ctx, exc),
            time.monotonic() - ctx.started,
            now,
            ctx.request_id,
        )
        self._accounts.finish(self, row)
        if self._shared is not None:
            self._charge_shared(prompt + completion)
        self._metrics.observe_usage(self.tenant, self._model, prompt, cached, completion)

    def _charge_shared(self, tokens: int) -> None:
        if self._shared is not None and self._shared_ticket is not None:
            ticket, self._shared_ticket = self._shared_ticket, None
            self._shared.charge(ticket, tokens)


def _status(ctx: RequestContext, exc: BaseException | None) -> int:
    """The status the client got (or is about to get: the error being answered)."""
    if ctx.response_started:
        return ctx.status
    if isinstance(exc, ProxyError):
        return exc.status
    if exc is None:
        return ctx.status or 200
    if isinstance(exc, ClientGone | asyncio.CancelledError):
        return 499  # nginx's "client closed request", as the access log says
    return 500


class _NoCharge:
    """Without a store: every step does nothing (one shared instance, no state)."""

    __slots__ = ()

    def __enter__(self) -> _NoCharge:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def admit(self, sequences: int, ctx_per_slot: int) -> None:
        return None

    async def admit_shared(self) -> None:
        return None

    def tap(self, fmt: StreamFormat) -> None:
        return None

    @property
    def relay(self) -> Relay | None:
        return None

    @relay.setter
    def relay(self, relay: Relay | None) -> None:
        pass


NO_CHARGE = _NoCharge()


def open_charge(
    state: ProxyState, ctx: RequestContext, who: Principal, model: str, kind: str
) -> Charge | _NoCharge:
    """The charge of one request of ``kind`` (its route's) to ``model``; ``NO_CHARGE`` without a store.
    The tenant's budgets are the accounts' own (``Accounts.reconfigure``), found by its name."""
    if state.book is None:
        return NO_CHARGE
    return Charge(state.book, state.metrics, ctx, who, model, kind, state.shared_budgets)
