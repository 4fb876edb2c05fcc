"""``llamagate bench sweep``: one run per offered load, the envelope, a recovery run, table/JSON/chart.

Exit status: 0 when the sweep completed (whatever the envelope), 2 on bad usage. The envelope is a
finding, not a failure.
"""

from __future__ import annotations

import argparse
import os
import sys

from supervisor.bench import options
from supervisor.bench.client import Target
from supervisor.bench.commands.run import load_spec, write_provenance
from supervisor.bench.loadgen import LoadSpec
from supervisor.bench.provenance import collect
from supervisor.bench.sweep import SweepResult, SweepSpec, markdown, sweep
from supervisor.errors import UsageError
from supervisor.interrupts import interruptible
from supervisor.progress import ConsoleProgress


def parse_values(text: str, what: str, integer: bool) -> list[float]:
    values: list[float] = []
    for raw in text.split(","):
        raw = raw.strip()
        try:
            value = float(int(raw)) if integer else float(raw)
        except ValueError as exc:
            raise UsageError(f"{what}: {raw!r} is not a {'whole ' if integer else ''}number") from exc
        if value <= 0:
            raise UsageError(f"{what}: {raw} must be > 0")
        values.append(value)
    if len(set(values)) != len(values):
        raise UsageError(f"{what}: duplicate value")
    return sorted(values)


def loads_from_args(args: argparse.Namespace) -> list[LoadSpec]:
    if args.concurrency:
        mode, values = "concurrency", parse_values(args.concurrency, "--concurrency", integer=True)
    else:
        mode, values = "rate", parse_values(args.rates, "--rates", integer=False)
    loads = [load_spec(args, mode, value) for value in values]
    return loads


def targets_from_args(args: argparse.Namespace) -> dict[str, Target]:
    targets = {args.name: options.target(args)}
    if args.compare_url:
        if args.compare_name == args.name:
            raise UsageError("--compare-name must differ from --name")
        if not args.compare_url.startswith(("http://", "https://")):
            raise UsageError(f"--compare-url {args.compare_url}: expected http:// or https://")
        key = None
        if args.compare_api_key_env:
            key = os.environ.get(args.compare_api_key_env)
            if not key:
                raise UsageError(f"--compare-api-key-env {args.compare_api_key_env}: variable is not set")
        targets[args.compare_name] = Target(args.compare_url, key)
    return targets


def add_sweep_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sweep")
    how = group.add_mutually_exclusive_group(required=True)
    how.add_argument("--concurrency", metavar="LIST", help="closed-loop users per point, e.g. 1,2,4,8")
    how.add_argument(
        "--rates", metavar="LIST", help="open-loop Poisson arrival rates per point, e.g. 0.5,1,2"
    )
    size = group.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, help="measured requests per point (default 4 per user, min 20)")
    size.add_argument("--duration", type=float, help="seconds of submissions per point instead")
    group.add_argument("--no-recovery", action="store_true", help="skip the recovery run after the overload")
    group.add_argument("--pause", type=float, default=2.0, help="seconds between points (2)")


def add_compare_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("comparison (same loads, interleaved, one chart)")
    group.add_argument("--name", default="target", help="series name of --url (default 'target')")
    group.add_argument("--compare-url", help="a second base URL, e.g. the bare llama-server behind llamagate")
    group.add_argument("--compare-name", default="compare", help="series name of --compare-url")
    group.add_argument(
        "--compare-api-key-env", metavar="VAR", help="API key of --compare-url from this variable"
    )


def print_result(result: SweepResult) -> None:
    print(markdown(result))
    if result.chart_note:
        print(result.chart_note, file=sys.stderr)
    print(f"results: {result.out_dir}")


def _handle(args: argparse.Namespace) -> int:
    targets = targets_from_args(args)
    if args.pause < 0:
        raise UsageError("--pause must be >= 0")
    spec = SweepSpec(
        targets=targets,
        loads=loads_from_args(args),
        prompts=options.prompts(args),
        options=options.request_options(args),
        gates=options.gates(args),
        recovery=not args.no_recovery,
        pause_s=args.pause,
    )
    out = options.out_dir(args, "sweep")
    write_provenance(out, collect(sys.argv, targets))
    print_result(sweep(spec, out, ConsoleProgress()))
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="a run per offered load; the envelope, a recovery run, table, JSON and chart",
        description="Run the same workload at increasing offered loads, find the highest load that "
        "passes the gates and the first that fails (and which gate), re-run the highest passing "
        "load after the overload, and write sweep.md, sweep.json and chart.png.",
    )
    options.add_target_options(parser)
    add_compare_options(parser)
    add_sweep_options(parser)
    options.add_request_options(parser)
    options.add_gate_options(parser)
    options.add_output_options(parser)
    parser.set_defaults(func=interruptible(_handle))
