"""A real Prometheus scrapes a live router on simulated backends every second, under a scripted load with
errors; every PromQL expression of the Grafana dashboard must then return data, and `promtool check
metrics` must find nothing wrong with /metrics.

Needs Debian's `prometheus` package (`apt-get install prometheus`: both binaries); without it the test
skips, except under CI, where it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from subprocess import PIPE
from typing import Any

import httpx
import pytest
import yaml

from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet

from loopback import eventually, free_port
from routerkit import RunningRouter, free_socket, router_settings, start_router

DASHBOARD = Path(__file__).parents[2] / "helm" / "prefix-router" / "dashboards" / "prefix-router.json"
NAMESPACE = "test"
RATE_INTERVAL = "15s"  # what Grafana's $__rate_interval is near at a 1 s scrape and a short time range
LOAD_S = 8.0
CHAT = "/v1/chat/completions"

pytestmark = pytest.mark.slow


def binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        reason = f"{name} is not on PATH (Debian/Ubuntu: apt-get install prometheus)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run this test")
        pytest.skip(reason)
    return found


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title / legend, PromQL) of every target, with Grafana's variables filled in."""
    data = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    out = []
    for panel in data["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", NAMESPACE)
            assert "$" not in re.sub(r'"\$1"', "", expr), f"a variable left unfilled: {expr}"
            out.append((f"{panel['title']} / {target['legendFormat']}", expr))
    return out


def template_label_queries() -> list[tuple[str, str]]:
    """The dashboard's `label_values(metric, label)` variables, as (metric, label)."""
    data = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    out = []
    for var in data["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"])
            assert match, var["definition"]
            out.append((match[1], match[2]))
    return out


class Prometheus:
    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self.url = url
        self.client = client

    async def query(self, expr: str) -> list[dict[str, Any]]:
        resp = await self.client.get(f"{self.url}/api/v1/query", params={"query": expr})
        body = resp.json()
        assert resp.status_code == 200 and body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def value(self, expr: str) -> float:
        result = await self.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    async def targets_up(self, count: int) -> bool:
        resp = await self.client.get(f"{self.url}/api/v1/targets")
        active = resp.json()["data"]["activeTargets"]
        return len(active) == count and all(t["health"] == "up" for t in active)


@contextlib.asynccontextmanager
async def start_prometheus(
    tmp_path: Path, router: RunningRouter, sims: list[str], client: httpx.AsyncClient
) -> AsyncIterator[Prometheus]:
    exe = binary("prometheus")
    port = free_port()

    def target(url: str) -> str:
        return url.removeprefix("http://")

    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "prefix-router",
                "static_configs": [
                    {"targets": [target(router.url)], "labels": {"namespace": NAMESPACE, "pod": "router-0"}}
                ],
            },
            {
                "job_name": "vllm",
                "static_configs": [
                    {"targets": [target(url)], "labels": {"namespace": NAMESPACE, "pod": f"vllm-{i}"}}
                    for i, url in enumerate(sims)
                ],
            },
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        exe,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", client)

    async def scraping() -> bool:
        if proc.returncode is not None:
            raise AssertionError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()}")
        try:
            ready = (await client.get(f"{prom.url}/-/ready")).status_code == 200
            return ready and await prom.targets_up(1 + len(sims))
        except httpx.TransportError:
            return False

    try:
        await eventually(scraping, 30, "prometheus scraping every target", 0.2)
        yield prom
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


def chat(system: str, question: str, *, stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": "sim-llama",
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }


async def scripted_load(client: httpx.AsyncClient, url: str, seconds: float) -> dict[int, int]:
    """Rounds of: shared-prefix traffic, two streams on a new prefix (a prefill hold), errors of every
    kind the router meets, and a burst over the fleet's capacity (queue waits and 503s)."""
    statuses: dict[int, int] = {}

    async def send(method: str, path: str, **kwargs: Any) -> None:
        resp = await client.request(method, f"{url}{path}", **kwargs)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1

    deadline = time.monotonic() + seconds
    round_no = 0
    while time.monotonic() < deadline:
        round_no += 1
        shared = [send("POST", CHAT, json=chat(f"system prompt {g} " * 20, f"q{round_no}")) for g in range(4)]
        fresh = f"a new long system prompt {round_no} " * 40  # each round prefills a new prefix
        first = asyncio.create_task(send("POST", CHAT, json=chat(fresh, "one", stream=True)))
        await asyncio.sleep(0.02)
        await asyncio.gather(first, send("POST", CHAT, json=chat(fresh, "two", stream=True)), *shared)
        await asyncio.gather(
            send("POST", CHAT, content=b'{"model": "sim-llama", "messages": [', headers=_JSON),  # bad JSON
            send("GET", "/v1/no-such-route"),  # the backend answers 404
            send("POST", CHAT, content=b"x" * 70_000, headers=_JSON),  # over max_body_bytes: 413
            send("TRACE", CHAT),  # refused by the router: 405
        )
        burst = [
            send("POST", CHAT, json=chat(f"burst {round_no} {i}", "go", max_tokens=30)) for i in range(24)
        ]
        await asyncio.gather(*burst)
    return statuses


