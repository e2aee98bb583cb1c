"""The chart's sharedState values: the store's URL from a Secret, or a single-pod Redis of its own;
off by default."""

from __future__ import annotations

from typing import Any

import pytest
from chartkit import NAMESPACE, RELEASE, kinds, one, with_backends

FULLNAME = f"{RELEASE}-prefix-router"
ENV = "PREFIX_ROUTER_ROUTING__SHARED_STATE_URL"


def router_env(manifests: Any) -> dict[str, Any]:
    deploy = manifests[("Deployment", FULLNAME)]
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in c.get("env", [])}


def test_off_by_default(render: Any) -> None:
    manifests = render()
    assert ENV not in router_env(manifests)
    assert ("Deployment", f"{FULLNAME}-redis") not in manifests


def test_an_existing_store_comes_from_a_secret(render: Any) -> None:
    values = {
        "sharedState": {"enabled": True, "existingSecret": "valkey", "existingSecretKey": "uri"},
        "env": [{"name": "EXTRA", "value": "1"}],
    }
    manifests = render(values)
    env = router_env(manifests)
    assert env[ENV] == {"name": ENV, "valueFrom": {"secretKeyRef": {"name": "valkey", "key": "uri"}}}
    assert env["EXTRA"]["value"] == "1"  # the user's env is kept
    assert kinds(manifests) == {"Deployment", "Service", "ConfigMap"}  # no Redis of the chart's


def test_the_chart_can_run_a_single_redis_that_the_routers_use(render: Any) -> None:
    manifests = render({"sharedState": {"enabled": True, "redis": {"enabled": True, "port": 6380}}})
    redis = manifests[("Deployment", f"{FULLNAME}-redis")]
    svc = manifests[("Service", f"{FULLNAME}-redis")]
    assert redis["spec"]["replicas"] == 1
    assert router_env(manifests)[ENV]["value"] == f"redis://{FULLNAME}-redis:6380/0"
    assert svc["spec"]["ports"][0]["port"] == 6380
    pod_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    # The routers' own Service and Deployment must never select the Redis pod.
    router_selector = one_router(manifests)["spec"]["selector"]["matchLabels"]
    assert not router_selector.items() <= pod_labels.items()
    assert not manifests[("Service", FULLNAME)]["spec"]["selector"].items() <= pod_labels.items()
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--save" in c["args"] and "allkeys-lru" in c["args"]


def one_router(manifests: Any) -> dict[str, Any]:
    found: dict[str, Any] = manifests[("Deployment", FULLNAME)]
    return found


def test_a_restricted_egress_lets_the_routers_reach_the_charts_redis(render: Any) -> None:
    values = {
        "sharedState": {"enabled": True, "redis": {"enabled": True}},
        "networkPolicy": {"enabled": True, "egress": {"enabled": True}},
    }
    np = one(render(values), "NetworkPolicy")["spec"]
    rules = [r for r in np["egress"] if any(p["port"] == 6379 for p in r["ports"])]
    assert rules and rules[0]["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"].endswith(
        "-redis"
    )


def test_enabled_without_a_store_fails_the_render(chart: Any, helm: Any) -> None:
    with pytest.raises(helm.HelmRenderError, match="sharedState"):
        chart.render(
            values=with_backends({"sharedState": {"enabled": True}}), name=RELEASE, namespace=NAMESPACE
        )
