"""What /metrics tells an operator: every series there from the start, states as 0/1, the join to the
engines' own series, build and process facts, the router's own answers and waits."""

from __future__ import annotations

import asyncio
import platform

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import prefix_router
from prefix_router.fleet.backends import BackendSpec
from prefix_router.frontend.local_routes import ERROR_TABLE
from prefix_router.ops.metrics import (
    PREFILL_OUTCOMES,
    RETRY_REASONS,
    ROUTER_ERROR_CODES,
    UPSTREAM_ERROR_KINDS,
    WAIT_REASONS,
    FleetSnapshot,
    RouterMetrics,
)
from prefix_router.routing.picker import Branch

from routerkit import RunningRouter, eventually, free_socket, router_settings

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
CHAT = "/v1/chat/completions"


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(labels) for n, labels in samples if n == name]


async def scrape(client: httpx.AsyncClient, r: RunningRouter) -> Samples:
    resp = await client.get(f"{r.url}/metrics")
    assert resp.status_code == 200
    return parse(resp.text)


def chat(text: str, stream: bool = False) -> dict[str, object]:
    return {"model": "m", "stream": stream, "messages": [{"role": "user", "content": text}]}


def test_every_code_the_router_answers_with_is_initialised() -> None:
    assert {code for _, _, code in ERROR_TABLE.values()} <= set(ROUTER_ERROR_CODES)


async def test_every_labelled_counter_starts_at_zero(fake_backends, router, client) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends))
    got = await scrape(client, r)
    for b in backends:
        for branch in Branch:
            for klass in ("2xx", "4xx", "5xx"):
                labels = {"backend": b.url, "branch": branch.value, "status_class": klass}
                assert value(got, "prefix_router_requests_total", **labels) == 0.0, labels
        for kind in UPSTREAM_ERROR_KINDS:
            assert value(got, "prefix_router_upstream_errors_total", backend=b.url, kind=kind) == 0.0
        assert value(got, "prefix_router_request_duration_seconds_count", backend=b.url) == 0.0
        assert value(got, "prefix_router_time_to_first_byte_seconds_count", backend=b.url) == 0.0
    for klass in ("4xx", "5xx"):
        assert (
            value(got, "prefix_router_requests_total", backend="none", branch="none", status_class=klass) == 0
        )
    for branch in Branch:
        assert value(got, "prefix_router_decisions_total", branch=branch.value) == 0.0
    for code in ROUTER_ERROR_CODES:
        assert value(got, "prefix_router_errors_total", code=code) == 0.0
    for reason in RETRY_REASONS:
        assert value(got, "prefix_router_retries_total", reason=reason) == 0.0
    for outcome in PREFILL_OUTCOMES:
        assert value(got, "prefix_router_prefill_waits_total", outcome=outcome) == 0.0
    for reason in WAIT_REASONS:
        assert value(got, "prefix_router_wait_seconds_count", reason=reason) == 0.0


async def test_a_backend_gets_its_series_when_it_joins_and_loses_them_when_it_leaves(
    fake_backends, router, client
) -> None:
    first, second = await fake_backends(2)
    r = await router(router_settings([first]))
    assert not [
        s
        for s in series(await scrape(client, r), "prefix_router_requests_total")
        if s["backend"] == second.url
    ]
    r.app.backends.replace_members([BackendSpec(first.url), BackendSpec(second.url)])
    got = await scrape(client, r)
    assert (
        value(got, "prefix_router_requests_total", backend=second.url, branch="affinity", status_class="5xx")
        == 0
    )
    assert value(got, "prefix_router_upstream_errors_total", backend=second.url, kind="connect") == 0
    assert value(
        got, "prefix_router_backend_info", backend=second.url, backend_instance=f"127.0.0.1:{second.port}"
    )
    r.app.backends.replace_members([BackendSpec(second.url)])
    got = await scrape(client, r)
    for name in (
        "prefix_router_requests_total",
        "prefix_router_upstream_errors_total",
        "prefix_router_backend_state",
        "prefix_router_backend_info",
        "prefix_router_request_duration_seconds_count",
    ):
        assert all(s.get("backend") != first.url for s in series(got, name)), name


async def test_backend_state_is_one_series_per_state(fake_backends, router, client) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends, health={"unhealthy_threshold": 1}))
    sick = backends[0]
    got = await scrape(client, r)
    for b in backends:
        states = {
            s["state"]: value(got, "prefix_router_backend_state", **s)
            for s in series(got, "prefix_router_backend_state")
            if s["backend"] == b.url
        }
        assert states == {"healthy": 1.0, "ejected": 0.0, "draining": 0.0}
    r.app.backends.record_failure(sick.url, probe=False)
    got = await scrape(client, r)
    assert value(got, "prefix_router_backend_state", backend=sick.url, state="healthy") == 0.0
    assert value(got, "prefix_router_backend_state", backend=sick.url, state="ejected") == 1.0
    assert value(got, "prefix_router_backend_state", backend=sick.url, state="draining") == 0.0
    assert value(got, "prefix_router_backend_healthy", backend=sick.url) == 0.0


