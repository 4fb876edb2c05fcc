"""``llamagate usage``: what tenants and keys used, from the store's hourly rollup of the usage ledger.

Sums of prompt, cached and completion tokens and of requests, per tenant and by hour, UTC day, model or
key; ``--since`` counts from the start of its hour (the rollup's grain). Read from the store file beside a
running daemon; the last second or so of requests is still on its way there (the ledger writes in
batches).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time

from proxy.accounts.report import (
    check_key_id,
    check_tenant_name,
    usage_columns,
    usage_record,
    usage_report,
    usage_total,
)
from proxy.accounts.store import StoreError
from supervisor.commands.config import add_config_argument
from supervisor.commands.keys import print_table
from supervisor.commands.storefile import configured, open_configured
from supervisor.commands.timespec import parse_when
from supervisor.errors import Misconfigured, UsageError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("usage", help="tokens and requests by tenant, hour, day, model or key")
    parser.add_argument("--tenant", help="only this tenant")
    parser.add_argument("--key", metavar="ID", help="only this key (its id)")
    parser.add_argument(
        "--since",
        metavar="WHEN",
        help="from this date or time (2026-12-01, 2026-12-01T10:00; UTC unless it has an offset) or this "
        "long ago (7d, 12h); default: everything kept",
    )
    parser.add_argument(
        "--by", choices=("tenant", "hour", "day", "model", "key"), default="tenant", help="one row per..."
    )
    parser.add_argument("--format", choices=("table", "json", "csv"), default="table")
    add_config_argument(parser)
    parser.set_defaults(func=_usage)


def _usage(args: argparse.Namespace) -> int:
    since = parse_when("--since", args.since, time.time()) if args.since else None
    for flag, check, value in (
        ("--tenant", check_tenant_name, args.tenant),
        ("--key", check_key_id, args.key),
    ):
        if value:
            try:
                check(value)
            except ValueError as exc:
                raise UsageError(f"{flag} {value[:40]!r}: {exc}") from None
    conf = configured(args)
    store = open_configured(conf, create=False, read_only=True)
    try:
        rows = store.usage(by=args.by, tenant=args.tenant, key_id=args.key, since=since)
    except StoreError as exc:
        raise Misconfigured(str(exc)) from exc
    finally:
        store.close()
    if args.format == "json":
        print(json.dumps(usage_report(rows, args.by, since), indent=2))
        return 0
    records = [usage_record(r, args.by) for r in rows]
    total = usage_total(rows)
    if args.format == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=usage_columns(args.by), lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
    else:
        header = usage_columns(args.by)
        print_table([h.upper() for h in header], [[r[h] for h in header] for r in records])
        print(
            f"total: {total['requests']} requests, {total['total_tokens']} tokens "
            f"({total['prompt_tokens']} prompt, {total['cached_tokens']} of them cached; "
            f"{total['completion_tokens']} completion)"
        )
    return 0
