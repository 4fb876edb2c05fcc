"""The options and the target of a command that calls a running daemon's admin routes (``llamagate
models``, ``llamagate requests``): one set of flags, one way to find the URL and the key."""

from __future__ import annotations

import argparse
import os

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