async def test_backend_info_joins_on_the_engines_instance_label(fake_backends, router, client) -> None:
    backends = await fake_backends(2)
    r = await router(router_settings(backends))
    got = await scrape(client, r)
    info = series(got, "prefix_router_backend_info")
    assert sorted(info, key=lambda s: s["backend"]) == sorted(
        ({"backend": b.url, "backend_instance": f"127.0.0.1:{b.port}"} for b in backends),
        key=lambda s: s["backend"],
    )


async def test_build_info_and_process_metrics(fake_backends, router, client) -> None:
    backends = await fake_backends(1)
    r = await router(router_settings(backends))
    got = await scrape(client, r)
    build = {"version": prefix_router.__version__, "python": platform.python_version()}
    assert value(got, "prefix_router_build_info", **build) == 1.0
    names = {name for name, _ in got}
    assert {"process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds_total"} <= names
    assert "python_info" in names
    assert "python_gc_collections_total" in names


async def test_errors_the_router_answers_are_counted_as_requests(fake_backends, router, client) -> None:
    backends = await fake_backends(1)
    sock = free_socket()  # bound, never listening
    dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        r = await router(
            router_settings([dead], server={"max_body_bytes": 1000}, upstream={"max_attempts": 1})
        )
        # 502: the one backend refused the connection; the router answered, after choosing it.
        assert (await client.post(f"{r.url}{CHAT}", json=chat("x"))).status_code == 502
        # 413 from the listener, before any backend was chosen.
        assert (await client.post(f"{r.url}{CHAT}", content=b"x" * 2000)).status_code == 413
        # 405 on a local route.
        assert (await client.post(f"{r.url}/metrics")).status_code == 405
        got = await scrape(client, r)
        assert (
            value(got, "prefix_router_requests_total", backend=dead, branch="cache_room", status_class="5xx")
            == 1
        )
        assert (
            value(got, "prefix_router_requests_total", backend="none", branch="none", status_class="4xx") == 2
        )
        assert value(got, "prefix_router_errors_total", code="upstream_unavailable") == 1
        assert value(got, "prefix_router_errors_total", code="body_too_large") == 1
        # 503: no backend left once it is ejected.
        r2 = await router(
            router_settings(backends, health={"unhealthy_threshold": 1, "max_ejected_ratio": 1.0})
        )
        r2.app.backends.record_failure(backends[0].url, probe=False)
        assert (await client.post(f"{r2.url}{CHAT}", json=chat("x"))).status_code == 503
        got = await scrape(client, r2)
        assert (
            value(got, "prefix_router_requests_total", backend="none", branch="none", status_class="5xx") == 1
        )
        assert value(got, "prefix_router_errors_total", code="no_backend") == 1
    finally:
        sock.close()


async def test_capacity_waits_are_observed(fake_backends, router, client) -> None:
    gate = asyncio.Event()
    (backend,) = await fake_backends(1, gate=gate)
    r = await router(
        router_settings([backend], balancing={"max_inflight": 1, "queue_max": 8, "queue_timeout_s": 30})
    )
    held = asyncio.create_task(client.post(f"{r.url}{CHAT}", json=chat("first")))
    await eventually(lambda: backend.active == 1)
    queued = asyncio.create_task(client.post(f"{r.url}{CHAT}", json=chat("second")))
    await eventually(lambda: r.app.placer.waiting == 1)
    await asyncio.sleep(0.05)
    gate.set()
    assert (await held).status_code == 200 and (await queued).status_code == 200
    got = await scrape(client, r)
    assert value(got, "prefix_router_wait_seconds_count", reason="capacity") == 1.0
    assert (value(got, "prefix_router_wait_seconds_sum", reason="capacity") or 0.0) >= 0.04
    assert value(got, "prefix_router_wait_seconds_count", reason="prefill") == 0.0


def test_a_status_class_not_initialised_is_counted_on_first_use() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, lambda: FleetSnapshot(backends=[], ejection_cap_active=False))
    series = metrics.backend("http://10.0.0.1:8000")
    labels = {"backend": "http://10.0.0.1:8000", "branch": "affinity", "status_class": "3xx"}
    assert registry.get_sample_value("prefix_router_requests_total", labels) is None
    series.answered(Branch.AFFINITY, 302)
    series.answered(Branch.AFFINITY, 200)
    assert registry.get_sample_value("prefix_router_requests_total", labels) == 1.0
    assert registry.get_sample_value("prefix_router_requests_total", {**labels, "status_class": "2xx"}) == 1.0
