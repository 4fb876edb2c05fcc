"""``llamagate bench experiment threads|cache-prompt|slots|models|kv-reuse``: runs that explain the envelope.

Exit status: 0 when the experiment completed (its tables are findings, not a verdict), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from supervisor.artifacts.demo_model import GEMMA, ensure_demo_model
from supervisor.artifacts.files import sha256_file
from supervisor.bench import (
    experiment_charts,
    experiment_report,
    experiments,
    hostload,
    llamabench,
    options,
    quant_files,
)
from supervisor.bench import quality as quality_mod
from supervisor.bench.commands import kv_reuse
from supervisor.bench.commands.run import write_provenance
from supervisor.bench.commands.sweep import parse_values
from supervisor.bench.launcher import read_base_config, start_llama_server, validate
from supervisor.bench.loadgen import LoadSpec
from supervisor.bench.provenance import collect
from supervisor.errors import UsageError
from supervisor.interrupts import interruptible
from supervisor.paths import default_lock_path
from supervisor.progress import ConsoleProgress, Progress


def _workload(args: argparse.Namespace, concurrency: int) -> experiments.Workload:
    try:
        load = LoadSpec(
            "concurrency", concurrency, requests=args.requests, warmup=args.warmup, seed=args.seed
        )
    except ValueError as exc:
        raise UsageError(f"load: {exc}") from exc
    return experiments.Workload(
        load, options.prompts(args), options.request_options(args), options.gates(args)
    )


def _finish(result: experiments.ExperimentResult, out: Path) -> int:
    window = hostload.record_end(out)
    result.extra["load_average"] = window
    result.notes.append(f"host: {hostload.describe(window)}")
    experiment_report.write(result, out)
    title = f"bench experiment {result.name} ({hostload.describe(window)})"
    chart = experiment_charts.write(result, out, title)
    print(experiment_report.markdown(result))
    print(chart, file=sys.stderr)
    print(f"results: {out}")
    return 0


def _threads(args: argparse.Namespace, progress: Progress) -> int:
    counts = [int(v) for v in parse_values(args.threads, "--threads", integer=True)]
    base = read_base_config(args.config)
    out = options.out_dir(args, "threads")
    write_provenance(out, collect(sys.argv, {}))
    runner: Callable[[Path, Sequence[int]], list[Any]] | None = None
    notes = []
    if not args.no_llama_bench:
        binary = validate(base, "bench config").llama.binary
        found = llamabench.find(binary, args.llama_bench)
        if found is None:
            notes.append(llamabench.HOW_TO_BUILD)
        else:
            bench_binary = found

            def runner(model: Path, threads: Sequence[int]) -> list[Any]:
                return list(llamabench.run(bench_binary, model, threads))

    result = experiments.threads(base, counts, _workload(args, args.concurrency or 1), out, progress, runner)
    result.notes += notes
    return _finish(result, out)


def _cache(args: argparse.Namespace, progress: Progress) -> int:
    out = options.out_dir(args, "cache-prompt")
    workload = _workload(args, args.concurrency or 1)
    if args.url:
        target = options.target(args)
        write_provenance(out, collect(sys.argv, {"target": target}))
        return _finish(experiments.cache_prompt(target, workload, out, progress), out)
    launched, _ = start_llama_server(read_base_config(args.config), out / "server", progress=progress)
    try:
        write_provenance(
            out, collect(sys.argv, {"llama-server": launched.target}, {"identity": launched.identity})
        )
        result = experiments.cache_prompt(launched.target, workload, out, progress)
    finally:
        launched.stop()
    return _finish(result, out)


def _grid(text: str) -> list[tuple[int, int]]:
    grid = []
    for part in text.split(","):
        slots, _, ctx = part.strip().partition("x")
        if not (slots.isdigit() and ctx.isdigit()) or int(slots) < 1 or int(ctx) < 256:
            raise UsageError(f"--grid: {part!r} is not SLOTSxCTX (e.g. 4x4096; ctx >= 256)")
        grid.append((int(slots), int(ctx)))
    return grid


def _slots(args: argparse.Namespace, progress: Progress) -> int:
    grid = _grid(args.grid)
    base = read_base_config(args.config)
    out = options.out_dir(args, "slots")
    write_provenance(out, collect(sys.argv, {}))
    result = experiments.slots(base, grid, lambda n: _workload(args, args.concurrency or n), out, progress)
    return _finish(result, out)


def _model_spec(text: str) -> tuple[Path, str]:
    path_text, _, sha = text.partition("=")
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"--model {text}: no such file")
    if sha and (len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha)):
        raise UsageError(f"--model {text}: the sha256 after '=' must be 64 lowercase hex digits")
    if not sha:
        sha = sha256_file(path)  # trust on first use: the file as it is now is what gets measured
    return path, sha


def _models(args: argparse.Namespace, progress: Progress) -> int:
    files = [_model_spec(m) for m in args.model or ()]
    base = read_base_config(args.config)
    if args.quantize:
        # The labs' recorded runs derive their types from Gemma 3 270M's Q4_K_M (docs/benchmarks.md).
        source = args.source or ensure_demo_model(progress=progress, model=GEMMA)
        lock = validate(base, "bench config").llama.lock or default_lock_path()
        files += quant_files.prepare(
            quant_files.parse_types(args.quantize), source.resolve(), lock_path=lock, progress=progress
        )
    if not files:
        raise UsageError("bench experiment models: give --model PATH (repeat) or --quantize TYPES")
    items = quality_mod.load(args.quality) if args.quality else None
    if not 0.0 <= args.min_pass_rate <= 1.0:
        raise UsageError("--min-pass-rate must be in [0, 1]")
    concurrency = args.concurrency or validate(base, "bench config").llama.slots
    out = options.out_dir(args, "models")
    write_provenance(out, collect(sys.argv, {}))
    result = experiments.models(
        base, files, _workload(args, concurrency), out, progress, items, args.min_pass_rate
    )
    return _finish(result, out)


def _common(parser: argparse.ArgumentParser, launches: bool = True) -> None:
    if launches:
        parser.add_argument("--config", type=Path, help="llamagate config to start from (default: embedded)")
    parser.add_argument("--concurrency", type=int, help="closed-loop users per point")
    parser.add_argument("--requests", type=int, default=10, help="measured requests per point (10)")
    options.add_request_options(parser)
    options.add_gate_options(parser)
    options.add_output_options(parser)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "experiment",
        aliases=["experiments"],
        help="runs that explain the envelope: threads, cache-prompt, slots, models, kv-reuse",
    )
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT")

    def handler(fn: Callable[[argparse.Namespace, Progress], int]) -> Callable[[argparse.Namespace], int]:
        return interruptible(lambda args: fn(args, ConsoleProgress()))

    p = sub.add_parser("threads", help="restart llama-server at each thread count: decode/prompt rates, TPOT")
    p.add_argument("--threads", required=True, metavar="LIST", help="thread counts, e.g. 1,2")
    p.add_argument("--llama-bench", type=Path, help="llama-bench binary (default: next to llama-server)")
    p.add_argument("--no-llama-bench", action="store_true", help="skip llama.cpp's llama-bench")
    _common(p)
    p.set_defaults(func=handler(_threads))

    p = sub.add_parser("cache-prompt", help="the same shared-prefix load with cache_prompt on and off")
    options.add_target_options(p, required=False)
    _common(p)
    p.set_defaults(func=handler(_cache), prompts="shared:1024")

    p = sub.add_parser("slots", help="slots x context per slot: memory against concurrency")
    p.add_argument(
        "--grid", required=True, metavar="LIST", help="SLOTSxCTX points, e.g. 1x8192,2x4096,4x2048"
    )
    _common(p)
    p.set_defaults(func=handler(_slots))

    p = sub.add_parser("models", help="several model files: size, memory, latency, optional quality")
    p.add_argument("--model", action="append", metavar="PATH[=SHA256]", help="a GGUF file (repeat)")
    p.add_argument(
        "--quantize",
        metavar="TYPES",
        help="compare these types of --source, e.g. Q4_K_M,Q5_K_M,Q8_0,F16: the source's own type is the "
        "file itself, the others are derived by `llamagate model quantize` (cached)",
    )
    p.add_argument("--source", type=Path, help="the GGUF --quantize derives from (default: the demo model)")
    p.add_argument("--quality", type=Path, help="quality set (JSONL: prompt/messages + expect/expect_regex)")
    p.add_argument("--min-pass-rate", type=float, default=1.0, help="quality pass rate needed (1.0)")
    _common(p)
    p.set_defaults(func=handler(_models))

    kv_reuse.register(sub)

    def _no_experiment(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_no_experiment)
