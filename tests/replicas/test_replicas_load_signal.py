"""The scraped load signal: vLLM's running + waiting, parsed, and used by a real router.

Another replica's traffic is stood in for by a client that talks to the simulated backend directly,
bypassing the router: only the backend's own /metrics can tell this router about it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from prefix_router.fleet.load_signal import parse_vllm_load
from prefix_router.routing.keys import extract_key
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimBackend

from routerkit import RunningRouter, eventually, free_socket, router_settings

CHAT = "/v1/chat/completions"
BACKEND_HEADER = "x-prefix-router-backend"

# What vLLM v1 (0.8+) serves on /metrics for one engine, trimmed to the families around the two we read.
VLLM_PAGE = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="x"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="x"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="x"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="x"} 12345.0
"""


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        pytest.param(VLLM_PAGE, 5.0, id="vllm-v1-page"),
        pytest.param(
            b'vllm:num_requests_running{engine="0",model_name="x"} 3.0\n'
            b'vllm:num_requests_running{engine="1",model_name="x"} 4.0\n'
            b'vllm:num_requests_waiting{engine="0",model_name="x"} 1.0\n'
            b'vllm:num_requests_waiting{engine="1",model_name="x"} 2.0\n',
            10.0,
            id="two-engines-summed",
        ),
        pytest.param(
            b'vllm:num_requests_running{engine="0",model_name="a"} 1\n'
            b'vllm:num_requests_running{engine="0",model_name="b"} 2\n',
            3.0,
            id="two-models-running-only",
        ),
        pytest.param(b"vllm:num_requests_waiting 7\n", 7.0, id="no-labels-waiting-only"),
        pytest.param(b'vllm:num_requests_running{model_name="my model"} 2\n', 2.0, id="space-in-label"),
        pytest.param(b"vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n", 0.0, id="idle-is-0"),
        pytest.param(VLLM_PAGE.replace(b"\n", b"\r\n"), 5.0, id="crlf"),
        pytest.param(b"", None, id="empty"),
        pytest.param(
            b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            b"# TYPE vllm:num_requests_running gauge\n",
            None,
            id="only-comments",
        ),
        pytest.param(
            b'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:prompt_tokens_total 9\n', None, id="missing"
        ),
        pytest.param(
            b'vllm:num_requests_running_total{engine="0"} 7\n'
            b'vllm:num_requests_waiting_by_reason{reason="capacity"} 4\n'
            b"vllm:num_requests_runningx 5\n"
            b"xvllm:num_requests_running 5\n"
            b"sglang:num_requests_running 5\n",
            None,
            id="lookalike-names-not-matched",
        ),
        pytest.param(
            b'vllm:num_requests_running_total{engine="0"} 7\nvllm:num_requests_running{engine="0"} 1\n',
            1.0,
            id="lookalike-beside-the-real-one",
        ),
        pytest.param(
            b"<html><body>502 Bad Gateway</body></html>\n"
            b'vllm:num_requests_running{engine="0"} not-a-number\n'
            b"vllm:num_requests_running\n"
            b'vllm:num_requests_waiting{engine="0"} 2\n'
            b"\xff\xfe\x00 binary junk\n",
            2.0,
            id="garbage-lines-ignored",
        ),
        pytest.param(b"<html>nothing to see</html>", None, id="all-garbage"),
        pytest.param(b"vllm:num_requests_running NaN\nvllm:num_requests_waiting 2\n", 2.0, id="nan-skipped"),
        pytest.param(
            b"vllm:num_requests_running 1e308\nvllm:num_requests_waiting 1e308\n", None, id="sum-overflows"
        ),
        pytest.param(b'{"backend": "b0", "path": "/metrics"}', None, id="json-echo"),
    ],
)
def test_parse_vllm_load(page: bytes, expected: float | None) -> None:
    assert parse_vllm_load(page) == expected


