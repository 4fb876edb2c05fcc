"""``llamagate models list|load|unload NAME``: see and act on a running daemon's models through its admin
routes (``GET /admin/models``, ``POST /admin/models/NAME/load|unload``). Exit 0 done, 1 refused (the
daemon's reason is printed), 2 usage or unreachable."""

from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.parse import quote

from supervisor.commands.admin_client import add_admin_arguments, request


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list, load or unload a running daemon's models (exit 0 done, 1 refused, 2 unreachable)",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="{list,load,unload}")
    for action, text in (
        ("list", "each model's state, residency, memory share, loads and load progress"),
        ("load", "load NAME and wait until it is READY"),
        ("unload", "drain NAME's requests, then stop its child (on_demand models only)"),
    ):
        sub = actions.add_parser(action, help=text)
        if action != "list":
            sub.add_argument("name", metavar="NAME", help="the model's name (models[].name)")
        # A load waits for READY: as long as the model's load_wait_s, and longer than a status probe.
        add_admin_arguments(sub, timeout_s=600.0)
        sub.set_defaults(func=_models)


def _models(args: argparse.Namespace) -> int:
    if args.action == "list":
        method, path = "GET", "/admin/models"
    else:
        method, path = "POST", f"/admin/models/{quote(args.name, safe='')}/{args.action}"
    status, body = request(args, method, path)
    if status:
        return status
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    rows = body.get("models", []) if args.action == "list" else [body]
    for row in rows:
        print(_line(row))
    return 0


def _line(row: dict[str, Any]) -> str:
    share = row.get("budget_share")
    line = (
        f"{row.get('name'):<16} {row.get('state'):<10} {row.get('residency'):<10}"
        f" memory {_mib(row.get('budget_bytes'))}"
        + (f" ({share:.0%} of usable)" if isinstance(share, int | float) else "")
        + f", loads {row.get('loads', '-')}, idle {row.get('idle_s', '-')} s"
    )
    progress = row.get("progress")
    if isinstance(progress, int | float) and row.get("state") not in ("READY", "UNLOADED"):
        eta = row.get("load_eta_s")
        line += f", loading {progress:.0%} ({row.get('load_step') or '-'}"
        line += f", about {eta:.0f} s left)" if isinstance(eta, int | float) else ")"
    if row.get("reason"):
        line += f": {row['reason']}"
    return line


def _mib(value: object) -> str:
    return f"{value / 2**20:,.0f} MiB" if isinstance(value, int) else "-"
