"""Each attempt's placement is released on every exit path, and retries follow the retry policy,
through a real router in front of real backends."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from routerkit import RunningRouter, eventually, free_socket, router_settings

CHAT = "/v1/chat/completions"
# A streaming request with a prefix to prefill: each attempt takes a prefill hold as well as a lease.
STREAMING = {
    "model": "m",
    "stream": True,
    "messages": [
        {"role": "system", "content": "a system prompt long enough for several blocks " * 30},
        {"role": "user", "content": "q"},
    ],
}
# The same on the native path (the fake backend streams what is POSTed to /stream).
NATIVE = {"stream": True, "prompt": "a prompt long enough for several blocks " * 30}


def everything_given_back(r: RunningRouter) -> bool:
    holds = r.app.placer.holds
    return (
        sum(r.inflight().values()) == 0
        and r.app.picker.prefilling == 0
        and holds is not None
        and len(holds) == 0
        and r.app.proxy.active_requests == 0
    )


def metric(r: RunningRouter, name: str, **labels: str) -> float | None:
    return r.app.registry.get_sample_value(name, labels)


async def streamed(r: RunningRouter, s: aiohttp.ClientSession) -> int:
    async with s.post(f"{r.url}/stream?n=3", json=NATIVE) as resp:
        await resp.read()
        return resp.status


async def gone_mid_stream(r: RunningRouter, s: aiohttp.ClientSession) -> int:
    resp = await s.post(f"{r.url}/stream?n=100000&delay=0.02", json=NATIVE)
    await resp.content.readuntil(b"\n\n")
    resp.close()
    return resp.status


async def idle_mid_stream(r: RunningRouter, s: aiohttp.ClientSession) -> int:
    async with s.post(f"{r.url}/stream?n=10&hang_after=1", json=NATIVE) as resp:
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()  # the router ends a stream that went idle: a truncated body
        return resp.status


async def refused_everywhere(r: RunningRouter, s: aiohttp.ClientSession) -> int:
    async with s.post(f"{r.url}/status/503", json=NATIVE) as resp:
        return resp.status


async def chat(r: RunningRouter, s: aiohttp.ClientSession) -> int:
    async with s.post(f"{r.url}{CHAT}", json=STREAMING) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize(
    ("exchange", "upstream", "status"),
    [
        pytest.param(streamed, {}, 200, id="streamed-to-the-end"),
        pytest.param(gone_mid_stream, {}, 200, id="client-gone-mid-stream"),
        pytest.param(idle_mid_stream, {"stream_idle_timeout_s": 0.2}, 200, id="backend-idle-mid-stream"),
        pytest.param(refused_everywhere, {}, 503, id="503-retried-then-passed-through"),
    ],
)
async def test_every_exit_path_gives_back_lease_and_prefill_hold(
    fake_backends: Any, router: Any, exchange: Any, upstream: dict[str, float], status: int
) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends, upstream=upstream))
    async with aiohttp.ClientSession() as s:
        assert await exchange(r, s) == status
    await eventually(lambda: everything_given_back(r))


async def test_a_first_byte_timeout_gives_back_lease_and_hold(fake_backends: Any, router: Any) -> None:
    gate = asyncio.Event()  # never opened: the backend answers nothing
    backends = await fake_backends(1, gate=gate)
    r = await router(router_settings(backends, upstream={"first_byte_timeout_s": 0.3}))
    async with aiohttp.ClientSession() as s:
        request = asyncio.create_task(chat(r, s))
        await eventually(lambda: backends[0].active == 1)
        holds = r.app.placer.holds
        assert holds is not None and len(holds) == 1 and sum(r.inflight().values()) == 1
        assert await request == 504
    await eventually(lambda: everything_given_back(r))


async def test_a_connect_failure_on_the_only_backend_is_not_counted_as_a_retry(router: Any) -> None:
    dead = free_socket()  # bound, never listening: connections are refused
    try:
        r = await router(router_settings([f"http://127.0.0.1:{dead.getsockname()[1]}"]))
        async with aiohttp.ClientSession() as s:
            assert await chat(r, s) == 502
        await eventually(lambda: everything_given_back(r))
        assert metric(r, "prefix_router_retries_total", reason="connect") == 0.0
        assert metric(r, "prefix_router_retry_budget_exhausted_total") == 0.0
    finally:
        dead.close()


async def test_attempts_stop_at_max_attempts_with_backends_left(fake_backends: Any, router: Any) -> None:
    backends = await fake_backends(4)
    r = await router(router_settings(backends, upstream={"max_attempts": 3}))
    async with aiohttp.ClientSession() as s, s.post(f"{r.url}/status/503", json=NATIVE) as resp:
        assert resp.status == 503
    assert sum(len(b.seen) for b in backends) == 3
    assert len({b.name for b in backends if b.seen}) == 3, "each attempt on another backend"
    assert metric(r, "prefix_router_retries_total", reason="status_503") == 2.0
    await eventually(lambda: everything_given_back(r))


async def test_a_spent_budget_passes_the_503_through_and_says_so(fake_backends: Any, router: Any) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends, upstream={"retry_budget_ratio": 0.0, "retry_budget_min": 0}))
    async with aiohttp.ClientSession() as s, s.post(f"{r.url}/status/503", json=NATIVE) as resp:
        assert resp.status == 503
    assert sum(len(b.seen) for b in backends) == 1
    assert metric(r, "prefix_router_retry_budget_exhausted_total") == 1.0
    await eventually(lambda: everything_given_back(r))
