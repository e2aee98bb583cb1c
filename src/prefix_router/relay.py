"""One proxied request: bounded read → key → attempts (each placed, sent, released) → relay.

The request arrives read whole from frontend.http1.Listener, not through ASGI or a FastAPI route: the data
path pays for no routing, validation or message dicts. Each attempt asks placement.py for a Placement
and releases it on every exit path; whether a failed attempt is retried is routing/retry.py's verdict.
`Proxy.handle` raises RouterError only before the response has started (router.py turns it into an
OpenAI-shaped error); once bytes have gone to the client, failures end the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
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
    ResponseNotFound,
    StreamBroken,
    UpstreamError,
)
from prefix_router.fleet.backends import BackendSet
from prefix_router.fleet.bytes_per_token import TOKENIZABLE_PATHS, BytesPerTokenProbe
from prefix_router.frontend.exchange import Exchange
from prefix_router.ops.metrics import RouterMetrics
from prefix_router.placement import Placement, Placer
from prefix_router.routing.keys import KeySource, RoutingKey, extract_key
from prefix_router.routing.response_ids import (
    RESPONSES_PATH,
    BackendTags,
    StreamRewriter,
    decode_id,
    response_id_in_path,
    rewrite_error_ids,
    rewrite_ids,
)
from prefix_router.routing.retry import RETRY_STATUSES, AttemptEnd, RetryPolicy, Verdict
from prefix_router.settings import Settings
from prefix_router.upstream.client import Upstream, UpstreamResponse, request_headers

BACKEND_HEADER = b"x-prefix-router-backend"
_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
# In a body only when it may name a stored response (a longer needle scans faster: 8-11 µs at 32 KB
# against 16-25 µs for the id's mark, benchmarks/responses_rewrite.py).
_PREVIOUS_FIELD = b'"previous_response_id"'


class Proxy:
    def __init__(
        self,
        settings: Settings,
        backends: BackendSet,
        placer: Placer,
        upstream: Upstream,
        metrics: RouterMetrics,
        token_samples: BytesPerTokenProbe | None = None,
    ) -> None:
        self._settings = settings
        # Prompts for learning each backend's bytes per token: whole (not cut at max_key_bytes) chat or
        # completions prompts a backend answered, when the probe wants one.
        self._token_samples = token_samples
        self._max_key_bytes = settings.routing.max_key_bytes
        self._tags = BackendTags(b.url for b in backends.backends())
        backends.on_change(lambda: self._tags.update(b.url for b in backends.backends()))
        self._key_config = settings.key_config()
        self._backends = backends
        self._placer = placer
        self._upstream = upstream
        self._metrics = metrics
        self._tenant_header = settings.routing.tenant_header.encode("latin-1")
        self._salt_secret = (
            settings.routing.cache_salt_secret.get_secret_value().encode()
            if settings.routing.set_cache_salt and settings.routing.cache_salt_secret
            else None
        )
        up = settings.upstream
        self._retry = RetryPolicy(up.max_attempts, up.retry_budget_min, up.retry_budget_ratio)
        self._active = 0
        self._retrying = 0

    @property
    def active_requests(self) -> int:
        return self._active

    # -- the request ---------------------------------------------------------------------------

    async def handle(self, ex: Exchange) -> None:
        if ex.method in _REFUSED_METHODS:
            raise MethodNotAllowed(f"method {ex.method} is not supported by the router")
        if not ex.raw_path.startswith(b"/"):
            # The asterisk form (OPTIONS *): the listener has made an absolute form a path, and the
            # target is only ever a configured backend.
            raise BadRequest("the request target must be a path starting with '/'")
        body = ex.body
        key = self._placer.settle_key(extract_key(ex.path, body, self._tenant(ex.headers), self._key_config))
        if self._placer.knows_model(key.model):
            ex.model = key.model
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

    # -- attempts ------------------------------------------------------------------------------

    async def _relay(
        self,
        ex: Exchange,
        body: bytes,
        key: RoutingKey,
        target: bytes,
        pin: str | None = None,
        responses: bool = False,
    ) -> None:
        headers = request_headers(ex.headers, ex.client_ip, ex.scheme)
        tried: list[str] = []
        last_error: UpstreamError | None = None
        while True:
            retrying = bool(tried)
            try:
                placement = await self._placer.place(key, tried, pin)
            except NoBackend:
                if last_error is not None:
                    raise last_error from None
                raise
            backend = placement.backend_id
            ex.backend = backend
            ex.branch = placement.branch.value
            self._metrics.decided(placement.branch)
            if retrying:
                self._retrying += 1
            started = time.perf_counter()
            try:
                try:
                    resp = await self._upstream.send(ex.method, backend, target, headers, body)
                except UpstreamError as exc:
                    self._metrics.upstream_errors.labels(backend, exc.kind).inc()
                    connect = isinstance(exc, ConnectFailed)
                    if connect:
                        self._backends.record_failure(backend, probe=False)
                    tried.append(backend)
                    end = AttemptEnd.CONNECT_FAILED if connect else AttemptEnd.FAILED
                    if self._may_retry(end, None, key, tried, pin):
                        last_error = exc
                        continue
                    raise
                if resp.status in RETRY_STATUSES:
                    tried.append(backend)
                    if self._may_retry(AttemptEnd.ANSWERED, resp.status, key, tried, pin):
                        resp.abort()
                        self._metrics.upstream_errors.labels(backend, BackendOverloaded.kind).inc()
                        last_error = BackendOverloaded(f"backend answered {resp.status}")
                        continue
                self._backends.record_success(backend, probe=False)
                if resp.status < 400:
                    placement.answered()
                    samples = self._token_samples
                    if (
                        samples is not None
                        and key.source is KeySource.OPENAI
                        and key.size < self._max_key_bytes
                        and ex.path in TOKENIZABLE_PATHS
                        and samples.wants(backend)
                    ):
                        samples.offer(backend, ex.path, body, key.size)
                tag = self._tags.tag_of(backend) if responses else None
                await self._stream(ex, resp, placement, started, tag)
                return
            finally:
                if retrying:
                    self._retrying -= 1
                placement.release()

    def _may_retry(
        self, end: AttemptEnd, status: int | None, key: RoutingKey, tried: list[str], pin: str | None
    ) -> bool:
        """The retry policy's verdict on the attempt that just ended, recorded; True: try the next."""
        verdict = self._retry.decide(
            end, status, len(tried), self._retrying, self._active, self._placer.has_other(key, tried, pin)
        )
        if verdict is Verdict.RETRY:
            reason = "connect" if end is AttemptEnd.CONNECT_FAILED else f"status_{status}"
            self._metrics.retries.labels(reason).inc()
            return True
        if verdict is Verdict.NO_RETRY_BUDGET:
            self._metrics.retry_budget_exhausted.inc()
        return False

    # -- relay ---------------------------------------------------------------------------------

    async def _stream(
        self,
        ex: Exchange,
        resp: UpstreamResponse,
        placement: Placement,
        started: float,
        tag: str | None = None,
    ) -> None:
        """Relay the response as it arrives; on any exit but the end, drop the upstream connection.

        With a backend `tag` (the Responses API), response ids are rewritten on the way: an event
        stream line by line, a JSON body whole (its length changes)."""
        backend = placement.backend_id
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
            placement.first_byte()

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
                broken = resp.broken
                if broken is not None:
                    # Nothing has reached the client: it gets the 502 rather than an empty close.
                    self._metrics.upstream_errors.labels(backend, broken.kind).inc()
                    raise broken
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
            series.answered(placement.branch, resp.status)
            series.duration.observe(time.perf_counter() - started)


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(n == b"content-type" and v.startswith(b"text/event-stream") for n, v in headers)
