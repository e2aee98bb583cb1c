"""The chart and the router can never disagree about the config file.

The ConfigMap's config.yaml is loaded with the router's own `load_settings`; the schema's `config`
subtree is compared field by field (names, types, enums, bounds) with settings.py; and the defaults in
values.yaml are the router's own defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from chartkit import (
    CHART_DIR,
    RELEASE,
    expected_field_schema,
    load_values_yaml,
    one,
    settings_sections,
)

from prefix_router.errors import SettingsError
from prefix_router.settings import Settings, load_settings

# Fields the chart refuses under `config` (a ConfigMap): they come from a Secret through the environment.
SECRET_FIELDS = {("server", "admin_token"), ("routing", "cache_salt_secret")}
# Where the chart is deliberately stricter than the router: a pod's ports must be fixed, not ephemeral.
TIGHTER: dict[tuple[str, str], dict[str, Any]] = {
    ("server", "port"): {"minimum": 1},
    ("server", "metrics_port"): {"minimum": 1},
}
TIGHTER[("server", "admin_port")] = {"minimum": 1}
# The same rule as the router's validator, at install time.
TIGHTER[("routing", "shared_state_url")] = {"pattern": "^(|(redis|rediss|unix)://.*)$"}

VALUE_SETS: list[Any] = [
    pytest.param({}, id="defaults"),
    pytest.param(
        {"config": {"discovery": {"mode": "dns", "dns_name": "vllm-headless.llm.svc.cluster.local"}}},
        id="dns",
    ),
    pytest.param(
        {"config": {"discovery": {"mode": "kubernetes", "k8s_service": "vllm", "k8s_port_name": "http"}}},
        id="kubernetes",
    ),
    pytest.param(
        {
            "config": {
                "backends": [
                    {"url": "http://vllm-0.vllm-headless.llm.svc.cluster.local:8000"},
                    {"url": "http://vllm-1.vllm-headless.llm.svc.cluster.local:8000", "weight": 2.5},
                ]
            }
        },
        id="static-backends",
    ),
    pytest.param(
        {
            "config": {
                "server": {
                    "metrics_port": 9090,
                    "admin_port": 8081,
                    "drain_timeout_s": 12.5,
                    "log_level": "debug",
                },
                "routing": {"mode": "openai", "prefix_chars": 2048, "vnodes": 320, "prefix_index": False},
                "balancing": {"policy": "round_robin", "max_inflight": 4, "load_factor": 1.1, "spill": False},
                "upstream": {"connect_timeout_s": 0.5, "max_attempts": 1, "retry_budget_ratio": 0.5},
                "health": {"path": "/ping", "unhealthy_threshold": 5, "max_ejected_ratio": 0.3},
                "load_signal": {"enabled": True, "interval_s": 1},
            }
        },
        id="non-defaults",
    ),
]


def rendered_config_file(render: Any, values: dict[str, Any], tmp_path: Path) -> Path:
    manifests = render(values)
    cm = manifests[("ConfigMap", f"{RELEASE}-prefix-router")]
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"], encoding="utf-8")
    return path


@pytest.mark.parametrize("values", VALUE_SETS)
def test_rendered_config_loads_in_the_router(render: Any, values: dict[str, Any], tmp_path: Path) -> None:
    path = rendered_config_file(render, values, tmp_path)
    settings = load_settings(path, environ=False)
    assert isinstance(settings, Settings)
    # What the pod exposes is what the router listens on.
    manifests = render(values)
    (c,) = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == settings.server.port
    assert ports.get("metrics") == settings.server.metrics_port
    assert ports.get("admin") == settings.server.admin_port
    assert settings.server.host == "0.0.0.0"  # reachable by the kubelet's probes and the Service
    # Every key the user set arrived with its value.
    for section, fields in values.get("config", {}).items():
        if section == "backends":
            assert [b.url for b in settings.backends] == [b["url"] for b in fields]
            continue
        for name, value in fields.items():
            assert getattr(getattr(settings, section), name) == value, f"{section}.{name}"


def test_values_yaml_defaults_are_the_router_defaults(tmp_path: Path) -> None:
    """Every `config` value in values.yaml equals the router's default, so installing the chart with no
    values behaves like the router with no config; change both together."""
    config = load_values_yaml()["config"]
    defaults = Settings()
    for section, fields in config.items():
        if section == "backends":
            assert fields == []
            continue
        for name, value in fields.items():
            assert getattr(getattr(defaults, section), name) == value, f"config.{section}.{name}"


def test_schema_config_mirrors_settings(chart: Any) -> None:
    config_schema = chart.schema["properties"]["config"]
    assert config_schema["additionalProperties"] is False
    sections = settings_sections()
    assert set(config_schema["properties"]) == set(sections)
    for section, model in sections.items():
        node = config_schema["properties"][section]
        if section == "backends":
            assert node["type"] == "array"
            node = node["items"]
        assert node["additionalProperties"] is False, section
        expected_names = {n for n in model.model_fields if (section, n) not in SECRET_FIELDS}
        assert set(node["properties"]) == expected_names, section
        required = sorted(n for n, f in model.model_fields.items() if f.is_required())
        assert sorted(node.get("required", [])) == required, section
        for name in expected_names:
            field = model.model_fields[name]
            want = {
                **expected_field_schema(field.annotation, field.metadata),
                **TIGHTER.get((section, name), {}),
            }
            got = {k: v for k, v in node["properties"][name].items() if k != "description"}
            if got.get("minLength") == 1 and name in ("dns_name", "k8s_service"):
                got.pop("minLength")
            assert got == want, f"config.{section}.{name}"


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"balancing": {"policy": "sticky"}}, id="policy"),
        pytest.param({"balancing": {"load_factor": 0.9}}, id="load-factor"),
        pytest.param({"server": {"drain_timeout_s": -1}}, id="negative-drain"),
        pytest.param({"server": {"port": 65536}}, id="port-range"),
        pytest.param({"routing": {"vnodes": 0}}, id="vnodes"),
        pytest.param({"upstream": {"retry_budget_ratio": 1.5}}, id="ratio"),
        pytest.param({"health": {"unhealthy_threshold": 0}}, id="threshold"),
        pytest.param({"discovery": {"mode": "dns"}}, id="dns-needs-a-name"),
        pytest.param({"discovery": {"mode": "kubernetes"}}, id="kubernetes-needs-a-service"),
        pytest.param({"load_signal": {"enable": True}}, id="typo"),
        pytest.param({"routing": {"shared_state_url": "http://redis:6379"}}, id="shared-state-scheme"),
        pytest.param({"routing": {"shared_state_timeout_s": 0}}, id="shared-state-timeout"),
    ],
)
def test_chart_and_router_reject_the_same_bad_config(
    chart: Any, helm: Any, config: dict[str, Any], tmp_path: Path
) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(chart.merge_values({"config": config}))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    with pytest.raises(SettingsError):
        load_settings(path, environ=False)


def test_chart_readme_documents_both_discovery_modes() -> None:
    readme = (CHART_DIR / "README.md").read_text(encoding="utf-8")
    assert "vllm-headless.llm.svc.cluster.local" in readme
    assert "mode: dns" in readme and "mode: kubernetes" in readme
    values_text = (CHART_DIR / "values.yaml").read_text(encoding="utf-8")
    assert "vllm-headless" in values_text


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param({}, "ring", id="two-replicas-by-default"),
        pytest.param({"replicaCount": 1}, "cache_room", id="one-replica"),
        pytest.param({"replicaCount": 1, "autoscaling": {"enabled": True}}, "ring", id="an-hpa"),
        pytest.param(
            {"config": {"routing": {"first_placement": "cache_room"}}}, "cache_room", id="set-by-user"
        ),
        pytest.param(
            {"sharedState": {"enabled": True, "existingSecret": "redis-url"}}, "cache_room", id="shared-state"
        ),
        pytest.param(
            {"sharedState": {"enabled": True, "redis": {"enabled": True}}}, "cache_room", id="chart-redis"
        ),
        pytest.param(
            {"config": {"routing": {"shared_state_url": "redis://redis:6379/0"}}},
            "cache_room",
            id="url-in-config",
        ),
    ],
)
def test_stateless_replicas_place_new_prefixes_by_the_ring(
    render: Any, values: dict[str, Any], expected: str, tmp_path: Path
) -> None:
    """Each replica's cache-room view is its own: without shared state, only the ring is the same
    choice on every replica."""
    settings = load_settings(rendered_config_file(render, values, tmp_path), environ=False)
    assert settings.routing.first_placement.value == expected
