"""The shared state of a replica set for ``llamagate bench scaleout --compare limits``: a real redis-server
(the tenants' leases and budget windows) and a real PostgreSQL (keys and the ledger), both started here in
``folder`` and tied to this process, stopped when the block ends. It yields the config overrides that
point every replica at them (the caller sets the tenant's limit for the whole set) and the servers' pids
(for the report: a test checks that nothing outlives the command)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.bench.postgres import start_postgres
from supervisor.bench.redis import start_redis
from supervisor.progress import Progress


@dataclass(frozen=True)
class SharedState:
    overrides: dict[str, Any]
    pids: dict[str, int]


@contextmanager
def shared_state(folder: Path, replicas: int, progress: Progress) -> Iterator[SharedState]:
    progress.update("starting redis-server and PostgreSQL", None)
    started = time.monotonic()
    redis = start_redis(folder / "redis")
    try:
        postgres = start_postgres()
        try:
            progress.done("starting redis-server and PostgreSQL", f"{time.monotonic() - started:.1f} s")
            overrides = {
                # refuse: a benchmark whose Redis failed must show it (503s), not quietly go local.
                "cluster": {"redis_url": redis.url, "replicas": replicas, "on_redis_error": "refuse"},
                "store": {"url": postgres.create_database("scaleout")},
            }
            yield SharedState(overrides, {"redis-server": redis.pid or 0, "postgres": postgres.proc.pid})
        finally:
            postgres.stop()
    finally:
        redis.stop()
