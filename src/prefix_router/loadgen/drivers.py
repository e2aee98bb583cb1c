"""A load driver for the demo and the benchmark: send a Workload to an OpenAI endpoint, measure it.

Three arrival models: closed loop (C workers, each sending its next request when the last one
ends), open loop (Poisson arrivals at rate λ, bounded in count and time, so an overloaded fleet shows
queueing instead of slowing the driver down) and timed (a replayed trace: each request at its own
`at_s`). Given several router URLs (replicas behind a load balancer), request i goes to router
i mod n: round robin over the workload's order, which is the arrival order when no turn waits.
Every request streams (`stream: true`, `stream_options.include_usage`), so TTFT is the time to the
first content chunk as a client sees it.

The hit rate is never taken from the client's side: it is the backends' own prefix-cache counters,
diffed over the run (`/sim/stats` of the sim, or vLLM's `vllm:prefix_cache_{hits,queries}_total` on
/metrics), so it is what the engines did, whatever the router or the driver believe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.loadgen.workloads import CHAT_PATH, Workload, WorkloadRequest

BACKEND_HEADER = "x-prefix-router-backend"


@dataclass(slots=True)
class RequestResult:
    index: int
    group: str
    tenant: str | None
    status: int = 0  # 0: no HTTP answer (connect error, timeout)
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    backend: str | None = None  # the router's x-prefix-router-backend header, when it sends one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    sent_s: float = 0.0  # time.monotonic() when it was sent: the order requests really went in

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300


class Progress:
    """Requests done so far, for a ticker to print while a run goes on."""

    def __init__(self) -> None:
        self.done = 0
        self.errors = 0
        self.started = time.monotonic()

    def note(self, result: RequestResult) -> None:
        self.done += 1
        if not result.ok:
            self.errors += 1

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


async def send_one(
    session: aiohttp.ClientSession,
    base_url: str,
    index: int,
    request: WorkloadRequest,
    timeout_s: float,
    routes: Mapping[str, str] | None = None,
) -> RequestResult:
    """Stream one chat completion; the result records failures instead of raising them.

    `routes` (group -> backend URL) bypasses `base_url` for the groups it names: a fixed placement
    to compare routers against; the result's `backend` is then that URL."""
    result = RequestResult(index, request.group, request.tenant)
    if routes and request.group in routes:
        base_url = routes[request.group]
        result.backend = base_url
    chat = request.path == CHAT_PATH
    body = request.body | (
        {"stream": True, "stream_options": {"include_usage": True}} if chat else {"stream": True}
    )
    headers = {"content-type": "application/json", **request.headers()}
    start = result.sent_s = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(
                f"{base_url}{request.path}", data=orjson.dumps(body), headers=headers
            ) as resp:
                result.status = resp.status
                result.backend = resp.headers.get(BACKEND_HEADER, result.backend)
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return result
                await _read_stream(resp, result, start)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        result.latency_s = time.monotonic() - start
    return result


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult, start: float) -> None:
    done = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        chunk = orjson.loads(payload)
        kind = chunk.get("type")
        if kind is not None:  # a Responses API event
            if kind == "response.output_text.delta" and result.ttft_s is None and chunk.get("delta"):
                result.ttft_s = time.monotonic() - start
            elif kind == "response.completed":
                usage = (chunk.get("response") or {}).get("usage") or {}
                result.prompt_tokens = usage.get("input_tokens")
                result.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
                done = True
                break
            continue
        if result.ttft_s is None:
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content") or choice.get("text"):
                    result.ttft_s = time.monotonic() - start
                    break
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            result.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
    if not done:
        result.error = "stream ended early: no [DONE] (chat) or response.completed (Responses)"


BaseUrls = str | Sequence[str]


def _router_for(base_url: BaseUrls, index: int) -> str:
    """Round robin over several routers by request index; one router is just that one."""
    if isinstance(base_url, str):
        return base_url
    return base_url[index % len(base_url)]


class _Dependencies:
    """Completion events per request index, so a chat's next turn waits for the previous one."""

    def __init__(self, count: int) -> None:
        self._events = [asyncio.Event() for _ in range(count)]

    async def wait_for(self, request: WorkloadRequest) -> None:
        if request.after is not None:
            await self._events[request.after].wait()

    def finished(self, index: int) -> None:
        self._events[index].set()


