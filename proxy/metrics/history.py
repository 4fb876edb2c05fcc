"""The last 15 minutes of traffic, per model, in memory: what ``GET /admin/history`` serves and the status
page charts, so that a page opened now shows the past traffic (not only what it sampled itself).

A model's history is a ring of fixed buckets (10 s each, 90 of them: 15 minutes). A bucket is named by
its number, ``floor(wall clock / bucket_s)``; slot ``number % 90`` of the ring holds it, and a slot whose
number is not the one asked for is stale and reset before use. So a quiet model costs nothing, a wall
clock that jumps never mixes two periods in one bucket, and the memory is fixed: 90 buckets per model,
each with at most ``SAMPLE`` TTFT samples (about 60 KiB per model at worst).

What a bucket holds, and when it is fed:

- ``requests``, ``tokens``: generation requests answered (whatever their status) and their output tokens,
  counted when the request ends (``observe``, one call per request from the request record the middleware
  already has): a long stream's tokens all land in the bucket it ended in.
- TTFT: a bounded sample (reservoir sampling, ``SAMPLE`` values; every request has the same chance of being
  in it), its p50 and p95 read when the history is read (``proxy.metrics.percentile``, the bench's
  definition). A sample rather than a fixed histogram: exact percentiles whenever a bucket saw at most
  ``SAMPLE`` requests (a llama-server with a few slots answers far fewer in 10 s), with no bucket bounds
  to choose for a TTFT that goes from 20 ms to a minute; the price, sorting at most 64 numbers per
  bucket, is paid by the reader, not the request.
- TPOT: the mean of the requests' own mean times per output token (a sum and a count).
- ``queued``, ``running``: the highest of the admission gate's figures sampled about once a second
  (``sample``, from a timer and at each read), so that a burst shorter than the bucket still shows.

The request path pays one clock read, a dict look-up and a few additions (``observe``): no lock (the event
loop is the only writer), nothing per token.
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Callable, Iterable, Mapping

from proxy.metrics.percentile import percentile

BUCKET_S = 10
BUCKETS = 90  # 15 minutes
# TTFT samples kept per bucket (see the module docstring).
SAMPLE = 64


class Bucket:
    __slots__ = (
        "n",
        "queued",
        "requests",
        "running",
        "tokens",
        "tpot_count",
        "tpot_sum",
        "ttft",
        "ttft_seen",
    )

    def __init__(self) -> None:
        self.reset(-1)

    def reset(self, n: int) -> None:
        self.n = n
        self.requests = 0
        self.tokens = 0
        self.ttft = array("d")
        self.ttft_seen = 0
        self.tpot_sum = 0.0
        self.tpot_count = 0
        self.queued = 0
        self.running = 0


class History:
    def __init__(
        self,
        bucket_s: int = BUCKET_S,
        buckets: int = BUCKETS,
        sample: int = SAMPLE,
        clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.bucket_s = bucket_s
        self.buckets = buckets
        self.sample_size = sample
        self._clock = clock
        self._rand = rand
        self._rings: dict[str, list[Bucket]] = {}
        # The first bucket this history saw: nothing before it is reported (the proxy was not running).
        self._first = int(clock() // bucket_s)

    def _bucket(self, model: str) -> Bucket:
        n = int(self._clock() // self.bucket_s)
        ring = self._rings.get(model)
        if ring is None:
            ring = self._rings[model] = [Bucket() for _ in range(self.buckets)]
        bucket = ring[n % self.buckets]
        if bucket.n != n:
            bucket.reset(n)
        return bucket

    def observe(self, model: str, tokens: int, ttft_s: float | None, tpot_s: float | None) -> None:
        """One generation request of ``model`` answered (whatever its status)."""
        b = self._bucket(model)
        b.requests += 1
        b.tokens += tokens
        if ttft_s is not None:
            b.ttft_seen += 1
            if len(b.ttft) < self.sample_size:
                b.ttft.append(ttft_s)
            else:
                # Reservoir sampling (Algorithm R): the i-th value replaces a kept one with chance k / i.
                j = int(self._rand() * b.ttft_seen)
                if j < self.sample_size:
                    b.ttft[j] = ttft_s
        if tpot_s is not None:
            b.tpot_sum += tpot_s
            b.tpot_count += 1

    def sample(self, gauges: Mapping[str, tuple[int, int]]) -> None:
        """The gates now: model -> (running, queued); the bucket keeps the highest of each. A model that
        is no longer served (a reload removed it) is forgotten."""
        for model in [m for m in self._rings if m not in gauges]:
            del self._rings[model]
        for model, (running, queued) in gauges.items():
            b = self._bucket(model)
            b.running = max(b.running, running)
            b.queued = max(b.queued, queued)

    def report(self, models: Iterable[str]) -> dict[str, object]:
        """``GET /admin/history``'s answer: for each of ``models``, every bucket of the last 15 minutes
        since this history began, oldest first, the newest being the one still filling (empty ones
        included, with zeros and no percentiles)."""
        now = self._clock()
        last = int(now // self.bucket_s)
        first = max(self._first, last - self.buckets + 1)
        out: dict[str, list[dict[str, object]]] = {}
        for model in models:
            ring = self._rings.get(model)
            rows = []
            for n in range(first, last + 1):
                b = ring[n % self.buckets] if ring is not None else None
                rows.append(self._row(n, b if b is not None and b.n == n else None))
            out[model] = rows
        return {"bucket_s": self.bucket_s, "now": round(now, 3), "models": out}

    def _row(self, n: int, b: Bucket | None) -> dict[str, object]:
        t = n * self.bucket_s
        if b is None:
            return {
                "t": t,
                "requests": 0,
                "tokens": 0,
                "ttft_p50_s": None,
                "ttft_p95_s": None,
                "tpot_s": None,
                "queued": 0,
                "running": 0,
            }
        ordered = array("d", sorted(b.ttft))
        return {
            "t": t,
            "requests": b.requests,
            "tokens": b.tokens,
            "ttft_p50_s": _round(percentile(ordered, 50)),
            "ttft_p95_s": _round(percentile(ordered, 95)),
            "tpot_s": _round(b.tpot_sum / b.tpot_count) if b.tpot_count else None,
            "queued": b.queued,
            "running": b.running,
        }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)
