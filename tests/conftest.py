"""Shared fixtures.

Integration tests use the real llama-server built from ``llama-build.lock`` and the real demo model,
both from llamagate's own cache (built/fetched on first use, reused afterwards). Two environment
variables let a developer point at an existing binary or model instead:
``LLAMAGATE_TEST_BINARY`` and ``LLAMAGATE_TEST_MODEL``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.postgres_server import Postgres, start_postgres
from tests.helpers.redis_server import RedisServer

# The needs_tool marker: checked before a test's fixtures (tests/helpers/system.py).
from tests.helpers.system import (
    pytest_runtest_setup,  # noqa: F401
    require_tool,
)

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "llama-build.lock"


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    override = os.environ.get("LLAMAGATE_TEST_BINARY")
    if override:
        return Path(override)
    from supervisor.artifacts.build import ensure_binary
    from supervisor.progress import ConsoleProgress

    return ensure_binary(LOCK, progress=ConsoleProgress()).path


@pytest.fixture(scope="session")
def demo_model() -> Path:
    override = os.environ.get("LLAMAGATE_TEST_MODEL")
    if override:
        return Path(override)
    from supervisor.artifacts.demo_model import ensure_demo_model
    from supervisor.progress import ConsoleProgress

    return ensure_demo_model(progress=ConsoleProgress())


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """Gemma 3 270M, the other demo model: for what needs its traits (no chat template in the GGUF, a
    sliding-window attention)."""
    from supervisor.artifacts.demo_model import GEMMA, ensure_demo_model
    from supervisor.progress import ConsoleProgress

    return ensure_demo_model(progress=ConsoleProgress(), model=GEMMA)


@pytest.fixture(scope="session")
def llama_quantize_binary() -> Path:
    """The lock's llama-quantize from llamagate's own cache, built there (minutes, once) if missing."""
    from supervisor.artifacts.build import ensure_binary
    from supervisor.artifacts.tools import QUANTIZE
    from supervisor.progress import ConsoleProgress

    return ensure_binary(LOCK, progress=ConsoleProgress(), target=QUANTIZE).path


@pytest.fixture(scope="session")
def demo_q8_0(
    llama_quantize_binary: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The demo model derived as Q8_0 (seconds) once per session, into a temporary folder (not the cache),
    with its ``.derived.json`` record beside it."""
    from supervisor.artifacts.quantize import derive
    from supervisor.progress import ConsoleProgress

    out = tmp_path_factory.mktemp("derived") / f"{demo_model.stem}-q8_0.gguf"
    return derive(demo_model, "Q8_0", lock_path=LOCK, progress=ConsoleProgress(), out=out).path


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Postgres]:
    """One private PostgreSQL server for the session (``tests/helpers/postgres_server.py``: tied to this
    process, run as the postgres user when the tests run as root). A test that uses it declares
    ``needs_tool("initdb", "postgres")``, and takes a fresh database from ``postgres_url``."""
    require_tool("initdb")
    require_tool("postgres")
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: Postgres) -> str:
    """A new empty database on the session's server, for one test."""
    return postgres_server.create_database("test")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server on a free port, tied to the test (``tests/helpers/redis_server.py``). A test
    that uses it declares ``needs_tool("redis-server")``."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
