"""The soak's books: every request it starts, how each ended, what the monitor saw, and the targets.

Pure (no I/O, no clock of its own) so the accounting is unit-tested with made-up events. The runner
(``soak.py``) calls ``start``/``finish`` around every client call, ``slots``/``resources`` from its
monitor, and ``evaluate`` once at the end.

How a request may end (``Ending``):
- ``completed``: 200 and a whole answer (a stream's ``[DONE]``, a JSON body with choices);
- ``abandoned``: the client left mid-answer on purpose (the disconnect clients);
- ``refused``: the proxy or the child said no with a status (429, 503, ...), kept by status;
- ``failed``: anything else, kept by a short reason (``502``, ``ReadError``, ``stream error``...);
- ``hung``: the client call hit its own deadline. A target: none may hang.
A request started and never finished is ``lost`` (a bug in the runner or a hang it did not catch).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

Ending = Literal["completed", "abandoned", "refused", "failed", "hung"]

# The kinds of call whose answer is one JSON body: the client sees nothing until it is whole, so a child
# that dies meanwhile costs it nothing but time (``proxy.routes.replay``).
NON_STREAMED = ("plain", "drop_plain")
RSS_DRIFT_TARGET = 0.05  # the target: < 5 % over the last 5 minutes
RSS_WINDOW_S = 300.0


@dataclass(frozen=True)
class SlotSample:
    t: float
    busy: int  # /slots: slots processing
    permits_before: int  # /metrics: in-flight permits + lingering slots, read just before /slots
    permits_after: int  # ... and just after

    @property
    def over(self) -> bool:
        """Busy slots above every permit count seen around the read: the gate let the child over-commit."""
        return self.busy > max(self.permits_before, self.permits_after)


@dataclass(frozen=True)
class ResourceSample:
    t: float
    rss_bytes: int
    fds: int


@dataclass
class Ledger:
    started: int = 0
    endings: Counter[str] = field(default_factory=Counter)
    refused_by_status: Counter[int] = field(default_factory=Counter)
    failed_by_reason: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    slot_samples: list[SlotSample] = field(default_factory=list)
    slot_errors: int = 0
    slot_not_ready: int = 0
    resources: list[ResourceSample] = field(default_factory=list)
    chaos: list[dict[str, Any]] = field(default_factory=list)
    _open: set[int] = field(default_factory=set)

    def start(self) -> int:
        self.started += 1
        self._open.add(self.started)
        return self.started

    def finish(
        self, ticket: int, kind: str, ending: Ending, *, status: int | None = None, reason: str | None = None
    ) -> None:
        if ticket not in self._open:
            raise ValueError(f"request {ticket} finished twice or never started")
        self._open.discard(ticket)
        self.endings[ending] += 1
        self.by_kind.setdefault(kind, Counter())[ending] += 1
        if ending == "refused":
            self.refused_by_status[status if status is not None else 0] += 1
        elif ending in ("failed", "hung"):
            self.failed_by_reason[reason or (f"HTTP {status}" if status else "unknown")] += 1

    @property
    def lost(self) -> int:
        return len(self._open)

    def slots(self, sample: SlotSample) -> None:
        self.slot_samples.append(sample)

    def resource(self, sample: ResourceSample) -> None:
        self.resources.append(sample)


@dataclass(frozen=True)
class Target:
    name: str
    met: bool
    value: Any
    goal: str


def rss_drift(samples: list[ResourceSample], end_t: float, window_s: float = RSS_WINDOW_S) -> float | None:
    """Relative RSS change across the last ``window_s`` before ``end_t`` (medians of the first and last
    three samples in the window, so one noisy sample does not decide); None with too few samples."""
    window = [s for s in samples if end_t - window_s <= s.t <= end_t]
    if len(window) < 6:
        return None
    first = statistics.median(s.rss_bytes for s in window[:3])
    last = statistics.median(s.rss_bytes for s in window[-3:])
    return (last - first) / first if first else None


def evaluate(
    ledger: Ledger,
    *,
    gauges_at_end: dict[str, float] | None,
    fds_start: int | None,
    fds_end: int | None,
    load_end_t: float,
    rss_window_s: float = RSS_WINDOW_S,
) -> list[Target]:
    """The issue's targets, each with the value seen. ``gauges_at_end`` None: never read (a failure)."""
    accounted = sum(ledger.endings.values())
    over = [s for s in ledger.slot_samples if s.over]
    drift = rss_drift(ledger.resources, load_end_t, rss_window_s)
    gauges_zero = gauges_at_end is not None and all(v == 0 for v in gauges_at_end.values())
    plain_failed = sum(ledger.by_kind.get(kind, Counter())["failed"] for kind in NON_STREAMED)
    return [
        Target(
            "every request accounted for",
            ledger.lost == 0 and accounted == ledger.started and ledger.started > 0,
            {"started": ledger.started, "accounted": accounted, "lost": ledger.lost},
            "started == completed + abandoned + refused + failed + hung, none lost",
        ),
        Target(
            "no request hung", ledger.endings["hung"] == 0, ledger.endings["hung"], "0 client deadlines hit"
        ),
        Target(
            "no non-streamed request failed",
            plain_failed == 0,
            plain_failed,
            "0 plain calls failed: one in flight when the child dies is run again on the next child",
        ),
        Target(
            "gauges back to 0",
            gauges_zero,
            gauges_at_end,
            "in-flight, queued and lingering back to 0 after the load",
        ),
        Target(
            "/slots busy never above permits",
            bool(ledger.slot_samples) and not over,
            {
                "samples": len(ledger.slot_samples),
                "over": len(over),
                "worst": max((s.busy - max(s.permits_before, s.permits_after) for s in over), default=0),
                "unreadable": ledger.slot_errors,
                "not_ready": ledger.slot_not_ready,
            },
            "busy slots <= permits handed out (in-flight + lingering), in every sample",
        ),
        Target(
            f"daemon RSS drift over the last {rss_window_s / 60:g} min",
            drift is not None and drift < RSS_DRIFT_TARGET,
            None if drift is None else round(drift, 4),
            f"< {RSS_DRIFT_TARGET:.0%}",
        ),
        Target(
            "file descriptors back to the start count",
            fds_start is not None and fds_end is not None and fds_end <= fds_start,
            {"start": fds_start, "end": fds_end},
            "daemon's open descriptors at the end <= at the start",
        ),
    ]


