"""``llamagate requests [--cancel ID]``: a running daemon's generation requests, queued and running,
through its admin routes (``GET /admin/requests``, ``DELETE /admin/requests/ID``). Exit 0 done, 1
refused (the daemon's reason is printed: an unknown id, a request already ending), 2 usage or
unreachable."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any
from urllib.parse import quote

import httpx

from supervisor.commands.config import add_config_argument
from supervisor.commands.status import KEY_ENV, URL_ENV, default_url, normalize_url
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
    parser.add_argument(
        "--url",
        help=f"daemon URL, e.g. http://127.0.0.1:8080 (default ${URL_ENV}, else proxy.host/port of "
        "--config, else 127.0.0.1:8080)",
    )
    add_config_argument(parser)
    parser.add_argument("--key", help=f"admin key (default ${KEY_ENV})")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds for the request")
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    parser.set_defaults(func=_requests)


def _requests(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: must be > 0 seconds")
    if args.cancel is not None and not args.cancel.strip():
        raise UsageError("--cancel needs a request id (the X-Request-ID that `llamagate requests` lists)")
    key = args.key or os.environ.get(KEY_ENV)
    if not key:
        raise UsageError(f"an admin key is needed: --key KEY or ${KEY_ENV}")
    url = normalize_url(args.url or default_url(args))
    headers = {"Authorization": f"Bearer {key}"}
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
