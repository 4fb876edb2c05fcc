"""``llamagate requests [--cancel ID]``: a running daemon's generation requests, queued and running,
through its admin routes (``GET /admin/requests``, ``DELETE /admin/requests/ID``). Exit 0 done, 1
refused (the daemon's reason is printed: an unknown id, a request already ending), 2 usage or
unreachable."""

from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.parse import quote

import httpx

from supervisor.commands.admin_client import add_admin_arguments, admin_target
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
    url, headers = admin_target(args)
    if args.cancel is None:
        method, path = "GET", "/admin/requests"
    else:
        method, path = "DELETE", f"/admin/requests/{quote(args.cancel.strip(), safe='')}"
    with httpx.Client(timeout=args.timeout, trust_env=False) as client:
        try:
            response = client.request(method, f"{url}{path}", headers=headers)
            body: Any = response.json()
        except httpx.HTTPError as exc:
            print(f"unreachable: {url}: {type(exc).__name__}: {exc}")
            return 2
        except ValueError:
            print(
                f"unreachable: {url}{path} did not answer JSON (HTTP {response.status_code});"
                " is this llamagate?"
            )
            return 2
    error = body.get("error", {}) if isinstance(body, dict) else {}
    if response.status_code in (401, 403):
        print(f"refused: {error.get('message') or response.status_code} (--key must be an admin key)")
        return 2
    if response.status_code != 200:
        print(f"refused (HTTP {response.status_code}): {error.get('message') or body}")
        return 1
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
