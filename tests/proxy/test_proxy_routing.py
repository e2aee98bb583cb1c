"""The router in front of fake backends: affinity, canonical routing, tenants, headers, access log."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from typing import Any

import httpx
import pytest

from prefix_router.settings import load_settings

from routerkit import eventually, router_settings

CHAT = "/v1/chat/completions"


def chat(system: str, user: str = "hi", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra,
    }


async def test_same_prefix_same_backend_and_distinct_prefixes_spread(fake_backends, router, client) -> None:
    backends = await fake_backends(4)
    r = await router(router_settings(backends))
    placements: dict[str, set[str]] = {}
    for group in range(24):
        system = f"You are assistant number {group}. " * 20
        for q in range(4):
            resp = await client.post(f"{r.url}{CHAT}", json=chat(system, f"question {q}"))
            assert resp.status_code == 200
            placements.setdefault(system, set()).add(resp.headers["x-prefix-router-backend"])
    assert all(len(v) == 1 for v in placements.values()), "a shared prefix must stay on one backend"
    used = Counter(next(iter(v)) for v in placements.values())
    assert len(used) >= 3, f"24 distinct prefixes should spread over the fleet, got {used}"


async def test_backend_header_names_the_backend_that_answered(fake_backends, router, client) -> None:
    backends = await fake_backends(3)
    r = await router(router_settings(backends))
    resp = await client.post(f"{r.url}{CHAT}", json=chat("s"))
    by_url = {b.url: b for b in backends}
    assert resp.json()["backend"] == by_url[resp.headers["x-prefix-router-backend"]].name


async def test_backend_header_is_off_by_default(fake_backends, router, client) -> None:
    """The header names an internal address; clients see it only where an operator turned it on."""
    backends = await fake_backends(1)
    settings = load_settings(None, {"backends": [{"url": backends[0].url}]}, environ=False)
    assert settings.server.backend_header is False
    for r in (
        await router(settings),
        await router(router_settings(backends, server={"backend_header": False})),
    ):
        resp = await client.post(f"{r.url}{CHAT}", json=chat("s"))
        assert resp.status_code == 200
        assert "x-prefix-router-backend" not in resp.headers


async def test_native_routing_is_canonical(fake_backends, router, client) -> None:
    backends = await fake_backends(4)
    r = await router(router_settings(backends))
    seen = set()
    for body in (
        b'{"prompt": "caf\\u00e9 story", "temperature": 0.1, "max_tokens": 5}',
        b'{"max_tokens":5,"temperature":0.9,"prompt":"caf\xc3\xa9 story"}',
        b'{\n  "temperature": 1,\n  "prompt" : "caf\\u00e9 story"\n}',
    ):
        resp = await client.post(
            f"{r.url}/generate", content=body, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 200
        seen.add(resp.headers["x-prefix-router-backend"])
    assert len(seen) == 1, "serialisations of one prompt must route alike"


async def test_tenants_are_placed_independently_and_stay_sticky(fake_backends, router, client) -> None:
    backends = await fake_backends(4)
    r = await router(router_settings(backends))
    body = chat("the very same system prompt " * 10)
    per_tenant: dict[str, set[str]] = {}
    for tenant in range(16):
        for _ in range(3):
            resp = await client.post(
                f"{r.url}{CHAT}", json=body, headers={"x-prefix-cache-key": f"t{tenant}"}
            )
            per_tenant.setdefault(f"t{tenant}", set()).add(resp.headers["x-prefix-router-backend"])
    assert all(len(v) == 1 for v in per_tenant.values())
    assert len({next(iter(v)) for v in per_tenant.values()}) >= 2


async def test_prompt_cache_key_body_field_is_a_tenant(fake_backends, router, client) -> None:
    backends = await fake_backends(4)
    r = await router(router_settings(backends))
    homes = set()
    for tenant in range(16):
        resp = await client.post(f"{r.url}{CHAT}", json=chat("same prompt", prompt_cache_key=f"k{tenant}"))
        homes.add(resp.headers["x-prefix-router-backend"])
    assert len(homes) >= 2


async def test_every_method_and_path_forwarded_with_headers(fake_backends, router, client) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
        resp = await client.request(
            method,
            f"{r.url}/some/native/path?x=1&y=%20z",
            content=b"abc" if method != "GET" else None,
            headers={"x-custom": "v", "authorization": "Bearer secret", "connection": "keep-alive, x-hop"},
        )
        assert resp.status_code == 200
        got = resp.json()
        assert got["method"] == method
        assert got["path"] == "/some/native/path"
        assert got["query"] == "x=1&y=%20z"
        assert got["headers"]["x-custom"] == "v"
        assert got["headers"]["Authorization"] == "Bearer secret"
        assert got["headers"]["X-Forwarded-For"] == "127.0.0.1"
        assert got["headers"]["X-Forwarded-Proto"] == "http"
        assert "x-hop" not in {k.lower() for k in got["headers"]}
    assert resp.headers["x-fake-backend"] == "b0"


async def test_x_forwarded_for_is_appended(fake_backends, router, client) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    resp = await client.get(f"{r.url}/x", headers={"x-forwarded-for": "10.1.2.3"})
    assert resp.json()["headers"]["X-Forwarded-For"] == "10.1.2.3, 127.0.0.1"


async def test_body_forwarded_byte_for_byte(fake_backends, router, client) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    body = json.dumps(chat("x" * 100_000)).encode()
    resp = await client.post(f"{r.url}{CHAT}", content=body)
    assert backends[0].seen[-1].body == body
    assert resp.status_code == 200


async def test_model_is_part_of_the_key(fake_backends, router, client) -> None:
    backends = await fake_backends(4)
    r = await router(router_settings(backends))
    homes = set()
    for i in range(16):
        body = chat("one shared system prompt")
        body["model"] = f"model-{i}"
        resp = await client.post(f"{r.url}{CHAT}", json=body)
        homes.add(resp.headers["x-prefix-router-backend"])
    assert len(homes) >= 2


async def test_local_routes(fake_backends, router, client) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends))
    assert (await client.get(f"{r.url}/healthz")).json() == {"status": "ok"}
    await eventually(r.app.backends.is_ready)  # the first probes answered
    assert (await client.get(f"{r.url}/readyz")).status_code == 200
    await client.post(f"{r.url}{CHAT}", json=chat("s"))
    text = (await client.get(f"{r.url}/metrics")).text
    assert 'prefix_router_decisions_total{branch="cache_room"} 1.0' in text
    assert "prefix_router_backend_inflight" in text
    assert "prefix_router_ring_members 2.0" in text
    assert not any(b.seen and b.seen[-1].path in ("/healthz", "/metrics") for b in backends)


async def test_multi_turn_conversation_follows_its_history(fake_backends, router, client) -> None:
    """Each turn changes the first prefix_chars characters while the conversation is short; the
    prefix index still sends turn k+1 to turn k's backend."""
    backends = await fake_backends(8)
    r = await router(router_settings(backends))
    for conv in range(12):
        messages: list[dict[str, str]] = [
            {"role": "system", "content": f"conversation {conv} " + "ctx " * 80}
        ]
        homes = set()
        for turn in range(6):
            messages.append({"role": "user", "content": f"turn {turn} question " * 10})
            resp = await client.post(f"{r.url}{CHAT}", json={"model": "m", "messages": messages})
            homes.add(resp.headers["x-prefix-router-backend"])
            messages.append({"role": "assistant", "content": f"answer {turn} " * 30})
        assert len(homes) == 1, f"conversation {conv} moved between backends: {homes}"


