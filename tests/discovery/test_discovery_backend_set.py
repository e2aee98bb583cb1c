"""Discovery plugged into a real BackendSet: a membership change rebuilds the ring, moves only the keys
consistent hashing says must move (about 1/(N+1) on an add, 1/N on a remove), and a pod that starts
terminating drains instead of losing its in-flight requests.
"""

from __future__ import annotations

import asyncio
import random

from discovery_fakes import (
    NAMESPACE,
    SERVICE,
    SERVICE_NAME,
    FakeDnsServer,
    FakeEndpointSliceApi,
    endpoint,
    endpoint_slice,
)

from prefix_router.fleet.backends import BackendSet, BackendSpec, HealthPolicy, HealthState
from prefix_router.fleet.discovery import DnsDiscovery, build_discovery
from prefix_router.settings import DiscoveryMode, DiscoverySettings

from loopback import eventually

KEY_COUNT = 20_000
MOVE_TOLERANCE = 1.2  # moved share may be at most this multiple of the ideal


def key_hashes() -> list[int]:
    rng = random.Random(20240611)
    return [rng.getrandbits(64) for _ in range(KEY_COUNT)]


def owners(backend_set: BackendSet, keys: list[int]) -> list[str | None]:
    return [backend_set.ring.primary(h) for h in keys]


async def test_dns_membership_changes_rebuild_the_ring_and_move_few_keys(dns_server: FakeDnsServer) -> None:
    fleet = [f"192.0.2.{i}" for i in range(1, 9)]
    dns_server.records = {"A": list(fleet), "AAAA": []}
    backend_set = BackendSet([], vnodes=160, health=HealthPolicy())
    discovery = DnsDiscovery(
        SERVICE_NAME, 8000, interval_s=0.05, nameserver="127.0.0.1", nameserver_port=dns_server.port
    )
    keys = key_hashes()
    task = asyncio.create_task(discovery.run(backend_set.replace_members))
    try:
        await eventually(lambda: len(backend_set.ring) == 8)
        before = owners(backend_set, keys)
        ring_before = backend_set.ring

        # Add one of N+1: about 1/(N+1) of the keys move, and every one of them onto the new backend.
        dns_server.records = {"A": [*fleet, "192.0.2.9"], "AAAA": []}
        await eventually(lambda: len(backend_set.ring) == 9)
        assert backend_set.ring is not ring_before, "membership change must build a new ring"
        after_add = owners(backend_set, keys)
        moved = [(old, new) for old, new in zip(before, after_add, strict=True) if old != new]
        assert {new for _, new in moved} == {"http://192.0.2.9:8000"}
        assert len(moved) / KEY_COUNT <= MOVE_TOLERANCE / 9
        assert len(moved) / KEY_COUNT >= 1 / 9 / MOVE_TOLERANCE, "the new backend must take its share"

        # Remove one of N: exactly its keys move, about 1/N of them, spread over the others.
        removed = "http://192.0.2.1:8000"
        dns_server.records = {"A": [*fleet[1:], "192.0.2.9"], "AAAA": []}
        await eventually(lambda: removed not in backend_set.ring.members)
        assert len(backend_set.ring) == 8
        after_remove = owners(backend_set, keys)
        moved_keys = [i for i in range(KEY_COUNT) if after_add[i] != after_remove[i]]
        assert all(after_add[i] == removed for i in moved_keys)
        assert removed not in after_remove
        share = len(moved_keys) / KEY_COUNT
        assert 1 / 9 / MOVE_TOLERANCE <= share <= MOVE_TOLERANCE / 9
        assert len({after_remove[i] for i in moved_keys}) > 4, "a removed backend's keys spread out"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_terminating_pod_drains_in_the_backend_set(k8s_api: FakeEndpointSliceApi) -> None:
    k8s_api.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1"), endpoint("192.0.2.2")]))
    settings = DiscoverySettings(
        mode=DiscoveryMode.KUBERNETES,
        k8s_namespace=NAMESPACE,
        k8s_service=SERVICE,
        k8s_port_name="http",
        k8s_api_url=k8s_api.url,
    )
    static = [BackendSpec("http://127.0.0.1:8000")]
    discovery = build_discovery(settings, static)
    assert discovery is not None
    backend_set = BackendSet(static, vnodes=64, health=HealthPolicy())
    leaving = "http://192.0.2.2:8000"
    task = asyncio.create_task(discovery.run(backend_set.replace_members))
    try:
        await eventually(lambda: set(backend_set.ring.members) == {"http://192.0.2.1:8000", leaving})
        assert backend_set.get("http://127.0.0.1:8000") is None, "the static seed is replaced"
        lease = backend_set.load.acquire(leaving)  # a request still streaming from the pod

        shutting_down = endpoint("192.0.2.2", terminating=True)
        k8s_api.upsert(endpoint_slice("vllm-a", [endpoint("192.0.2.1"), shutting_down]))
        await eventually(lambda: leaving not in backend_set.candidates.members)
        draining = backend_set.get(leaving)
        assert draining is not None and draining.state is HealthState.DRAINING
        assert leaving in backend_set.ring.members, "on the ring, skipped, until its last request ends"

        lease.release()
        backend_set.lease_ended(leaving)
        assert backend_set.get(leaving) is None, "gone once its last request ended"
        assert backend_set.ring.members == ("http://192.0.2.1:8000",)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