def test_parse_vllm_load_with_timestamps() -> None:
    page = (
        b'vllm:num_requests_running{engine="0"} 3 1700000000000\nvllm:num_requests_waiting 1 1700000000000\n'
    )
    assert parse_vllm_load(page) == 4.0


# -- end to end on simulated backends ------------------------------------------------------------------

HELD_TOKENS = 4000  # at itl 10 ms, a 40 s stream: held for the whole test, closed by the client
SIM = SimConfig(overhead_ms=1.0, prefill_ms_per_token=0.0, itl_ms=10.0, itl_batch_slowdown=0.0)


@contextlib.asynccontextmanager
async def sim_pair() -> AsyncIterator[list[SimBackend]]:
    backends = [SimBackend(SIM), SimBackend(SIM)]
    for b in backends:
        await b.start()
    try:
        yield backends
    finally:
        for b in backends:
            await b.stop()


async def sim_inflight(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/sim/stats") as resp:
        stats = await resp.json()
    return int(stats["running"]) + int(stats["waiting"])


async def sim_stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/sim/stats") as resp:
        result: dict[str, Any] = await resp.json()
        return result


def _chat(prompt: str) -> bytes:
    return orjson.dumps(
        {
            "model": "sim-llama",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": HELD_TOKENS,
            "stream": True,
        }
    )


async def hold(session: aiohttp.ClientSession, url: str, body: bytes, held: list[Any]) -> str | None:
    """Start a long stream and keep it open (its first bytes read); returns the router's backend header."""
    resp = await session.post(url + CHAT, data=body, headers={"content-type": "application/json"})
    held.append(resp)
    assert resp.status == 200, await resp.text()
    await resp.content.readline()
    return resp.headers.get(BACKEND_HEADER)


def prompts_owned_by(r: RunningRouter, owner: str, count: int) -> list[bytes]:
    """Distinct prompts whose ring walk starts at `owner` (fresh prompts: the prefix index has none)."""
    config = r.app.settings.key_config()
    out: list[bytes] = []
    for i in range(10_000):
        body = _chat(f"{i:05d} request for the busy backend")
        if r.app.backends.ring.primary(extract_key(CHAT, body, None, config).ring_hash) == owner:
            out.append(body)
            if len(out) == count:
                return out
    raise AssertionError("the ring never chose the owner")


async def place_one_at_a_time(
    session: aiohttp.ClientSession, r: RunningRouter, urls: list[str], bodies: list[bytes], held: list[Any]
) -> list[str | None]:
    """Each request reaches a backend before the next is placed, and a scrape or two runs between."""
    chosen = []
    for body in bodies:
        before = sum([await sim_inflight(session, u) for u in urls])
        chosen.append(await hold(session, r.url, body, held))
        for _ in range(200):
            if sum([await sim_inflight(session, u) for u in urls]) > before:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.15)  # pacing, not an assertion: lets the 50 ms scraper catch up
    return chosen


N_OTHER = 6  # requests another replica holds on the busy backend
MAX_INFLIGHT = 8
N_OURS = 5


