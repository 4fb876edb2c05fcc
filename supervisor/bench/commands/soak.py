"""``llamagate bench soak``: N minutes at twice the envelope with the child killed, stopped and reloaded
underneath; every request accounted for. Exit 0 only when every target is met, 1 otherwise."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from supervisor.bench import options
from supervisor.bench.launcher import read_base_config
from supervisor.bench.soak import SoakSpec, run_soak
from supervisor.bench.soak_ledger import summary_text
from supervisor.errors import UsageError
from supervisor.interrupts import interruptible
from supervisor.progress import ConsoleProgress


def _handle(args: argparse.Namespace) -> int:
    checks = (
        (args.minutes > 0, "--minutes must be > 0"),
        (args.concurrency is None or args.concurrency >= 1, "--concurrency must be >= 1"),
        (args.max_tokens >= 1, "--max-tokens must be >= 1"),
        (args.request_timeout > 0, "--request-timeout must be > 0"),
        (args.stop_seconds >= 0, "--stop-seconds must be >= 0"),
        (args.drop_after > 0, "--drop-after must be > 0"),
    )
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    spec = SoakSpec(
        base_config=read_base_config(args.config),
        minutes=args.minutes,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        drop_after_s=args.drop_after,
        stop_s=args.stop_seconds,
        chaos=not args.no_chaos,
    )
    out = options.out_dir(args, "soak")
    result = run_soak(spec, out, sys.argv, ConsoleProgress())
    text = summary_text(result)
    (out / "summary.txt").write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"results: {out}")
    return 0 if result["all_met"] else 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "soak",
        help="minutes of load at twice the envelope, with kill/stop/reload chaos; every request accounted",
        description="Start a llamagate daemon from the config (three tenants and fresh keys are added), "
        "load it with twice its slots of mixed streamed, plain and disconnecting clients, SIGKILL and "
        "SIGSTOP its child and SIGHUP it meanwhile, and check: every request accounted for, none hung, "
        "no non-streamed request failed, gauges back to 0, /slots busy never above the permits, daemon "
        "RSS drift over the last 5 minutes < 5 %%, descriptors back to the start count. Exit 0 only when "
        "all are met.",
    )
    parser.add_argument(
        "--config", type=Path, help="llamagate config to start from (default: embedded default)"
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load (10)")
    parser.add_argument("--concurrency", type=int, help="client loops (default: twice the slots)")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="max_tokens of a request (32; drops: twice)"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=120.0, help="each call's deadline in s (120)"
    )
    parser.add_argument("--drop-after", type=float, default=0.5, help="plain calls cut after s (0.5)")
    parser.add_argument(
        "--stop-seconds", type=float, default=20.0, help="how long the child is SIGSTOPped (20)"
    )
    parser.add_argument("--no-chaos", action="store_true", help="load only: no kill, stop or reload")
    options.add_output_options(parser)
    parser.set_defaults(func=interruptible(_handle))
