"""Shared fixtures: fake backends and a real router, all on 127.0.0.1 ephemeral ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from prefix_router.settings import Settings

from fakebackend import FakeBackend
from routerkit import RunningRouter, start_router


@pytest.fixture
async def fake_backends() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeBackend] = []

    async def make(n: int, **kwargs: Any) -> list[FakeBackend]:
        out = []
        for _ in range(n):
            backend = FakeBackend(name=f"b{len(started)}", **kwargs)
            await backend.start()
            started.append(backend)
            out.append(backend)
        return out

    yield make
    for backend in started:
        await backend.stop()


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Any]]:
    running: list[RunningRouter] = []

    async def make(settings: Settings) -> RunningRouter:
        r = await start_router(settings)
        running.append(r)
        return r

    yield make
    for r in running:
        await r.stop()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c
