"""``llamagate config check``: validate a configuration without starting anything."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from supervisor.config.load import CONFIG_ENV, load_config, resolve_config_path
from supervisor.errors import ConfigError


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"YAML configuration (default: ${CONFIG_ENV}, else the embedded default)",
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("config", help="check a configuration file")
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION")
    check = sub.add_parser(
        "check",
        help="validate every field, and that serve would start here; exit 0 ok, 2 with the problems",
        description="Validates every field, then (unless --offline) what serve and plan would refuse on "
        "this host: the model file (present, a GGUF, its sha256), the binary, the memory budget, the "
        "accounts store's file. Nothing is started, built, downloaded or created.",
    )
    add_config_argument(check)
    check.add_argument(
        "--offline",
        action="store_true",
        help="check the file only, not the model, binary, memory budget and store (e.g. on another machine)",
    )
    check.set_defaults(func=_check)

    def _usage(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_usage)


def _report(name: str, problems: Sequence[str]) -> int:
    print(f"{name}: {len(problems)} problem(s):")
    for problem in problems:
        print(f"  {problem}")
    return 2


def _check(args: argparse.Namespace) -> int:
    path = resolve_config_path(args.config)
    name = str(path) if path is not None else "embedded default (no config file)"
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        return _report(name, exc.problems)
    if args.offline:
        scope = "the file only (--offline)"
    else:
        from supervisor.config.models import as_model_path, served_models
        from supervisor.daemon.startcheck import HostCheck, check_host  # imports prepare: when needed

        if cfg.models:
            # Each model on its own (binary, file and sha256, budget); the set's budget: `llamagate plan`.
            host = HostCheck()
            for i, served in enumerate(served_models(cfg)):
                one = check_host(served.cfg)
                host.checked.extend(one.checked)
                host.problems.extend(as_model_path(p, i) for p in one.problems)
                host.notes.extend(f"models '{served.name}': {n}" for n in one.notes)
        else:
            host = check_host(cfg)
        from supervisor.daemon.wiring import check_store
        from supervisor.errors import Misconfigured

        try:
            store = check_store(cfg)
        except Misconfigured as exc:
            host.problems.append(str(exc))  # names the file and what is wrong with it, as serve does
        else:
            if store is not None:
                host.checked.append("store")
                host.notes.append(f"store: {store}")
        if host.problems:
            return _report(name, host.problems)
        scope = "checked on this host: " + (", ".join(dict.fromkeys(host.checked)) or "nothing yet")
    serving = (
        f"{len(cfg.models)} model(s)"
        if cfg.models
        else f"{cfg.llama.slots} slots x {cfg.llama.ctx_per_slot} tokens"
    )
    print(f"{name}: ok ({len(cfg.tenants)} tenant(s), {len(cfg.keys)} key(s), {serving}; {scope})")
    if not args.offline:
        for note in host.notes:
            print(f"  note: {note}")
    return 0
