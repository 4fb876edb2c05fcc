"""One generation request's account: the usage it is charged at the end, in the ledger and its budgets.

Admission (``proxy.admission.pipeline``) takes the budgets' holds; this is the other half, what the
request used. ``Inference`` opens an ``Account`` around each request (``open_account``: with neither a
store nor budgets, ``NO_ACCOUNT``, whose every step does nothing) and uses it at two points:

- ``tap(fmt)`` for each attempt's ``Relay`` (it reads the usage a whole or assembled answer reports; a
  stream's is in its meter's report chunks: ``proxy.streams.usage``), and ``relay`` set to that relay:
  after a replay, the last attempt's, whose tap and meter hold only that attempt's usage (a child that
  died before the client saw a byte is not charged);
- ``charging(grant)`` around the request's life inside its grant: at its end, a request that reached
  the child is charged what it used to the ledger (a ``LedgerRow``: never a prompt or a completion; a
  store only), the ``llamagate_usage_tokens`` series, and its budgets (``Grant.charge``: every budget
  hold of the pipeline is charged the same tokens). One that never reached the child (refused later,
  timed out in the queue, the client left while it waited) is charged nothing: the pipeline gives its
  budget holds back.

What a request that reached the child is charged (its ledger row's ``usage_source`` says where the
prompt's figure came from):

- ``reported``: the usage the child reported (its ``usage``, or the timings of a chat stream without
  ``include_usage``: ``proxy.streams.usage``);
- ``counted``: the child never reported its figures (a client that closed its stream early, an
  operator's cancel, a stream cut by a child's death after its first byte, a deadline): the prompt is
  counted again by the model's own tokenizer and chat template (``count_prompt_tokens``: the counting
  route of the request's kind on a READY child of the same model), beside the completion tokens the
  meter counted until the end. The prefill is the expensive part of a request: a client cannot make it
  free by hanging up (issue 39: 8 early-closed streams of a 489-token prompt were charged 16 tokens);
- ``estimated``: the same, with no READY child to count on: a quarter of the prompt's bytes, the
  common rule of thumb for English text under byte-pair tokenizers;
- ``undelivered``: the child died (or hung up) before any byte of the answer reached the client, on the
  request's last attempt: nothing the tenant received, so nothing is charged (a replay that succeeded
  is charged its own attempt only). The ledger still has its row, with zeros, as the access log has.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

from proxy.accounts.records import LedgerRow
from proxy.admission.pipeline import Grant
from proxy.asgi.context import RequestContext
from proxy.asgi.disconnect import ClientGone
from proxy.auth import Principal
from proxy.errors import ProxyError, UpstreamGone, UpstreamUnreachable
from proxy.state import ProxyState
from proxy.streams.formats import StreamFormat
from proxy.streams.relay import Relay
from proxy.streams.usage import Usage, UsageTap

# What a relay without a usage tap reports: nothing (read only, never changed).
_UNREPORTED = Usage()


class PromptCount(Protocol):
    """A request's prompt, for its charge when the child did not report it (the endpoint's is
    ``proxy.routes.prompt_tokens.PromptTokens``)."""

    async def for_charge(self) -> tuple[int, str]:
        """Its tokens, and how they were found: "counted" by the model's tokenizer, or "estimated"
        without a child to count on."""
        ...


class Account:
    """What one request is charged, and where it is written."""

    def __init__(
        self,
        state: ProxyState,
        ctx: RequestContext,
        who: Principal,
        model: str,
        kind: str,
        prompt: PromptCount,
    ) -> None:
        self._ledger = state.accounts  # the store's accounts; None: budgets in memory, no ledger
        self._metrics = state.metrics
        self._ctx = ctx
        self._who = who
        self._model = model
        self._kind = kind  # the route's, as the ledger names it
        self._prompt = prompt
        self.relay: Relay | None = None

    def tap(self, fmt: StreamFormat) -> UsageTap | None:
        return UsageTap(fmt.usage)

    @asynccontextmanager
    async def charging(self, grant: Grant) -> AsyncIterator[None]:
        """Charge the request's usage when the block ends, however it ends."""
        try:
            yield
        except BaseException as exc:
            await self._charge(grant, exc)
            raise
        else:
            await self._charge(grant, None)

    async def _charge(self, grant: Grant, exc: BaseException | None) -> None:
        relay = self.relay
        if relay is None or not relay.exchange.sent:
            return  # never reached the child: the pipeline gives the holds back
        ctx = self._ctx
        if isinstance(exc, UpstreamGone | UpstreamUnreachable) and not ctx.response_started:
            used, source = _NOTHING, "undelivered"
        else:
            used, source = await self._used(relay)
        prompt, cached, completion = used
        ctx.usage = used  # the request's record: what it is charged (telemetry reports it)
        answer = relay.usage.usage if relay.usage is not None and source != "undelivered" else None
        if answer is not None:
            ctx.response_id = answer.response_id
            ctx.finish_reasons = tuple(answer.finish_reasons or ())
        if self._ledger is not None:
            row = LedgerRow(
                tenant=self._who.tenant,
                key_id=self._who.key_id,
                model=self._model,
                kind=self._kind,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
                status=_status(ctx, exc),
                duration_s=time.monotonic() - ctx.started,
                at=time.time(),
                request_id=ctx.request_id,
                usage_source=source,
            )
            self._ledger.record(row)
        grant.charge(prompt + completion)
        self._metrics.observe_usage(self._who.tenant, self._model, prompt, cached, completion)

    async def _used(self, relay: Relay) -> tuple[tuple[int, int, int], str]:
        """(prompt, cached, completion) tokens of the request's last attempt, and where the prompt's
        figure came from."""
        meter, tap = relay.meter, relay.usage
        usage = tap.result(meter.reports if meter is not None else ()) if tap is not None else _UNREPORTED
        prompt, cached, completion = usage.prompt, usage.cached, usage.completion
        if usage.reported or prompt > 0:
            return (prompt, cached, completion), "reported"
        if meter is not None:
            completion = max(completion, meter.tokens)  # cut short: what was generated until then
        prompt, source = await self._prompt.for_charge()
        return (prompt, 0, completion), source


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


_NOTHING = (0, 0, 0)


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

    @asynccontextmanager
    async def charging(self, grant: Grant) -> AsyncIterator[None]:
        yield


NO_ACCOUNT = NoAccount()


def open_account(
    state: ProxyState, ctx: RequestContext, who: Principal, model: str, kind: str, prompt: PromptCount
) -> Account | NoAccount:
    """The account of one request of ``kind`` (its route's) to ``model``; ``NO_ACCOUNT`` without a store,
    budgets or telemetry (which reports the usage too)."""
    if state.accounts is None and not state.budgeted and ctx.genai is None:
        return NO_ACCOUNT
    return Account(state, ctx, who, model, kind, prompt)
