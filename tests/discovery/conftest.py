"""Fixtures of the discovery tests: a fake DNS server and a fake Kubernetes API, each on a 127.0.0.1
ephemeral port and torn down after the test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from discovery_fakes import PODS_PATH, SLICES_PATH, FakeDnsServer, FakeEndpointSliceApi


@pytest.fixture
async def dns_server() -> AsyncIterator[FakeDnsServer]:
    loop = asyncio.get_running_loop()
    _, server = await loop.create_datagram_endpoint(FakeDnsServer, local_addr=("127.0.0.1", 0))
    yield server
    server.close()


@pytest.fixture
async def k8s_api() -> AsyncIterator[FakeEndpointSliceApi]:
    """The fake API server; its URL (for discovery.k8s_api_url) is `k8s_api.url`."""
    fake = FakeEndpointSliceApi()
    app = web.Application()
    app.router.add_get(SLICES_PATH, fake.handle)
    app.router.add_get(PODS_PATH, fake.handle_pods)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield fake
    await runner.cleanup()