@pytest.mark.parametrize("api", ["chat", "responses", "responses-tools"])
async def test_a_conversation_opened_by_a_short_question_stays_on_its_backend(
    fake_backends, router, client, api: str
) -> None:
    """No system prompt and a first question shorter than the key's first block: the prefix index
    holds no block of it, only who took it. The next turns still go there, while the other
    conversations' turns, interleaved, change what each cache holds. The same for the Responses API
    used without server-side state (`store: false`, each turn's `input` the whole history, the
    answers as the output items it returned), also as an agent runs it: each answer a reasoning
    summary and a function call, each next turn the call's output and no new question."""
    backends = await fake_backends(8)
    r = await router(router_settings(backends, routing={"kv_capacity_tokens": 4096}))
    chats: list[list[dict[str, Any]]] = [[] for _ in range(12)]
    homes: list[list[str]] = [[] for _ in chats]
    for turn in range(4):
        for conv, messages in enumerate(chats):
            if api != "responses-tools" or not turn:
                messages.append({"role": "user", "content": f"Hi, question {turn} of chat {conv}?"})
            if api == "chat":
                resp = await client.post(f"{r.url}{CHAT}", json={"model": "m", "messages": messages})
            else:
                body = {"model": "m", "input": messages, "store": False}
                resp = await client.post(f"{r.url}/v1/responses", json=body)
            assert resp.status_code == 200
            homes[conv].append(resp.headers["x-prefix-router-backend"])
            answer = f"Answer {turn} of chat {conv}. " * 20
            if api == "chat":
                messages.append({"role": "assistant", "content": answer})
            elif api == "responses-tools":
                call = f"call_{conv}_{turn}"
                messages += [
                    {
                        "type": "reasoning",
                        "id": f"rs_{call}",
                        "summary": [{"type": "summary_text", "text": answer}],
                    },
                    {
                        "type": "function_call",
                        "call_id": call,
                        "name": "read_file",
                        "arguments": '{"path": "a.py"}',
                    },
                    {"type": "function_call_output", "call_id": call, "output": f"line {turn} of a.py"},
                ]
            else:
                messages.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": answer}],
                    }
                )
    moved = {conv: seen for conv, seen in enumerate(homes) if len(set(seen)) > 1}
    assert not moved, f"conversations moved between backends: {moved}"