_JSON = {"content-type": "application/json"}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as c:
        yield c


async def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path: Path, client) -> None:
    promtool = binary("promtool")
    binary("prometheus")
    dead = free_socket()  # a third backend that refuses connections: retries, connect errors, ejection
    sim = SimConfig(prefill_ms_per_token=0.5, itl_ms=2.0)
    async with SimFleet(sim, count=2) as fleet:
        urls = list(fleet.urls)
        settings = router_settings(
            [*urls, f"http://127.0.0.1:{dead.getsockname()[1]}"],
            # never ejected, so requests keep meeting it: connect errors and retries all along
            health={"interval_s": 1.0, "unhealthy_threshold": 1000},
            balancing={"max_inflight": 4, "queue_max": 2, "queue_timeout_s": 0.2},
            server={"max_body_bytes": 65536},
        )
        router = await start_router(settings)
        try:
            async with start_prometheus(tmp_path, router, urls, client) as prom:
                statuses = await scripted_load(client, router.url, LOAD_S)
                assert {200, 400, 404, 405, 413, 503} <= set(statuses), statuses
                await asyncio.sleep(2.5)  # two more scrapes take in the last requests
                empty = []
                for name, expr in dashboard_queries():
                    if not await prom.query(expr):
                        empty.append(f"{name}: {expr}")
                assert not empty, "dashboard queries with no data:\n" + "\n".join(empty)
                for metric, label in template_label_queries():
                    resp = await client.get(
                        f"{prom.url}/api/v1/label/{label}/values", params={"match[]": metric}
                    )
                    assert NAMESPACE in resp.json()["data"], (metric, label)
                # The figures behind the panels say what happened.
                window = "[1m]"
                ns = f'namespace="{NAMESPACE}"'
                share = await prom.value(
                    f'sum(increase(prefix_router_decisions_total{{{ns},branch=~"affinity|prefix_match|cache_room"}}{window}))'
                    f" / sum(increase(prefix_router_decisions_total{{{ns}}}{window}))"
                )
                assert share > 0.5, share
                for code in ("body_too_large", "overloaded", "bad_request"):
                    got = await prom.value(
                        f'sum(increase(prefix_router_errors_total{{{ns},code="{code}"}}{window}))'
                    )
                    assert got > 0, code
                for reason in ("capacity", "prefill"):
                    got = await prom.value(
                        f'sum(increase(prefix_router_wait_seconds_count{{{ns},reason="{reason}"}}{window}))'
                    )
                    assert got > 0, reason
                router_4xx = await prom.value(
                    f'sum(prefix_router_requests_total{{{ns},backend="none",status_class="4xx"}})'
                )
                assert router_4xx >= statuses[413] + statuses[405], (router_4xx, statuses)
                connect = await prom.value(f'sum(prefix_router_upstream_errors_total{{{ns},kind="connect"}})')
                assert connect > 0
                joined = await prom.query(
                    "count by (backend) (vllm:num_requests_running * on (instance) group_left (backend) "
                    'label_replace(prefix_router_backend_info, "instance", "$1", "backend_instance", "(.*)"))'
                )
                assert sorted(r["metric"]["backend"] for r in joined) == sorted(urls)
            metrics = (await client.get(f"{router.url}/metrics")).content
            check = await asyncio.create_subprocess_exec(
                promtool, "check", "metrics", stdin=PIPE, stdout=PIPE, stderr=subprocess.STDOUT
            )
            out, _ = await asyncio.wait_for(check.communicate(metrics), 30)
            assert check.returncode == 0 and not out.strip(), out.decode()
        finally:
            await router.stop()
            dead.close()
