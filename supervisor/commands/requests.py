"""``llamagate requests [--cancel ID]``: a running daemon's generation requests, queued and running,
through its admin routes (``GET /admin/requests``, ``DELETE /admin/requests/ID``). Exit 0 done, 1
refused (the daemon's reason is printed: an unknown id, a request already ending), 2 usage or
unreachable."""

from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.parse import quote

from supervisor.commands.admin_client import add_admin_arguments, request
from supervisor.errors import UsageError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "requests",
        help="list a running daemon's queued and running requests, or cancel one "
        "(exit 0 done, 1 refused, 2 unreachable)",
    )
    parser.add_argument(
        "--cancel",
        metavar="ID",
        help="cancel the request with this X-Request-ID (its client gets 410 cancelled_error)",
    )
    add_admin_arguments(parser, timeout_s=30.0)
    parser.set_defaults(func=_requests)


def _requests(args: argparse.Namespace) -> int:
    if args.cancel is not None and not args.cancel.strip():
        raise UsageError("--cancel needs a request id (the X-Request-ID that `llamagate requests` lists)")
    if args.cancel is None:
        method, path = "GET", "/admin/requests"
    else:
        method, path = "DELETE", f"/admin/requests/{quote(args.cancel.strip(), safe='')}"
    status, body = request(args, method, path)
    if status:
        return status
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    if args.cancel is not None:
        for row in body.get("cancelled", []):
            print(f"cancelled {_line(row)}")
        return 0
    rows = body.get("requests", [])
    if not rows:
        print("no requests queued or running")
    for row in rows:
        print(_line(row))
    return 0


def _line(row: dict[str, Any]) -> str:
    running = row.get("running_s")
    line = (
        f"{row.get('id')}  {row.get('state'):<7} {row.get('model')} {row.get('route')}"
        f"  tenant {row.get('tenant')} key {row.get('key_id') or '-'}"
        f"  waited {_s(row.get('waited_s'))}"
    )
    if row.get("state") == "running":
        line += f", running {_s(running)}, {row.get('tokens', 0)} tokens"
    return line


def _s(value: object) -> str:
    return f"{value:.1f} s" if isinstance(value, int | float) else "-"
