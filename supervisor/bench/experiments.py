"""Experiments that explain the envelope, each a series of runs on the same harness:

- ``threads``: restart llama-server at each thread count; decode and prompt rates (llama-server's own
  timings) and TPOT, beside llama.cpp's ``llama-bench`` when available. Decode is memory-bandwidth
  bound: past a few threads more cores stop helping.
- ``cache-prompt``: the same shared-prefix workload with ``cache_prompt`` on and off (a request field,
  so any URL works); TTFT and the prompt tokens actually processed.
- ``slots``: slots x context per slot at equal total memory; each point at concurrency = slots, with
  the KV budget and the measured RSS: memory traded against concurrency.
- ``models``: several model files (quantizations): size, RSS, latency and an optional quality-set pass
  rate, to pick the smallest model that passes both the quality and the latency gates.

Every launched point also records the child's resident memory idle and at its peak while the requests
run (``rss.PeakSampler``), and the memory budget against that peak (``budget_check``).

Each point that launches a server starts it from the config (``launcher.start_llama_server``), measures,
and stops it before the next point, so points never share the CPU.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from supervisor.artifacts.quantize import file_type, read_record
from supervisor.bench import budget_check
from supervisor.bench import quality as quality_mod
from supervisor.bench.client import Target
from supervisor.bench.hostload import load_average
from supervisor.bench.launcher import deep_merge, start_llama_server
from supervisor.bench.loadgen import LoadSpec
from supervisor.bench.prompts import PromptSet
from supervisor.bench.records import RequestRecord
from supervisor.bench.rss import PeakSampler, cpu_seconds, resident
from supervisor.bench.runner import RequestOptions, RunSpec, run_async
from supervisor.bench.stats import Gates
from supervisor.bench.summary import Summary
from supervisor.progress import NullProgress, Progress


@dataclass(frozen=True)
class Workload:
    load: LoadSpec
    prompts: PromptSet
    options: RequestOptions
    gates: Gates


@dataclass
class PointResult:
    label: str
    settings: dict[str, Any]
    summary: Summary
    folder: Path
    prompt_tps: float | None = None
    decode_tps: float | None = None
    rss_loaded: int | None = None
    rss_after: int | None = None
    budget: dict[str, Any] | None = None
    identity: dict[str, Any] | None = None
    quality: quality_mod.QualityResult | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExperimentResult:
    name: str
    points: list[PointResult]
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def server_rates(records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    """Median prompt and decode tokens/s per request, from llama-server's own timings."""
    prompt, decode = [], []
    for r in records:
        if not r.completed or r.warmup or r.server is None:
            continue
        s = r.server
        if s.prompt_n and s.prompt_ms:
            prompt.append(s.prompt_n * 1000.0 / s.prompt_ms)
        if s.predicted_n and s.predicted_ms:
            decode.append(s.predicted_n * 1000.0 / s.predicted_ms)
    return (statistics.median(prompt) if prompt else None, statistics.median(decode) if decode else None)


