"""The cheap bound on counting and templating routes (``/tokenize``, ``.../input_tokens``...).

They take no slot: llama-server answers them from its HTTP threads while the slots generate. What they
do cost is tokenizer and template time on the child's few cores, so each tenant gets a token bucket
(``proxy.counting``: ``rate_per_s`` refilled, ``burst`` at most) instead of a queue: a request that finds
the bucket empty is refused at once with ``429`` and a ``Retry-After`` of when the next one refills.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from proxy.errors import Rejected


class CountRate:
    """Per-tenant token buckets; ``allow`` raises ``Rejected`` (429) when a tenant's bucket is empty."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        # tenant -> (tokens left, when last refilled)
        self._buckets: dict[str, tuple[float, float]] = {}

    def configure(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s, self.burst = rate_per_s, burst
        self._buckets.clear()

    def allow(self, tenant: str) -> None:
        now = self._clock()
        tokens, since = self._buckets.get(tenant, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - since) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[tenant] = (tokens, now)
            wait = (1.0 - tokens) / self.rate_per_s
            raise Rejected(
                "count_rate",
                wait,
                f"too many counting requests: at most {self.rate_per_s:g}/s (burst {self.burst}) per tenant",
            )
        self._buckets[tenant] = (tokens - 1.0, now)
