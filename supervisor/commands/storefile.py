"""The accounts store named by a configuration, for the ``keys`` and ``usage`` commands.

Only the ``store`` and ``tenants`` sections are read (``load_sections``), so the commands run where the
daemon's other ``${VAR}``s are not set. The store is opened as a command, not as the daemon: no daemon
lock, so they run beside a serving daemon (SQLite's WAL; PostgreSQL serves many clients anyway), and
what they change is in force there (on every replica, with PostgreSQL) within a second.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from proxy.accounts.engines import open_configured_store
from proxy.accounts.store import Store, StoreError
from supervisor.config.load import load_sections, resolve_config_path, served_names
from supervisor.config.proxy_settings import store_settings
from supervisor.config.schema import Config
from supervisor.errors import Misconfigured


@dataclass(frozen=True)
class Configured:
    source: Path | None  # the config file; None: the embedded default (which has no store)
    config: Config

    @property
    def store_path(self) -> Path | None:
        """The SQLite file; None without a store or with a PostgreSQL one (``has_store`` says which)."""
        settings = store_settings(self.config.store)
        return Path(settings.path) if settings is not None and settings.url is None else None

    @property
    def has_store(self) -> bool:
        return self.config.store is not None

    @property
    def name(self) -> str:
        return str(self.source) if self.source is not None else "the embedded default configuration"

    def tenants(self) -> list[str]:
        return [t.name for t in self.config.tenants]

    def served(self) -> tuple[str, ...]:
        """The names of the models the daemon of this configuration serves (what ``POST /admin/keys``
        checks a key's models against)."""
        return served_names(self.source)


def configured(args: argparse.Namespace) -> Configured:
    source = resolve_config_path(getattr(args, "config", None))
    return Configured(source, load_sections(source, ("store", "tenants")))


def open_configured(conf: Configured, *, create: bool, read_only: bool = False) -> Store:
    """The configuration's store, as ``serve`` would open it (the same checks): a store that is corrupt,
    cut short, foreign, newer or unreadable is a clear exit 2 naming the file. ``read_only`` for the
    commands that only read."""
    settings = store_settings(conf.config.store)
    if settings is None:
        raise Misconfigured(
            f"{conf.name}: no store configured (add 'store: {{}}' for the default file, or "
            "store.path, or store.url for PostgreSQL); without one, keys live in the configuration's "
            "keys: list"
        )
    try:
        return open_configured_store(settings, create=create, read_only=read_only)
    except StoreError as exc:
        raise Misconfigured(str(exc)) from exc
