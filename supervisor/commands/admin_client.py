"""The options and the target of a command that calls a running daemon's admin routes (``llamagate
models``, ``llamagate requests``): one set of flags, one way to find the URL and the key, one call."""

from __future__ import annotations

import argparse
import os
from typing import Any

import httpx

from supervisor.commands.config import add_config_argument
from supervisor.commands.status import KEY_ENV, add_url_argument, default_url, normalize_url
from supervisor.errors import UsageError


def add_admin_arguments(parser: argparse.ArgumentParser, timeout_s: float) -> None:
    add_url_argument(parser)
    add_config_argument(parser)
    parser.add_argument("--key", help=f"admin key (default ${KEY_ENV})")
    parser.add_argument("--timeout", type=float, default=timeout_s, help="seconds for the request")
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")


def admin_target(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    """The daemon's URL and the admin key's headers, or the usage error naming what is missing."""
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: must be > 0 seconds")
    key = args.key or os.environ.get(KEY_ENV)
    if not key:
        raise UsageError(f"an admin key is needed: --key KEY or ${KEY_ENV}")
    return normalize_url(args.url or default_url(args)), {"Authorization": f"Bearer {key}"}


def request(args: argparse.Namespace, method: str, path: str) -> tuple[int, Any]:
    """Call the daemon's admin route: (0, its JSON answer) for a 200, else (the command's exit status,
    None) once what went wrong is printed: 2 for a daemon that cannot be reached or a key it refuses, 1
    for any other refusal (its message)."""
    url, headers = admin_target(args)
    with httpx.Client(timeout=args.timeout, trust_env=False) as client:
        try:
            response = client.request(method, f"{url}{path}", headers=headers)
            body: Any = response.json()
        except httpx.HTTPError as exc:
            print(f"unreachable: {url}: {type(exc).__name__}: {exc}")
            return 2, None
        except ValueError:
            status = response.status_code
            print(f"unreachable: {url}{path} did not answer JSON (HTTP {status}); is this llamagate?")
            return 2, None
    error = body.get("error", {}) if isinstance(body, dict) else {}
    if response.status_code in (401, 403):
        print(f"refused: {error.get('message') or response.status_code} (--key must be an admin key)")
        return 2, None
    if response.status_code != 200:
        print(f"refused (HTTP {response.status_code}): {error.get('message') or body}")
        return 1, None
    return 0, body
