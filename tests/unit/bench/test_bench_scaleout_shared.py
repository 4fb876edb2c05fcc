"""``llamagate bench scaleout --compare limits`` on the operator's servers
(``supervisor.bench.shared_state``): the usage errors when ``--redis-url`` or ``--store-url`` is missing or
not a URL of its kind, and, against a real redis-server and PostgreSQL from tests/helpers, that the run
writes only under its own tenant and in its own database and takes both back, and that a server refusing
at the start is named."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import redis

from supervisor.bench.shared_state import (
    database_name,
    database_url,
    display_redis,
    redis_keys,
    run_tenant,
    shared_state,
)
from supervisor.child.spawn import free_port
from supervisor.cli import main
from supervisor.errors import UsageError
from supervisor.progress import NullProgress
from tests.helpers.postgres_server import Postgres
from tests.helpers.redis_server import RedisServer

REDIS = "redis://127.0.0.1:6379/0"
STORE = "postgresql://bench@127.0.0.1:5432/postgres"
needs_servers = pytest.mark.needs_tool("redis-server", "initdb", "postgres")

# -- usage -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--compare limits needs --redis-url URL and --store-url URL"),
        (["--store-url", STORE], "--compare limits needs --redis-url URL:"),
        (["--redis-url", REDIS], "--compare limits needs --store-url URL:"),
        (["--redis-url", "127.0.0.1:6379", "--store-url", STORE], "--redis-url: '127.0.0.1:6379' is not"),
        (
            ["--redis-url", "http://h:6379", "--store-url", STORE],
            "--redis-url: 'http://h:6379' is not a redis",
        ),
        (
            ["--redis-url", REDIS, "--store-url", "mysql://h/db"],
            "--store-url: 'mysql://h/db' is not a postgres",
        ),
    ],
)
def test_compare_limits_needs_both_urls(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "scaleout", "--compare", "limits", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_the_urls_are_refused_without_compare_limits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scaleout", "--redis-url", REDIS, "--store-url", STORE]) == 2
    assert "--redis-url and --store-url: only with --compare limits" in capsys.readouterr().err


def test_the_help_says_what_is_written_where(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scaleout", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "llamagate:{scaleout-RUN}:*" in text and "llamagate_scaleout_RUN" in text
    assert "deleted at the end" in text and "dropped at the end" in text


def test_the_runs_database_keeps_the_rest_of_the_url() -> None:
    socket = "postgresql:///postgres?host=/var/run/postgresql"
    assert (
        database_url(socket, "llamagate_scaleout_1")
        == "postgresql:///llamagate_scaleout_1?host=/var/run/postgresql"
    )
    tcp = "postgresql://gate:s3cret@db.example:6432/accounts?sslmode=require"
    assert database_url(tcp, "x") == "postgresql://gate:s3cret@db.example:6432/x?sslmode=require"
    assert database_url("postgres://db.example", "x") == "postgres://db.example/x"
    assert display_redis("rediss://gate:s3cret@cache:6380/15") == "rediss://gate@cache:6380/15"
    assert display_redis("redis://:s3cret@cache/0") == "redis://cache/0"


# -- on real servers ---------------------------------------------------------------------------------


def _databases(server: Postgres) -> set[str]:
    with psycopg.connect(server.url()) as conn:
        return {row[0] for row in conn.execute("SELECT datname FROM pg_database")}


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        client.close()


@needs_servers
def test_the_run_writes_under_its_own_tenant_and_database_and_takes_both_back(
    redis_server: RedisServer, redis_client: redis.Redis, postgres_server: Postgres
) -> None:
    # Another tenant's lease (a production set sharing the Redis) and another database on the server.
    redis_client.zadd("llamagate:{bench}:lease:m", {"r1#0": 1})
    other = postgres_server.create_database("other")
    tenant = run_tenant()
    before = _databases(postgres_server)
    with shared_state(redis_server.url, postgres_server.url(), tenant, 3, NullProgress()) as state:
        assert state.overrides["cluster"] == {
            "redis_url": redis_server.url,
            "replicas": 3,
            "on_redis_error": "refuse",
        }
        store_url = state.overrides["store"]["url"]
        assert store_url == postgres_server.url(database_name(tenant))
        assert _databases(postgres_server) == before | {database_name(tenant)}
        with psycopg.connect(store_url, autocommit=True) as conn:  # a replica's ledger, in the run's database
            conn.execute("CREATE TABLE usage (n integer)")
        # A replica's keys for the run's tenant: a lease group and a waiting line.
        redis_client.zadd(f"llamagate:{{{tenant}}}:lease:m", {"r2#0": 1})
        redis_client.zadd(f"llamagate:{{{tenant}}}:queue:m", {"r3": 1})
        # A session a replica left open: the drop ends it (WITH FORCE) rather than failing.
        held = psycopg.connect(store_url)
    with held, pytest.raises(psycopg.OperationalError):
        held.execute("SELECT 1")
    assert state.record["left_behind"] == []
    assert state.record["redis_keys"] == redis_keys(tenant) == f"llamagate:{{{tenant}}}:*"
    assert redis_client.keys("*") == [b"llamagate:{bench}:lease:m"]
    assert _databases(postgres_server) == before
    assert other.rsplit("/", 1)[1] in before


@needs_servers
def test_what_could_not_be_taken_back_is_listed(redis_server: RedisServer, postgres_server: Postgres) -> None:
    tenant = run_tenant()
    before = _databases(postgres_server)
    with shared_state(redis_server.url, postgres_server.url(), tenant, 2, NullProgress()) as state:
        redis_server.kill()  # gone before the end: its keys cannot be deleted (they expire by themselves)
    [left] = state.record["left_behind"]
    assert left.startswith(f"keys llamagate:{{{tenant}}}:* in redis://127.0.0.1:{redis_server.port}/0")
    assert "expire within 2 x cluster.lease_ttl_s" in left
    assert _databases(postgres_server) == before  # the database was still dropped


@needs_servers
def test_a_redis_that_does_not_answer_is_named_and_nothing_is_made(postgres_server: Postgres) -> None:
    before = _databases(postgres_server)
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    with (
        pytest.raises(UsageError, match=r"--redis-url redis://127\.0\.0\.1:\d+/0: Redis did not") as info,
        shared_state(url, postgres_server.url(), run_tenant(), 2, NullProgress()),
    ):
        pytest.fail("entered")
    assert "s3cret" not in str(info.value)
    assert _databases(postgres_server) == before


@needs_servers
def test_a_store_that_refuses_is_named_with_what_the_user_needs(redis_server: RedisServer) -> None:
    url = f"postgresql://gate:s3cret@127.0.0.1:{free_port()}/postgres"
    with (
        pytest.raises(
            UsageError, match=r"--store-url postgresql://gate@127\.0\.0\.1:\d+/postgres: .*CREATEDB"
        ) as info,
        shared_state(redis_server.url, url, run_tenant(), 2, NullProgress()),
    ):
        pytest.fail("entered")
    assert "s3cret" not in str(info.value)
