"""Shared fixtures: fake backends and a real router, all on 127.0.0.1 ephemeral ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from hypothesis import settings as hypothesis_settings

from prefix_router.settings import Settings

from fakebackend import FakeBackend
from rawbackend import RawBackend, Script, Start
from routerkit import RunningRouter, eventually, router_settings, start_router

# Properties are about values, not speed: on a shared, loaded machine one example can take far over
# hypothesis's 200 ms deadline (seen: 638 ms for a pure function that takes 2 ms), which fails a
# correct test. Speed is measured in benchmarks/.
hypothesis_settings.register_profile("shared-machine", deadline=None)
hypothesis_settings.load_profile("shared-machine")


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


@pytest.fixture
async def raw(router: Callable[..., Any]) -> AsyncIterator[Start]:
    """start(script, idle_close_s=None, **router_sections) -> (backend, router), the router's
    start-up health probe already answered so it never races a test's first request."""
    started: list[RawBackend] = []

    async def start(
        script: Script, idle_close_s: float | None = None, **sections: dict[str, Any]
    ) -> tuple[RawBackend, RunningRouter]:
        backend = RawBackend(script, idle_close_s)
        await backend.start()
        started.append(backend)
        r = await router(router_settings([backend.url], **sections))
        await eventually(lambda: backend.health_probes >= 1)
        await eventually(lambda: backend.open == 0)
        return backend, r

    yield start
    for backend in started:
        await backend.stop()
