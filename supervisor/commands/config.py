"""``llamagate config check``: validate a configuration without starting anything."""

from __future__ import annotations

import argparse

from supervisor.config import CONFIG_ENV, load_config, resolve_config_path
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
    check = sub.add_parser("check", help="validate every field; exit 0 when valid, 2 with the problems")
    add_config_argument(check)
    check.set_defaults(func=_check)

    def _usage(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_usage)


def _check(args: argparse.Namespace) -> int:
    path = resolve_config_path(args.config)
    if path is None:
        print("no config file given: the embedded default is used (and is valid)")
        return 0
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        print(f"{path}: {len(exc.problems)} problem(s):")
        for problem in exc.problems:
            print(f"  {problem}")
        return 2
    print(
        f"{path}: ok ({len(cfg.tenants)} tenant(s), {len(cfg.keys)} key(s), "
        f"{cfg.llama.slots} slots x {cfg.llama.ctx_per_slot} tokens)"
    )
    return 0
