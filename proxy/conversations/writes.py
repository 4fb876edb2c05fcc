"""Which conversation states the disk tier writes: only those likely to be read again (issue 56).

Every chat request is a conversation (its opening's digest, ``proxy.conversations.key``), so before this
the tier saved every state a slot replaced: 400 one-shot requests of ~400 prompt tokens wrote 2,546 MB
(6.4 MB each) and read none back. A state leaving its slot is now written when its conversation is
likely to come back (``WritePolicy.reason``), first reason that holds:
- ``named``: the client named the conversation (``X-Session-Id``, ``prompt_cache_key``, an agent's
  session header): it says it will come back;
- ``returned``: it has had a second turn: a conversation that came back once is one that goes on;
- ``tenant``: its tenant's unnamed conversations do come back: the tenant's *return rate*, measured
  here, is at least one in ``WRITE_ONE_IN``.
Otherwise the state is not written (``one_shot``). A chat application's conversations come back (in
``llamagate bench conversations`` every one does: a rate of 1); one-shot traffic's never do (0).

The return rate, per tenant: ``(returned + PRIOR_RETURNS) / (left + PRIOR_RETURNS)``, where ``left``
counts the unnamed first-turn states that left a slot (the decisions taken) and ``returned`` the
unnamed conversations seen for a second turn, counted when that turn is placed (``DiskTier.before_turn``),
before the state it displaces is decided: a restore overwrites that state, which then has no copy in
llama-server's RAM cache either, so the return that caused it must already count. The prior is one
return: a tenant starts out trusted, so the first states of a fresh daemon are written while nothing
is known (a chat application's first conversations all open before any comes back: 32 conversations
opened at once return only after their 32 first turns), and one-shot traffic stops being written after
``FIRST_WRITES`` = 20 decisions: at most 20 states per tenant and model, however long it runs (issue
56's 400 one-shot requests and a benchmark's 8 warm-up requests replace 406 states on 2 slots: 4.9 % of
them are written). The price: a fresh daemon
whose first unnamed conversations all open before any comes back writes the first 20 of them, and those
past that which llama-server's RAM cache no longer holds when their second turn comes compute that
turn's history (their shared system prompt aside); from the first return on, the tenant's states are
written. Both counts are halved when ``left`` reaches ``RATE_WINDOW``: the rate follows the tenant's
traffic as it changes, in fixed size.

A conversation is remembered (its turns, named or not) in an LRU of ``SEEN`` keys: a conversation that
returns after that many others opened counts as new (a first turn), which only errs towards not
writing. The memory is fixed: ``SEEN`` keys of 32 characters and an int each (about 0.2 KiB a key with
the dict's node: under 1 MiB), and two floats per tenant.

Writes are also bounded by a rate (``llama.state_write_mib_s``, per model): a token bucket of bytes,
filled at that rate up to ``BURST_S`` seconds of it; a write goes when the bucket is not empty and
takes its bytes out once the child reports them (a state's size is known only after it is written), so
the rate holds on average and a burst is at most the bucket plus one state. A state not written for it
is counted (``rate``): its conversation's next turn computes what its RAM cache does not hold.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# A tenant's unnamed first-turn states are written while at least one in ``WRITE_ONE_IN`` of them comes
# back. A write costs the child's loop 0.8 ms per MiB (docs/benchmarks.md: a 450-token SmolLM2 state,
# 10 MiB, is 8 ms), a restore saves recomputing the history (hundreds of ms on a CPU): even one in twenty
# read back pays for the writes in the child's time; below it they are mostly disk wear. With the prior
# below it also sets how many states a new tenant's traffic gets written before its rate is known
# (``FIRST_WRITES``), and that number is what both workloads of issue 56 ask of it: at most 5 % of the
# states of 400 one-shot requests (20 of 406), and enough of a chat application's first conversations,
# opened all at once before any comes back, that their second turns still find their history
# (``llamagate bench conversations --conversations 32``: docs/benchmarks.md).
WRITE_ONE_IN = 20
# Returns assumed before any is seen (the prior): the first states of a tenant are written.
PRIOR_RETURNS = 1
# First-turn states of a tenant written before any of its conversations came back.
FIRST_WRITES = PRIOR_RETURNS * WRITE_ONE_IN
# Decisions after which a tenant's counts are halved (the rate's memory).
RATE_WINDOW = 1024
# Conversations remembered (turns seen, named): the LRU's size.
SEEN = 4096
# The rate bound's bucket: this many seconds of the rate (a burst of states leaving slots at once).
BURST_S = 2.0

_NAMED = 1  # the low bit of a remembered conversation's int; the turns seen are the rest


@dataclass(slots=True)
class _Returns:
    """One tenant's unnamed conversations: first-turn states that left a slot, and second turns seen."""

    left: float = 0.0
    returned: float = 0.0

    def rate(self) -> float:
        return min(1.0, (self.returned + PRIOR_RETURNS) / (self.left + PRIOR_RETURNS))