def _run(
    target: Target,
    workload: Workload,
    folder: Path,
    progress: Progress,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[Summary, list[RequestRecord]]:
    spec = RunSpec(target, workload.load, workload.prompts, workload.options, workload.gates)
    result = asyncio.run(run_async(spec, folder, progress, transport))
    return result.summary, result.records


def measure_launched(
    label: str,
    settings: dict[str, Any],
    config: Mapping[str, Any],
    workload: Workload,
    folder: Path,
    progress: Progress,
    quality_items: Sequence[quality_mod.Item] | None = None,
) -> PointResult:
    load_start = load_average()
    launched, prepared = start_llama_server(config, folder / "server", progress=progress)
    try:
        rss_loaded = launched.rss_bytes()
        pid = launched.server_pid()
        idle = None if pid is None else resident(pid)
        cpu_before = cpu_seconds(pid)
        # The peak while the requests run, split into file-backed and anonymous (the budget's parts).
        with PeakSampler(pid) as sampler:
            summary, records = _run(launched.target, workload, folder / "run", progress)
        cpu_after = cpu_seconds(pid)
        rss_after = launched.rss_bytes()
        quality = None
        if quality_items:
            quality = quality_mod.evaluate(launched.target, prepared.spec.alias, quality_items)
    finally:
        launched.stop()
    prompt_tps, decode_tps = server_rates(records)
    point = PointResult(
        label,
        settings,
        summary,
        folder,
        prompt_tps,
        decode_tps,
        rss_loaded,
        rss_after,
        prepared.budget.as_dict(),
        prepared.identity,
        quality,
    )
    peak = sampler.peak
    point.extra["rss_idle"] = None if idle is None else idle.to_dict()
    point.extra["rss_peak_bytes"] = None if peak is None else peak.rss
    point.extra["rss_peak"] = None if peak is None else peak.to_dict()
    point.extra["rss_samples"] = sampler.samples
    point.extra["budget_check"] = budget_check.check(point.budget, peak)
    # Per point: on a shared host the load moves between points, and with it each point's speed.
    point.extra["load_average"] = {"start": load_start, "end": load_average()}
    # What the child's CPU did for the run (warm-ups included). Other jobs inflate it less than the
    # latencies, but they do: a preempted thread leaves its partner spinning at the next barrier.
    generated = sum(r.completion_tokens or 0 for r in records if r.completed)
    cpu = None if cpu_before is None or cpu_after is None else round(cpu_after - cpu_before, 3)
    point.extra["child_cpu_seconds"] = cpu
    point.extra["child_cpu_ms_per_output_token"] = (
        None if cpu is None or not generated else cpu * 1000 / generated
    )
    return point


def threads(
    base: Mapping[str, Any],
    counts: Sequence[int],
    workload: Workload,
    out: Path,
    progress: Progress | None = None,
    llama_bench: Callable[[Path, Sequence[int]], list[Any]] | None = None,
) -> ExperimentResult:
    progress = progress or NullProgress()
    points = []
    for t in counts:
        config = deep_merge(base, {"llama": {"threads": t, "threads_batch": t}})
        points.append(measure_launched(f"t={t}", {"threads": t}, config, workload, out / f"t{t}", progress))
    result = ExperimentResult("threads", points)
    identity = (points[0].identity or {}) if points else {}
    model = identity.get("model")
    if llama_bench is not None and isinstance(model, dict):
        # Same model file, same thread counts, llama.cpp's own measurement loop, no HTTP.
        result.extra["llama_bench"] = [r.__dict__ for r in llama_bench(Path(str(model["path"])), counts)]
    return result


def cache_prompt(
    target: Target,
    workload: Workload,
    out: Path,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> ExperimentResult:
    progress = progress or NullProgress()
    points = []
    for on in (True, False):
        options = RequestOptions(
            **{**workload.options.__dict__, "extra_body": {**workload.options.extra_body, "cache_prompt": on}}
        )
        wl = Workload(workload.load, workload.prompts, options, workload.gates)
        label = "cache_prompt=on" if on else "cache_prompt=off"
        folder = out / label.replace("=", "-")
        summary, records = _run(target, wl, folder, progress, transport)
        prompt_tps, decode_tps = server_rates(records)
        processed = [
            r.server.prompt_n for r in records if r.server and r.server.prompt_n is not None and not r.warmup
        ]
        cached = [
            r.server.cache_n for r in records if r.server and r.server.cache_n is not None and not r.warmup
        ]
        point = PointResult(label, {"cache_prompt": on}, summary, folder, prompt_tps, decode_tps)
        point.extra = {
            "prompt_tokens_processed_median": statistics.median(processed) if processed else None,
            "prompt_tokens_cached_median": statistics.median(cached) if cached else None,
        }
        points.append(point)
    return ExperimentResult("cache-prompt", points)


def slots(
    base: Mapping[str, Any],
    grid: Sequence[tuple[int, int]],
    workload_for: Callable[[int], Workload],
    out: Path,
    progress: Progress | None = None,
) -> ExperimentResult:
    progress = progress or NullProgress()
    points = []
    for n, ctx in grid:
        config = deep_merge(base, {"llama": {"slots": n, "ctx_per_slot": ctx}})
        label = f"{n}x{ctx}"
        wl = workload_for(n)
        settings = {"slots": n, "ctx_per_slot": ctx, "concurrency": wl.load.value}
        points.append(measure_launched(label, settings, config, wl, out / label, progress))
    return ExperimentResult("slots", points)


def models(
    base: Mapping[str, Any],
    files: Sequence[tuple[Path, str]],
    workload: Workload,
    out: Path,
    progress: Progress | None = None,
    quality_items: Sequence[quality_mod.Item] | None = None,
    min_pass_rate: float = 1.0,
) -> ExperimentResult:
    progress = progress or NullProgress()
    points = []
    for i, (path, sha) in enumerate(files):
        config = deep_merge(base, {"llama": {"model": {"path": str(path), "sha256": sha}}})
        label = path.name
        point = measure_launched(
            label,
            {"model": str(path)},
            config,
            workload,
            out / f"{i:02d}-{path.stem}",
            progress,
            quality_items,
        )
        point.extra["file_bytes"] = path.stat().st_size
        point.extra["type"] = file_type(path)
        point.extra["derived"] = read_record(path)  # how `model quantize` made it, if it did
        points.append(point)
    result = ExperimentResult("models", points)
    result.notes += _derivation_notes(points)

    def passes(p: PointResult) -> bool:
        q_ok = p.quality is None or (p.quality.rate is not None and p.quality.rate >= min_pass_rate)
        return p.summary.verdict.passed and q_ok

    passing = sorted((p for p in points if passes(p)), key=lambda p: p.extra["file_bytes"])
    result.extra["smallest_passing"] = passing[0].label if passing else None
    result.extra["min_pass_rate"] = min_pass_rate
    return result


def _derivation_notes(points: Sequence[PointResult]) -> list[str]:
    """Say plainly when some files were requantized: their quality is their source's."""
    by_source: dict[tuple[str, str], list[str]] = {}
    for p in points:
        d = p.extra.get("derived")
        if isinstance(d, dict) and d.get("requantized"):
            src = d.get("source") or {}
            key = (str(src.get("type") or "quantized"), str(src.get("sha256", "?")))
            by_source.setdefault(key, []).append(str(d.get("type")))
    return [
        f"{', '.join(types)} {'was' if len(types) == 1 else 'were'} derived from the {src_type} file "
        f"(sha256 {sha[:16]}...) with llama-quantize --allow-requantize: "
        f"{'it carries' if len(types) == 1 else 'they carry'} {src_type}'s quality, not "
        f"{'its' if len(types) == 1 else 'their'} own, and differ{'s' if len(types) == 1 else ''} only in "
        "kernels, size and memory bandwidth. This comparison is of speed and memory, not quality."
        for (src_type, sha), types in by_source.items()
    ]
