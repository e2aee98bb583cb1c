"""The Helm chart: lint, render with default and non-default values, schema rejections, pod security,
RBAC only for EndpointSlice discovery, and a grace period that outlasts the drain."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import yaml
from chartkit import CHART_DIR, NAMESPACE, RELEASE, Manifests, kinds, one, with_backends

FULLNAME = f"{RELEASE}-prefix-router"

# Every optional object on, EndpointSlice discovery, a separate metrics port.
EVERYTHING_ON: dict[str, Any] = {
    "config": {
        "server": {"metrics_port": 9090, "admin_port": 8081, "drain_timeout_s": 45.5},
        "discovery": {"mode": "kubernetes", "k8s_service": "vllm", "k8s_port_name": "http"},
        "balancing": {"policy": "least_loaded", "max_inflight": 8},
    },
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12},
    "podDisruptionBudget": {"enabled": True, "minAvailable": "50%"},
    "networkPolicy": {
        "enabled": True,
        "ingressFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        "egress": {"enabled": True, "backendPeers": [{"podSelector": {"matchLabels": {"app": "vllm"}}}]},
    },
    "grafanaDashboard": {"enabled": True},
}

DNS: dict[str, Any] = {
    "config": {"discovery": {"mode": "dns", "dns_name": f"vllm-headless.{NAMESPACE}.svc.cluster.local"}}
}


def pod_spec(manifests: Manifests) -> dict[str, Any]:
    spec: dict[str, Any] = one(manifests, "Deployment")["spec"]["template"]["spec"]
    return spec


def container(manifests: Manifests) -> dict[str, Any]:
    (c,) = pod_spec(manifests)["containers"]
    assert isinstance(c, dict)
    return c


# ---- lint ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, DNS, EVERYTHING_ON], ids=["defaults", "dns", "everything-on"])
def test_helm_lint_is_clean(helm: Any, values: dict[str, Any] | None) -> None:
    report = helm.lint(CHART_DIR, with_backends(values), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert problems == []


# ---- rendering ----------------------------------------------------------------------------------------


def test_defaults_render_the_core_objects_only(render: Any) -> None:
    manifests = render()
    assert kinds(manifests) == {"Deployment", "Service", "ConfigMap"}
    for obj in manifests.values():
        assert obj["metadata"]["namespace"] == NAMESPACE
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    deploy = one(manifests, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    c = container(manifests)
    assert c["args"] == ["serve", "--config", "/etc/prefix-router/config.yaml"]
    assert c["image"] == "prefix-router:0.1.0"  # the chart's appVersion
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    svc = one(manifests, "Service")
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [("http", 8080, "http")]
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]


def test_everything_on_renders_every_optional_object(render: Any) -> None:
    manifests = render(EVERYTHING_ON)
    assert kinds(manifests) == {
        "Deployment",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ServiceMonitor",
    }
    # The HPA owns the replica count.
    assert "replicas" not in one(manifests, "Deployment")["spec"]
    hpa = one(manifests, "HorizontalPodAutoscaler")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (3, 12)
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert one(manifests, "PodDisruptionBudget")["spec"]["minAvailable"] == "50%"
    # A separate metrics port is exposed and scraped.
    c = container(manifests)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "http": 8080,
        "metrics": 9090,
        "admin": 8081,
    }
    svc_ports = {p["name"] for p in one(manifests, "Service")["spec"]["ports"]}
    assert svc_ports == {"http", "metrics"}  # never the admin listener
    sm = one(manifests, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("metrics", "/metrics")]
    np = one(manifests, "NetworkPolicy")["spec"]
    assert np["policyTypes"] == ["Ingress", "Egress"]
    assert np["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    assert {p["port"] for rule in np["ingress"] for p in rule["ports"]} == {"http", "metrics"}
    assert {
        "to": [{"podSelector": {"matchLabels": {"app": "vllm"}}}],
        "ports": [{"port": 8000, "protocol": "TCP"}],
    } in (np["egress"])


def test_service_monitor_uses_the_main_port_without_a_metrics_port(render: Any) -> None:
    sm = one(render({"serviceMonitor": {"enabled": True}}), "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "http"


def test_pdb_max_unavailable_wins(render: Any) -> None:
    pdb = one(render({"podDisruptionBudget": {"enabled": True, "maxUnavailable": 1}}), "PodDisruptionBudget")
    assert pdb["spec"] == {**pdb["spec"], "maxUnavailable": 1}
    assert "minAvailable" not in pdb["spec"]


def test_grafana_dashboard_configmap(render: Any) -> None:
    manifests = render({"grafanaDashboard": {"enabled": True}})
    cm = manifests[("ConfigMap", f"{FULLNAME}-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(cm["data"]["prefix-router.json"])
    assert shipped == json.loads((CHART_DIR / "dashboards" / "prefix-router.json").read_text())


def test_image_digest_wins_over_tag(render: Any) -> None:
    digest = "sha256:" + "a" * 64
    c = container(render({"image": {"repository": "reg.example/pr", "tag": "1.2.3", "digest": digest}}))
    assert c["image"] == f"reg.example/pr@{digest}"


def test_config_change_rolls_the_pods(render: Any) -> None:
    def checksum(values: dict[str, Any]) -> str:
        value: str = one(render(values), "Deployment")["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"
        ]
        return value

    base = checksum({})
    assert len(base) == 64
    assert checksum({}) == base
    assert checksum({"config": {"balancing": {"max_inflight": 16}}}) != base
    assert checksum({"replicaCount": 5}) == base  # not a config change


# ---- pod security -------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON], ids=["defaults", "everything-on"])
def test_pod_security_settings(render: Any, values: dict[str, Any]) -> None:
    manifests = render(values)
    pod = pod_spec(manifests)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(manifests)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 10001
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "add" not in sc["capabilities"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc.get("privileged", False) is False
    # A writable /tmp on the read-only root filesystem, and the config mounted read-only.
    mounts = {m["mountPath"]: m for m in container(manifests)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert mounts["/etc/prefix-router"]["readOnly"] is True
    assert volumes[mounts["/etc/prefix-router"]["name"]]["configMap"]["name"] == FULLNAME


# ---- RBAC and the API token only for EndpointSlice discovery ------------------------------------------


@pytest.mark.parametrize("values", [{}, DNS], ids=["static", "dns"])
def test_no_rbac_and_no_token_without_kubernetes_discovery(render: Any, values: dict[str, Any]) -> None:
    manifests = render(values)
    assert not kinds(manifests) & {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ClusterRole",
        "ClusterRoleBinding",
    }
    pod = pod_spec(manifests)
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod


def test_kubernetes_discovery_gets_read_only_endpointslice_rbac(render: Any) -> None:
    manifests = render(EVERYTHING_ON)
    pod = pod_spec(manifests)
    assert pod["automountServiceAccountToken"] is True
    sa = one(manifests, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"] == FULLNAME
    role = one(manifests, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = one(manifests, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": FULLNAME}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


def test_a_model_label_adds_read_access_to_pods_only(render: Any) -> None:
    discovery = {"mode": "kubernetes", "k8s_service": "vllm", "k8s_model_label": "model"}
    role = one(render({"config": {"discovery": discovery}}), "Role")
    assert role["rules"][1:] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]


def test_rbac_follows_the_watched_namespace(render: Any) -> None:
    values = {"config": {"discovery": {"mode": "kubernetes", "k8s_service": "vllm", "k8s_namespace": "gpu"}}}
    manifests = render(values)
    assert one(manifests, "Role")["metadata"]["namespace"] == "gpu"
    binding = one(manifests, "RoleBinding")
    assert binding["metadata"]["namespace"] == "gpu"
    assert binding["subjects"][0]["namespace"] == NAMESPACE  # the account lives with the pod


def test_bring_your_own_service_account(render: Any) -> None:
    values = {
        "config": {"discovery": {"mode": "kubernetes", "k8s_service": "vllm"}},
        "rbac": {"create": False},
        "serviceAccount": {"name": "mine"},
    }
    manifests = render(values)
    assert not kinds(manifests) & {"ServiceAccount", "Role", "RoleBinding"}
    assert pod_spec(manifests)["serviceAccountName"] == "mine"
    assert pod_spec(manifests)["automountServiceAccountToken"] is True


# ---- shutdown: preStop + drain fit inside the grace period ---------------------------------------------


@pytest.mark.parametrize(
    ("values", "drain_s", "pre_stop_s"),
    [
        pytest.param({}, 30.0, 5, id="defaults"),
        pytest.param({"config": {"server": {"drain_timeout_s": 45.5}}}, 45.5, 5, id="fractional-drain"),
        pytest.param(
            {"config": {"server": {"drain_timeout_s": 0}}, "preStopSleepSeconds": 0}, 0.0, 0, id="zero"
        ),
        pytest.param({"preStopSleepSeconds": 20, "terminationGracePeriodSeconds": 120}, 30.0, 20, id="given"),
    ],
)
def test_grace_period_outlasts_prestop_and_drain(
    render: Any, values: dict[str, Any], drain_s: float, pre_stop_s: int
) -> None:
    manifests = render(values)
    pod = pod_spec(manifests)
    rendered_config = yaml.safe_load(one(manifests, "ConfigMap")["data"]["config.yaml"])
    assert rendered_config["server"]["drain_timeout_s"] == drain_s
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s
    assert pod["terminationGracePeriodSeconds"] >= math.ceil(pre_stop_s + drain_s) + 1
    lifecycle = container(manifests).get("lifecycle")
    if pre_stop_s:
        assert lifecycle is not None
        command = lifecycle["preStop"]["exec"]["command"]
        assert command == ["python", "-c", f"import time; time.sleep({pre_stop_s})"]
    else:
        assert lifecycle is None


def test_a_too_short_grace_period_fails_the_render(chart: Any, helm: Any) -> None:
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds"):
        chart.render(
            values=with_backends({"terminationGracePeriodSeconds": 35}), name=RELEASE, namespace=NAMESPACE
        )


# ---- the schema rejects bad values at install time -----------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        pytest.param({"replicaCount": "two"}, id="replicas-string"),
        pytest.param({"replicaCount": -1}, id="replicas-negative"),
        pytest.param({"replicaCunt": 2}, id="unknown-top-level-key"),
        pytest.param({"image": {"pullPolicy": "Sometimes"}}, id="pull-policy-enum"),
        pytest.param({"service": {"type": "ExternalName"}}, id="service-type-enum"),
        pytest.param({"service": {"port": 70000}}, id="service-port-range"),
        pytest.param({"preStopSleepSeconds": "5s"}, id="prestop-string"),
        pytest.param({"securityContext": {"allowPrivilegeEscalation": True}}, id="privilege-escalation"),
        pytest.param({"autoscaling": {"enabled": "yes"}}, id="bool-as-string"),
        pytest.param({"serviceMonitor": {"interval": "often"}}, id="duration"),
        pytest.param({"podDisruptionBudget": {"minAvailable": "half"}}, id="pdb-int-or-percent"),
        pytest.param({"config": {"balancing": {"policy": "sticky"}}}, id="unknown-policy"),
        pytest.param({"config": {"balancing": {"load_factor": 0.5}}}, id="load-factor-below-1"),
        pytest.param({"config": {"balancing": {"max_inflight": 0}}}, id="max-inflight-zero"),
        pytest.param({"config": {"balancing": {"spil": True}}}, id="unknown-config-key"),
        pytest.param({"config": {"sever": {}}}, id="unknown-config-section"),
        pytest.param({"config": {"server": {"port": 0}}}, id="ephemeral-port"),
        pytest.param({"config": {"server": {"log_level": "verbose"}}}, id="log-level-enum"),
        pytest.param({"config": {"server": {"admin_token": "s3cret"}}}, id="secret-in-configmap"),
        pytest.param({"config": {"routing": {"cache_salt_secret": "s3cret"}}}, id="salt-in-configmap"),
        pytest.param({"config": {"discovery": {"mode": "consul"}}}, id="discovery-mode-enum"),
        pytest.param({"config": {"discovery": {"mode": "dns"}}}, id="dns-without-name"),
        pytest.param({"config": {"discovery": {"mode": "kubernetes"}}}, id="kubernetes-without-service"),
        pytest.param({"config": {"backends": [{"weight": 2}]}}, id="backend-without-url"),
        pytest.param({"config": {"upstream": {"max_attempts": 11}}}, id="attempts-range"),
    ],
)
def test_schema_rejects_bad_values(chart: Any, helm: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(chart.merge_values(values))  # as an install sees them: over the defaults
    # And an install/template would stop on it too, not only an explicit validation.
    with pytest.raises(helm.HelmValuesError):
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("values", [{}, DNS, EVERYTHING_ON], ids=["defaults", "dns", "everything-on"])
def test_schema_accepts_good_values(chart: Any, values: dict[str, Any]) -> None:
    chart.validate_schema(chart.merge_values(values))


# ---- an install without backends is refused, not crash-looping ------------------------------------------


def test_the_default_install_is_refused_naming_the_values_to_set(chart: Any, helm: Any) -> None:
    """Static discovery and no backends: the router would exit 2 in every pod (a crash loop), so the
    render itself stops and says what to set."""
    with pytest.raises(helm.HelmError) as info:
        chart.render(values={}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    message = str(info.value)
    assert "no backends" in message and "config.backends" in message
    assert "config.discovery.mode=dns" in message and "config.discovery.dns_name" in message


@pytest.mark.parametrize(
    "values",
    [
        pytest.param({"config": {"backends": [{"url": "http://vllm-0:8000"}]}}, id="static-list"),
        pytest.param(DNS, id="dns"),
        pytest.param(
            {"config": {"discovery": {"mode": "kubernetes", "k8s_service": "vllm"}}}, id="kubernetes"
        ),
        pytest.param({"env": [{"name": "PREFIX_ROUTER_BACKENDS", "value": "http://vllm-0:8000"}]}, id="env"),
        pytest.param({"envFrom": [{"configMapRef": {"name": "router-env"}}]}, id="env-from"),
    ],
)
def test_any_source_of_backends_lets_the_install_render(chart: Any, values: dict[str, Any]) -> None:
    files = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    assert any(path.endswith("deployment.yaml") for path in files)


def test_notes_say_where_the_backends_come_from(chart: Any) -> None:
    def notes(values: dict[str, Any]) -> str:
        files = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        text: str = files["prefix-router/templates/NOTES.txt"]
        assert "WARNING: config.backends is empty" not in text  # that install is refused now
        assert "/readyz" in text
        return text

    two = {"config": {"backends": [{"url": "http://vllm-0:8000"}, {"url": "http://vllm-1:8000"}]}}
    assert 'discovery mode "static", 2 listed in config.backends.' in notes(two)
    assert 'discovery mode "dns".' in notes(DNS)
    env = {"env": [{"name": "PREFIX_ROUTER_BACKENDS", "value": "http://vllm-0:8000"}]}
    assert "from PREFIX_ROUTER_BACKENDS" in notes(env)
