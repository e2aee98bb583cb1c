"""One proxied request: bounded read → key → pick → lease → relay → release.

The request arrives read whole from http_server.Listener, not through ASGI or a FastAPI route: the data
path pays for no routing, validation or message dicts. `Proxy.handle` raises RouterError only before
the response has started (app.py turns it into an OpenAI-shaped error); once bytes have gone to the
client, failures end the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import random
import time

import orjson

from prefix_router.admission import CapacityWaiters, PrefillEvents
from prefix_router.backends import BackendSet
from prefix_router.errors import (
    BackendOverloaded,
    BadRequest,
    ConnectFailed,
    MethodNotAllowed,
    NoBackend,
    Overloaded,
    StreamBroken,
    UpstreamError,
)
from prefix_router.http_server import Exchange
from prefix_router.metrics import RouterMetrics
from prefix_router.routing.keys import RoutingKey, extract_key
from prefix_router.routing.load import Lease
from prefix_router.routing.picker import Branch, Candidates, Decision, Picker
from prefix_router.routing.shared_view import claim_request, resolve
from prefix_router.settings import Settings
from prefix_router.shared_state import SharedPlacement
from prefix_router.upstream import Upstream, UpstreamResponse, request_headers

BACKEND_HEADER = b"x-prefix-router-backend"
_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
_RETRY_STATUSES = frozenset({429, 503})


class Proxy:
    def __init__(
        self,
        settings: Settings,
        backends: BackendSet,
        picker: Picker,
        upstream: Upstream,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
        shared: SharedPlacement | None = None,
    ) -> None:
        self._settings = settings
        self._shared = shared
        self._key_config = settings.key_config()
        self._backends = backends
        self._picker = picker
        self._upstream = upstream
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._tenant_header = settings.routing.tenant_header.encode("latin-1")
        self._salt_secret = (
            settings.routing.cache_salt_secret.get_secret_value().encode()
            if settings.routing.set_cache_salt and settings.routing.cache_salt_secret
            else None
        )
        self._waiters = CapacityWaiters(settings.balancing.queue_max)
        self._active = 0
        self._retrying = 0
        self._prefill_wait_s = settings.routing.prefill_wait_s
        self._prefills = PrefillEvents()

    @property
    def active_requests(self) -> int:
        return self._active

    def capacity_changed(self) -> None:
        """Something other than a local release may have freed capacity: let waiters look again."""
        self._waiters.wake_all()

    # -- the request ---------------------------------------------------------------------------

    async def handle(self, ex: Exchange) -> None:
        if ex.method in _REFUSED_METHODS:
            raise MethodNotAllowed(f"method {ex.method} is not supported by the router")
        if not ex.raw_path.startswith(b"/"):
            # An absolute URI or authority form: the target is only ever a configured backend.
            raise BadRequest("the request target must be a path starting with '/'")
        body = ex.body
        key = extract_key(ex.path, body, self._tenant(ex.headers), self._key_config)
        if self._salt_secret is not None and body:
            body = self._with_cache_salt(body, key)
        self._active += 1
        try:
            await self._relay(ex, body, key)
        except asyncio.CancelledError:
            if ex.client_gone:
                self._metrics.client_disconnects.inc()
            raise
        finally:
            self._active -= 1

    def _tenant(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        for name, value in headers:
            if name == self._tenant_header:
                return value.decode("latin-1")
        return None

    def _with_cache_salt(self, body: bytes, key: RoutingKey) -> bytes:
        """Set vLLM's cache_salt from the trusted tenant, overwriting whatever the client sent."""
        assert self._salt_secret is not None
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        if not isinstance(doc, dict):
            return body
        tenant = (key.tenant or "").encode("utf-8", "surrogatepass")
        doc["cache_salt"] = hmac.new(self._salt_secret, tenant, hashlib.sha256).hexdigest()
        return orjson.dumps(doc)

    # -- placement -----------------------------------------------------------------------------

    async def _choose(self, key: RoutingKey, exclude: list[str]) -> Decision:
        """A decision within the bound, waiting (bounded) while every backend is at max_inflight,
        and (bounded) while another request prefills this one's prefix on the chosen backend."""
        balancing = self._settings.balancing
        loop = asyncio.get_running_loop()
        deadline = loop.time() + balancing.queue_timeout_s
        wait = self._prefill_wait_s > 0 and not exclude
        queued_s = 0.0  # time spent in the capacity queue, observed once per request
        while True:
            candidates = self._backends.candidates_now(self._rng)
            decision = self._picker.pick(
                key, self._backends.ring, candidates, self._backends.load, exclude, wait=wait
            )
            if decision is None:
                raise NoBackend("no healthy backend is available")
            if decision.wait_for is not None:
                wait = False  # once: after it, the index knows where the prefix went
                await self._wait_for_prefill(decision.wait_for)
                continue
            if self._backends.load.load(decision.backend_id) < balancing.max_inflight:
                if queued_s:
                    self._metrics.waited("capacity", queued_s)
                if self._shared is not None and not exclude and key.blocks:
                    return await self._share(key, decision, candidates)
                return decision
            left = deadline - loop.time()
            began = time.perf_counter()
            woken = await self._waiters.wait(left)
            queued_s += time.perf_counter() - began
            if not woken:
                self._metrics.waited("capacity", queued_s)
                raise Overloaded(
                    f"every backend is at its limit of {balancing.max_inflight} requests in flight",
                    retry_after_s=1,
                )

    async def _share(self, key: RoutingKey, local: Decision, candidates: Candidates) -> Decision:
        """The decision every replica agrees on (routing/shared_view.py): one bounded round trip to
        the shared store; while it is slow or down, the local decision."""
        shared = self._shared
        assert shared is not None
        if not shared.up:
            return local
        picker = self._picker
        request = claim_request(key, local, picker, self._backends.ring)
        answer = await shared.claim(request)
        if answer is None:
            return local
        picker.shared_footprints(answer.figures)
        load = self._backends.load
        resolution = resolve(local, answer, candidates.members, lambda b: picker.fits(b, candidates, load))
        if resolution.takeover is not None:
            shared.take_over(resolution.takeover, request, request.capacity_bytes)
        return resolution.decision

    async def _wait_for_prefill(self, ticket: int) -> None:
        began = time.perf_counter()
        outcome = await self._prefills.wait(ticket, self._prefill_wait_s)
        if outcome is not None:
            self._metrics.prefill_waits.labels(outcome).inc()
            self._metrics.waited("prefill", time.perf_counter() - began)

    def _start_prefill(self, key: RoutingKey, backend: str) -> int | None:
        if self._prefill_wait_s <= 0:
            return None
        ticket = self._picker.prefill_started(key, backend)
        if ticket is not None:
            self._prefills.open(ticket)
        return ticket

    def _end_prefill(self, ticket: int | None) -> None:
        """The first byte arrived (or the attempt ended): release whoever waits on this prefill."""
        if ticket is not None and self._prefills.close(ticket):
            self._picker.prefill_done(ticket)

    def _release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.release()
        self._backends.lease_ended(lease.backend_id)
        if len(self._waiters):
            self._waiters.wake_one()

    def _retry_allowed(self) -> bool:
        up = self._settings.upstream
        budget = max(up.retry_budget_min, int(up.retry_budget_ratio * self._active))
        if self._retrying < budget:
            return True
        self._metrics.retry_budget_exhausted.inc()
        return False

    # -- relay ---------------------------------------------------------------------------------

    async def _relay(self, ex: Exchange, body: bytes, key: RoutingKey) -> None:
        up = self._settings.upstream
        headers = request_headers(ex.headers, ex.client_ip, ex.scheme)
        tried: list[str] = []
        last_error: UpstreamError | None = None
        while True:
            attempt = len(tried)
            retrying = attempt > 0
            try:
                decision = await self._choose(key, tried)
            except NoBackend:
                if last_error is not None:
                    raise last_error from None
                raise
            backend = decision.backend_id
            branch = Branch.RETRY if retrying else decision.branch
            ex.backend = backend
            ex.branch = branch.value
            self._metrics.decided(branch)
            lease = self._backends.load.acquire(backend)
            self._picker.chosen(key, backend)
            if retrying:
                self._retrying += 1
            prefill = self._start_prefill(key, backend)
            started = time.perf_counter()
            try:
                try:
                    resp = await self._upstream.send(ex.method, backend, ex.target, headers, body)
                except ConnectFailed as exc:
                    self._metrics.upstream_errors.labels(backend, exc.kind).inc()
                    self._backends.record_failure(backend, probe=False)
                    tried.append(backend)
                    last_error = exc
                    if len(tried) < up.max_attempts and self._retry_allowed():
                        self._metrics.retries.labels("connect").inc()
                        continue
                    raise
                except UpstreamError as exc:
                    self._metrics.upstream_errors.labels(backend, exc.kind).inc()
                    raise
                if resp.status in _RETRY_STATUSES and len(tried) + 1 < up.max_attempts:
                    tried.append(backend)
                    if self._retry_allowed() and self._has_other(tried):
                        resp.abort()
                        self._metrics.upstream_errors.labels(backend, BackendOverloaded.kind).inc()
                        self._metrics.retries.labels(f"status_{resp.status}").inc()
                        last_error = BackendOverloaded(f"backend answered {resp.status}")
                        continue
                self._backends.record_success(backend, probe=False)
                if resp.status < 400:
                    self._picker.placed(key, backend)
                await self._stream(ex, resp, backend, branch, started, prefill)
                return
            finally:
                self._end_prefill(prefill)
                if retrying:
                    self._retrying -= 1
                self._release(lease)

    def _has_other(self, tried: list[str]) -> bool:
        members = self._backends.candidates.members
        return any(b not in tried for b in members)

    async def _stream(
        self,
        ex: Exchange,
        resp: UpstreamResponse,
        backend: str,
        branch: Branch,
        started: float,
        prefill: int | None = None,
    ) -> None:
        """Relay the response as it arrives; on any exit but the end, drop the upstream connection."""
        series = self._metrics.backend(backend)
        headers = resp.headers
        if self._settings.server.backend_header:
            headers.append((BACKEND_HEADER, backend.encode("latin-1")))
        complete = False
        first_seen = False

        def on_first() -> None:
            nonlocal first_seen
            first_seen = True
            series.ttfb.observe(time.perf_counter() - started)
            self._end_prefill(prefill)

        try:
            ex.start(resp.status, headers)
            ex.flow = resp
            if ex.writing_paused:
                resp.pause_reading()
            try:
                # Body chunks go from the backend's socket callback straight to the client's.
                await resp.pipe(ex.write, on_first, ex.flush)
            except StreamBroken as exc:
                self._metrics.upstream_errors.labels(backend, exc.kind).inc()
                # No [DONE] is invented: the listener closes a response that did not end, which the
                # client sees as a truncated body.
                return
            if not first_seen:
                on_first()
            ex.end()
            complete = True
            resp.finish()
        finally:
            if not complete:
                resp.abort()
            series.answered(branch, resp.status)
            series.duration.observe(time.perf_counter() - started)