class WritePolicy:
    """One model's decision what to write (``proxy.conversations.tier.DiskTier`` asks it)."""

    def __init__(self, rate_bytes_s: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: OrderedDict[str, int] = OrderedDict()  # key -> turns << 1 | named
        self._tenants: dict[str, _Returns] = {}
        self._rate: int | None = None
        self._bucket = 0.0
        self._filled_at = clock()
        self.limit(rate_bytes_s)

    # --- what the tier tells it -------------------------------------------------------------------------
    def named(self, key: str) -> None:
        """The client named conversation ``key`` (``proxy.conversations.key.named``)."""
        self._remember(key, self._seen.get(key, 0) | _NAMED)

    def turn(self, key: str, tenant: str) -> None:
        """A turn of ``key`` is being placed on a slot: a second turn of an unnamed conversation is a
        return. (A request replayed on a new child is placed again: it only errs towards writing.)"""
        value = self._seen.get(key, 0) + 2
        self._remember(key, value)
        if value >> 1 == 2 and not value & _NAMED:
            self._returns(tenant).returned += 1

    def reason(self, key: str, tenant: str) -> tuple[bool, str]:
        """Whether ``key``'s state, leaving its slot, is written, and why: ``named``, ``returned``,
        ``tenant`` (written), ``one_shot`` (not). A first-turn decision counts towards the rate."""
        value = self._seen.get(key, 0)
        if value & _NAMED:
            return True, "named"
        if value >> 1 >= 2:
            return True, "returned"
        returns = self._returns(tenant)
        # In counts, not as a float compared with 1 / WRITE_ONE_IN: the bar is exact at the prior's edge.
        write = (returns.returned + PRIOR_RETURNS) * WRITE_ONE_IN >= returns.left + PRIOR_RETURNS
        returns.left += 1
        if returns.left >= RATE_WINDOW:
            returns.left /= 2
            returns.returned /= 2
        return (True, "tenant") if write else (False, "one_shot")

    def return_rates(self) -> dict[str, float]:
        """Each tenant's measured return rate (its prior included), for ``/metrics``."""
        return {tenant: r.rate() for tenant, r in self._tenants.items()}

    # --- the rate bound ---------------------------------------------------------------------------------
    @property
    def rate_bytes_s(self) -> int | None:
        return self._rate

    def limit(self, rate_bytes_s: int | None) -> None:
        """Bound the writes to ``rate_bytes_s`` (None: unbounded); a full bucket to start with."""
        if rate_bytes_s == self._rate and self._rate is not None:
            return
        if rate_bytes_s is not None and rate_bytes_s <= 0:
            raise ValueError("the write rate must be positive (None: unbounded)")
        self._rate = rate_bytes_s
        self._bucket = 0.0 if rate_bytes_s is None else rate_bytes_s * BURST_S
        self._filled_at = self._clock()

    def may_write(self) -> bool:
        """The rate bound lets a write go now."""
        if self._rate is None:
            return True
        now = self._clock()
        self._bucket = min(self._rate * BURST_S, self._bucket + (now - self._filled_at) * self._rate)
        self._filled_at = now
        return self._bucket > 0

    def wrote(self, nbytes: int) -> None:
        """A write of ``nbytes`` went: taken out of the bucket."""
        if self._rate is not None:
            self._bucket -= nbytes

    # --- internals --------------------------------------------------------------------------------------
    def _remember(self, key: str, value: int) -> None:
        self._seen[key] = value
        self._seen.move_to_end(key)
        if len(self._seen) > SEEN:
            self._seen.popitem(last=False)

    def _returns(self, tenant: str) -> _Returns:
        found = self._tenants.get(tenant)
        if found is None:
            found = self._tenants[tenant] = _Returns()
        return found