async def test_round_robin_policy_cycles(fake_backends, router, client) -> None:
    backends = await fake_backends(3)
    r = await router(router_settings(backends, balancing={"policy": "round_robin"}))
    got: Counter[str] = Counter()
    for _ in range(9):
        resp = await client.post(f"{r.url}{CHAT}", json=chat("same"))
        got[resp.headers["x-prefix-router-backend"]] += 1
    assert sorted(got.values()) == [3, 3, 3]


async def test_openai_sdk_chat_and_stream_through_router(fake_backends, router) -> None:
    import openai
    from openai.types.chat import ChatCompletionMessageParam

    from prefix_router.sim.config import SimConfig
    from prefix_router.sim.fleet import SimFleet

    async with SimFleet(SimConfig(overhead_ms=1, prefill_ms_per_token=0.001, itl_ms=1), count=2) as fleet:
        r = await router(router_settings(fleet.urls))
        async with openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0) as sdk:
            messages: list[ChatCompletionMessageParam] = [
                {"role": "system", "content": "be brief " * 50},
                {"role": "user", "content": "hello"},
            ]
            first = await sdk.chat.completions.create(model="sim-llama", messages=messages, max_tokens=4)
            assert first.choices[0].message.content
            again = await sdk.chat.completions.create(model="sim-llama", messages=messages, max_tokens=4)
            assert again.usage is not None and again.usage.prompt_tokens_details is not None
            assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 0, (
                "the repeat must hit the same cache"
            )
            stream = await sdk.chat.completions.create(
                model="sim-llama", messages=messages, max_tokens=5, stream=True
            )
            pieces = [
                c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content
            ]
            assert len(pieces) == 5
            raw = await sdk.chat.completions.with_raw_response.create(
                model="sim-llama", messages=messages, max_tokens=1
            )
            assert raw.headers["x-prefix-router-backend"] in fleet.urls
            models = await sdk.models.list()
            assert [m.id for m in models.data] == ["sim-llama"]


