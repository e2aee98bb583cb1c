"""/readyz: ready once a backend has passed a health probe, not merely because one is configured."""

from __future__ import annotations

from routerkit import eventually, free_socket, router_settings


async def test_not_ready_while_the_only_backend_is_unreachable(router, client) -> None:
    sock = free_socket()  # bound, never listening: connections to it are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        r = await router(router_settings([url]))
        answer = await client.get(f"{r.url}/readyz")
        assert answer.status_code == 503
        assert answer.json() == {"status": "no backend has passed a health probe"}
        # The backend is still "healthy" (one failed probe is under unhealthy_threshold), which is what
        # readiness used to go by.
        assert r.app.backends.get(url).state.value == "healthy"
    finally:
        sock.close()


async def test_ready_after_the_first_probe_passes(fake_backends, router, client) -> None:
    (backend,) = await fake_backends(1, health_status=503)
    r = await router(router_settings([backend], health={"interval_s": 0.05, "unhealthy_threshold": 1000}))
    await eventually(lambda: backend.health_probes >= 2)
    assert (await client.get(f"{r.url}/readyz")).status_code == 503
    # It takes requests meanwhile (health never failed it): readiness is about the pod, not routing.
    assert (await client.post(f"{r.url}/v1/chat/completions", json={"messages": []})).status_code == 200
    assert (await client.get(f"{r.url}/readyz")).status_code == 503  # a request served is not a probe
    backend.health_status = 200

    async def ready() -> bool:
        return (await client.get(f"{r.url}/readyz")).status_code == 200

    await eventually(ready)
    assert (await client.get(f"{r.url}/readyz")).json() == {"status": "ready"}