def report(ledger: Ledger, targets: list[Target]) -> dict[str, Any]:
    return {
        "requests": {
            "started": ledger.started,
            "lost": ledger.lost,
            "endings": dict(ledger.endings),
            "refused_by_status": {str(k): v for k, v in sorted(ledger.refused_by_status.items())},
            "failed_by_reason": dict(ledger.failed_by_reason.most_common()),
            "by_kind": {k: dict(v) for k, v in sorted(ledger.by_kind.items())},
        },
        "chaos": ledger.chaos,
        "slot_samples": len(ledger.slot_samples),
        "resources": [{"t": round(s.t, 1), "rss_bytes": s.rss_bytes, "fds": s.fds} for s in ledger.resources],
        "targets": [{"name": t.name, "met": t.met, "value": t.value, "goal": t.goal} for t in targets],
        "all_met": all(t.met for t in targets),
    }


def summary_text(result: dict[str, Any]) -> str:
    req = result["requests"]
    endings = ", ".join(f"{k} {v}" for k, v in sorted(req["endings"].items()))
    lines = [
        f"soak: {req['started']} requests ({endings}); lost {req['lost']}",
        "refused by status: "
        + (", ".join(f"{k}: {v}" for k, v in req["refused_by_status"].items()) or "none"),
        "failed by reason: " + (", ".join(f"{k}: {v}" for k, v in req["failed_by_reason"].items()) or "none"),
        "chaos: " + (", ".join(f"{c['action']}@{c['at_s']:.0f}s" for c in result["chaos"]) or "none"),
    ]
    by_kind = req.get("by_kind", {})
    if by_kind:
        lines.insert(
            3,
            "by kind: "
            + "; ".join(
                f"{kind}: " + ", ".join(f"{k} {v}" for k, v in sorted(endings.items()))
                for kind, endings in by_kind.items()
            ),
        )
    if "replays" in result:
        replays = result["replays"]
        text = "unread" if replays is None else ", ".join(f"{k} {v:g}" for k, v in sorted(replays.items()))
        lines.append("replays (llamagate_replays_total): " + (text or "none"))
    for t in result["targets"]:
        lines.append(
            f"  [{'met' if t['met'] else 'NOT MET'}] {t['name']}: {t['value']} (target: {t['goal']})"
        )
    lines.append("all targets met" if result["all_met"] else "targets NOT met")
    return "\n".join(lines)
