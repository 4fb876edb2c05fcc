"""One generation request's account: the usage it is charged at the end, in the ledger and its budgets.

Admission (``proxy.admission.pipeline``) takes the budgets' holds; this is the other half, what the
request used. ``Inference`` opens an ``Account`` around each request (``open_account``: with neither a
store nor budgets, ``NO_ACCOUNT``, whose every step does nothing) and uses it at two points:

- ``tap(fmt)`` for each attempt's ``Relay`` (it reads the usage a whole or assembled answer reports; a
  stream's is in its meter's report chunks: ``proxy.streams.usage``), and ``relay`` set to that relay:
  after a replay, the last attempt's, whose tap and meter hold only that attempt's usage (a child that
  died before the client saw a byte is not charged);
- ``charging(grant)`` around the request's life inside its grant: at its end, a request that reached
  the child is charged the usage the child reported (a client that left: the completion tokens the meter
  counted until then, and the prompt if it was reported) to the ledger (a ``LedgerRow``: never a prompt
  or a completion; a store only), the ``llamagate_usage_tokens`` series, and its budgets (``Grant.charge``:
  every budget hold of the pipeline is charged the same tokens). One that never reached the child
  (refused later, timed out in the queue, the client left while it waited) is charged nothing: the
  pipeline gives its budget holds back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from proxy.accounts.records import LedgerRow
from proxy.accounts.service import Accounts
from proxy.admission.pipeline import Grant
from proxy.asgi.context import RequestContext
from proxy.asgi.disconnect import ClientGone
from proxy.auth import Principal
from proxy.errors import ProxyError
from proxy.metrics.proxy import ProxyMetrics
from proxy.state import ProxyState
from proxy.streams.formats import StreamFormat
from proxy.streams.relay import Relay
from proxy.streams.usage import Usage, UsageTap

# What a relay without a usage tap reports: nothing (read only, never changed).
_UNREPORTED = Usage()


class Account:
    """What one request is charged, and where it is written."""

    def __init__(
        self,
        ledger: Accounts | None,
        metrics: ProxyMetrics,
        ctx: RequestContext,
        who: Principal,
        model: str,
        kind: str,
    ) -> None:
        self._ledger = ledger  # the store's accounts; None: budgets in memory, no ledger
        self._metrics = metrics
        self._ctx = ctx
        self._who = who
        self._model = model
        self._kind = kind  # the route's, as the ledger names it
        self.relay: Relay | None = None

    def tap(self, fmt: StreamFormat) -> UsageTap | None:
        return UsageTap(fmt.usage)

    @contextmanager
    def charging(self, grant: Grant) -> Iterator[None]:
        """Charge the request's usage when the block ends, however it ends."""
        try:
            yield
        except BaseException as exc:
            self._charge(grant, exc)
            raise
        else:
            self._charge(grant, None)

    def _charge(self, grant: Grant, exc: BaseException | None) -> None:
        relay = self.relay
        if relay is None or not relay.exchange.sent:
            return  # never reached the child: the pipeline gives the holds back
        meter, tap = relay.meter, relay.usage
        usage = tap.result(meter.reports if meter is not None else ()) if tap is not None else _UNREPORTED
        prompt, cached, completion = usage.prompt, usage.cached, usage.completion
        if not usage.reported and meter is not None:
            completion = max(completion, meter.tokens)  # cut short: what was generated until then
        ctx, who = self._ctx, self._who
        now = time.time()
        if self._ledger is not None:
            row: LedgerRow = (
                who.tenant,
                who.key_id,
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
            self._ledger.finish(None, row)
        grant.charge(prompt + completion)
        self._metrics.observe_usage(who.tenant, self._model, prompt, cached, completion)


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


class NoAccount:
    """Neither a store nor budgets: nothing is charged, and no usage is read (one shared instance, no
    state: the relay it is given is dropped)."""

    @property
    def relay(self) -> Relay | None:
        return None

    @relay.setter
    def relay(self, relay: Relay | None) -> None:
        pass

    def tap(self, fmt: StreamFormat) -> UsageTap | None:
        return None

    @contextmanager
    def charging(self, grant: Grant) -> Iterator[None]:
        yield


NO_ACCOUNT = NoAccount()


def open_account(
    state: ProxyState, ctx: RequestContext, who: Principal, model: str, kind: str
) -> Account | NoAccount:
    """The account of one request of ``kind`` (its route's) to ``model``; ``NO_ACCOUNT`` without a store
    or budgets."""
    if state.accounts is None and not state.budgeted:
        return NO_ACCOUNT
    return Account(state.accounts, state.metrics, ctx, who, model, kind)