async def run_closed_loop(
    session: aiohttp.ClientSession,
    base_url: BaseUrls,
    workload: Workload,
    *,
    concurrency: int,
    progress: Progress | None = None,
    timeout_s: float = 120.0,
    routes: Mapping[str, str] | None = None,
) -> list[RequestResult]:
    """`concurrency` workers take the requests in workload order; results in workload order."""
    requests = workload.requests
    results: list[RequestResult | None] = [None] * len(requests)
    deps = _Dependencies(len(requests))
    cursor = iter(range(len(requests)))

    async def worker() -> None:
        for index in cursor:
            request = requests[index]
            await deps.wait_for(request)
            result = await send_one(session, _router_for(base_url, index), index, request, timeout_s, routes)
            results[index] = result
            deps.finished(index)
            if progress is not None:
                progress.note(result)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return [r for r in results if r is not None]


async def run_open_loop(
    session: aiohttp.ClientSession,
    base_url: BaseUrls,
    workload: Workload,
    *,
    rate_per_s: float,
    max_requests: int | None = None,
    max_duration_s: float | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    timeout_s: float = 120.0,
    routes: Mapping[str, str] | None = None,
) -> list[RequestResult]:
    """Poisson arrivals at `rate_per_s` (exponential gaps, seeded), in workload order, until the
    workload, `max_requests` or `max_duration_s` of arrivals runs out; waits for all sent to end."""
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be positive")
    rng = random.Random(seed)
    requests = workload.requests[: max_requests if max_requests is not None else None]
    deps = _Dependencies(len(workload.requests))
    results: list[RequestResult] = []
    tasks: list[asyncio.Task[None]] = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    due = start

    async def fire(index: int, request: WorkloadRequest) -> None:
        await deps.wait_for(request)
        result = await send_one(session, _router_for(base_url, index), index, request, timeout_s, routes)
        results.append(result)
        deps.finished(index)
        if progress is not None:
            progress.note(result)

    for index, request in enumerate(requests):
        due += rng.expovariate(rate_per_s)
        if max_duration_s is not None and due - start > max_duration_s:
            break
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(fire(index, request)))
    if tasks:
        await asyncio.gather(*tasks)
    # A request whose predecessor was never sent (the time bound cut it) is never sent either.
    return sorted(results, key=lambda r: r.index)


async def run_timed_loop(
    session: aiohttp.ClientSession,
    base_url: BaseUrls,
    workload: Workload,
    *,
    max_duration_s: float | None = None,
    progress: Progress | None = None,
    timeout_s: float = 300.0,
    routes: Mapping[str, str] | None = None,
) -> list[RequestResult]:
    """Each request at its own `at_s` after the start (a replayed trace), or once the request it
    follows (`after`) has ended, whichever is later; arrivals stop past `max_duration_s`. Waits for
    all sent to end. A request without `at_s` goes at once."""
    requests = workload.requests
    deps = _Dependencies(len(requests))
    results: list[RequestResult] = []
    tasks: list[asyncio.Task[None]] = []
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def fire(index: int, request: WorkloadRequest) -> None:
        await deps.wait_for(request)
        result = await send_one(session, _router_for(base_url, index), index, request, timeout_s, routes)
        results.append(result)
        deps.finished(index)
        if progress is not None:
            progress.note(result)

    order = sorted(range(len(requests)), key=lambda i: (requests[i].at_s or 0.0, i))
    for index in order:
        at_s = requests[index].at_s or 0.0
        if max_duration_s is not None and at_s > max_duration_s:
            break
        delay = start + at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(fire(index, requests[index])))
    if tasks:
        await asyncio.gather(*tasks)
    return sorted(results, key=lambda r: r.index)


def balanced_placement(workload: Workload, urls: Sequence[str]) -> dict[str, str]:
    """A fixed group -> backend map with no group split: largest groups first, each onto the backend
    with the fewest requests so far (ties: the earlier URL). A reference a router cannot beat on
    affinity or balance of whole groups, since it knows every group's size in advance."""
    sizes = Counter(r.group for r in workload.requests)
    loads = dict.fromkeys(urls, 0)
    routes: dict[str, str] = {}
    for group, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        url = min(urls, key=lambda u: loads[u])
        routes[group] = url
        loads[url] += n
    return routes


