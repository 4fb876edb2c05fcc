"""Which engine a ``StoreSettings`` names: ``url`` (``postgresql://...``) is PostgreSQL, else the SQLite
file at ``path``. The daemon, ``config check`` and the commands open stores only through here.

psycopg is imported only when a URL is configured: a daemon on SQLite never loads it.
"""

from __future__ import annotations

from pathlib import Path

from proxy.accounts.sqlite import inspect_store, open_store
from proxy.accounts.store import Store
from proxy.settings import StoreSettings


def where(settings: StoreSettings) -> str:
    """The store for messages: the file, or the URL without its password."""
    if settings.url is not None:
        from proxy.accounts.postgres import display_url

        return display_url(settings.url)
    return settings.path


def open_configured_store(
    settings: StoreSettings, *, daemon: bool = False, create: bool = True, read_only: bool = False
) -> Store:
    """Open (and migrate) the store. ``daemon``: as the serving daemon (SQLite: take the file's daemon
    lock; PostgreSQL shares one database between replicas, so there is none). ``create``: SQLite only,
    whether an absent file is made (a database is made by its administrator, and initialised here).
    ``read_only``: SQLite only, for the commands that only read (``usage``, ``keys list``): checked,
    never written (a full disk does not stop them); a database server has no such failure to avoid.
    Raises ``StoreError``."""
    if settings.url is not None:
        from proxy.accounts.postgres import open_postgres

        return open_postgres(settings.url)
    return open_store(
        Path(settings.path), daemon=daemon, create=create and not read_only, read_only=read_only
    )


def inspect_configured_store(settings: StoreSettings) -> str:
    """What ``config check`` says, changing nothing; ``StoreError`` for a store ``serve`` would refuse."""
    if settings.url is not None:
        from proxy.accounts.postgres import inspect_postgres

        return inspect_postgres(settings.url)
    return inspect_store(settings.path)
