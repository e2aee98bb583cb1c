"""Draining a backend, SIGTERM drain of the router process, health ejection and recovery."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import aiohttp
import httpx

from fakebackend import Reply
from loopback import free_port
from processes import clean_env, launch_router
from routerkit import eventually, router_settings, start_side_app

CHAT = "/v1/chat/completions"


def chat(i: int) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": f"prefix {i} " * 10}]}


async def test_admin_drain_finishes_inflight_then_leaves_ring_without_moving_other_keys(
    fake_backends, router, client
) -> None:
    backends = await fake_backends(4)
    r = await router(router_settings(backends, server={"admin_token": "tok"}))
    server, task, port = await start_side_app(r.app.admin_app, r.app.settings)
    try:
        before = {}
        for i in range(40):
            resp = await client.post(f"{r.url}{CHAT}", json=chat(i))
            before[i] = resp.headers["x-prefix-router-backend"]
        victim = backends[0]
        gate = asyncio.Event()
        victim.gate = gate
        held = next(i for i, url in before.items() if url == victim.url)
        inflight = asyncio.create_task(client.post(f"{r.url}{CHAT}", json=chat(held)))
        await eventually(lambda: victim.active == 1)

        admin = f"http://127.0.0.1:{port}"
        denied = await client.post(f"{admin}/admin/backends/drain", json={"url": victim.url})
        assert denied.status_code == 401
        ok = await client.post(
            f"{admin}/admin/backends/drain", json={"url": victim.url}, headers={"authorization": "Bearer tok"}
        )
        assert ok.status_code == 200
        listing = (
            await client.get(f"{admin}/admin/backends", headers={"authorization": "Bearer tok"})
        ).json()
        assert {b["url"]: b["state"] for b in listing["backends"]}[victim.url] == "draining"

        after = {}
        for i in range(40):
            resp = await client.post(f"{r.url}{CHAT}", json=chat(i))
            after[i] = resp.headers["x-prefix-router-backend"]
        assert victim.url not in after.values(), "a draining backend takes no new requests"
        assert all(after[i] == before[i] for i in before if before[i] != victim.url), "other keys stay"

        assert victim.url in r.app.backends.ring.members, "still on the ring while a request is in flight"
        gate.set()
        assert (await inflight).status_code == 200, "the in-flight request finishes"
        await eventually(lambda: victim.url not in r.app.backends.ring.members)
    finally:
        server.should_exit = True
        await task


async def test_active_probes_eject_and_bring_back_gradually(fake_backends, router, client) -> None:
    backends = await fake_backends(2)
    r = await router(
        router_settings(
            backends,
            health={
                "interval_s": 0.05,
                "unhealthy_threshold": 2,
                "healthy_threshold": 2,
                "slow_start_s": 0.5,
            },
        )
    )
    sick = backends[0]
    sick.health_status = 500
    await eventually(lambda: r.app.backends.get(sick.url).state.value == "ejected")
    assert (await client.get(f"{r.url}/readyz")).status_code == 200  # the other one is healthy
    sick.health_status = 200
    await eventually(lambda: r.app.backends.get(sick.url).state.value == "healthy")
    assert r.app.backends.get(sick.url).recovered_at is not None


async def test_slow_health_does_not_eject_a_backend_that_serves(fake_backends, router, client) -> None:
    backends = await fake_backends(1, health_delay_s=1.0)
    r = await router(
        router_settings(backends, health={"interval_s": 0.05, "timeout_s": 0.05, "unhealthy_threshold": 2})
    )
    for i in range(30):
        resp = await client.post(f"{r.url}{CHAT}", json=chat(i))
        assert resp.status_code == 200
        await asyncio.sleep(0.02)
    assert r.app.backends.get(backends[0].url).state.value == "healthy"


async def test_shared_fault_never_ejects_the_whole_fleet(fake_backends, router, client) -> None:
    backends = await fake_backends(4)
    r = await router(router_settings(backends, health={"interval_s": 0.05, "unhealthy_threshold": 1}))
    for b in backends:
        b.health_status = 503
    await eventually(lambda: r.app.backends.all_ejected_override)
    # Still routing, to the least-bad backends, and saying so in metrics.
    resp = await client.post(f"{r.url}{CHAT}", json=chat(1))
    assert resp.status_code == 200
    text = (await client.get(f"{r.url}/metrics")).text
    assert "prefix_router_ejection_cap_active 1.0" in text
    assert r.app.backends.candidates.ids, "some backends stay candidates"


async def test_retry_budget_bounds_amplification(fake_backends, router) -> None:
    backends = await fake_backends(3, script=Reply(503))
    r = await router(router_settings(backends, upstream={"retry_budget_ratio": 0.0, "retry_budget_min": 1}))
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> int:
            async with s.post(f"{r.url}{CHAT}", json=chat(i)) as resp:
                return resp.status

        statuses = await asyncio.gather(*(one(i) for i in range(30)))
    assert set(statuses) == {503}
    attempts = sum(len(b.seen) for b in backends)
    assert attempts < 30 * 3, "the budget refused some retries"
    text = (await httpx.AsyncClient().get(f"{r.url}/metrics")).text
    assert "prefix_router_retry_budget_exhausted_total" in text


async def test_hot_prefix_at_10x_capacity_keeps_every_backend_within_bound(fake_backends, router) -> None:
    backends = await fake_backends(4)
    gate = asyncio.Event()
    for b in backends:
        b.gate = gate
    r = await router(
        router_settings(backends, balancing={"max_inflight": 3, "queue_max": 100, "queue_timeout_s": 10})
    )
    async with aiohttp.ClientSession() as s:

        async def one() -> int:
            async with s.post(f"{r.url}{CHAT}", json=chat(0)) as resp:
                await resp.read()
                return resp.status

        tasks = [asyncio.create_task(one()) for _ in range(30)]
        await eventually(lambda: sum(b.active for b in backends) == 12)
        await asyncio.sleep(0.1)
        assert max(b.peak_active for b in backends) <= 3
        gate.set()
        statuses = await asyncio.gather(*tasks)
    assert statuses == [200] * 30
    assert max(b.peak_active for b in backends) <= 3


async def test_sigterm_fails_readyz_stops_accepting_and_finishes_streams(fake_backends, tmp_path) -> None:
    backends = await fake_backends(1, chunk_delay_s=0.1)
    env = clean_env(PREFIX_ROUTER_SERVER__DRAIN_TIMEOUT_S="20")
    router = launch_router(
        ["--backend", backends[0].url], tmp_path / "router.log", env=env, metrics_port=free_port()
    )
    port, mport = router.port, router.metrics_port
    try:
        await router.ready(timeout_s=20)
        async with aiohttp.ClientSession() as s:
            assert (await s.get(f"http://127.0.0.1:{mport}/readyz")).status == 200
            streams = [await s.get(f"http://127.0.0.1:{port}/stream?n=20&i={i}") for i in range(3)]
            for resp in streams:
                await resp.content.readuntil(b"\n\n")
            router.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            ready = await s.get(f"http://127.0.0.1:{mport}/readyz")
            assert ready.status == 503, "readiness fails at once"
            try:
                async with aiohttp.ClientSession() as fresh:
                    await fresh.get(f"http://127.0.0.1:{port}/v1/models")
                refused = False
            except aiohttp.ClientConnectionError:
                refused = True
            assert refused, "the listener stops accepting"
            bodies = [await resp.read() for resp in streams]
        for body in bodies:
            assert body.rstrip().endswith(b"data: [DONE]"), "no stream is cut inside the drain window"
            assert Counter(body.split(b"\n\n"))[b""] <= 1
        assert await asyncio.to_thread(router.proc.wait, 20) == 0
    finally:
        router.stop()
