"""The shared set's state for ``llamagate bench scaleout --compare limits``, on the operator's own Redis
(``--redis-url``) and PostgreSQL (``--store-url``): the command starts neither (the launchers the tests
use are in tests/helpers/), so it must not leave its data in them. What it writes where, and takes back:

- **Redis**: the shared set's tenant is named for the run (``scaleout-<8 hex digits>``), and every key a
  replica writes for it is under that tenant's hash tag, ``llamagate:{scaleout-...}:*`` (there is no key
  prefix setting: the tenant is the namespace). No other tenant's keys are read or written. The keys
  expire by themselves within 2 x ``cluster.lease_ttl_s`` (10 s) even if the command is killed; at the
  end it deletes them. (Only a request whose replay killed llama-server twice would add to the
  replicas' shared poison memory, ``llamagate:{poison}:*``, which expires with its cool-down.)
- **PostgreSQL**: a database of the run's own, ``llamagate_scaleout_<8 hex digits>``, created on that
  server (the URL's user needs ``CREATEDB``; the URL's database is only where it connects to create it)
  and dropped at the end with the keys and the ledger the replicas wrote in it.

What it could not take back (a server gone away meanwhile) is listed in ``SharedState.record``'s
``left_behind``, which the command prints and puts in its report.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import psycopg
import redis
from psycopg import sql

from proxy.accounts.postgres import display_url
from supervisor.errors import UsageError
from supervisor.progress import Progress

# The schemes cluster.redis_url and store.url accept (supervisor/config/schema.py).
REDIS_URL = re.compile(r"(rediss?://|unix://)\S+")
STORE_URL = re.compile(r"postgres(ql)?://\S*")
TIMEOUT_S = 5.0
_CREDENTIALS = re.compile(r"://[^@/\s\"]*@")


def run_tenant() -> str:
    """The shared set's tenant for one run: its name is the run's namespace in Redis."""
    return f"scaleout-{uuid.uuid4().hex[:8]}"


def redis_keys(tenant: str) -> str:
    """The pattern of every key the replicas write for ``tenant`` (proxy/cluster/scripts.py)."""
    return f"llamagate:{{{tenant}}}:*"


def database_name(tenant: str) -> str:
    return "llamagate_" + tenant.replace("-", "_")


def check_redis_url(url: str) -> None:
    if not REDIS_URL.fullmatch(url):
        raise UsageError(f"--redis-url: {url!r} is not a redis://, rediss:// or unix:// URL")


def check_store_url(url: str) -> None:
    if not STORE_URL.fullmatch(url):
        raise UsageError(f"--store-url: {url!r} is not a postgresql:// URL")


def display_redis(url: str) -> str:
    """The Redis URL for messages and the report, without its password."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}@" if parts.username else ""
    return f"{parts.scheme}://{user}{host}{parts.path}"


def database_url(url: str, database: str) -> str:
    """``url`` naming ``database`` instead of its own (its query, sslmode or a socket's host, is kept)."""
    parts = urlsplit(url)
    query = f"?{parts.query}" if parts.query else ""
    return f"{parts.scheme}://{parts.netloc}/{database}{query}"


def _said(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else exc.__class__.__name__
    return _CREDENTIALS.sub("://", first)  # a driver may quote the URL back, password included


@dataclass
class SharedState:
    overrides: dict[str, Any]
    # For the report: where the run wrote, and what it could not take back.
    record: dict[str, Any] = field(default_factory=dict)


@contextmanager
def shared_state(
    redis_url: str, store_url: str, tenant: str, replicas: int, progress: Progress
) -> Iterator[SharedState]:
    """Check that the Redis answers and make the run's database, yield the overrides that point the
    shared set at them, and on the way out (after the replicas stopped) delete the tenant's Redis keys
    and drop the database. ``UsageError`` naming the option when either server refuses at the start."""
    stage = "reaching the Redis and the PostgreSQL"
    progress.update(stage, None)
    client = redis.Redis.from_url(redis_url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    database = database_name(tenant)
    record: dict[str, Any] = {
        "redis": display_redis(redis_url),
        "redis_keys": redis_keys(tenant),
        "store": display_url(store_url),
        "database": database,
        "left_behind": [],
    }
    try:
        try:
            client.ping()
        except redis.RedisError as exc:
            raise UsageError(f"--redis-url {record['redis']}: Redis did not answer: {_said(exc)}") from None
        _create_database(store_url, database, record["store"])
        try:
            try:
                progress.done(stage, f"database {database}, Redis keys {record['redis_keys']}")
                overrides = {
                    # refuse: a benchmark whose Redis failed must show it (503s), not quietly go local.
                    "cluster": {"redis_url": redis_url, "replicas": replicas, "on_redis_error": "refuse"},
                    "store": {"url": database_url(store_url, database)},
                }
                yield SharedState(overrides, record)
            finally:
                record["left_behind"] += _drop_database(store_url, database, record["store"])
        finally:
            record["left_behind"] += _delete_keys(client, tenant, record["redis"])
    finally:
        client.close()


def _create_database(url: str, database: str, shown: str) -> None:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=int(TIMEOUT_S)) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    except psycopg.Error as exc:
        raise UsageError(
            f"--store-url {shown}: cannot create the run's database {database} (the URL's user needs"
            f" CREATEDB): {_said(exc)}"
        ) from None


def _drop_database(url: str, database: str, shown: str) -> list[str]:
    # FORCE (PostgreSQL 13+) ends a session a stopped replica may still hold for a moment.
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=int(TIMEOUT_S)) as conn:
            conn.execute(drop)
    except psycopg.Error as exc:
        return [f"database {database} on {shown} ({_said(exc)}): DROP DATABASE {database}"]
    return []


def _delete_keys(client: redis.Redis, tenant: str, shown: str) -> list[str]:
    pattern = redis_keys(tenant)
    try:
        keys = list(client.scan_iter(match=pattern, count=1000))
        for i in range(0, len(keys), 1000):
            client.unlink(*keys[i : i + 1000])
    except redis.RedisError as exc:
        return [f"keys {pattern} in {shown} ({_said(exc)}; they expire within 2 x cluster.lease_ttl_s)"]
    return []
