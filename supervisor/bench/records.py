"""One JSONL record per request: the raw evidence every benchmark figure is computed from.

Timestamps are seconds on the monotonic clock, relative to the run's origin (``run.json`` holds the
origin and the wall-clock start), so a record can be placed on a timeline without trusting the wall
clock. Nothing is dropped: a rejected, failed, timed-out or cancelled request is a record too, with
``outcome`` saying which, so ``submitted == len(records)`` always holds for a finished run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TextIO, get_args

from supervisor.errors import UsageError

RECORD_SCHEMA = "llamagate.bench.record/1"

Outcome = Literal["ok", "rejected", "failed", "timeout", "cancelled"]
OUTCOMES: tuple[str, ...] = get_args(Outcome)
# 429 (tenant queue full / wait too long) and 503 (not ready) are the server saying "not now":
# load shedding, counted apart from failures.
REJECT_STATUSES = frozenset({429, 503})


@dataclass(frozen=True)
class ServerTimings:
    """llama-server's own ``timings`` from the last chunk (absent through servers that drop it)."""

    prompt_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None
    cache_n: int | None = None


@dataclass(frozen=True)
class RequestRecord:
    seq: int
    warmup: bool
    prompt_id: str
    outcome: Outcome
    t_submit: float
    t_send: float | None = None
    t_first_content: float | None = None
    t_last_content: float | None = None
    t_end: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    content_events: int = 0
    status: int | None = None
    error: str | None = None
    retry_after_s: float | None = None
    met_ttft: bool | None = None
    met_tpot: bool | None = None
    met_gates: bool | None = None
    server: ServerTimings | None = None
    schema: str = field(default=RECORD_SCHEMA)

    @property
    def completed(self) -> bool:
        return self.outcome == "ok"

    @property
    def rejected(self) -> bool:
        return self.outcome == "rejected"

    @property
    def failed(self) -> bool:
        return self.outcome in ("failed", "timeout", "cancelled")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        schema = data.get("schema")
        if schema != RECORD_SCHEMA:
            raise ValueError(f"schema is {schema!r}, expected {RECORD_SCHEMA!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(unknown)}")
        if data.get("outcome") not in OUTCOMES:
            raise ValueError(f"outcome is {data.get('outcome')!r}, expected one of {', '.join(OUTCOMES)}")
        values = dict(data)
        server = values.get("server")
        if server is not None:
            values["server"] = ServerTimings(**server)
        try:
            return cls(**values)
        except TypeError as exc:  # a missing required field
            raise ValueError(str(exc)) from exc


def write_record(stream: TextIO, record: RequestRecord) -> None:
    # One flush per record: an interrupted run keeps every request that finished.
    stream.write(record.to_json() + "\n")
    stream.flush()


def iter_records(path: Path) -> Iterator[RequestRecord]:
    with path.open(encoding="utf-8") as stream:
        for lineno, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                yield RequestRecord.from_dict(json.loads(line))
            except (ValueError, TypeError) as exc:
                raise UsageError(f"{path}:{lineno}: not a benchmark record: {exc}") from exc


def read_records(path: Path) -> list[RequestRecord]:
    return list(iter_records(path))


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    with path.open("w", encoding="utf-8") as stream:
        for record in records:
            stream.write(record.to_json() + "\n")
