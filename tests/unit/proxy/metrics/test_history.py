"""The in-memory traffic history (``proxy.metrics.history``): buckets, rollover, percentiles, bounded
memory, per model. A clock and a random source are injected: no sleep."""

from __future__ import annotations

import random
import sys

from proxy.metrics.history import History
from proxy.metrics.percentile import percentile


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


START = 1_764_640_000.0  # a multiple of 10: the first bucket starts here


def rows(h: History, model: str = "chat") -> list[dict[str, object]]:
    report = h.report([model])
    models = report["models"]
    assert isinstance(models, dict)
    out = models[model]
    assert isinstance(out, list)
    return out


def test_a_request_lands_in_the_bucket_of_its_end_with_its_tokens_and_times() -> None:
    clock = Clock(START + 3)
    h = History(clock=clock)
    h.observe("chat", 40, 0.25, 0.02)
    h.observe("chat", 10, 0.75, 0.04)
    h.observe("chat", 0, None, None)  # refused before any token: counted, no times
    (row,) = rows(h)
    assert row == {
        "t": int(START),
        "requests": 3,
        "tokens": 50,
        "ttft_p50_s": 0.5,  # between the two, linearly
        "ttft_p95_s": 0.725,
        "tpot_s": 0.03,
        "queued": 0,
        "running": 0,
    }


def test_buckets_roll_over_oldest_first_with_the_empty_ones_present() -> None:
    clock = Clock(START)
    h = History(clock=clock)
    h.observe("chat", 5, 0.1, None)
    clock.now = START + 25  # two buckets later
    h.observe("chat", 7, 0.2, None)
    got = rows(h)
    assert [r["t"] for r in got] == [START, START + 10, START + 20]
    assert [r["tokens"] for r in got] == [5, 0, 7]
    assert got[1]["ttft_p50_s"] is None and got[1]["requests"] == 0
    report = h.report(["chat"])
    assert report["bucket_s"] == 10 and report["now"] == START + 25


def test_the_window_is_15_minutes_and_a_slot_reused_later_starts_empty() -> None:
    clock = Clock(START)
    h = History(clock=clock)
    h.observe("chat", 5, 0.1, 0.01)
    clock.now = START + 900  # 90 buckets later: the same slot of the ring
    got = rows(h)
    assert len(got) == 90 and got[0]["t"] == START + 10 and got[-1]["t"] == START + 900
    assert sum(int(str(r["tokens"])) for r in got) == 0  # the old bucket is out of the window
    h.observe("chat", 3, None, None)
    assert rows(h)[-1]["tokens"] == 3 and rows(h)[-1]["requests"] == 1  # not 5 + 3, not 2


def test_nothing_is_reported_before_the_history_began() -> None:
    clock = Clock(START + 5)
    h = History(clock=clock)
    clock.now = START + 31
    assert [r["t"] for r in rows(h)] == [START, START + 10, START + 20, START + 30]


def test_percentiles_interpolate_between_the_buckets_closest_ranks() -> None:
    clock = Clock(START)
    h = History(clock=clock)
    for v in range(1, 21):  # 1 .. 20 ms
        h.observe("chat", 1, v / 1000, None)
    (row,) = rows(h)
    assert row["ttft_p50_s"] == 0.0105 and row["ttft_p95_s"] == 0.01905
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0


def test_the_ttft_sample_stays_bounded_and_represents_the_whole_bucket() -> None:
    clock = Clock(START)
    h = History(clock=clock, sample=64, rand=random.Random(7).random)
    for i in range(10_000):
        h.observe("chat", 1, (i % 1000) / 1000, None)  # uniform over 0 .. 0.999
    bucket = h._rings["chat"][int(START // 10) % 90]
    assert len(bucket.ttft) == 64 and bucket.ttft_seen == 10_000
    # A sample of the whole bucket, not its first 64 requests (0 .. 0.063).
    (row,) = rows(h)
    assert 0.3 < float(str(row["ttft_p50_s"])) < 0.7
    assert float(str(row["ttft_p95_s"])) > 0.8
    assert row["requests"] == 10_000


def test_memory_is_fixed_however_long_and_busy() -> None:
    clock = Clock(START)
    h = History(clock=clock, rand=random.Random(1).random)

    def size() -> int:
        ring = h._rings["chat"]
        return sys.getsizeof(ring) + sum(sys.getsizeof(b) + sys.getsizeof(b.ttft) for b in ring)

    for _ in range(90):
        for _ in range(200):
            h.observe("chat", 1, 0.1, 0.01)
        clock.now += 10
    first = size()
    for _ in range(180):  # two more turns of the ring
        for _ in range(200):
            h.observe("chat", 1, 0.1, 0.01)
        clock.now += 10
    assert len(h._rings["chat"]) == 90
    assert size() == first < 128 * 1024


def test_each_model_has_its_own_history_and_gauges_keep_the_highest() -> None:
    clock = Clock(START)
    h = History(clock=clock)
    h.observe("chat", 9, 0.5, None)
    h.sample({"chat": (1, 4), "embed": (0, 0)})
    h.sample({"chat": (2, 1), "embed": (1, 0)})
    h.sample({"chat": (0, 0), "embed": (0, 0)})
    report = h.report(["chat", "embed"])
    models = report["models"]
    assert isinstance(models, dict)
    (chat,) = models["chat"]
    (embed,) = models["embed"]
    assert (chat["tokens"], chat["running"], chat["queued"]) == (9, 2, 4)
    assert (embed["tokens"], embed["running"], embed["queued"], embed["requests"]) == (0, 1, 0, 0)
    # A model no longer served is forgotten at the next sample.
    h.sample({"embed": (0, 0)})
    assert "chat" not in h._rings
    assert rows(h)[0]["tokens"] == 0
