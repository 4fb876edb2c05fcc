"""``llamagate keys new --tenant NAME [--admin]`` and ``llamagate keys hash``.

``new`` prints a fresh API key once (it is not stored anywhere: only its digest goes in the config) and
the YAML lines to add under ``keys:``. ``hash`` prints the entry for an existing key read from stdin
(e.g. to move a key between configs), so the key never appears on a command line or in shell history.
"""

from __future__ import annotations

import argparse
import re
import sys

from proxy.auth import key_digest, new_key
from proxy.settings import KeyEntry, Scope
from supervisor.errors import UsageError

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_KEY = re.compile(r"lg_([0-9a-f]{12})_[A-Za-z0-9_-]{43}")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("keys", help="create API keys (the config stores only their digests)")
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION")

    new = sub.add_parser("new", help="print a new key once, and the lines to add under keys: in the config")
    new.add_argument("--tenant", required=True, help="tenant the key belongs to (must exist under tenants:)")
    _add_scope_flags(new)
    new.set_defaults(func=_new)

    hashed = sub.add_parser("hash", help="read a key on stdin, print its config entry")
    hashed.add_argument("--tenant", required=True)
    _add_scope_flags(hashed)
    hashed.set_defaults(func=_hash)

    def _usage(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    parser.set_defaults(func=_usage)


def _add_scope_flags(parser: argparse.ArgumentParser) -> None:
    # One or the other: "--admin --admin-only" has no single meaning, so it is a usage error (exit 2).
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--admin", action="store_true", help="also allow admin routes (/slots, /metrics, ...)")
    scope.add_argument(
        "--admin-only", action="store_true", help="admin routes only, no inference (for monitoring)"
    )


def _scopes(args: argparse.Namespace) -> frozenset[Scope]:
    if args.admin_only:
        return frozenset({"admin"})
    return frozenset({"inference", "admin"}) if args.admin else frozenset({"inference"})


def _check_tenant(name: str) -> None:
    if not _TENANT.fullmatch(name):
        raise UsageError(f"--tenant {name!r}: use letters, digits, '_', '.' or '-' (at most 64)")


def entry_yaml(entry: KeyEntry) -> str:
    scopes = ", ".join(sorted(entry.scopes))
    return (
        f'  - id: "{entry.key_id}"\n'
        f'    digest: "{entry.digest}"\n'
        f"    tenant: {entry.tenant}\n"
        f"    scopes: [{scopes}]\n"
    )


def _new(args: argparse.Namespace) -> int:
    _check_tenant(args.tenant)
    key, entry = new_key(args.tenant, _scopes(args))
    print(f"API key (shown once, store it now): {key}")
    print()
    print("Add under keys: in the config, then reload (SIGHUP) or restart:")
    print(entry_yaml(entry), end="")
    return 0


def _hash(args: argparse.Namespace) -> int:
    _check_tenant(args.tenant)
    key = sys.stdin.readline().strip()
    match = _KEY.fullmatch(key)
    if match is None:
        raise UsageError("stdin: not a llamagate key (expected lg_<12 hex>_<43 base64url chars>)")
    entry = KeyEntry(match.group(1), key_digest(key), args.tenant, _scopes(args))
    print(entry_yaml(entry), end="")
    return 0
