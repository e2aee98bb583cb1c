"""The Grafana dashboard: valid JSON, the panels operators need, and only metrics the router exports."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from chartkit import CHART_DIR

DASHBOARD = CHART_DIR / "dashboards" / "prefix-router.json"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def router_metric_names(dashboard: dict[str, Any]) -> set[str]:
    return {m for e in exprs(dashboard) for m in re.findall(r"\bprefix_router_[a-z_]+", e)}


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "prefix-router"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["datasource"]["uid"] == "${datasource}"


@pytest.mark.parametrize(
    "pattern",
    [
        pytest.param(
            r"sum by \(branch\) \(rate\(prefix_router_decisions_total\{[^}]*\}\[\$__rate_interval\]\)\)",
            id="branch",
        ),
        pytest.param(r"prefix_router_backend_inflight", id="inflight"),
        pytest.param(r"sum by \(backend\) \(rate\(prefix_router_requests_total", id="request-share"),
        pytest.param(
            r"histogram_quantile\(0\.99, sum by \(le, backend\) \(rate\("
            r"prefix_router_time_to_first_byte_seconds_bucket",
            id="ttfb",
        ),
        pytest.param(
            r"histogram_quantile\(0\.5, sum by \(le, backend\) \(rate\("
            r"prefix_router_request_duration_seconds_bucket",
            id="duration",
        ),
        pytest.param(r"sum by \(kind\) \(rate\(prefix_router_upstream_errors_total", id="errors-by-kind"),
        pytest.param(r"prefix_router_retries_total", id="retries"),
        pytest.param(r"prefix_router_backend_healthy", id="health"),
        pytest.param(r"prefix_router_ring_members", id="ring"),
        pytest.param(r"prefix_router_wait_seconds_bucket", id="waits"),
        pytest.param(r"sum by \(code\) \(rate\(prefix_router_errors_total", id="router-errors"),
        pytest.param(r"sum by \(status_class\) \(rate\(prefix_router_requests_total", id="status-classes"),
        pytest.param(r"prefix_router_backend_state", id="states"),
        pytest.param(
            r"on \(backend_instance\) group_left \(backend\)[^/]*prefix_router_backend_info", id="join"
        ),
        pytest.param(r"process_cpu_seconds_total.*prefix_router_build_info", id="process"),
        pytest.param(
            r"rate\(vllm:prefix_cache_hits_total\{[^}]*\}\[\$__rate_interval\]\)\)"
            r" / sum\(rate\(vllm:prefix_cache_queries_total",
            id="vllm-hit-rate",
        ),
    ],
)
def test_dashboard_has_panel_for(dashboard: dict[str, Any], pattern: str) -> None:
    assert any(re.search(pattern, e) for e in exprs(dashboard)), pattern


def test_no_query_hard_codes_a_rate_range(dashboard: dict[str, Any]) -> None:
    """A fixed [1m] is empty at a 60 s scrape interval; $__rate_interval follows the data source's."""
    for expr in exprs(dashboard):
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", expr


def test_affinity_share_counts_every_cache_affine_branch(dashboard: dict[str, Any]) -> None:
    by_title = {p["title"]: p for p in dashboard["panels"]}
    share = next(
        t for t in by_title["vLLM prefix-cache hit rate"]["targets"] if "affinity" in t["legendFormat"]
    )
    assert re.search(r'branch=~"affinity\|prefix_match\|cache_room"', share["expr"]), share["expr"]
    assert "prefix_router_decisions_total" in share["expr"]


def test_hit_rate_sits_beside_the_decisions(dashboard: dict[str, Any]) -> None:
    by_title = {p["title"]: p for p in dashboard["panels"]}
    decisions = by_title["Decisions by branch"]["gridPos"]
    hit_rate = by_title["vLLM prefix-cache hit rate"]["gridPos"]
    assert decisions["y"] == hit_rate["y"]


def test_dashboard_queries_only_metrics_the_router_exports(dashboard: dict[str, Any]) -> None:
    """Build the router's metrics on a fresh registry and compare family names with the dashboard's."""
    from prometheus_client import CollectorRegistry

    from prefix_router.ops.metrics import FleetSnapshot, RouterMetrics

    registry = CollectorRegistry()
    RouterMetrics(registry, lambda: FleetSnapshot(backends=[], ejection_cap_active=False))
    exported: set[str] = set()
    for family in registry.collect():
        exported.add(family.name)
        exported.update(s.name for s in family.samples)
        if family.type == "counter":
            exported.add(family.name + "_total")
        if family.type == "histogram":
            exported.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    missing = router_metric_names(dashboard) - exported
    assert not missing, f"the dashboard queries metrics the router does not export: {sorted(missing)}"