# -- counters from the backends and the router -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BackendCounters:
    """One backend's cumulative counters at one moment; `peak_inflight` is a high-water mark."""

    queries_tokens: float
    hits_tokens: float
    requests: float
    peak_inflight: int | None = None  # the sim only


async def fetch_sim_stats(session: aiohttp.ClientSession, url: str) -> BackendCounters:
    async with session.get(f"{url}/sim/stats") as resp:
        resp.raise_for_status()
        stats = await resp.json()
    return BackendCounters(
        stats["prefix_cache_queries"], stats["prefix_cache_hits"], stats["requests"], stats["peak_inflight"]
    )


async def fetch_vllm_counters(session: aiohttp.ClientSession, url: str) -> BackendCounters:
    """vLLM's prefix-cache counters (tokens) and finished requests from its /metrics."""
    async with session.get(f"{url}/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    values = prometheus_totals(text)
    requests = sum(v for k, v in values.items() if k == "vllm:request_success")
    return BackendCounters(
        values.get("vllm:prefix_cache_queries", 0.0), values.get("vllm:prefix_cache_hits", 0.0), requests
    )


def prometheus_totals(text: str, label: str | None = None) -> dict[str, float]:
    """Samples of a Prometheus text page summed per family name (counters without `_total`), or per
    value of `label` when given."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            key = family.name if label is None else sample.labels.get(label)
            if key is None:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


async def fetch_router_decisions(session: aiohttp.ClientSession, router_url: str) -> dict[str, float]:
    """prefix_router_decisions_total by branch; {} when the endpoint is not our router."""
    return (await fetch_router_counters(session, router_url)).decisions


@dataclass(frozen=True, slots=True)
class RouterCounters:
    """Our router's cumulative counters at one moment (empty when the endpoint is not our router)."""

    decisions: dict[str, float] = field(default_factory=dict)  # prefix_router_decisions_total by branch
    prefill_waits: dict[str, float] = field(default_factory=dict)  # ..._prefill_waits_total by outcome


def parse_router_counters(text: str) -> RouterCounters:
    counters = RouterCounters()
    wanted = {
        "prefix_router_decisions_total": ("branch", counters.decisions),
        "prefix_router_prefill_waits_total": ("outcome", counters.prefill_waits),
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                label, into = wanted[sample.name]
                into[sample.labels[label]] = sample.value
    return counters


async def fetch_router_counters(session: aiohttp.ClientSession, router_url: str) -> RouterCounters:
    """Decisions by branch and prefill holds by outcome from the router's /metrics."""
    try:
        async with session.get(f"{router_url}/metrics") as resp:
            if resp.status != 200:
                return RouterCounters()
            text = await resp.text()
    except aiohttp.ClientError:
        return RouterCounters()
    return parse_router_counters(text)


def _diff(before: Mapping[str, float] | None, after: Mapping[str, float]) -> dict[str, float]:
    base = before or {}
    return {k: v - base.get(k, 0.0) for k, v in after.items() if v - base.get(k, 0.0) > 0}


async def reset_sim(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Zero the sim's counters and drop its cached blocks, so runs start alike."""
    await reset_backends(session, urls, "/sim/reset")


async def reset_backends(session: aiohttp.ClientSession, urls: Sequence[str], path: str) -> None:
    """POST `path` on every backend: e.g. vLLM's /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1).

    Once more, on a connection of its own, when the pooled one was closed under it: the session
    outlives a run, and an engine closes a connection idle for its keep-alive timeout (uvicorn's
    5 s) just as the next run reuses it. A reset is idempotent; aiohttp retries no POST itself."""
    path = path if path.startswith("/") else "/" + path
    for url in urls:
        target = f"{url.rstrip('/')}{path}"
        try:
            async with session.post(target) as resp:
                resp.raise_for_status()
        except aiohttp.ServerDisconnectedError:
            async with client_session(limit=1) as fresh, fresh.post(target) as resp:
                resp.raise_for_status()


# -- the summary ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class RunSummary:
    requests: int
    errors: int
    wall_s: float
    hit_rate: float  # backends' hits / queries (tokens) over the run
    oracle_hit_rate: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    latency_p50_s: float | None
    throughput_rps: float
    backend_share: dict[str, float]  # share of the run's requests each backend received
    max_mean_load: float  # the busiest backend's request count over the mean
    peak_inflight: dict[str, int]  # high-water mark of running + waiting per backend (sim only)
    overflow_share: float | None  # decisions on overflow or fallback branches / all (our router only)
    branches: dict[str, float] = field(default_factory=dict)
    # Requests our router held while another prefilled their prefix, by outcome (ready | timeout).
    prefill_waits: dict[str, float] = field(default_factory=dict)
    # Over (tenant, group) pairs of tenant-tagged requests (the router keys on tenant + prefix, so a
    # pair is one placement): the share of a pair's requests on its most-used backend, min and mean.
    tenant_stickiness_min: float | None = None
    tenant_stickiness_mean: float | None = None
    tenant_spread: float | None = None  # distinct top backends of the pairs / min(pairs, backends)
    tenant_pairs: int | None = None
    first_error: str | None = None

    @property
    def oracle_ratio(self) -> float | None:
        if not self.oracle_hit_rate:
            return None
        return self.hit_rate / self.oracle_hit_rate

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["oracle_ratio"] = self.oracle_ratio
        return out


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (the value below which a share q of the sample lies); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarise(
    results: Sequence[RequestResult],
    before: dict[str, BackendCounters],
    after: dict[str, BackendCounters],
    *,
    wall_s: float,
    oracle_hit_rate: float | None = None,
    decisions_before: dict[str, float] | None = None,
    decisions_after: dict[str, float] | None = None,
    prefill_waits_before: dict[str, float] | None = None,
    prefill_waits_after: dict[str, float] | None = None,
) -> RunSummary:
    queries = sum(after[u].queries_tokens - before[u].queries_tokens for u in after)
    hits = sum(after[u].hits_tokens - before[u].hits_tokens for u in after)
    per_backend = {u: after[u].requests - before[u].requests for u in after}
    if not any(per_backend.values()):  # no counters of requests: trust the router's header
        header_counts = Counter(r.backend for r in results if r.backend)
        per_backend = {u: float(header_counts.get(u, 0)) for u in after}
    total_requests = sum(per_backend.values())
    share = {u: (n / total_requests if total_requests else 0.0) for u, n in per_backend.items()}
    mean = total_requests / len(per_backend) if per_backend else 0.0
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    branches: dict[str, float] = {}
    overflow: float | None = None
    if decisions_after:
        branches = _diff(decisions_before, decisions_after)
        placed = sum(branches.values())
        overflow = (branches.get("overflow", 0.0) + branches.get("fallback", 0.0)) / placed if placed else 0.0
    errors = [r for r in results if not r.ok]
    summary = RunSummary(
        requests=len(results),
        errors=len(errors),
        wall_s=wall_s,
        hit_rate=hits / queries if queries else 0.0,
        oracle_hit_rate=oracle_hit_rate,
        ttft_p50_s=quantile(ttfts, 0.5),
        ttft_p99_s=quantile(ttfts, 0.99),
        latency_p50_s=quantile([r.latency_s for r in ok], 0.5),
        throughput_rps=len(ok) / wall_s if wall_s > 0 else 0.0,
        backend_share=share,
        max_mean_load=max(per_backend.values()) / mean if mean else 0.0,
        peak_inflight={u: c.peak_inflight for u, c in after.items() if c.peak_inflight is not None},
        overflow_share=overflow,
        branches=branches,
        prefill_waits=_diff(prefill_waits_before, prefill_waits_after or {}),
        first_error=errors[0].error if errors else None,
    )
    _add_stickiness(summary, results, len(after))
    return summary


def _add_stickiness(summary: RunSummary, results: Sequence[RequestResult], n_backends: int) -> None:
    """Stickiness per (tenant, group) pair and the pairs' spread over the fleet; see RunSummary."""
    by_pair: dict[tuple[str, str], Counter[str]] = {}
    for r in results:
        if r.tenant is not None and r.backend is not None:
            by_pair.setdefault((r.tenant, r.group), Counter())[r.backend] += 1
    if not by_pair:
        return
    sticky = [c.most_common(1)[0][1] / c.total() for c in by_pair.values()]
    tops = {c.most_common(1)[0][0] for c in by_pair.values()}
    summary.tenant_stickiness_min = min(sticky)
    summary.tenant_stickiness_mean = statistics.fmean(sticky)
    summary.tenant_spread = len(tops) / max(1, min(len(by_pair), n_backends))
    summary.tenant_pairs = len(by_pair)


async def snapshot(
    session: aiohttp.ClientSession, urls: Sequence[str], *, sim: bool = True
) -> dict[str, BackendCounters]:
    """Every backend's counters now, from /sim/stats (sim) or vLLM's /metrics."""
    fetch = fetch_sim_stats if sim else fetch_vllm_counters
    values = await asyncio.gather(*(fetch(session, u) for u in urls))
    return dict(zip(urls, values, strict=True))


@dataclass(frozen=True, slots=True)
class Target:
    """Where a run sends requests, and where its counters come from."""

    base_url: str  # the router (or any OpenAI endpoint)
    backend_urls: tuple[str, ...]
    # Several routers behind round robin (replicas); when set, requests go to these, not base_url.
    router_urls: tuple[str, ...] = ()
    sim: bool = True  # /sim/stats and /sim/reset; False: vLLM's /metrics
    reset_path: str | None = None  # not the sim: POST this on every backend before a run, when set
    routes: Mapping[str, str] | None = None  # group -> backend URL, bypassing base_url (a fixed placement)


async def measure(
    session: aiohttp.ClientSession,
    target: Target,
    workload: Workload,
    *,
    concurrency: int | None = None,
    rate_per_s: float | None = None,
    timed: bool = False,
    max_duration_s: float | None = None,
    oracle_hit_rate: float | None = None,
    progress: Progress | None = None,
    reset: bool = True,
) -> tuple[RunSummary, list[RequestResult]]:
    """One run: reset (the sim, or `target.reset_path`), snapshot, drive (closed loop if
    `concurrency`, open loop if `rate_per_s`, each request at its `at_s` if `timed`), diff. With
    `target.router_urls`, requests go round robin over them and their counters are summed."""
    if target.sim and reset:
        await reset_sim(session, target.backend_urls)
    elif target.reset_path and reset:
        await reset_backends(session, target.backend_urls, target.reset_path)
    routers: BaseUrls = target.router_urls or target.base_url
    router_list = list(target.router_urls) or [target.base_url]
    before = await snapshot(session, target.backend_urls, sim=target.sim)
    router_before = await fetch_routers_counters(session, router_list)
    start = time.monotonic()
    if concurrency is not None:
        results = await run_closed_loop(
            session, routers, workload, concurrency=concurrency, progress=progress, routes=target.routes
        )
    elif rate_per_s is not None:
        results = await run_open_loop(
            session, routers, workload, rate_per_s=rate_per_s,
            max_duration_s=max_duration_s, progress=progress, routes=target.routes,
        )  # fmt: skip
    elif timed:
        results = await run_timed_loop(
            session, routers, workload, max_duration_s=max_duration_s, progress=progress,
            routes=target.routes,
        )  # fmt: skip
    else:
        raise ValueError("give concurrency (closed loop), rate_per_s (open loop) or timed (trace times)")
    wall_s = time.monotonic() - start
    after = await snapshot(session, target.backend_urls, sim=target.sim)
    router_after = await fetch_routers_counters(session, router_list)
    summary = summarise(
        results, before, after, wall_s=wall_s, oracle_hit_rate=oracle_hit_rate,
        decisions_before=router_before.decisions, decisions_after=router_after.decisions,
        prefill_waits_before=router_before.prefill_waits, prefill_waits_after=router_after.prefill_waits,
    )  # fmt: skip
    return summary, results


async def fetch_routers_counters(
    session: aiohttp.ClientSession, router_urls: Sequence[str]
) -> RouterCounters:
    """The counters of several routers (replicas), summed per label value."""
    total = RouterCounters()
    for counters in await asyncio.gather(*(fetch_router_counters(session, u) for u in router_urls)):
        pairs = ((total.decisions, counters.decisions), (total.prefill_waits, counters.prefill_waits))
        for mine, theirs in pairs:
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0.0) + value
    return total


def client_session(limit: int = 512) -> aiohttp.ClientSession:
    """A session sized for a benchmark: no per-host cap below the concurrency, no total timeout."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
