"""Failover, overflow at max_inflight, overload answers and bad input, against real servers."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from fakebackend import Close, Hang, Reply
from routerkit import eventually, free_socket, router_settings

CHAT = "/v1/chat/completions"


def body(system: str) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}],
    }


async def test_dead_backend_fails_over_to_next_in_walk(fake_backends, router, client) -> None:
    backends = await fake_backends(3)
    dead_sock = free_socket()  # bound, never listening: connections are refused
    dead = f"http://127.0.0.1:{dead_sock.getsockname()[1]}"
    r = await router(router_settings([*backends, dead], health={"unhealthy_threshold": 2}))
    homes = set()
    for i in range(40):
        resp = await client.post(f"{r.url}{CHAT}", json=body(f"prefix {i}"))
        assert resp.status_code == 200, resp.text
        homes.add(resp.headers["x-prefix-router-backend"])
    assert dead not in homes
    text = (await client.get(f"{r.url}/metrics")).text
    assert 'prefix_router_retries_total{reason="connect"}' in text
    assert r.app.backends.get(dead).state.value == "ejected"
    dead_sock.close()


async def test_503_before_first_byte_moves_to_next_backend(fake_backends, router, client) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends))
    backends[0].script = Reply(503)
    for i in range(10):
        resp = await client.post(f"{r.url}{CHAT}", json=body(f"p{i}"))
        assert resp.status_code == 200
        assert resp.headers["x-prefix-router-backend"] == backends[1].url


async def test_all_backends_503_passes_the_last_answer_through(fake_backends, router, client) -> None:
    backends = await fake_backends(2, script=Reply(503))
    r = await router(router_settings(backends))
    resp = await client.post(f"{r.url}{CHAT}", json=body("p"))
    assert resp.status_code == 503
    assert "says 503" in resp.json()["error"]["message"]
    assert sum(len(b.seen) for b in backends) == 2, "one attempt per backend, bounded"


async def test_overflow_at_max_inflight_keeps_every_backend_within_bound(fake_backends, router) -> None:
    backends = await fake_backends(3)
    gate = asyncio.Event()
    for b in backends:
        b.gate = gate
    r = await router(
        router_settings(backends, balancing={"max_inflight": 2, "queue_max": 0, "load_factor": 100})
    )
    async with aiohttp.ClientSession() as s:
        hot = body("one hot prefix " * 50)
        tasks = [asyncio.create_task(s.post(f"{r.url}{CHAT}", json=hot)) for _ in range(6)]
        await eventually(lambda: sum(b.active for b in backends) == 6)
        assert max(b.active for b in backends) == 2, "spill-over keeps each backend at max_inflight"
        # A 7th request finds every backend full and no queue: 503 with Retry-After, not a hang.
        async with s.post(f"{r.url}{CHAT}", json=hot) as resp:
            assert resp.status == 503
            assert resp.headers["retry-after"] == "1"
            err = await resp.json()
            assert err["error"]["code"] == "overloaded"
        gate.set()
        for t in tasks:
            resp = await t
            assert resp.status == 200
            resp.release()
    await eventually(lambda: sum(r.inflight().values()) == 0)


async def test_bounded_wait_then_served_when_capacity_frees(fake_backends, router) -> None:
    backends = await fake_backends(1)
    gate = asyncio.Event()
    backends[0].gate = gate
    r = await router(router_settings(backends, balancing={"max_inflight": 1, "queue_timeout_s": 5}))
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(s.post(f"{r.url}{CHAT}", json=body("a")))
        await eventually(lambda: backends[0].active == 1)
        second = asyncio.create_task(s.post(f"{r.url}{CHAT}", json=body("b")))
        await asyncio.sleep(0.1)
        assert backends[0].active == 1 and not second.done(), "the second waits in the bounded queue"
        gate.set()
        assert (await first).status == 200
        assert (await second).status == 200


async def test_a_full_owner_is_waited_for_rather_than_a_spill_to_a_backend_as_busy(
    fake_backends, router
) -> None:
    """Every backend busy: the one whose running requests hold the prefix is waited for (bounded),
    not traded for a cold prefill on another as full; a user sees one queue, not a lost cache."""
    backends = await fake_backends(2)
    # max_inflight 2, load factor 1.25: another backend takes the request only while it is idle.
    r = await router(
        router_settings(backends, balancing={"max_inflight": 2, "queue_timeout_s": 10, "load_floor": 0})
    )
    hot = body("one hot system prompt " * 60)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{r.url}{CHAT}", json=hot) as resp:  # teaches the router where it went
            assert resp.status == 200
            owner = next(b for b in backends if b.name == resp.headers["x-fake-backend"])
        other = next(b for b in backends if b is not owner)
        owner.gate, other.gate = asyncio.Event(), asyncio.Event()
        held = [asyncio.create_task(s.post(f"{r.url}{CHAT}", json=hot)) for _ in range(2)]
        await eventually(lambda: owner.active == 2)
        elsewhere = asyncio.create_task(s.post(f"{r.url}{CHAT}", json=body("another prompt " * 60)))
        await eventually(lambda: other.active == 1)
        waiting = asyncio.create_task(s.post(f"{r.url}{CHAT}", json=hot))
        await asyncio.sleep(0.2)
        assert not waiting.done() and other.active == 1, "waits for its owner, not the busy other"
        owner.gate.set()
        resp = await waiting
        assert resp.status == 200 and resp.headers["x-fake-backend"] == owner.name
        resp.release()
        other.gate.set()
        for t in [*held, elsewhere]:
            (await t).release()
    await eventually(lambda: sum(r.inflight().values()) == 0)


async def test_no_backend_gives_openai_shaped_503(router, client) -> None:
    dead_sock = free_socket()
    dead = f"http://127.0.0.1:{dead_sock.getsockname()[1]}"
    r = await router(router_settings([dead], upstream={"max_attempts": 1}))
    resp = await client.post(f"{r.url}{CHAT}", json=body("p"))
    assert resp.status_code == 502
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    assert err["code"] == "upstream_unavailable"
    text = (await client.get(f"{r.url}/metrics")).text
    assert 'prefix_router_errors_total{code="upstream_unavailable"} 1.0' in text
    dead_sock.close()


def test_every_error_code_is_a_closed_metric_label() -> None:
    from prefix_router.frontend.local_routes import ERROR_TABLE
    from prefix_router.ops.metrics import ROUTER_ERROR_CODES

    assert {code for _, _, code in ERROR_TABLE.values()} <= set(ROUTER_ERROR_CODES)


async def test_backend_closing_without_answer_is_502(fake_backends, router, client) -> None:
    backends = await fake_backends(1, script=Close())
    r = await router(router_settings(backends))
    resp = await client.post(f"{r.url}{CHAT}", json=body("p"))
    assert resp.status_code == 502
    assert resp.json()["error"]["type"] == "server_error"


async def test_first_byte_timeout_is_504(fake_backends, router, client) -> None:
    backends = await fake_backends(1, script=Hang())
    r = await router(router_settings(backends, upstream={"first_byte_timeout_s": 0.3}))
    resp = await client.post(f"{r.url}{CHAT}", json=body("p"))
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "upstream_timeout"
    await asyncio.wait_for(backends[0].cancel_event.wait(), 2)


async def test_body_over_limit_is_413_without_reading_it(fake_backends, router) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"max_body_bytes": 1000}))
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{r.url}{CHAT}", data=b"x" * 5000) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "body_too_large"

        async def chunked():  # no Content-Length: the limit is enforced while reading
            for _ in range(100):
                yield b"y" * 100

        async with s.post(f"{r.url}{CHAT}", data=chunked()) as resp:
            assert resp.status == 413
    assert backends[0].seen == []


BAD_BODIES = [
    b"{not json",
    b"\xff\xfe\xfd garbage",
    b'{"messages": "\\ud800 lone surrogate"}',
    b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"messages": "not a list"}',
    b'{"messages": [{"role": "user", "content": null}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]}',
    b'{"messages": [1, "two", null, {"role": 5}]}',
    b"",
    b"[1, 2, 3]",
    b'{"n": 10000000, "max_tokens": -5, "messages": []}',
    b'"just a string"',
    b'{"prompt": 1e999}',
    b'{"prompt": 123456789012345678901234567890}',
]


async def test_bad_input_is_routed_or_rejected_never_a_router_5xx(fake_backends, router, client) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends))
    for raw in BAD_BODIES:
        for path in (CHAT, "/v1/completions", "/generate"):
            resp = await client.post(
                f"{r.url}{path}", content=raw, headers={"content-type": "application/json"}
            )
            assert resp.status_code == 200, (raw[:40], path, resp.status_code)
            assert json.loads(resp.text)["body"] == raw.decode("utf-8", "replace")
    # And the router keeps serving the next request.
    resp = await client.post(f"{r.url}{CHAT}", json=body("fine"))
    assert resp.status_code == 200


async def test_connect_timeout_is_retried_on_the_next_backend(fake_backends, router, client) -> None:
    """A backend whose accept queue is full times out on connect: that is a connect failure
    (retried, counted towards ejection), not a first-byte timeout."""
    import socket

    good = (await fake_backends(1))[0]
    stuck = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    stuck.bind(("127.0.0.1", 0))
    stuck.listen(0)
    fillers = []
    for _ in range(8):  # fill the backlog so further SYNs are dropped
        f = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        f.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            f.connect(stuck.getsockname())
        fillers.append(f)
    stuck_url = f"http://127.0.0.1:{stuck.getsockname()[1]}"
    r = await router(router_settings([good, stuck_url], upstream={"connect_timeout_s": 0.3}))
    try:
        for i in range(12):
            resp = await client.post(f"{r.url}{CHAT}", json=body(f"key {i}"))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-prefix-router-backend"] == good.url
        text = (await client.get(f"{r.url}/metrics")).text
        assert f'prefix_router_upstream_errors_total{{backend="{stuck_url}",kind="connect"}}' in text
        assert "first_byte_timeout" not in text.split("prefix_router_upstream_errors_total")[1].split("#")[0]
    finally:
        for f in fillers:
            f.close()
        stuck.close()