@pytest.mark.parametrize("signal", [True, False], ids=["signal-on", "signal-off"])
async def test_router_sees_another_clients_load(router: Any, signal: bool) -> None:
    held: list[Any] = []
    connector = aiohttp.TCPConnector(limit=64)
    async with sim_pair() as sims, aiohttp.ClientSession(connector=connector) as session:
        busy, idle = (s.url for s in sims)
        try:
            for i in range(N_OTHER):
                await hold(session, busy, _chat(f"other replica's request {i}"), held)
            assert await sim_inflight(session, busy) == N_OTHER
            r = await router(
                router_settings(
                    [busy, idle],
                    load_signal={"enabled": signal, "interval_s": 0.05},
                    # Only the absolute bound binds here: c is set out of the way.
                    balancing={"max_inflight": MAX_INFLIGHT, "load_factor": 100.0},
                )
            )
            load = r.app.backends.load
            if signal:
                await eventually(lambda: load.load(busy) == N_OTHER)
                assert load.inflight(busy) == 0  # none of it is ours
                assert load.total_load() == N_OTHER
            else:
                await asyncio.sleep(0.3)  # several intervals: nothing would ever arrive
                assert load.load(busy) == 0
            async with session.post(busy + "/sim/reset") as resp:  # peaks restart from the present
                assert resp.status == 200
            bodies = prompts_owned_by(r, busy, N_OURS)
            chosen = await place_one_at_a_time(session, r, [busy, idle], bodies, held)
            peak_busy = (await sim_stats(session, busy))["peak_inflight"]
            if signal:
                fits = MAX_INFLIGHT - N_OTHER
                assert chosen == [busy] * fits + [idle] * (N_OURS - fits)
                assert peak_busy <= MAX_INFLIGHT
                assert load.load(busy) == MAX_INFLIGHT  # ours (2) + the other's (6)
            else:
                assert chosen == [busy] * N_OURS  # blind to the other client: everything by the ring
                assert peak_busy == N_OTHER + N_OURS > MAX_INFLIGHT
        finally:
            for resp in held:
                resp.close()


# -- failed scrapes ----------------------------------------------------------------------------------


class MetricsBackend:
    """A backend whose /metrics answer the test scripts; other paths wait on a gate (held requests)."""

    def __init__(self) -> None:
        self.status = 200
        self.page = b""
        self.delay_s = 0.0
        self.scrapes = 0
        self.gate = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._held)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        sock = free_socket()
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        self.gate.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.Response(status=self.status, body=self.page, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _held(self, request: web.Request) -> web.Response:
        await request.read()
        await self.gate.wait()
        return web.json_response({"ok": True})


def page(running: int, waiting: int) -> bytes:
    return (
        f'vllm:num_requests_running{{engine="0",model_name="x"}} {running}.0\n'
        f'vllm:num_requests_waiting{{engine="0",model_name="x"}} {waiting}.0\n'
    ).encode()


async def test_a_failed_scrape_falls_back_to_local_counts(router: Any) -> None:
    backend = MetricsBackend()
    await backend.start()
    tasks: list[asyncio.Task[int]] = []
    try:
        r = await router(
            router_settings(
                [backend.url], load_signal={"enabled": True, "interval_s": 0.05, "timeout_s": 0.2}
            )
        )
        load = r.app.backends.load
        url = backend.url
        async with aiohttp.ClientSession() as session:
            body = orjson.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]})

            async def one() -> int:
                async with session.post(r.url + CHAT, data=body) as resp:
                    await resp.read()
                    return resp.status

            tasks = [asyncio.create_task(one()) for _ in range(2)]  # two requests of ours, held
            await eventually(lambda: load.inflight(url) == 2)

            def settled_at(value: float) -> bool:
                return load.load(url) == value

            # The backend counts our 2 and 4 of someone else's.
            backend.page = page(5, 1)
            await eventually(lambda: settled_at(6))
            steps: list[tuple[str, Any]] = [
                ("status", 500),  # an error answer
                ("page", b"<html>upstream says hello</html>"),  # 200 with garbage
                ("page", b'vllm:num_requests_running_total{engine="0"} 40\n'),  # only a lookalike
                ("delay_s", 1.0),  # slower than timeout_s
            ]
            for attr, value in steps:
                backend.status, backend.page, backend.delay_s = 200, page(5, 1), 0.0
                await eventually(lambda: settled_at(6))
                setattr(backend, attr, value)
                await eventually(lambda: settled_at(2))  # local counts alone
                assert load.total_load() == 2
            # And back: the next good scrape brings the other replica's share back.
            backend.status, backend.page, backend.delay_s = 200, page(5, 1), 0.0
            await eventually(lambda: settled_at(6))
            backend.gate.set()
            assert await asyncio.gather(*tasks) == [200, 200]
            await eventually(lambda: load.inflight(url) == 0)
    finally:
        for task in tasks:
            task.cancel()
        await backend.stop()
