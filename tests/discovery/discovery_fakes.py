"""Fakes for the discovery tests, all on 127.0.0.1: a DNS server answering from a mutable table, and a
Kubernetes API server serving EndpointSlice list and watch the way the real one does (resourceVersions,
history replay for a resumed watch, 410 Gone once a version is compacted away, label selectors).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
from aiohttp import web

from prefix_router.fleet.backends import BackendSpec
from prefix_router.fleet.discovery import Discovery

SERVICE_NAME = "vllm.prefix-router.test."  # never resolved anywhere but the fake DNS server
NAMESPACE = "inference"
SERVICE = "vllm"
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"

_BREAK = object()  # cut the watch connection in the middle of an event
_END = object()  # end the watch cleanly, as the server does when timeoutSeconds expires


class FakeDnsServer(asyncio.DatagramProtocol):
    """Answers A/AAAA queries for SERVICE_NAME from `records`; `mode` simulates failures."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {"A": [], "AAAA": []}
        self.mode = "answer"  # answer | servfail | nxdomain | drop
        self.queries = 0
        self.port = 0
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)
        self.port = transport.get_extra_info("sockname")[1]

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.queries += 1
        query = dns.message.from_wire(data)
        if self.mode == "drop" or self._transport is None:
            return
        response = dns.message.make_response(query)
        question = query.question[0]
        if self.mode == "servfail":
            response.set_rcode(dns.rcode.SERVFAIL)
        elif self.mode == "nxdomain" or question.name.to_text() != SERVICE_NAME:
            response.set_rcode(dns.rcode.NXDOMAIN)
        else:
            record_type = dns.rdatatype.to_text(question.rdtype)
            addresses = self.records.get(record_type, [])
            if addresses:
                response.answer.append(
                    dns.rrset.from_text_list(question.name, 5, "IN", record_type, addresses)
                )
        self._transport.sendto(response.to_wire(), addr)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class AppliedSets:
    """Records every call discovery makes to `apply`."""

    def __init__(self) -> None:
        self.calls: list[frozenset[str]] = []
        self.models: dict[str, frozenset[str]] = {}  # as declared by the last call

    def apply(self, specs: list[BackendSpec]) -> None:
        urls = [spec.url for spec in specs]
        assert len(urls) == len(set(urls)), "apply got duplicates"
        self.calls.append(frozenset(urls))
        self.models = {spec.url: spec.models for spec in specs if spec.models}

    @property
    def last(self) -> set[str] | None:
        return set(self.calls[-1]) if self.calls else None


@asynccontextmanager
async def running(discovery: Discovery, applied: AppliedSets) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(discovery.run(applied.apply))
    try:
        yield task
        if task.done():
            task.result()  # surfaces the exception if discovery crashed
            raise AssertionError("discovery returned; it must run until cancelled")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def endpoint(address: str, *, ready: bool | None = True, terminating: bool | None = None) -> dict[str, Any]:
    conditions: dict[str, Any] = {}
    if ready is not None:
        conditions["ready"] = ready
    if terminating is not None:
        conditions["terminating"] = terminating
    return {"addresses": [address], "conditions": conditions}


def endpoint_slice(
    name: str,
    endpoints: list[dict[str, Any]],
    *,
    service: str = SERVICE,
    address_type: str = "IPv4",
    ports: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"kubernetes.io/service-name": service}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports if ports is not None else [{"name": "http", "port": 8000, "protocol": "TCP"}],
    }


def pod(name: str, ip: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "status": {"podIP": ip, "podIPs": [{"ip": ip}]},
    }


def status_gone(message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "Expired",
        "code": 410,
    }


class FakeEndpointSliceApi:
    """The EndpointSlice collection of one namespace, with list and watch."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.history: list[tuple[int, dict[str, Any]]] = []  # (resourceVersion, event) for resumed watches
        self.compacted_below = 0  # a watch from an older resourceVersion than this gets HTTP 410
        self.failing_lists = 0  # answer this many list requests with a 500 first
        self.requests: list[dict[str, str]] = []
        self.pods: list[dict[str, Any]] = []  # listed (not watched) by a label-exists selector
        self.pod_lists: list[dict[str, str]] = []
        self.url = ""  # set by the fixture once the server listens
        self._watch_queues: list[asyncio.Queue[object]] = []

    # -- test controls ---------------------------------------------------------------------------------

    def upsert(self, obj: dict[str, Any], *, emit: bool = True) -> int:
        """Create or replace a slice; emit=False changes it without an event (as if compacted away)."""
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.slices else "ADDED"
        self.slices[name] = obj
        if emit:
            self._emit({"type": kind, "object": obj})
        return self.version

    def delete(self, name: str, *, emit: bool = True) -> int:
        self.version += 1
        obj = copy.deepcopy(self.slices.pop(name))
        obj["metadata"]["resourceVersion"] = str(self.version)
        if emit:
            self._emit({"type": "DELETED", "object": obj})
        return self.version

    def break_watches(self) -> None:
        for queue in self._watch_queues:
            queue.put_nowait(_BREAK)

    def end_watches(self) -> None:
        for queue in self._watch_queues:
            queue.put_nowait(_END)

    def send_to_watches(self, event: dict[str, Any]) -> None:
        for queue in self._watch_queues:
            queue.put_nowait(event)

    def lists(self) -> list[dict[str, str]]:
        return [r for r in self.requests if r.get("watch", "").lower() != "true"]

    def watches(self) -> list[dict[str, str]]:
        return [r for r in self.requests if r.get("watch", "").lower() == "true"]

    @property
    def open_watches(self) -> int:
        return len(self._watch_queues)

    # -- the API ---------------------------------------------------------------------------------------

    def _emit(self, event: dict[str, Any]) -> None:
        self.history.append((self.version, event))
        for queue in self._watch_queues:
            queue.put_nowait(event)

    def _selected(self, obj: dict[str, Any], selector: str) -> bool:
        key, _, value = selector.partition("=")
        return bool(obj["metadata"].get("labels", {}).get(key) == value)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(query)
        selector = query.get("labelSelector", "")
        if query.get("watch", "").lower() == "true":
            return await self._watch(request, query, selector)
        if self.failing_lists > 0:
            self.failing_lists -= 1
            return web.json_response({"kind": "Status", "code": 500, "message": "etcd is sad"}, status=500)
        items = [obj for obj in self.slices.values() if self._selected(obj, selector)]
        return web.json_response(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def handle_pods(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        self.pod_lists.append(query)
        key = query.get("labelSelector", "")
        items = [p for p in self.pods if not key or key in p["metadata"].get("labels", {})]
        return web.json_response(
            {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": items}
        )

    async def _watch(self, request: web.Request, query: dict[str, str], selector: str) -> web.StreamResponse:
        since = int(query["resourceVersion"])
        if since < self.compacted_below:
            return web.json_response(status_gone(f"too old resource version: {since}"), status=410)
        queue: asyncio.Queue[object] = asyncio.Queue()
        for version, event in self.history:
            if version > since:
                queue.put_nowait(event)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        self._watch_queues.append(queue)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    await response.write_eof()
                    return response
                if item is _BREAK:
                    await response.write(b'{"type": "MODIFIED", "object": {"metad')
                    assert request.transport is not None
                    request.transport.close()
                    return response
                assert isinstance(item, dict)
                if item["type"] == "ERROR" or self._selected(item["object"], selector):
                    await response.write(json.dumps(item).encode() + b"\n")
        finally:
            self._watch_queues.remove(queue)
