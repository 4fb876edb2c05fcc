"""One benchmark run: offered load -> one record per request -> summary, in a result folder.

Folder layout (each file is self-describing JSON with a ``schema`` field):
  records.jsonl    one line per request, warm-up included and flagged, written as each one ends
  run.json         the run's settings, the model id used, the clock origin and wall-clock times
  summary.json     counts, goodput, TTFT/TPOT/e2e distributions and the verdict; summary.md for humans
  provenance.json  written by the command layer (identity, command line)
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from supervisor.bench import stats
from supervisor.bench.client import Exchange, Target, stream_chat
from supervisor.bench.loadgen import LoadSpec, Plan, Sent, generate
from supervisor.bench.prompts import PromptSet
from supervisor.bench.records import RequestRecord, write_record
from supervisor.bench.report import summary_markdown
from supervisor.bench.summary import Summary, summarize
from supervisor.errors import UsageError
from supervisor.progress import NullProgress, Progress

RUN_SCHEMA = "llamagate.bench.run/1"
# A closed-loop user turned away (429/503) waits Retry-After before its next request, bounded so one
# odd header cannot stall a run; without a header it waits this long.
REJECT_PAUSE_DEFAULT_S = 1.0
REJECT_PAUSE_MAX_S = 10.0


@dataclass(frozen=True)
class RequestOptions:
    model: str | None = None  # None: the first id the target lists at /v1/models
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0

    def body(self, model: str, messages: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": list(messages),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "stream": True,
            # Exact prompt/completion token counts arrive in a final usage chunk.
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # llama-server extension: every answer is max_tokens long
        body.update(self.extra_body)
        return body


@dataclass(frozen=True)
class RunSpec:
    target: Target
    load: LoadSpec
    prompts: PromptSet
    options: RequestOptions
    gates: stats.Gates


@dataclass(frozen=True)
class RunResult:
    out_dir: Path
    summary: Summary
    records: list[RequestRecord]
    model: str


def _rel(t: float | None, origin: float) -> float | None:
    return None if t is None else round(t - origin, 6)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def make_record(plan: Plan, prompt_id: str, ex: Exchange, origin: float, gates: stats.Gates) -> RequestRecord:
    completed = ex.outcome == "ok"
    ttft = stats.ttft_ms(plan.t_submit, ex.t_first_content)
    tpot = stats.tpot_ms(ex.t_first_content, ex.t_end, ex.completion_tokens) if completed else None
    e2e = None if ex.t_end is None else (ex.t_end - plan.t_submit) * 1000.0
    met_ttft, met_tpot, met = stats.gate_flags(completed, ttft, tpot, gates)
    return RequestRecord(
        seq=plan.seq,
        warmup=plan.warmup,
        prompt_id=prompt_id,
        outcome=ex.outcome,
        t_submit=round(plan.t_submit - origin, 6),
        t_send=_rel(ex.t_send, origin),
        t_first_content=_rel(ex.t_first_content, origin),
        t_last_content=_rel(ex.t_last_content, origin),
        t_end=_rel(ex.t_end, origin),
        ttft_ms=_ms(ttft),
        tpot_ms=_ms(tpot),
        e2e_ms=_ms(e2e),
        prompt_tokens=ex.prompt_tokens,
        completion_tokens=ex.completion_tokens,
        content_events=ex.content_events,
        status=ex.status,
        error=ex.error,
        retry_after_s=ex.retry_after_s,
        met_ttft=met_ttft,
        met_tpot=met_tpot,
        met_gates=met,
        server=ex.server,
    )


async def discover_model(client: httpx.AsyncClient, target: Target) -> str:
    url = target.api_root + "/models"
    try:
        response = await client.get(url, headers=target.headers(), timeout=10.0)
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise UsageError(
            f"{url} answered HTTP {response.status_code}; check the URL and key, or pass --model"
        )
    try:
        data = response.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise UsageError(f"{url} lists no model; pass --model") from exc


class _Tally:
    def __init__(self, spec: RunSpec, progress: Progress, clock: Callable[[], float]) -> None:
        self.done = 0
        self.rejected = 0
        self.failed = 0
        self._spec = spec
        self._progress = progress
        self._clock = clock
        self._start = clock()
        self._stage = f"bench {spec.load.label}"

    def add(self, record: RequestRecord) -> None:
        self.done += 1
        self.rejected += record.rejected
        self.failed += record.failed
        load = self._spec.load
        if load.requests is not None:
            # Closed loop: rejections do not use up the budget (loadgen), so they do not advance it.
            counted = self.done - self.rejected if load.mode == "concurrency" else self.done
            fraction = counted / (load.requests + load.warmup)
        else:
            fraction = (self._clock() - self._start) / (load.duration_s or 1.0)
        detail = f"{self.done} done, {self.rejected} rejected, {self.failed} failed"
        self._progress.update(self._stage, min(1.0, fraction), detail)

    def finish(self) -> None:
        self._progress.done(
            self._stage, f"{self.done} requests, {self.rejected} rejected, {self.failed} failed"
        )


def _client(transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    # One fresh connection per request, no keep-alive. llama-server does not keep a connection alive
    # after a streamed answer, and reusing one it is closing fails the next request with "Server
    # disconnected" (seen here): a client artifact, not a server failure. The connect time (loopback:
    # well under a millisecond; TLS to a remote host: a round trip or two) is part of every TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    # No read timeout: a queued request legitimately hears nothing for a long time; the per-request
    # deadline (RequestOptions.timeout_s) bounds it instead.
    timeout = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None)
    return httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)


async def _execute(
    spec: RunSpec, client: httpx.AsyncClient, model: str, sink: Callable[[RequestRecord], None], origin: float
) -> int:
    clock = time.monotonic

    async def send(plan: Plan) -> Sent:
        prompt = spec.prompts.get(plan.seq)
        body = spec.options.body(model, prompt.messages)
        try:
            ex = await stream_chat(client, spec.target, body, spec.options.timeout_s, clock)
        except asyncio.CancelledError:
            # Interrupted runs still account for every submitted request.
            sink(make_record(plan, prompt.id, _cancelled(clock()), origin, spec.gates))
            raise
        record = make_record(plan, prompt.id, ex, origin, spec.gates)
        sink(record)
        if record.rejected:
            hint = record.retry_after_s if record.retry_after_s is not None else REJECT_PAUSE_DEFAULT_S
            return Sent(rejected=True, pause_s=min(max(hint, 0.0), REJECT_PAUSE_MAX_S))
        return Sent()

    return await generate(spec.load, send, clock)


def _cancelled(now: float) -> Exchange:
    return Exchange(outcome="cancelled", t_end=now, error="run interrupted")


def _loadavg() -> float | None:
    # Other work on the host moves every figure; the load average says how quiet it was.
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


async def run_async(
    spec: RunSpec,
    out_dir: Path,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunResult:
    """Run the load, writing records as they finish; the folder is created (and must not hold a run).

    ``transport`` replaces the network (tests use httpx.MockTransport)."""
    progress = progress or NullProgress()
    records_path = _prepare(out_dir)
    records: list[RequestRecord] = []
    async with _client(transport) as client:
        model = spec.options.model or await discover_model(client, spec.target)
        origin = time.monotonic()
        meta: dict[str, Any] = {
            "schema": RUN_SCHEMA,
            "label": spec.load.label,
            "target": spec.target.base_url,
            "model": model,
            "load": asdict(spec.load),
            "prompts": spec.prompts.name,
            "options": {**asdict(spec.options), "extra_body": dict(spec.options.extra_body)},
            "gates": asdict(spec.gates),
            "origin_monotonic": origin,
            "started_at": _now_iso(),
            "loadavg_1m_start": _loadavg(),
        }
        tally = _Tally(spec, progress, time.monotonic)
        cpu_start = time.process_time()
        with records_path.open("w", encoding="utf-8") as stream:

            def sink(record: RequestRecord) -> None:
                records.append(record)
                write_record(stream, record)
                tally.add(record)

            submitted = await _execute(spec, client, model, sink, origin)
    tally.finish()
    # On a small host the load generator competes with the server for the same cores: say how much.
    meta["client_cpu_seconds"] = round(time.process_time() - cpu_start, 3)
    meta["finished_at"] = _now_iso()
    meta["loadavg_1m_end"] = _loadavg()
    meta["submitted_including_warmup"] = submitted
    records.sort(key=lambda r: r.seq)
    summary = summarize(records, spec.gates, spec.load.label)
    _write_json(out_dir / "run.json", meta)
    _write_json(out_dir / "summary.json", {"schema": "llamagate.bench.summary/1", **summary.to_dict()})
    (out_dir / "summary.md").write_text(summary_markdown(summary), encoding="utf-8")
    return RunResult(out_dir, summary, records, model)


def _prepare(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    records_path = out_dir / "records.jsonl"
    if records_path.exists():
        raise UsageError(f"{out_dir} already holds a run (records.jsonl); choose another --out")
    return records_path


def run(spec: RunSpec, out_dir: Path, progress: Progress | None = None) -> RunResult:
    return asyncio.run(run_async(spec, out_dir, progress))


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
