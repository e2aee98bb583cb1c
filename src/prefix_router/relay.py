"""One proxied request: bounded read → key → pick → lease → relay → release.

The request arrives read whole from frontend.http1.Listener, not through ASGI or a FastAPI route: the data
path pays for no routing, validation or message dicts. `Proxy.handle` raises RouterError only before
the response has started (router.py turns it into an OpenAI-shaped error); once bytes have gone to the
client, failures end the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import random
import time
from collections.abc import Callable
from urllib.parse import quote

import orjson

from prefix_router.errors import (
    BackendOverloaded,
    BadRequest,
    ConnectFailed,
    MethodNotAllowed,
    NoBackend,
    Overloaded,
    ResponseNotFound,
    StreamBroken,
    UpstreamError,
)
from prefix_router.fleet.backends import BackendSet
from prefix_router.fleet.models import ModelDirectory
from prefix_router.fleet.shared_state import SharedPlacement
from prefix_router.frontend.exchange import Exchange
from prefix_router.ops.metrics import RouterMetrics
from prefix_router.placement import CapacityWaiters, PrefillEvents
from prefix_router.routing.keys import RoutingKey, extract_key
from prefix_router.routing.load import Lease
from prefix_router.routing.picker import Branch, Candidates, Decision, Picker
from prefix_router.routing.response_ids import (
    RESPONSES_PATH,
    BackendTags,
    StreamRewriter,
    decode_id,
    response_id_in_path,
    rewrite_error_ids,
    rewrite_ids,
)
from prefix_router.routing.ring import HashRing
from prefix_router.routing.shared_view import claim_request, resolve
from prefix_router.settings import Settings
from prefix_router.upstream.client import Upstream, UpstreamResponse, request_headers

BACKEND_HEADER = b"x-prefix-router-backend"
_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
_RETRY_STATUSES = frozenset({429, 503})
# In a body only when it may name a stored response (a longer needle scans faster: 8-11 µs at 32 KB
# against 16-25 µs for the id's mark, benchmarks/responses_rewrite.py).
_PREVIOUS_FIELD = b'"previous_response_id"'


class Proxy:
    def __init__(
        self,
        settings: Settings,
        backends: BackendSet,
        picker: Picker,
        upstream: Upstream,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
        models: ModelDirectory | None = None,
        shared: SharedPlacement | None = None,
    ) -> None:
        self._settings = settings
        self._models = models
        self._shared = shared
        self._tags = BackendTags(b.url for b in backends.backends())
        backends.on_change(lambda: self._tags.update(b.url for b in backends.backends()))
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
        target, pin, responses = ex.target, None, ex.path.startswith(RESPONSES_PATH)
        if responses:
            body, target, pin = self._restore_response_ids(ex, body)
        if self._salt_secret is not None and body:
            body = self._with_cache_salt(body, key)
        self._active += 1
        try:
            await self._relay(ex, body, key, target, pin, responses)
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

    def _restore_response_ids(self, ex: Exchange, body: bytes) -> tuple[bytes, bytes, str | None]:
        """(body, target) with the backend's own response ids, and the backend that stored the one
        the request names (None: it names none the router made). ResponseNotFound when that backend
        has left the fleet."""
        target = ex.target
        named: str | None = None
        in_path = response_id_in_path(ex.path)
        decoded = decode_id(in_path[0]) if in_path is not None else None
        if in_path is not None and decoded is not None:
            named = in_path[0]
            path = ex.raw_path.replace(named.encode("ascii"), decoded[1].encode("ascii"), 1)
            if path == ex.raw_path:  # the client percent-encoded some of it
                path = quote(f"{RESPONSES_PATH}/{decoded[1]}{in_path[1]}").encode("latin-1")
            target = path + b"?" + ex.query if ex.query else path
        elif _PREVIOUS_FIELD in body:
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError:
                doc = None
            previous = doc.get("previous_response_id") if isinstance(doc, dict) else None
            decoded = decode_id(previous) if isinstance(previous, str) else None
            if decoded is not None and isinstance(previous, str):
                named = previous
                body = body.replace(b'"%s"' % previous.encode(), b'"%s"' % decoded[1].encode())
        if named is None or decoded is None:
            return body, target, None
        url = self._tags.url_of(decoded[0])
        if url is None:
            raise ResponseNotFound(
                f"Response with id '{named}' was stored by a backend that is no longer in the fleet; "
                "it cannot be retrieved or continued."
            )
        return body, target, url

    # -- placement -----------------------------------------------------------------------------

    def _scope(self, key: RoutingKey, fleet: Candidates) -> tuple[HashRing, Candidates]:
        """The ring and candidates of the key's model (the whole fleet's without model routing)."""
        route = self._models.route(key.model) if self._models is not None else None
        if route is None:
            return self._backends.ring, fleet
        return route.ring, route.narrow(fleet)

    async def _choose(self, key: RoutingKey, exclude: list[str], pin: str | None = None) -> Decision:
        """A decision within the bound, waiting (bounded) while every backend is at max_inflight,
        and (bounded) while another request prefills this one's prefix on the chosen backend."""
        balancing = self._settings.balancing
        loop = asyncio.get_running_loop()
        deadline = loop.time() + balancing.queue_timeout_s
        wait = self._prefill_wait_s > 0 and not exclude
        queued_s = 0.0  # time spent in the capacity queue, observed once per request
        while True:
            if pin is not None:
                # The backend that stored the response named: no other one could answer.
                present = pin not in exclude and self._backends.get(pin) is not None
                decision = Decision(pin, Branch.AFFINITY) if present else None
            else:
                ring, candidates = self._scope(key, self._backends.candidates_now(self._rng))
                decision = self._picker.pick(key, ring, candidates, self._backends.load, exclude, wait=wait)
            if decision is None:
                raise NoBackend("no healthy backend is available")
            if decision.wait_for is not None:
                wait = False  # once: after it, the index knows where the prefix went
                await self._wait_for_prefill(decision.wait_for)
                continue
            if self._backends.load.load(decision.backend_id) < balancing.max_inflight:
                if queued_s:
                    self._metrics.waited("capacity", queued_s)
                if pin is None and self._shared is not None and not exclude and key.blocks:
                    return await self._share(key, decision, ring, candidates)
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

    async def _share(
        self, key: RoutingKey, local: Decision, ring: HashRing, candidates: Candidates
    ) -> Decision:
        """The decision every replica agrees on (routing/shared_view.py): one bounded round trip to
        the shared store; while it is slow or down, the local decision."""
        shared = self._shared
        assert shared is not None
        if not shared.up:
            return local
        picker = self._picker
        request = claim_request(key, local, picker, ring)
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

    async def _relay(
        self,
        ex: Exchange,
        body: bytes,
        key: RoutingKey,
        target: bytes,
        pin: str | None = None,
        responses: bool = False,
    ) -> None:
        up = self._settings.upstream
        headers = request_headers(ex.headers, ex.client_ip, ex.scheme)
        tried: list[str] = []
        last_error: UpstreamError | None = None
        while True:
            attempt = len(tried)
            retrying = attempt > 0
            try:
                decision = await self._choose(key, tried, pin)
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
                    resp = await self._upstream.send(ex.method, backend, target, headers, body)
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
                    if pin is None and self._retry_allowed() and self._has_other(key, tried):
                        resp.abort()
                        self._metrics.upstream_errors.labels(backend, BackendOverloaded.kind).inc()
                        self._metrics.retries.labels(f"status_{resp.status}").inc()
                        last_error = BackendOverloaded(f"backend answered {resp.status}")
                        continue
                self._backends.record_success(backend, probe=False)
                if resp.status < 400:
                    self._picker.placed(key, backend)
                tag = self._tags.tag_of(backend) if responses else None
                await self._stream(ex, resp, backend, branch, started, prefill, tag)
                return
            finally:
                self._end_prefill(prefill)
                if retrying:
                    self._retrying -= 1
                self._release(lease)

    def _has_other(self, key: RoutingKey, tried: list[str]) -> bool:
        members = self._scope(key, self._backends.candidates)[1].members
        return any(b not in tried for b in members)

    async def _stream(
        self,
        ex: Exchange,
        resp: UpstreamResponse,
        backend: str,
        branch: Branch,
        started: float,
        prefill: int | None = None,
        tag: str | None = None,
    ) -> None:
        """Relay the response as it arrives; on any exit but the end, drop the upstream connection.

        With a backend `tag` (the Responses API), response ids are rewritten on the way: an event
        stream line by line, a JSON body whole (its length changes)."""
        series = self._metrics.backend(backend)
        headers = resp.headers
        if self._settings.server.backend_header:
            headers.append((BACKEND_HEADER, backend.encode("latin-1")))
        sink: Callable[[bytes], None] = ex.write
        rewriter: StreamRewriter | None = None
        whole = tag is not None and not _is_event_stream(headers)
        if tag is not None and not whole:
            rewriter = StreamRewriter(tag, ex.write)
            sink = rewriter.write
        complete = False
        first_seen = False

        def on_first() -> None:
            nonlocal first_seen
            first_seen = True
            series.ttfb.observe(time.perf_counter() - started)
            self._end_prefill(prefill)

        try:
            if whole:
                assert tag is not None
                # A JSON body, read whole: its length changes (a StreamBroken here is the client's 502).
                try:
                    data = await resp.read()
                except StreamBroken as exc:
                    self._metrics.upstream_errors.labels(backend, exc.kind).inc()
                    raise
                data = rewrite_error_ids(data, tag) if resp.status >= 400 else rewrite_ids(data, tag)
                headers = [(n, v) for n, v in headers if n != b"content-length"]
                headers.append((b"content-length", b"%d" % len(data)))
                on_first()
                ex.start(resp.status, headers)
                ex.write(data)
            else:
                ex.start(resp.status, headers)
                ex.flow = resp
                if ex.writing_paused:
                    resp.pause_reading()
                try:
                    # Body chunks go from the backend's socket callback straight to the client's.
                    await resp.pipe(sink, on_first, ex.flush)
                except StreamBroken as exc:
                    self._metrics.upstream_errors.labels(backend, exc.kind).inc()
                    # No [DONE] is invented: the listener closes a response that did not end, which the
                    # client sees as a truncated body.
                    return
                if not first_seen:
                    on_first()
                if rewriter is not None:
                    rewriter.flush()
            ex.end()
            complete = True
            resp.finish()
        finally:
            if not complete:
                resp.abort()
            series.answered(branch, resp.status)
            series.duration.observe(time.perf_counter() - started)


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(n == b"content-type" and v.startswith(b"text/event-stream") for n, v in headers)
