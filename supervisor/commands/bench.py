"""``llamagate bench ...``: each benchmark lives in ``supervisor.bench.commands.<name>``.

These are the measurements an operator runs on their own host. Benchmarks that only back a number in
docs/benchmarks.md (the proxy's cost, startup, scrape, cache isolation, several models) are not product
commands: they live in ``tests/benchmarks`` (``python -m tests.benchmarks.NAME``)."""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES = ("run", "sweep", "overload", "experiments", "soak", "scaleout", "conversations")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure this host: capacity envelope, overload, experiments, soak, scale-out, conversations",
    )
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(f"supervisor.bench.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"supervisor.bench.commands.{name}":
                raise
            continue
        module.register(sub)

    def _no_subcommand(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_no_subcommand)
