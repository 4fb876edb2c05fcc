"""``llamagate plan``: the memory budget and the child's command line, without starting anything."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from supervisor.artifacts.build import find_installed
from supervisor.artifacts.files import sha256_file
from supervisor.budget.window import WindowChoice
from supervisor.commands.config import add_config_argument
from supervisor.config.load import load_config, resolve_config_path
from supervisor.config.models import is_multi, served_models
from supervisor.config.schema import Config
from supervisor.daemon.deploy_hints import ServiceLimits
from supervisor.daemon.prepare import Binary, devices_for, launch_spec, plan_window, resolve_model
from supervisor.daemon.state_disk import DiskPlan
from supervisor.errors import UsageError
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
    if is_multi(cfg):
        return _plan_models(args, cfg)
    model = resolve_model(cfg, progress=ConsoleProgress())
    binary_path: Path | None
    if cfg.llama.binary is not None:
        binary_path = cfg.llama.binary
    else:
        installed = find_installed(cfg.llama.lock or default_lock_path(), variant=cfg.llama.variant)
        binary_path = installed.path if installed else None
    shown = binary_path or Path(
        f"llama-server(not built yet: `llamagate build --variant {cfg.llama.variant}`)"
    )
    spec = launch_spec(cfg, Binary(shown, "", None), model)
    window = plan_window(cfg, model, spec.alias, _digest(binary_path), devices=devices_for(cfg, binary_path))
    budget, disk = window.budget, window.disk
    spec = replace(spec, slot_states=disk.states, swa_full=window.choice.added)
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
        out = {
            "budget": budget.as_dict(),
            "argv": argv,
            "model": str(model.path),
            "state_disk": disk.record(),
            "watchdog": _watchdog(cfg),
            "sliding_window": window.choice.record(),
        }
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
        print(disk.line(spec.alias) + _on_disk(disk, budget.state_1k_bytes))
        print(_watchdog_line(cfg))
        print(window.choice.line())
    return 0 if budget.fits else 1


def _plan_models(args: argparse.Namespace, cfg: Config) -> int:
    """``models:``: each model's budget and command line, then the set every always model and the
    largest on_demand one make, against the same available memory minus headroom ``serve`` checks."""
    if args.systemd or args.kubernetes:
        raise UsageError("--systemd/--kubernetes limits are for one model; with models: use plain plan")
    rows = []
    disks: dict[str, DiskPlan] = {}
    windows: dict[str, WindowChoice] = {}
    for served in served_models(cfg):
        model = resolve_model(served.cfg, progress=ConsoleProgress())
        llama = served.cfg.llama
        installed = (
            None if llama.binary else find_installed(llama.lock or default_lock_path(), variant=llama.variant)
        )
        binary = llama.binary or (installed.path if installed else None)
        spec = launch_spec(served.cfg, Binary(Path("llama-server"), "", None), model)
        window = plan_window(
            served.cfg,
            model,
            spec.alias,
            _digest(served.cfg.llama.binary),
            devices=devices_for(served.cfg, binary),
        )
        budget, disk = window.budget, window.disk
        argv = build_argv(replace(spec, slot_states=disk.states, swa_full=window.choice.added))
        argv[argv.index("--port") + 1] = "<free port>"
        rows.append((served, budget, argv))
        disks[served.name] = disk
        windows[served.name] = window.choice
    always = sum(b.required_bytes for s, b, _ in rows if not s.on_demand)
    largest = max((b.required_bytes for s, b, _ in rows if s.on_demand), default=0)
    need, usable = always + largest, min(b.usable_bytes for _, b, _ in rows)
    fits = need <= usable and all(b.fits for _, b, _ in rows)
    if args.json:
        out = {
            "models": {
                s.name: {
                    "residency": s.residency,
                    "budget": b.as_dict(),
                    "argv": a,
                    "state_disk": disks[s.name].record(),
                    "sliding_window": windows[s.name].record(),
                }
                for s, b, a in rows
            },
            "watchdog": _watchdog(cfg),
            "needed_bytes": need,
            "usable_bytes": usable,
            "fits": fits,
        }
        print(json.dumps(out, indent=2))
        return 0 if fits else 1
    mib = 1024 * 1024
    for served, budget, argv in rows:
        print(f"{served.name} ({served.residency}): {budget.required_bytes / mib:,.0f} MiB")
        print(f"  argv     {' '.join(argv)}")
        for line in budget.lines():
            print(f"  {line}")
        print(
            f"  {disks[served.name].line(served.name)}{_on_disk(disks[served.name], budget.state_1k_bytes)}"
        )
        print(f"  {windows[served.name].line()}")
    print(
        f"every always model + the largest on_demand one: {need / mib:,.0f} MiB needed,"
        f" {usable / mib:,.0f} MiB usable"
    )
    print(_watchdog_line(cfg))
    print(
        "fits"
        if fits
        else "does not fit: lower slots or ctx_per_slot, make a model on_demand, or serve fewer"
    )
    return 0 if fits else 1


def _watchdog(cfg: Config) -> dict[str, float]:
    s = cfg.supervision
    return {"probe_interval_s": s.health_interval_s, "loop_deadline_s": s.loop_deadline_s}


def _watchdog_line(cfg: Config) -> str:
    """The hang watchdog's deadline: a loop that does not answer GET /slots this long is replaced."""
    s = cfg.supervision
    return (
        f"watchdog GET /slots every {s.health_interval_s:g} s; a loop that does not answer within "
        f"{s.loop_deadline_s:g} s (supervision.loop_deadline_s) is hung: killed and restarted"
    )


def _digest(binary: Path | None) -> str:
    """The binary's sha256 when it is there (it names the states' folder), else a placeholder."""
    if binary is None or not binary.is_file():
        return "unbuilt"
    return sha256_file(binary)


def _on_disk(disk: DiskPlan, state_1k_bytes: int | None) -> str:
    """How many conversations of 1,024 tokens the disk budget keeps (", N of 1,024 tokens")."""
    if disk.states is None or not state_1k_bytes:
        return ""
    return f", {disk.states.budget_bytes // state_1k_bytes:,} conversations of 1,024 tokens"
