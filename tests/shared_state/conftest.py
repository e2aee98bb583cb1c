"""A real redis-server per test, on a 127.0.0.1 ephemeral port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from redisserver import RedisServer, started_redis


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = started_redis()
    yield server
    server.close()
