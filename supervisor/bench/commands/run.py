"""``llamagate bench run``: one offered load against one OpenAI-compatible URL.

Exit status: 0 when the verdict passes, 1 when it fails (so a CI job can gate on it), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from supervisor.bench import options
from supervisor.bench.loadgen import LoadSpec
from supervisor.bench.provenance import collect
from supervisor.bench.report import summary_markdown
from supervisor.bench.runner import RunSpec, run
from supervisor.errors import UsageError
from supervisor.interrupts import interruptible
from supervisor.progress import ConsoleProgress


def add_load_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load")
    how = group.add_mutually_exclusive_group(required=True)
    how.add_argument("--concurrency", type=int, help="closed loop: this many users, back to back")
    how.add_argument("--rate", type=float, help="open loop: Poisson arrivals at this many requests/s")
    size = group.add_mutually_exclusive_group()
    size.add_argument(
        "--requests",
        type=int,
        help="measured requests (default: 4 per user or 30 s of arrivals at --rate; at least 20)",
    )
    size.add_argument("--duration", type=float, help="submit for this many seconds instead")


def load_spec(args: argparse.Namespace, mode: str, value: float) -> LoadSpec:
    requests = args.requests
    if requests is None and args.duration is None:
        # Enough samples for a p95 to mean something (>= 20), more for more users.
        requests = max(20, 4 * int(value)) if mode == "concurrency" else max(20, int(30 * value))
    try:
        return LoadSpec(
            mode="concurrency" if mode == "concurrency" else "rate",
            value=value,
            requests=requests,
            duration_s=args.duration,
            warmup=args.warmup,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UsageError(f"load: {exc}") from exc


def write_provenance(out: Path, provenance: dict[str, object]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "provenance.json").write_text(
        json.dumps(provenance, indent=2, default=str) + "\n", encoding="utf-8"
    )


def _handle(args: argparse.Namespace) -> int:
    target = options.target(args)
    mode = "concurrency" if args.concurrency is not None else "rate"
    value = float(args.concurrency if args.concurrency is not None else args.rate)
    spec = RunSpec(
        target=target,
        load=load_spec(args, mode, value),
        prompts=options.prompts(args),
        options=options.request_options(args),
        gates=options.gates(args),
    )
    out = options.out_dir(args, "run")
    write_provenance(out, collect(sys.argv, {"target": target}))
    result = run(spec, out, ConsoleProgress())
    print(summary_markdown(result.summary))
    print(f"results: {out}")
    return 0 if result.summary.verdict.passed else 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="one offered load against an OpenAI-compatible URL: records, summary, verdict",
        description="Send streaming chat completions at a fixed concurrency or arrival rate; write one "
        "JSONL record per request, a summary and a verdict against the latency gates. "
        "Exit 0 when the verdict passes, 1 when it fails.",
    )
    options.add_target_options(parser)
    add_load_options(parser)
    options.add_request_options(parser)
    options.add_gate_options(parser)
    options.add_output_options(parser)
    parser.set_defaults(func=interruptible(_handle))
