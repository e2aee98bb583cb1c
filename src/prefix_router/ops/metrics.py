"""Every metric the router exports, on an injected registry; label values from closed sets only.

`backend` is a member URL (the fleet is the bound) or `none`, `branch` a routing.picker.Branch or
`none`, `status_class` one of 1xx..5xx, `kind` an upstream error kind. Never a tenant, a key, a path or
a header value. Every labelled counter starts at 0 for every value known in advance, and for each
backend as it joins, so `rate()` and `increase()` see the first error rather than a series that only
appears with it (https://prometheus.io/docs/practices/instrumentation/#avoid-missing-metrics).
In-flight, health and membership are read from the backend set at scrape time, so the data path pays
nothing for them.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefix_router import __version__, errors
from prefix_router.fleet.backends import HealthState
from prefix_router.routing.picker import Branch

# Seconds; TTFB of a warm prefix is tens of ms, a cold 8k-token prefill a few seconds.
TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# The router's own waits: a capacity wait ends at balancing.queue_timeout_s (0.5 s by default), a
# prefill hold at routing.prefill_wait_s (5 s); both may be set to tens of seconds.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
# Errors the router answers itself, by OpenAI-style error code (a closed set: the codes of
# frontend.local_routes.ERROR_TABLE).
ROUTER_ERROR_CODES = (
    "body_too_large",
    "headers_too_large",
    "bad_request",
    "no_backend",
    "overloaded",
    "upstream_unavailable",
    "upstream_timeout",
    "internal_error",
    "not_implemented",
    "http_version_not_supported",
    "request_timeout",
    "model_not_found",
    "response_not_found",
)
UPSTREAM_ERROR_KINDS = tuple(
    cls.kind
    for cls in (
        errors.ConnectFailed,
        errors.BackendOverloaded,
        errors.NoAnswer,
        errors.FirstByteTimeout,
        errors.StreamBroken,
        errors.StreamIdleTimeout,
    )
)
RETRY_REASONS = ("connect", "status_429", "status_503")  # proxy: connect failure, or the status seen
PREFILL_OUTCOMES = ("ready", "timeout")
# Why a request waited in the router before it was sent: every backend at max_inflight (capacity),
# the backend holding its prefix at max_inflight while no other was clearly less busy (owner), or
# another request prefilling its prefix on the chosen backend (prefill).
WAIT_REASONS = ("capacity", "owner", "prefill")
# The `backend` and `branch` of a request the router answered before any backend was chosen (a body
# over the limit, a malformed head, no healthy backend, a full queue).
UNROUTED = "none"
# Status classes the router itself answers with: its own errors only.
_ROUTER_STATUS_CLASSES = ("4xx", "5xx")
_INITIALISED_STATUS_CLASSES = ("2xx", "4xx", "5xx")
_STATES = tuple(state.value for state in HealthState)


@dataclass(frozen=True, slots=True)
class BackendStatus:
    url: str
    inflight: int
    load: float
    state: str  # a HealthState value: healthy | ejected | draining
    # What first placements weigh: the KV capacity in bytes of key material (None: the policy keeps no
    # ledgers), and the bytes a token stands for on that backend (configured, learnt or the default).
    kv_capacity_bytes: float | None = None
    bytes_per_token: float | None = None


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    backends: list[BackendStatus]
    ejection_cap_active: bool  # a shared fault ejected too many: routing to ejected backends anyway


def status_class(status: int) -> str:
    return STATUS_CLASSES[min(max(status // 100, 1), 5) - 1]


def backend_instance(url: str) -> str:
    """`host:port` of a backend URL: the `instance` label Prometheus gives a scrape of that address,
    so the router's `backend` joins with the engine's own series."""
    return urlsplit(url).netloc


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, snapshot: Callable[[], FleetSnapshot]) -> None:
        self.registry = registry
        self.requests = Counter(
            "prefix_router_requests",
            "Requests answered, by the backend that answered (or none), routing branch (or none) and "
            "status class; includes the errors the router answered itself.",
            ["backend", "branch", "status_class"],
            registry=registry,
        )
        self.model_requests = Counter(
            "prefix_router_model_requests",
            "Requests answered, by model and status class: the model is one the backends list (or an "
            "adapter's configured base), else none, so the label set stays the fleet's, not the clients'.",
            ["model", "status_class"],
            registry=registry,
        )
        self.decisions = Counter(
            "prefix_router_decisions",
            "Routing decisions by branch (one per attempt; retries are branch=retry).",
            ["branch"],
            registry=registry,
        )
        self.duration = Histogram(
            "prefix_router_request_duration_seconds",
            "Time from the routing decision to the last byte relayed, per backend (the router's own "
            "waits before it are prefix_router_wait_seconds).",
            ["backend"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.ttfb = Histogram(
            "prefix_router_time_to_first_byte_seconds",
            "Time from sending the request upstream to the first response body byte, per backend.",
            ["backend"],
            buckets=TTFB_BUCKETS,
            registry=registry,
        )
        self.waits = Histogram(
            "prefix_router_wait_seconds",
            "Time a request waited in the router before it was sent, by reason (capacity: every "
            "backend at max_inflight; prefill: another request prefilling its prefix). Only waits.",
            ["reason"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            "prefix_router_upstream_errors",
            "Failures talking to a backend, by kind.",
            ["backend", "kind"],
            registry=registry,
        )
        self.retries = Counter(
            "prefix_router_retries",
            "Attempts moved to the next backend of the walk, by reason.",
            ["reason"],
            registry=registry,
        )
        self.retry_budget_exhausted = Counter(
            "prefix_router_retry_budget_exhausted",
            "Retries refused because the retry budget was spent.",
            registry=registry,
        )
        self.router_errors = Counter(
            "prefix_router_errors",
            "Error responses produced by the router itself, by error code.",
            ["code"],
            registry=registry,
        )
        self.prefill_waits = Counter(
            "prefix_router_prefill_waits",
            "Requests held while another request prefilled their prefix, by outcome (ready, timeout).",
            ["outcome"],
            registry=registry,
        )
        self.client_disconnects = Counter(
            "prefix_router_client_disconnects",
            "Requests whose client went away before the response ended.",
            registry=registry,
        )
        build = Info("prefix_router_build", "Router version and the Python running it.", registry=registry)
        build.info({"version": __version__, "python": platform.python_version()})
        # The process's CPU, memory, file descriptors and start time; the interpreter; its collector.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self._decision_children = {branch: self.decisions.labels(branch.value) for branch in Branch}
        self._wait_children = {reason: self.waits.labels(reason) for reason in WAIT_REASONS}
        self._backend_series: dict[str, BackendSeries] = {}
        self._model_children: dict[tuple[str, str], Any] = {}
        for code in ROUTER_ERROR_CODES:
            self.router_errors.labels(code)
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        for outcome in PREFILL_OUTCOMES:
            self.prefill_waits.labels(outcome)
        for klass in _ROUTER_STATUS_CLASSES:
            self.requests.labels(UNROUTED, UNROUTED, klass)
        for klass in _INITIALISED_STATUS_CLASSES:
            self._model_children[(UNROUTED, klass)] = self.model_requests.labels(UNROUTED, klass)
        registry.register(_FleetCollector(snapshot))

    def model_answered(self, model: str | None, status: int) -> None:
        """A request finished with `status`, for `model` (a name the fleet serves) or none."""
        name = model if model is not None else UNROUTED
        klass = status_class(status)
        child = self._model_children.get((name, klass))
        if child is None:
            # A model's first answer brings its series at 0 for the classes alerts divide by.
            for k in (*_INITIALISED_STATUS_CLASSES, klass):
                if (name, k) not in self._model_children:
                    self._model_children[(name, k)] = self.model_requests.labels(name, k)
            child = self._model_children[(name, klass)]
        child.inc()

    def decided(self, branch: Branch) -> None:
        self._decision_children[branch].inc()

    def waited(self, reason: str, seconds: float) -> None:
        self._wait_children[reason].observe(seconds)

    def prefill_waited(self, outcome: str, seconds: float) -> None:
        """A request held for another's prefill of its prefix, until `outcome` (ready, timeout)."""
        self.prefill_waits.labels(outcome).inc()
        self.waited("prefill", seconds)

    def answered_by_router(self, status: int, backend: str | None, branch: str | None) -> None:
        """An error the router answered itself, after choosing `backend` on `branch` or before."""
        if backend is None or branch is None or backend not in self._backend_series:
            # (a backend that left while this request failed is not brought back as a series)
            self.requests.labels(UNROUTED, UNROUTED, status_class(status)).inc()
        else:
            self.requests.labels(backend, branch, status_class(status)).inc()

    def backend(self, url: str) -> BackendSeries:
        """A backend's labelled series, looked up once rather than on every request."""
        series = self._backend_series.get(url)
        if series is None:
            series = BackendSeries(self, url)
            self._backend_series[url] = series
        return series

    def forget_backend(self, url: str) -> None:
        """Drop the series of a backend that left, so series stay bounded by the live fleet."""
        self._backend_series.pop(url, None)
        for metric in (self.requests, self.duration, self.ttfb, self.upstream_errors):
            for labels in list(metric._metrics):  # prometheus_client has no public listing
                if labels and labels[0] == url:
                    metric.remove(*labels)


