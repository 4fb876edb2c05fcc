"""``llamagate keys new | list | revoke | rotate | budget | hash``.

With a configuration that has a store (``store:``; ``--config`` or ``$LLAMAGATE_CONFIG``), ``new`` writes
the key into the store and prints it once; the running daemon has it within a second, no reload. Without
one (no configuration at all, or one without ``store:``), ``new`` prints the key once and the YAML lines
to add under ``keys:`` (only the digest goes in the config), as before the store existed; the options a
config key cannot carry (``--expires``, ``--models``, ``--name``, budgets) then need a store.
``list``, ``revoke``, ``rotate`` and ``budget`` work on the store's keys. ``hash`` prints the config
entry for an existing key read from stdin, so the key never appears on a command line or in shell history.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import ParamSpec, TypeVar

from proxy.accounts.issue import check_models, check_name, issue_key, successor
from proxy.accounts.records import KeyRecord
from proxy.accounts.report import check_budget, key_row
from proxy.accounts.store import Store, StoreError
from proxy.auth import key_digest, new_key
from proxy.settings import BudgetSettings, KeyEntry, Scope
from supervisor.commands.config import add_config_argument
from supervisor.commands.storefile import Configured, configured, open_configured
from supervisor.commands.timespec import parse_duration, utc
from supervisor.errors import Misconfigured, UsageError

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KEY = re.compile(r"lg_([0-9a-f]{12})_[A-Za-z0-9_-]{43}")
_KEY_ID = re.compile(r"[0-9a-f]{12}")
_BUDGETS = ("tokens_per_minute", "tokens_per_day", "requests_per_minute")
P = ParamSpec("P")
T = TypeVar("T")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "keys", help="create, list, revoke and rotate API keys (only digests are kept)"
    )
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION")

    new = sub.add_parser(
        "new",
        help="a new key, printed once: into the config's store, or (without one) the lines for keys:",
    )
    new.add_argument("--tenant", required=True, help="tenant the key belongs to (must exist under tenants:)")
    _add_scope_flags(new)
    new.add_argument(
        "--expires", metavar="DURATION", help="the key stops working after this (30d, 12h); store only"
    )
    new.add_argument(
        "--models", metavar="A,B", help="models this key may use (default: its tenant's); store only"
    )
    new.add_argument("--name", default="", help="a note to tell keys apart in keys list; store only")
    _add_budget_flags(new)
    add_config_argument(new)
    new.set_defaults(func=_new)

    listed = sub.add_parser("list", help="the store's keys: id, tenant, scopes, name, dates (never a digest)")
    listed.add_argument("--format", choices=("table", "json"), default="table")
    add_config_argument(listed)
    listed.set_defaults(func=_list)

    revoke = sub.add_parser("revoke", help="revoke a store key now (the daemon refuses it within a second)")
    revoke.add_argument("key_id", metavar="ID")
    add_config_argument(revoke)
    revoke.set_defaults(func=_revoke)

    rotate = sub.add_parser("rotate", help="replace a store key by a new one (printed once), same settings")
    rotate.add_argument("key_id", metavar="ID")
    rotate.add_argument(
        "--grace",
        metavar="DURATION",
        help="the old key keeps working this long (e.g. 1h), so clients can move; default: revoked now",
    )
    add_config_argument(rotate)
    rotate.set_defaults(func=_rotate)

    budget = sub.add_parser("budget", help="change a store key's budgets (the counts so far are kept)")
    budget.add_argument("key_id", metavar="ID")
    _add_budget_flags(budget, unset=True)
    add_config_argument(budget)
    budget.set_defaults(func=_budget)

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


def _add_budget_flags(parser: argparse.ArgumentParser, *, unset: bool = False) -> None:
    extra = "; 'none' removes it" if unset else "; store only"
    for budget in _BUDGETS:
        parser.add_argument(
            f"--{budget.replace('_', '-')}",
            dest=budget,
            metavar="N",
            help=f"this key's {budget.replace('_', ' ')} budget{extra}",
        )


def _scopes(args: argparse.Namespace) -> frozenset[Scope]:
    if args.admin_only:
        return frozenset({"admin"})
    return frozenset({"inference", "admin"}) if args.admin else frozenset({"inference"})


def _check_tenant(name: str) -> None:
    if not _TENANT.fullmatch(name):
        raise UsageError(f"--tenant {name!r}: use letters, digits, '_', '.' or '-' (at most 64)")


def _check_key_id(key_id: str) -> None:
    if not _KEY_ID.fullmatch(key_id):
        raise UsageError(f"{key_id!r}: a key id is 12 lowercase hex digits (the id column of keys list)")


def _limit(flag: str, text: str | None, *, unset: bool) -> int | None:
    if text is None or (unset and text.lower() == "none"):
        return None
    try:
        return check_budget(int(text) if text.strip().isdigit() else 0)
    except ValueError as exc:
        raise UsageError(f"{flag} {text[:40]!r}: {exc}" + (", or none" if unset else "")) from None


def _budgets(args: argparse.Namespace, *, unset: bool = False) -> BudgetSettings:
    values = {b: _limit(f"--{b.replace('_', '-')}", getattr(args, b), unset=unset) for b in _BUDGETS}
    return BudgetSettings(**values)


def _models(text: str | None, conf: Configured) -> tuple[str, ...]:
    """The key's models: names the configuration's daemon serves, as ``POST /admin/keys`` requires."""
    if text is None:
        return ()
    models = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in models if not _MODEL.fullmatch(m)]
    if bad or not models:
        raise UsageError(f"--models {text!r}: model names separated by commas (e.g. gemma-3-270m,qwen)")
    try:
        return check_models(models, conf.served())
    except ValueError as exc:
        raise UsageError(f"--models {text!r}: {exc}") from None


def _name(text: str) -> str:
    try:
        return check_name(text)
    except ValueError as exc:
        raise UsageError(f"--name: {exc}") from None


def entry_yaml(entry: KeyEntry) -> str:
    scopes = ", ".join(sorted(entry.scopes))
    return (
        f'  - id: "{entry.key_id}"\n'
        f'    digest: "{entry.digest}"\n'
        f"    tenant: {entry.tenant}\n"
        f"    scopes: [{scopes}]\n"
    )


def _store_only_flags(args: argparse.Namespace) -> list[str]:
    flags = [f for f, v in (("--expires", args.expires), ("--models", args.models)) if v is not None]
    flags += ["--name"] if args.name else []
    flags += [f"--{b.replace('_', '-')}" for b in _BUDGETS if getattr(args, b) is not None]
    return flags


def _known_tenant(conf: Configured, tenant: str) -> None:
    names = conf.tenants()
    if tenant not in names:
        raise Misconfigured(
            f"--tenant {tenant}: {conf.name} has no such tenant (tenants: {', '.join(names)})"
        )


def _new(args: argparse.Namespace) -> int:
    _check_tenant(args.tenant)
    conf = configured(args)
    if not conf.has_store:
        flags = _store_only_flags(args)
        if flags:
            raise UsageError(
                f"{', '.join(flags)}: only for keys in a store, and {conf.name} has none "
                "(add 'store: {}' to the configuration, and give it with --config)"
            )
        key, entry = new_key(args.tenant, _scopes(args))
        print(f"API key (shown once, store it now): {key}")
        print()
        print("Add under keys: in the config, then reload (SIGHUP) or restart:")
        print(entry_yaml(entry), end="")
        return 0
    _known_tenant(conf, args.tenant)
    now = time.time()
    expires = now + parse_duration("--expires", args.expires) if args.expires else None
    key, record = issue_key(
        args.tenant,
        _scopes(args),
        now,
        name=_name(args.name),
        models=_models(args.models, conf),
        budgets=_budgets(args),
        expires=expires,
    )
    with _store(conf, create=True) as store:
        _call(store.add_key, record)
        where = store.where
    print(f"API key (shown once, store it now): {key}")
    print()
    print(f"Stored in {where} as id {record.key_id} (tenant {record.tenant}, scopes {_scope_text(record)}).")
    print("A running daemon with this store accepts it within a second; no reload needed.")
    return 0


@contextlib.contextmanager
def _store(conf: Configured, *, create: bool, read_only: bool = False) -> Iterator[Store]:
    store = open_configured(conf, create=create, read_only=read_only)
    try:
        yield store
    finally:
        store.close()


def _call(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """A store call; its ``StoreError`` (a full disk, a key id taken) is a clear exit 2."""
    try:
        return call(*args, **kwargs)
    except StoreError as exc:
        raise Misconfigured(str(exc)) from exc


def _scope_text(record: KeyRecord) -> str:
    return ",".join(sorted(record.scopes))


def _rows(keys: Sequence[KeyRecord], now: float) -> list[dict[str, object]]:
    return [key_row(k, now) for k in keys]


def _list(args: argparse.Namespace) -> int:
    with _store(configured(args), create=False, read_only=True) as store:
        keys = _call(store.list_keys)
    now = time.time()
    if args.format == "json":
        print(json.dumps({"keys": _rows(keys, now)}, indent=2))
        return 0
    header = ("ID", "TENANT", "SCOPES", "NAME", "CREATED (UTC)", "EXPIRES", "LAST USED", "STATUS")
    table = [
        (
            k.key_id,
            k.tenant,
            _scope_text(k),
            k.name,
            utc(k.created),
            utc(k.expires) or "-",
            utc(k.last_used) or "-",
            k.status(now),
        )
        for k in keys
    ]
    print_table(header, table)
    return 0


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _revoke(args: argparse.Namespace) -> int:
    _check_key_id(args.key_id)
    now = time.time()
    with _store(configured(args), create=False) as store:
        before = _call(store.get_key, args.key_id)
        if before is None:
            raise UsageError(f"no key with id {args.key_id} in {store.where}")
        after = _call(store.revoke_key, args.key_id, now)
    if before.revoked is not None:
        print(f"key {args.key_id} (tenant {before.tenant}) was already revoked at {utc(before.revoked)} UTC")
        return 0
    assert after is not None
    print(f"revoked key {args.key_id} (tenant {after.tenant}); a running daemon refuses it within a second")
    return 0


def _rotate(args: argparse.Namespace) -> int:
    _check_key_id(args.key_id)
    grace = parse_duration("--grace", args.grace) if args.grace else 0.0
    now = time.time()
    with _store(configured(args), create=False) as store:
        old = _call(store.get_key, args.key_id)
        if old is None:
            raise UsageError(f"no key with id {args.key_id} in {store.where}")
        key, record = successor(old, now)
        _call(store.replace_key, args.key_id, record, now, grace)
    print(f"API key (shown once, store it now): {key}")
    print()
    print(f"New key {record.key_id} replaces {args.key_id} (tenant {record.tenant}, same scopes and limits).")
    if grace:
        print(f"The old key works until {utc(now + grace)} UTC, then is refused.")
    else:
        print("The old key is revoked; a running daemon refuses it within a second.")
    return 0


def _budget(args: argparse.Namespace) -> int:
    _check_key_id(args.key_id)
    given = {b: getattr(args, b) for b in _BUDGETS if getattr(args, b) is not None}
    if not given:
        raise UsageError("give at least one of --tokens-per-minute, --tokens-per-day, --requests-per-minute")
    with _store(configured(args), create=False) as store:
        old = _call(store.get_key, args.key_id)
        if old is None:
            raise UsageError(f"no key with id {args.key_id} in {store.where}")
        new = _budgets(args, unset=True)
        merged = BudgetSettings(
            **{b: (getattr(new, b) if b in given else getattr(old.budgets, b)) for b in _BUDGETS}
        )
        _call(store.set_key_budgets, args.key_id, merged)
    shown = ", ".join(f"{b} {getattr(merged, b) or 'none'}" for b in _BUDGETS)
    print(f"key {args.key_id}: {shown}; in force within a second, the counts so far are kept")
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
