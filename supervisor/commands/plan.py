"""``llamagate plan``: the memory budget and the child's command line, without starting anything."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from supervisor.artifacts.build import find_installed
from supervisor.commands.config import add_config_argument
from supervisor.config.load import load_config, resolve_config_path
from supervisor.daemon.deploy_hints import ServiceLimits
from supervisor.daemon.prepare import Binary, budget_for, launch_spec, resolve_model
from supervisor.launch.flags import build_argv
from supervisor.paths import default_lock_path
from supervisor.progress import ConsoleProgress


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan", help="print the memory budget and llama-server's command line; exit 1 if it does not fit"
    )
    add_config_argument(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    hints = parser.add_mutually_exclusive_group()
    hints.add_argument(
        "--systemd",
        action="store_true",
        help="print a systemd drop-in with MemoryHigh/MemoryMax from the budget",
    )
    hints.add_argument(
        "--kubernetes",
        action="store_true",
        help="print container resources (requests/limits) from the budget",
    )
    parser.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    cfg = load_config(resolve_config_path(args.config))
    model = resolve_model(cfg, progress=ConsoleProgress())
    budget = budget_for(cfg, model)
    binary_path: Path | None
    if cfg.llama.binary is not None:
        binary_path = cfg.llama.binary
    else:
        installed = find_installed(cfg.llama.lock or default_lock_path())
        binary_path = installed.path if installed else None
    shown = binary_path or Path("llama-server(not built yet: `llamagate build`)")
    spec = launch_spec(cfg, Binary(shown, "", None), model)
    argv = build_argv(spec)
    argv[argv.index("--port") + 1] = "<free port>"
    if args.systemd or args.kubernetes:
        if not budget.fits:
            # Nothing on stdout: limits for a daemon that will refuse to start would look usable
            # (and `plan --systemd > memory.conf` would install them).
            print(f"llamagate: error: no limits: {budget.refusal()}", file=sys.stderr)
            return 1
        limits = ServiceLimits.from_budget(budget, spec.threads)
        print(limits.systemd_dropin() if args.systemd else limits.kubernetes_yaml(), end="")
        return 0 if budget.fits else 1
    if args.json:
        out = {"budget": budget.as_dict(), "argv": argv, "model": str(model.path)}
        print(json.dumps(out, indent=2))
    else:
        shape = model.shape
        kv = max(shape.kv_heads)
        print(f"model    {model.path} ({shape.architecture}, {shape.layers} layers, kv heads {kv})")
        print(f"argv     {' '.join(argv)}")
        print("memory budget:")
        for line in budget.lines():
            print(f"  {line}")
        print("fits" if budget.fits else budget.refusal())
    return 0 if budget.fits else 1