class BackendSeries:
    __slots__ = ("_metrics", "_requests", "duration", "ttfb", "url")

    def __init__(self, metrics: RouterMetrics, url: str) -> None:
        self._metrics = metrics
        self.url = url
        self.ttfb = metrics.ttfb.labels(url)
        self.duration = metrics.duration.labels(url)
        # The series alerts divide by, at 0 from the moment it joins: every branch x 2xx, 4xx, 5xx, and
        # every error kind. 1xx and 3xx (never final answers of an engine) appear on first use, which
        # keeps a backend at 64 samples rather than 76 (a 100-backend scrape renders in tens of ms).
        self._requests: dict[tuple[Branch, int], Any] = {
            (branch, int(klass[0])): metrics.requests.labels(url, branch.value, klass)
            for branch in Branch
            for klass in _INITIALISED_STATUS_CLASSES
        }
        for kind in UPSTREAM_ERROR_KINDS:
            metrics.upstream_errors.labels(url, kind)

    def answered(self, branch: Branch, status: int) -> None:
        key = (branch, min(max(status // 100, 1), 5))
        child = self._requests.get(key)
        if child is None:
            child = self._metrics.requests.labels(self.url, branch.value, status_class(status))
            self._requests[key] = child
        child.inc()


class _FleetCollector(Collector):
    def __init__(self, snapshot: Callable[[], FleetSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        statuses = snap.backends
        inflight = GaugeMetricFamily(
            "prefix_router_backend_inflight",
            "Requests in flight from this router, per backend.",
            labels=["backend"],
        )
        load = GaugeMetricFamily(
            "prefix_router_backend_load",
            "Load the picker sees per backend (in-flight plus other replicas' scraped share).",
            labels=["backend"],
        )
        healthy = GaugeMetricFamily(
            "prefix_router_backend_healthy",
            "1 if the backend takes new requests, else 0.",
            labels=["backend"],
        )
        state = GaugeMetricFamily(
            "prefix_router_backend_state",
            "1 for the backend's current state, 0 for each other state.",
            labels=["backend", "state"],
        )
        info = GaugeMetricFamily(
            "prefix_router_backend_info",
            "1 per backend; backend_instance is the host:port Prometheus calls `instance` when it "
            "scrapes that backend, to join the router's series with the engine's own.",
            labels=["backend", "backend_instance"],
        )
        for s in statuses:
            inflight.add_metric([s.url], s.inflight)
            load.add_metric([s.url], s.load)
            healthy.add_metric([s.url], 1.0 if s.state == HealthState.HEALTHY else 0.0)
            for name in _STATES:
                state.add_metric([s.url, name], 1.0 if s.state == name else 0.0)
            info.add_metric([s.url, backend_instance(s.url)], 1.0)
        members = GaugeMetricFamily("prefix_router_ring_members", "Backends on the hash ring.")
        members.add_metric([], sum(1 for s in statuses if s.state != "draining"))
        cap = GaugeMetricFamily(
            "prefix_router_ejection_cap_active",
            "1 while more backends failed than health.max_ejected_ratio allows and the least-bad are used.",
        )
        cap.add_metric([], 1.0 if snap.ejection_cap_active else 0.0)
        yield from (inflight, load, healthy, state, info, members, cap)