async def test_http_client_sees_no_difference_but_the_header(fake_backends, router, client) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    direct = await client.post(f"{backends[0].url}{CHAT}", json=chat("s"))
    via = await client.post(f"{r.url}{CHAT}", json=chat("s"))
    assert via.status_code == direct.status_code
    assert via.headers["content-type"] == direct.headers["content-type"]
    d, v = direct.json(), via.json()
    for drop in ("headers",):
        d.pop(drop)
        v.pop(drop)
    assert d == v
    assert isinstance(via, httpx.Response)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The access log's records, each parsed as the one JSON object it must be."""
    return [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "prefix_router.access"]


async def test_access_log_is_one_json_object_per_request_without_tenants_or_bodies(
    fake_backends, router, client, caplog: pytest.LogCaptureFixture
) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends, server={"access_log": True, "max_body_bytes": 4096}))
    caplog.set_level(logging.INFO, logger="prefix_router.access")
    secret_prompt = "the prompt of a user"
    resp = await client.post(
        f"{r.url}/v1/chat/completions?trace=secret-query",
        json=chat(secret_prompt),
        headers={"x-prefix-cache-key": "tenant-secret"},
    )
    assert resp.status_code == 200
    refused = await client.request("TRACE", f"{r.url}/v1/chat/completions")
    assert refused.status_code == 405
    for probe in ("/healthz", "/readyz", "/metrics"):
        await client.get(f"{r.url}{probe}")  # probes and scrapes are left out by default
    too_big = await client.post(f"{r.url}/v1/chat/completions?q=1", content=b"x" * 5000)
    assert too_big.status_code == 413  # refused by the listener before the body is read
    lines = access_lines(caplog)
    assert len(lines) == 3, lines
    chosen = resp.headers["x-prefix-router-backend"]
    keys = {"time", "client", "method", "path", "status", "duration_s", "backend", "branch", "model", "bytes"}
    assert all(set(line) == keys for line in lines), lines
    first, second, third = lines
    assert first["method"] == "POST" and first["path"] == "/v1/chat/completions"
    assert (first["status"], first["backend"], first["branch"]) == (200, chosen, "cache_room")
    assert first["bytes"] == len(resp.content) and first["client"] == "127.0.0.1"
    assert 0 <= first["duration_s"] < 60
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"]), first["time"]
    assert (second["method"], second["status"], second["backend"], second["branch"]) == (
        "TRACE",
        405,
        None,
        None,
    )
    assert second["bytes"] == len(refused.content)
    assert (third["method"], third["path"], third["status"], third["bytes"]) == (
        None,
        "/v1/chat/completions",
        413,
        None,
    )
    for line in caplog.records:
        text = line.getMessage()
        assert "tenant-secret" not in text and secret_prompt not in text and "secret-query" not in text


async def test_access_log_can_include_probes_and_scrapes(
    fake_backends, router, client, caplog: pytest.LogCaptureFixture
) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends, server={"access_log": True, "access_log_probes": True}))
    caplog.set_level(logging.INFO, logger="prefix_router.access")
    for probe in ("/healthz", "/readyz", "/metrics"):
        await client.get(f"{r.url}{probe}")
    assert [(line["path"], line["backend"]) for line in access_lines(caplog)] == [
        ("/healthz", None),
        ("/readyz", None),
        ("/metrics", None),
    ]


async def test_access_log_is_off_by_default(fake_backends, router, client, caplog) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    caplog.set_level(logging.INFO, logger="prefix_router.access")
    assert (await client.post(f"{r.url}/v1/chat/completions", json=chat("quiet"))).status_code == 200
    assert not [rec for rec in caplog.records if rec.name == "prefix_router.access"]
