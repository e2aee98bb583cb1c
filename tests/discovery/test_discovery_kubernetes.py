"""Kubernetes discovery against a fake API server on loopback (see discovery_fakes.FakeEndpointSliceApi):
list then watch, resume from the last resourceVersion, relist on 410 Gone, readiness filtering.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from discovery_fakes import (
    NAMESPACE,
    SERVICE,
    AppliedSets,
    FakeEndpointSliceApi,
    endpoint,
    endpoint_slice,
    pod,
    running,
    status_gone,
)

from prefix_router.errors import SettingsError
from prefix_router.fleet.discovery import Discovery, build_discovery
from prefix_router.fleet.discovery.kubernetes import read_pod_namespace
from prefix_router.settings import DiscoveryMode, DiscoverySettings

from loopback import eventually


def make_discovery(api_url: str, port_name: str | None = "http", model_label: str | None = None) -> Discovery:
    settings = DiscoverySettings(
        mode=DiscoveryMode.KUBERNETES,
        k8s_namespace=NAMESPACE,
        k8s_service=SERVICE,
        k8s_port_name=port_name,
        k8s_api_url=api_url,
        k8s_model_label=model_label,
    )
    discovery = build_discovery(settings, [])
    assert discovery is not None
    return discovery


async def test_ready_endpoints_of_all_the_services_slices_are_backends(
    k8s_api: FakeEndpointSliceApi,
) -> None:
    fake, url = k8s_api, k8s_api.url
    fake.upsert(
        endpoint_slice(
            "vllm-a",
            [
                endpoint("192.0.2.1"),
                endpoint("192.0.2.2", ready=None),  # unknown readiness counts as ready
                endpoint("192.0.2.3", ready=False),
                endpoint("192.0.2.4", ready=True, terminating=True),
                endpoint("192.0.2.5", ready=False, terminating=True),
            ],
            ports=[{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        )
    )
    fake.upsert(endpoint_slice("vllm-b", [endpoint("2001:db8::5")], address_type="IPv6"))
    fake.upsert(endpoint_slice("other-a", [endpoint("192.0.2.99")], service="other"))
    applied = AppliedSets()
    async with running(make_discovery(url), applied):
        await eventually(lambda: applied.last is not None and fake.open_watches == 1)
    assert applied.last == {"http://192.0.2.1:8000", "http://192.0.2.2:8000", "http://[2001:db8::5]:8000"}
    assert fake.lists()[0]["labelSelector"] == "kubernetes.io/service-name=vllm"
    assert fake.watches()[0]["resourceVersion"] == str(fake.version)


async def test_without_a_port_name_the_slices_first_port_is_used(
    k8s_api: FakeEndpointSliceApi,
) -> None:
    fake, url = k8s_api, k8s_api.url
    ports = [{"name": "serve", "port": 8100}, {"name": "metrics", "port": 9090}]
    fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1")], ports=ports))
    applied = AppliedSets()
    async with running(make_discovery(url, port_name=None), applied):
        await eventually(lambda: applied.last is not None)
    assert applied.last == {"http://192.0.2.1:8100"}


async def test_watch_events_add_modify_and_delete_backends(k8s_api: FakeEndpointSliceApi) -> None:
    fake, url = k8s_api, k8s_api.url
    fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1"), endpoint("192.0.2.2")]))
    applied = AppliedSets()
    async with running(make_discovery(url), applied):
        await eventually(lambda: fake.open_watches == 1)
        assert applied.last == {"http://192.0.2.1:8000", "http://192.0.2.2:8000"}

        fake.upsert(endpoint_slice("vllm-b", [endpoint("192.0.2.3")]))
        await eventually(lambda: applied.last is not None and "http://192.0.2.3:8000" in applied.last)

        # A pod shutting down: terminating, so it leaves the set (and the backend set drains it).
        fake.upsert(
            endpoint_slice("vllm-a", [endpoint("192.0.2.1"), endpoint("192.0.2.2", terminating=True)])
        )
        await eventually(lambda: applied.last == {"http://192.0.2.1:8000", "http://192.0.2.3:8000"})

        fake.delete("vllm-b")
        await eventually(lambda: applied.last == {"http://192.0.2.1:8000"})

        # An event on another service's slice is filtered by the selector and changes nothing.
        calls = len(applied.calls)
        fake.upsert(endpoint_slice("other-a", [endpoint("192.0.2.99")], service="other"))
        fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1"), endpoint("192.0.2.6")]))
        await eventually(lambda: len(applied.calls) > calls)
        assert applied.last == {"http://192.0.2.1:8000", "http://192.0.2.6:8000"}
    assert len(fake.lists()) == 1, "events alone must keep the set current"


async def test_no_ready_endpoint_means_no_backends(k8s_api: FakeEndpointSliceApi) -> None:
    """Unlike DNS, the API server is authoritative: an empty answer is applied."""
    fake, url = k8s_api, k8s_api.url
    fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1")]))
    applied = AppliedSets()
    async with running(make_discovery(url), applied):
        await eventually(lambda: fake.open_watches == 1 and applied.last is not None)
        fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1", ready=False)]))
        await eventually(lambda: len(applied.calls) == 2)
    assert applied.calls == [frozenset({"http://192.0.2.1:8000"}), frozenset()]


async def test_broken_watch_resumes_from_the_last_resource_version(
    k8s_api: FakeEndpointSliceApi,
) -> None:
    fake, url = k8s_api, k8s_api.url
    fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1")]))
    applied = AppliedSets()
    async with running(make_discovery(url), applied):
        await eventually(lambda: fake.open_watches == 1)
        last_seen = fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1"), endpoint("192.0.2.2")]))
        await eventually(lambda: applied.last == {"http://192.0.2.1:8000", "http://192.0.2.2:8000"})

        fake.break_watches()
        await eventually(lambda: fake.open_watches == 0)
        # Changed while no watch was open: only a watch resumed from `last_seen` replays it.
        fake.upsert(endpoint_slice("vllm-b", [endpoint("192.0.2.3")]))

        await eventually(lambda: len(fake.watches()) == 2)
        assert fake.watches()[1]["resourceVersion"] == str(last_seen)
        await eventually(lambda: applied.last is not None and "http://192.0.2.3:8000" in applied.last)

        # A watch the server ends cleanly (its timeoutSeconds) is resumed the same way.
        last_seen = fake.version
        fake.end_watches()
        await eventually(lambda: len(fake.watches()) == 3)
        assert fake.watches()[2]["resourceVersion"] == str(last_seen)
    assert applied.last == {"http://192.0.2.1:8000", "http://192.0.2.2:8000", "http://192.0.2.3:8000"}
    assert len(fake.lists()) == 1, "a resumable watch must not cost a relist"


async def test_http_410_on_resume_forces_a_relist(k8s_api: FakeEndpointSliceApi) -> None:
    fake, url = k8s_api, k8s_api.url
    fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1")]))
    fake.upsert(endpoint_slice("vllm-b", [endpoint("192.0.2.2")]))
    applied = AppliedSets()
    async with running(make_discovery(url), applied):
        await eventually(lambda: fake.open_watches == 1 and applied.last is not None)
        resumed_from = fake.version
        fake.break_watches()
        await eventually(lambda: fake.open_watches == 0)
        # Changes whose events were compacted away: the resumed watch gets 410, only a list shows them.
        fake.delete("vllm-b", emit=False)
        fake.upsert(endpoint_slice("vllm-c", [endpoint("192.0.2.3")]), emit=False)
        fake.compacted_below = fake.version

        await eventually(lambda: len(fake.lists()) == 2)
        await eventually(lambda: applied.last == {"http://192.0.2.1:8000", "http://192.0.2.3:8000"})
        await eventually(lambda: fake.open_watches == 1)
    watches = [w["resourceVersion"] for w in fake.watches()]
    assert str(resumed_from) in watches[1:], "first it tried to resume, and got 410"
    assert watches[-1] == str(fake.version), "then it watched from the relist's resourceVersion"


async def test_error_event_410_forces_a_relist(k8s_api: FakeEndpointSliceApi) -> None:
    fake, url = k8s_api, k8s_api.url
    fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1")]))
    fake.upsert(endpoint_slice("vllm-b", [endpoint("192.0.2.2")]))
    applied = AppliedSets()
    async with running(make_discovery(url), applied):
        await eventually(lambda: fake.open_watches == 1 and applied.last is not None)
        fake.delete("vllm-a", emit=False)
        fake.send_to_watches({"type": "ERROR", "object": status_gone("too old resource version")})
        await eventually(lambda: len(fake.lists()) == 2)
        await eventually(lambda: applied.last == {"http://192.0.2.2:8000"})


async def test_api_errors_are_retried_not_fatal(k8s_api: FakeEndpointSliceApi) -> None:
    fake, url = k8s_api, k8s_api.url
    fake.failing_lists = 2
    fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1")]))
    applied = AppliedSets()
    async with running(make_discovery(url), applied):
        await eventually(lambda: applied.last is not None and fake.open_watches == 1)
        assert len(fake.lists()) == 3
        # A non-410 error event: back off, then watch again from where we were.
        last_seen = fake.version
        error = {"kind": "Status", "code": 500, "reason": "InternalError", "message": "etcd leader changed"}
        fake.send_to_watches({"type": "ERROR", "object": error})
        await eventually(lambda: len(fake.watches()) == 2)
        assert fake.watches()[1]["resourceVersion"] == str(last_seen)
    assert applied.calls == [frozenset({"http://192.0.2.1:8000"})]


def test_missing_kubernetes_package_is_a_clear_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "kubernetes_asyncio" or n.startswith("kubernetes_asyncio.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "kubernetes_asyncio", None)
    settings = DiscoverySettings(mode=DiscoveryMode.KUBERNETES, k8s_namespace=NAMESPACE, k8s_service=SERVICE)
    with pytest.raises(SettingsError, match=r"pip install 'prefix-router\[kubernetes\]'"):
        build_discovery(settings, [])


def test_namespace_defaults_to_the_pods_own(tmp_path: Path) -> None:
    path = tmp_path / "namespace"
    path.write_text("inference\n", encoding="utf-8")
    assert read_pod_namespace(path) == "inference"
    with pytest.raises(SettingsError, match="k8s_namespace"):
        read_pod_namespace(tmp_path / "missing")


async def test_a_pod_label_declares_the_model_its_backend_serves(k8s_api: FakeEndpointSliceApi) -> None:
    fake = k8s_api
    fake.pods = [
        pod("llama-0", "192.0.2.1", {"app": "vllm", "model": "llama-3-8b"}),
        pod("qwen-0", "2001:db8:0:0::7", {"app": "vllm", "model": "qwen-7b"}),
        pod("plain-0", "192.0.2.3", {"app": "vllm"}),
    ]
    fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1"), endpoint("192.0.2.3")]))
    fake.upsert(endpoint_slice("vllm-b", [endpoint("2001:db8::7")], address_type="IPv6"))
    applied = AppliedSets()
    async with running(make_discovery(fake.url, model_label="model"), applied):
        await eventually(lambda: applied.last is not None and len(applied.last) == 3)
        assert applied.models == {
            "http://192.0.2.1:8000": frozenset({"llama-3-8b"}),
            "http://[2001:db8::7]:8000": frozenset({"qwen-7b"}),
        }
        assert fake.pod_lists[0]["labelSelector"] == "model"
        lists = len(fake.pod_lists)
        fake.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1")]))  # a pod leaves: list the pods again
        await eventually(lambda: applied.last is not None and len(applied.last) == 2)
        assert len(fake.pod_lists) == lists + 1
        assert applied.models["http://192.0.2.1:8000"] == frozenset({"llama-3-8b"})


async def test_without_a_model_label_no_pod_is_listed(k8s_api: FakeEndpointSliceApi) -> None:
    k8s_api.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1")]))
    applied = AppliedSets()
    async with running(make_discovery(k8s_api.url), applied):
        await eventually(lambda: applied.last is not None)
    assert k8s_api.pod_lists == [] and applied.models == {}
