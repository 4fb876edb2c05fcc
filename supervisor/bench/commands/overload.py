"""``llamagate bench overload``: start llama-server and llamagate from one config, sweep both, compare.

Exit status: 0 when the claim holds at the highest load (through llamagate the admitted requests meet
the gates, straight to llama-server they do not), 1 when it does not, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from supervisor.bench import options
from supervisor.bench.commands.sweep import loads_from_args, print_result
from supervisor.bench.launcher import read_base_config
from supervisor.bench.overload import OverloadSpec, comparison_markdown, run_overload
from supervisor.errors import UsageError
from supervisor.interrupts import interruptible
from supervisor.progress import ConsoleProgress


def _handle(args: argparse.Namespace) -> int:
    if args.slots < 1:
        raise UsageError("--slots must be >= 1")
    if args.admit is not None and not 1 <= args.admit <= args.slots:
        raise UsageError("--admit must be between 1 and --slots")
    if args.max_queue < 0:
        raise UsageError("--max-queue must be >= 0")
    if args.queue_timeout <= 0:
        raise UsageError("--queue-timeout must be > 0")
    if args.pause < 0:
        raise UsageError("--pause must be >= 0")
    if args.concurrency is None and args.rates is None:
        args.concurrency = "1,2,4,8"
    spec = OverloadSpec(
        base_config=read_base_config(args.config),
        loads=loads_from_args(args),
        prompts=options.prompts(args),
        options=options.request_options(args),
        gates=options.gates(args),
        slots=args.slots,
        admit=args.admit,
        ctx_per_slot=args.ctx_per_slot,
        threads=args.threads,
        max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout,
        recovery=not args.no_recovery,
        pause_s=args.pause,
    )
    out = options.out_dir(args, "overload")
    result, claim = run_overload(spec, out, sys.argv, ConsoleProgress())
    print_result(result)
    print(comparison_markdown(result, claim))
    return 0 if claim is not None and claim.holds else 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "overload",
        help="the same loads straight to llama-server and through llamagate, in one run",
        description="Start a bare llama-server and a llamagate daemon from one config (same binary, model, "
        "threads, slots, context), sweep both with interleaved points, and compare: at overload, do the "
        "requests llamagate admits meet the gates while the same load straight to llama-server does not? "
        "Exit 0 when that holds at the highest load, 1 when it does not.",
    )
    servers = parser.add_argument_group("servers (both started from one config)")
    servers.add_argument(
        "--config", type=Path, help="llamagate config to start from (default: embedded default)"
    )
    servers.add_argument("--slots", type=int, default=4, help="llama-server slots (4)")
    servers.add_argument("--ctx-per-slot", type=int, help="context per slot (default: the config's)")
    servers.add_argument("--threads", type=int, help="threads and batch threads (default: the config's)")
    servers.add_argument(
        "--admit",
        type=int,
        help="llamagate: requests admitted at once (tenant max_concurrency; default: slots)",
    )
    servers.add_argument(
        "--max-queue",
        type=int,
        default=0,
        help="llamagate: requests that may wait for a slot (0: 429 at once)",
    )
    servers.add_argument(
        "--queue-timeout", type=float, default=1.0, help="llamagate: longest wait for a slot in s (1)"
    )
    group = parser.add_argument_group("sweep")
    how = group.add_mutually_exclusive_group()
    how.add_argument("--concurrency", metavar="LIST", help="closed-loop users per point (default 1,2,4,8)")
    how.add_argument("--rates", metavar="LIST", help="open-loop Poisson arrival rates per point instead")
    size = group.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, help="measured requests per point (default 4 per user, min 20)")
    size.add_argument("--duration", type=float, help="seconds of submissions per point instead")
    group.add_argument("--no-recovery", action="store_true", help="skip the recovery runs")
    group.add_argument("--pause", type=float, default=2.0, help="seconds between points (2)")
    options.add_request_options(parser)
    options.add_gate_options(parser)
    options.add_output_options(parser)
    parser.set_defaults(func=interruptible(_handle))
