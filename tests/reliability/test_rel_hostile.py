"""Hostile input at the listener and in bodies; no open proxy; secrets never leave; tenant salts."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import socket
from typing import cast

import pytest

from fakebackend import Close, Reply
from routerkit import router_settings


async def raw_exchange(port: int, data: bytes, read_timeout_s: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = b""
    try:
        async with asyncio.timeout(read_timeout_s):
            while chunk := await reader.read(65536):
                out += chunk
    except TimeoutError:
        out += b"<still open>"
    writer.close()
    return out


SMUGGLING = [
    pytest.param(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        id="content-length-and-transfer-encoding",
    ),
    pytest.param(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcde",
        id="duplicate-content-length",
    ),
    pytest.param(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
        id="transfer-encoding-not-chunked-last",
    ),
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", id="negative-content-length"),
]


@pytest.mark.parametrize("request_bytes", SMUGGLING)
async def test_smuggling_attempts_get_400_and_reach_no_backend(fake_backends, router, request_bytes) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    answer = await raw_exchange(r.port, request_bytes)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    assert b'"code":"bad_request"' in answer
    assert backends[0].seen == []


async def test_oversized_headers_get_431(fake_backends, router) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"max_header_bytes": 4096}))
    answer = await raw_exchange(
        r.port, b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 431")
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(2000))
    answer = await raw_exchange(r.port, b"GET /x HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431")
    assert backends[0].seen == []


async def test_slow_headers_get_408_and_the_connection_closed(fake_backends, router) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"header_timeout_s": 0.5}))
    answer = await raw_exchange(r.port, b"GET /x HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert answer.startswith(b"HTTP/1.1 408")
    assert not answer.endswith(b"<still open>")


async def test_slow_body_gets_408(fake_backends, router) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"body_timeout_s": 0.5}))
    answer = await raw_exchange(
        r.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    )
    assert answer.startswith(b"HTTP/1.1 408")
    assert backends[0].seen == []


async def test_router_keeps_serving_after_hostile_input(fake_backends, router, client) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"header_timeout_s": 0.3}))
    for p in SMUGGLING:
        await raw_exchange(r.port, cast(bytes, p.values[0]))
    await raw_exchange(r.port, b"GET /x HTTP/1.1\r\n")
    assert (await client.get(f"{r.url}/v1/models")).status_code == 200


class Decoy:
    """A listener on another loopback port that must never see a connection."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self.server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]


async def test_no_open_proxy_decoy_sees_zero_connections(fake_backends, router) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    decoy = Decoy()
    port = await decoy.start()
    target = f"127.0.0.1:{port}"
    attempts = [
        f"GET http://{target}/x HTTP/1.1\r\nHost: {target}\r\n\r\n",
        f"GET //{target}/x HTTP/1.1\r\nHost: x\r\n\r\n",
        f"GET /@{target}/x HTTP/1.1\r\nHost: x\r\n\r\n",
        f"GET /x HTTP/1.1\r\nHost: {target}\r\n\r\n",
        f"GET /x HTTP/1.1\r\nHost: {target}\r\nX-Forwarded-Host: {target}\r\n\r\n",
        "GET /x HTTP/1.1\r\n\r\n",
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n",
        f"GET http://user@{target}/ HTTP/1.1\r\nHost: x\r\n\r\n",
        f"GET /..%2F..%2F{target} HTTP/1.1\r\nHost: x\r\n\r\n",
        f"GET /%2F%2F{target}/x HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    for attempt in attempts:
        await raw_exchange(r.port, attempt.encode(), read_timeout_s=2)
    body = json.dumps({"url": f"http://{target}", "model": f"http://{target}/", "messages": []})
    await raw_exchange(
        r.port,
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {target}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode(),
    )
    await asyncio.sleep(0.2)
    assert decoy.connections == 0
    # the userinfo URI, the CONNECT and the request without Host are refused; the rest reach the one
    # configured backend (an absolute URI in origin form, its authority never dialled)
    assert len(backends[0].seen) >= len(attempts) - 3
    assert decoy.server is not None
    decoy.server.close()


async def test_secrets_appear_in_no_log_metric_or_error(fake_backends, router, client, caplog) -> None:
    canary_auth = "sk-CANARY-0123456789"
    canary_tenant = "tenant-CANARY-42"
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"max_body_bytes": 2000}, upstream={"max_attempts": 1}))
    headers = {
        "authorization": f"Bearer {canary_auth}",
        "x-prefix-cache-key": canary_tenant,
        "x-api-key": canary_auth,
    }
    caplog.set_level(logging.DEBUG)
    bodies = []
    for body in (b'{"messages": []}', b"x" * 5000, b"{bad"):
        resp = await client.post(f"{r.url}/v1/chat/completions", content=body, headers=headers)
        bodies.append(resp.text if resp.status_code >= 400 and "backend" not in resp.text else "")
    backends[0].script = Close()
    resp = await client.post(f"{r.url}/v1/chat/completions", content=b"{}", headers=headers)
    assert resp.status_code == 502
    bodies.append(resp.text)
    backends[0].script = Reply(503)
    resp = await client.post(f"{r.url}/v1/chat/completions", content=b"{}", headers=headers)
    metrics = (await client.get(f"{r.url}/metrics")).text
    for text in [*bodies, metrics, caplog.text]:
        assert canary_auth not in text
        assert canary_tenant not in text


async def test_metric_series_stay_within_budget_whatever_the_traffic(fake_backends, router, client) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends))

    for i in range(300):
        await client.post(
            f"{r.url}/v1/chat/completions/{i}?q={i}",
            json={"model": f"m{i}", "messages": [{"role": "user", "content": str(i)}]},
            headers={"x-prefix-cache-key": f"t{i}", f"x-h{i}": "v"},
        )
    text = (await client.get(f"{r.url}/metrics")).text
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    # Bounded by backends x branches x status classes, plus fixed families: nothing grows with traffic.
    assert len(lines) < 400
    for i in (7, 150, 299):
        assert f"t{i}" not in text and f"m{i}" not in text and f"/{i}" not in text


async def test_cache_salt_is_set_from_the_tenant_overwriting_the_client(
    fake_backends, router, client
) -> None:
    backends = await fake_backends(1)
    secret = "s3cret-key"
    r = await router(router_settings(backends, routing={"set_cache_salt": True, "cache_salt_secret": secret}))
    sent = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "victim-salt"}
    await client.post(f"{r.url}/v1/chat/completions", json=sent, headers={"x-prefix-cache-key": "alice"})
    got = json.loads(backends[0].seen[-1].body)
    expected = hmac.new(secret.encode(), b"alice", hashlib.sha256).hexdigest()
    assert got["cache_salt"] == expected
    assert got["messages"] == sent["messages"]
    await client.post(f"{r.url}/v1/chat/completions", json=sent, headers={"x-prefix-cache-key": "bob"})
    assert json.loads(backends[0].seen[-1].body)["cache_salt"] not in (expected, "victim-salt")
    await client.post(f"{r.url}/v1/chat/completions", json=sent)  # no tenant: still never the client's value
    assert json.loads(backends[0].seen[-1].body)["cache_salt"] != "victim-salt"


def test_socket_helper_binds_loopback_only() -> None:
    from routerkit import free_socket

    sock = free_socket()
    assert sock.getsockname()[0] == "127.0.0.1"
    assert sock.family == socket.AF_INET
    sock.close()
