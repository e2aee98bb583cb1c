"""Kubernetes discovery: the ready endpoints of a Service's EndpointSlices are the backends.

It follows the list-then-watch pattern of client-go's reflector: list once for the state and its
resourceVersion, then watch from there; a broken or ended watch resumes from the last resourceVersion
seen (no event is lost), and only 410 Gone (that version was compacted away) costs a fresh list.
Unlike DNS, the API server is authoritative: when it says no endpoint is ready, the set is empty.
With `model_label`, the pods carrying that label are listed whenever the set changes, and each
backend is declared to serve the model its pod's label names (until its own /v1/models says).

kubernetes_asyncio is an optional extra, imported only when this source is built, so the core router
runs without it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn
from urllib.parse import urlsplit

import aiohttp  # only for the watch's timeouts: kubernetes_asyncio's transport is aiohttp

from prefix_router.errors import SettingsError
from prefix_router.fleet.discovery.base import ApplyBackends, Backoff, MembershipPublisher, backend_url

logger = logging.getLogger(__name__)

POD_NAMESPACE_PATH = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_GONE = 410
_STEADY_WATCH_S = 5.0  # a watch that lasted this long and then ended was not a failure


@dataclass(frozen=True, slots=True)
class KubernetesClient:
    """The parts of kubernetes_asyncio this module uses, imported on demand."""

    client: ModuleType
    config: ModuleType
    watch: ModuleType
    api_exception: type[Exception]


def import_kubernetes_client() -> KubernetesClient:
    try:
        import kubernetes_asyncio.client
        import kubernetes_asyncio.config
        import kubernetes_asyncio.watch
        from kubernetes_asyncio.client.exceptions import ApiException
    except ImportError as exc:
        raise SettingsError(
            "config error: discovery.mode 'kubernetes' needs the kubernetes_asyncio package: "
            "pip install 'prefix-router[kubernetes]'"
        ) from exc
    return KubernetesClient(
        client=kubernetes_asyncio.client,
        config=kubernetes_asyncio.config,
        watch=kubernetes_asyncio.watch,
        api_exception=ApiException,
    )


def read_pod_namespace(path: Path = POD_NAMESPACE_PATH) -> str:
    """The namespace of the pod we run in, as the service account mount reports it."""
    try:
        namespace = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SettingsError(
            f"config error: discovery.k8s_namespace is not set and {path} cannot be read "
            f"({exc.strerror or exc}); set it when running outside a pod"
        ) from exc
    if not namespace:
        raise SettingsError(f"config error: discovery.k8s_namespace is not set and {path} is empty")
    return namespace


def slice_backends(endpoint_slice: Any, scheme: str, port_name: str | None) -> frozenset[str]:
    """The backend URLs one EndpointSlice contributes: its ready, non-terminating endpoints.

    `ready` missing means ready (the API's own semantics: unknown state is treated as ready). The port is
    the one named `port_name`; without a name, the slice's first port. A slice lacking the named port
    contributes nothing: routing to some other port (metrics, say) would be worse than not routing.
    """
    port = _select_port(getattr(endpoint_slice, "ports", None) or (), port_name)
    if port is None:
        return frozenset()
    urls: set[str] = set()
    for endpoint in getattr(endpoint_slice, "endpoints", None) or ():
        conditions = getattr(endpoint, "conditions", None)
        ready = getattr(conditions, "ready", None)
        terminating = getattr(conditions, "terminating", None)
        if ready is False or terminating is True:
            continue
        for address in getattr(endpoint, "addresses", None) or ():
            try:
                urls.add(backend_url(scheme, str(address), port))
            except ValueError:
                logger.warning("kubernetes discovery: skipping unusable endpoint address %r", address)
    return frozenset(urls)


def pod_models(pods: Iterable[Any], label: str) -> dict[str, str]:
    """Pod IP (compressed) -> the model its `label` names, for every pod carrying the label."""
    out: dict[str, str] = {}
    for pod in pods:
        model = (getattr(getattr(pod, "metadata", None), "labels", None) or {}).get(label)
        status = getattr(pod, "status", None)
        if not isinstance(model, str) or not model or status is None:
            continue
        ips = [getattr(entry, "ip", None) for entry in getattr(status, "pod_i_ps", None) or ()]
        for ip in [*ips, getattr(status, "pod_ip", None)]:
            try:
                out[ipaddress.ip_address(str(ip)).compressed] = model
            except ValueError:
                continue
    return out


def backend_models(urls: Iterable[str], by_ip: Mapping[str, str]) -> dict[str, frozenset[str]]:
    """What each backend serves, by the label of the pod at its address."""
    out: dict[str, frozenset[str]] = {}
    for url in urls:
        host = urlsplit(url).hostname or ""
        try:
            model = by_ip.get(ipaddress.ip_address(host).compressed)
        except ValueError:
            model = None
        if model is not None:
            out[url] = frozenset({model})
    return out


def _select_port(ports: Iterable[Any], port_name: str | None) -> int | None:
    for port in ports:
        if port_name is None or getattr(port, "name", None) == port_name:
            number = getattr(port, "port", None)
            return int(number) if number is not None else None
    return None


@dataclass(slots=True)
class _SliceState:
    """What the watch knows: each slice's backends, and the resourceVersion to resume from."""

    resource_version: str | None = None  # None: (re)list before watching
    slices: dict[str, frozenset[str]] = field(default_factory=dict)

    def backends(self) -> frozenset[str]:
        return frozenset().union(*self.slices.values())


class KubernetesDiscovery:
    def __init__(
        self,
        namespace: str,
        service: str,
        *,
        port_name: str | None = None,
        scheme: str = "http",
        api_url: str | None = None,
        model_label: str | None = None,
        initial: Iterable[str] = (),
        watch_timeout_s: int = 300,
        request_timeout_s: float = 10.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
    ) -> None:
        self._namespace = namespace
        self._service = service
        self._port_name = port_name
        self._scheme = scheme
        self._api_url = api_url
        self._model_label = model_label
        self._models_by_ip: dict[str, str] = {}
        self._models_for: frozenset[str] | None = None  # the backend set the pods were listed for
        self._initial = frozenset(initial)
        # The server ends each watch after about this long (as client-go asks, 5-10 min); the client
        # gives up on a silent connection a little later, so a half-open TCP connection cannot hang us.
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._kubernetes = import_kubernetes_client()

    @property
    def label_selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self._service}"

    async def run(self, apply: ApplyBackends) -> None:
        publisher = MembershipPublisher(apply, "kubernetes", self._initial)
        backoff = Backoff(self._backoff_initial_s, self._backoff_max_s)
        state = _SliceState()
        while True:
            try:
                configuration = self._load_configuration()
                async with self._kubernetes.client.ApiClient(configuration) as api_client:
                    await self._list_and_watch(api_client, state, publisher, backoff)
            except Exception as exc:  # configuration or client set-up; never end the task
                logger.warning("kubernetes discovery: %s; retrying", _describe(exc))
                await asyncio.sleep(backoff.next_delay())

    def _load_configuration(self) -> Any:
        configuration = self._kubernetes.client.Configuration()
        if self._api_url:
            configuration.host = self._api_url.rstrip("/")
        else:
            # Keeps re-reading the projected token, which the kubelet rotates.
            self._kubernetes.config.load_incluster_config(client_configuration=configuration)
        return configuration

    async def _list_and_watch(
        self, api_client: Any, state: _SliceState, publisher: MembershipPublisher, backoff: Backoff
    ) -> NoReturn:
        api = self._kubernetes.client.DiscoveryV1Api(api_client)
        pods = self._kubernetes.client.CoreV1Api(api_client)

        async def publish() -> None:
            backends = state.backends()
            if self._model_label is None:
                publisher.publish(backends)
                return
            if backends != self._models_for:
                await self._list_pods(pods, backends)
            publisher.publish(backends, backend_models(backends, self._models_by_ip))

        while True:
            try:
                if state.resource_version is None:
                    await self._list(api, state)
                    await publish()
                await self._watch(api, state, publish, backoff)
                logger.debug("kubernetes discovery: watch ended at %s; resuming", state.resource_version)
            except self._kubernetes.api_exception as exc:
                if getattr(exc, "status", None) == _GONE:
                    logger.info(
                        "kubernetes discovery: resourceVersion %s is gone (410); listing again",
                        state.resource_version,
                    )
                    state.resource_version = None
                else:
                    logger.warning("kubernetes discovery: %s", _describe(exc))
            except Exception as exc:  # connection refused or reset, a timeout, a malformed event
                logger.warning(
                    "kubernetes discovery: watch broke (%s); resuming from %s",
                    _describe(exc),
                    state.resource_version,
                )
            await asyncio.sleep(backoff.next_delay())

    async def _list(self, api: Any, state: _SliceState) -> None:
        slice_list = await api.list_namespaced_endpoint_slice(
            self._namespace, label_selector=self.label_selector, _request_timeout=self._request_timeout_s
        )
        state.slices = {
            item.metadata.name: slice_backends(item, self._scheme, self._port_name)
            for item in slice_list.items or ()
        }
        state.resource_version = slice_list.metadata.resource_version

    async def _list_pods(self, pods: Any, backends: frozenset[str]) -> None:
        """The model label of every labelled pod; a failed list keeps the last answer."""
        assert self._model_label is not None
        try:
            pod_list = await pods.list_namespaced_pod(
                self._namespace, label_selector=self._model_label, _request_timeout=self._request_timeout_s
            )
        except Exception as exc:  # the API, RBAC (pods: list) or the connection
            logger.warning("kubernetes discovery: listing the labelled pods failed: %s", _describe(exc))
            return
        self._models_by_ip = pod_models(pod_list.items or (), self._model_label)
        self._models_for = backends

    async def _watch(
        self, api: Any, state: _SliceState, publish: Callable[[], Awaitable[None]], backoff: Backoff
    ) -> None:
        timeout = aiohttp.ClientTimeout(
            sock_connect=self._request_timeout_s, sock_read=self._watch_timeout_s + self._request_timeout_s
        )
        started = time.monotonic()
        async with self._kubernetes.watch.Watch() as watch:
            events = watch.stream(
                api.list_namespaced_endpoint_slice,
                self._namespace,
                label_selector=self.label_selector,
                resource_version=state.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_s,
                _request_timeout=timeout,
            )
            async for event in events:
                self._apply_event(event, state)
                if watch.resource_version:
                    state.resource_version = str(watch.resource_version)
                await publish()
                backoff.reset()  # the watch made progress: the next break is a fresh one
        if time.monotonic() - started > _STEADY_WATCH_S:
            backoff.reset()  # e.g. the server ended it on schedule (timeoutSeconds)

    def _apply_event(self, event: Any, state: _SliceState) -> None:
        if not isinstance(event, Mapping):
            raise ValueError(f"malformed watch event {str(event)[:200]!r}")
        kind = event.get("type")
        if kind == "BOOKMARK":
            return
        endpoint_slice = event.get("object")
        name = getattr(getattr(endpoint_slice, "metadata", None), "name", None)
        if name is None:
            raise ValueError(f"watch event {kind!r} carries no EndpointSlice name")
        if kind == "DELETED":
            state.slices.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            state.slices[name] = slice_backends(endpoint_slice, self._scheme, self._port_name)
        else:
            logger.warning("kubernetes discovery: ignoring watch event of type %r", kind)


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None and reason is not None:
        return f"API answered {status}: {reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
