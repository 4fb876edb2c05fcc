"""Clients of the real redis-server each test gets (``redis_server`` in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from tests.helpers.redis_server import RedisServer


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, socket_timeout=2.0)
    try:
        yield client
    finally:
        await client.aclose()
