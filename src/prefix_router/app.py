"""`create_app(settings)`: the router, its resources owned by start()/stop().

The main port's requests come from http_server.Listener to `RouterApp.handle`: the local routes
(/healthz, /readyz, /metrics) are answered here, everything else is `Proxy.handle`. FastAPI serves
the metrics port and the admin API on their own listeners. This module holds the only table from
errors to HTTP statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

from prefix_router import errors
from prefix_router.backends import BackendSet, BackendSpec, HealthPolicy
from prefix_router.discovery import build_discovery
from prefix_router.health import HealthProber
from prefix_router.http_server import Exchange, ResponseParts
from prefix_router.load_signal import LoadSignalScraper
from prefix_router.metrics import BackendStatus, FleetSnapshot, RouterMetrics
from prefix_router.proxy import Proxy
from prefix_router.routing.picker import Picker
from prefix_router.settings import Settings, normalise_backend_url
from prefix_router.upstream import Upstream

log = logging.getLogger("prefix_router")
access_log = logging.getLogger("prefix_router.access")

LOCAL_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Matched on the path as sent: `/%68ealthz` is the backend's to answer, as nginx's exact `location =`
# matches the raw URI; a decoded match would answer for a path the client did not write.
_LOCAL_RAW_PATHS = frozenset(p.encode() for p in LOCAL_PATHS)
_JSON = b"application/json"

# error class -> (status, OpenAI error type, code). The first match in MRO order wins.
ERROR_TABLE: dict[type[errors.RouterError], tuple[int, str, str]] = {
    errors.BodyTooLarge: (413, "invalid_request_error", "body_too_large"),
    errors.MethodNotAllowed: (405, "invalid_request_error", "bad_request"),
    errors.RequestTimeout: (408, "invalid_request_error", "request_timeout"),
    errors.HeadersTooLarge: (431, "invalid_request_error", "headers_too_large"),
    errors.NotImplementedHere: (501, "invalid_request_error", "not_implemented"),
    errors.VersionNotSupported: (505, "invalid_request_error", "http_version_not_supported"),
    errors.BadRequest: (400, "invalid_request_error", "bad_request"),
    errors.NoBackend: (503, "server_error", "no_backend"),
    errors.Overloaded: (503, "server_error", "overloaded"),
    errors.FirstByteTimeout: (504, "server_error", "upstream_timeout"),
    errors.UpstreamError: (502, "server_error", "upstream_unavailable"),
    errors.RequestError: (400, "invalid_request_error", "bad_request"),
    errors.InternalError: (500, "server_error", "internal_error"),
    errors.RouterError: (500, "server_error", "internal_error"),
}


def error_code(exc: errors.RouterError) -> tuple[int, str, str]:
    """(status, OpenAI error type, code) of the nearest class of `exc` in ERROR_TABLE."""
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return ERROR_TABLE[errors.RouterError]  # pragma: no cover - every RouterError has an ancestor entry


def error_response_parts(exc: errors.RouterError) -> ResponseParts:
    """Status, headers and OpenAI-shaped JSON body for an error the router answers itself."""
    status, kind, code = error_code(exc)
    body = orjson.dumps({"error": {"message": str(exc), "type": kind, "code": code, "param": None}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if isinstance(exc, errors.Overloaded):
        headers.append((b"retry-after", str(exc.retry_after_s).encode()))
    if status in (400, 405, 408, 413, 431, 501, 505):
        headers.append((b"connection", b"close"))
    return status, headers, body


class DrainRequest(BaseModel):
    url: str


class RouterApp:
    """The router: `handle` answers the main port; `.admin_app` and `.metrics_app` (ASGI) share its state."""

    def __init__(self, settings: Settings, *, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        h = settings.health
        self.backends = BackendSet(
            [BackendSpec(b.url, b.weight) for b in settings.backends],
            vnodes=settings.routing.vnodes,
            health=HealthPolicy(
                unhealthy_threshold=h.unhealthy_threshold,
                healthy_threshold=h.healthy_threshold,
                max_ejected_ratio=h.max_ejected_ratio,
                slow_start_s=h.slow_start_s,
                probe_grace_s=2 * h.interval_s,
            ),
        )
        self.picker = Picker(settings.balance_config(), rng)
        self.upstream = Upstream(settings.upstream)
        self.metrics = RouterMetrics(self.registry, self.snapshot)
        self.proxy = Proxy(settings, self.backends, self.picker, self.upstream, self.metrics, rng)
        self.draining = False
        if settings.server.access_log:
            access_log.setLevel(logging.INFO)  # shown whatever log_level says: it was asked for
        self._known: set[str] = set(b.url for b in self.backends.backends())
        self.backends.on_change(self._membership_changed)
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics_app = self._build_metrics_app()
        self.admin_app = self._build_admin_app()

    # -- the main port -------------------------------------------------------------------------

    async def handle(self, ex: Exchange) -> None:
        if ex.raw_path in _LOCAL_RAW_PATHS:
            if ex.method in ("GET", "HEAD"):
                ex.respond(*self.local_answer(ex.path))
            else:
                ex.respond(*self.render_error(errors.MethodNotAllowed(f"{ex.path} answers GET only")))
            return
        try:
            await self.proxy.handle(ex)
        except errors.RouterError as exc:
            if not ex.started:
                ex.respond(*self.render_error(exc))

    # -- the access log (http_server.AccessLog), when server.access_log is on --------------------

    def answered(self, ex: Exchange, duration_s: float) -> None:
        """One line per request; 499 for a client that left first, as nginx logs it. Never a body,
        a tenant, or a header value."""
        status = 499 if ex.client_gone else ex.status
        access_log.info(
            '%s "%s %s HTTP/%s" %d backend=%s branch=%s ms=%.1f',
            ex.client_ip or "-",
            ex.method,
            ex.target.decode("latin-1"),
            "1.1" if ex.http_11 else "1.0",
            status,
            ex.backend or "-",
            ex.branch or "-",
            duration_s * 1000,
        )

    def refused(self, client_ip: str | None, target: bytes, status: int) -> None:
        """The access line of a request the listener refused before it was whole (400/408/413/431)."""
        access_log.info(
            '%s "- %s -" %d backend=- branch=- ms=-',
            client_ip or "-",
            target.decode("latin-1") or "-",
            status,
        )

    def render_error(self, exc: errors.RouterError) -> ResponseParts:
        """An error the router answers itself, counted by its code."""
        parts = error_response_parts(exc)
        self.metrics.router_errors.labels(error_code(exc)[2]).inc()
        return parts

    def local_answer(self, path: str) -> ResponseParts:
        """(status, headers, body) of /healthz, /readyz or /metrics, on every port that serves them."""
        if path == "/metrics":
            body = generate_latest(self.registry)
            return 200, [(b"content-type", CONTENT_TYPE_LATEST.encode()), _length(body)], body
        status, text = 200, b'{"status":"ok"}'
        if path == "/readyz":
            if self.draining:
                status, text = 503, b'{"status":"draining"}'
            elif not self.backends.is_ready():
                status, text = 503, b'{"status":"no healthy backend"}'
            else:
                text = b'{"status":"ready"}'
        return status, [(b"content-type", _JSON), _length(text)], text

    # -- resources -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.upstream.start()
        prober = HealthProber(self.settings.health, self.backends, self.upstream)
        self._spawn(prober.run(), "health")
        discovery = build_discovery(
            self.settings.discovery, [BackendSpec(b.url, b.weight) for b in self.settings.backends]
        )
        if discovery is not None:
            self._spawn(discovery.run(self.backends.replace_members), "discovery")
        if self.settings.load_signal.enabled:
            scraper = LoadSignalScraper(
                self.settings.load_signal, self.backends, self.upstream, self.proxy.capacity_changed
            )
            self._spawn(scraper.run(), "load_signal")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await self.upstream.close()

    def _spawn(self, coro: Any, name: str) -> None:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background task %s failed", name)

        self._tasks.append(asyncio.get_running_loop().create_task(guarded(), name=f"prefix_router.{name}"))

    def snapshot(self) -> FleetSnapshot:
        load = self.backends.load
        return FleetSnapshot(
            [
                BackendStatus(b.url, load.inflight(b.url), load.load(b.url), b.state.value)
                for b in self.backends.backends()
            ],
            self.backends.all_ejected_override,
        )

    def _membership_changed(self) -> None:
        now = {b.url for b in self.backends.backends()}
        for gone in self._known - now:
            self.picker.forget(gone)
            self.metrics.forget_backend(gone)
            self.backends.load.clear_external(gone)
            self.upstream.forget(gone)
        self._known = now

    # -- local routes and admin ----------------------------------------------------------------

    def _build_metrics_app(self) -> FastAPI:
        """/healthz, /readyz and /metrics for the metrics port."""
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        def answer(path: str) -> Response:
            status, headers, body = self.local_answer(path)
            media = dict(headers)[b"content-type"].decode()
            return Response(body, status_code=status, media_type=media)

        @app.get("/healthz")
        async def healthz() -> Response:
            return answer("/healthz")

        @app.get("/readyz")
        async def readyz() -> Response:
            return answer("/readyz")

        @app.get("/metrics")
        async def metrics() -> Response:
            return answer("/metrics")

        return app

    def _build_admin_app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        token = self.settings.server.admin_token

        def authorised(request: Request) -> bool:
            if token is None:
                return True
            given = request.headers.get("authorization", "")
            return hmac.compare_digest(given.encode(), f"Bearer {token.get_secret_value()}".encode())

        def denied() -> Response:
            body = {
                "error": {"message": "admin token required", "type": "authentication_error", "code": None}
            }
            return JSONResponse(body, status_code=401)

        @app.get("/admin/backends")
        async def list_backends(request: Request) -> Response:
            if not authorised(request):
                return denied()
            snap = self.snapshot()
            return JSONResponse(
                {
                    "backends": [
                        {"url": s.url, "state": s.state, "inflight": s.inflight, "load": s.load}
                        for s in snap.backends
                    ],
                    "ring_members": list(self.backends.ring.members),
                    "ejection_cap_active": snap.ejection_cap_active,
                }
            )

        @app.post("/admin/backends/drain")
        async def drain(request: Request, body: DrainRequest) -> Response:
            if not authorised(request):
                return denied()
            try:
                url = normalise_backend_url(body.url)
            except ValueError as exc:
                err = {"error": {"message": str(exc), "type": "invalid_request_error", "code": None}}
                return JSONResponse(err, status_code=400)
            if not self.backends.drain(url):
                err = {"error": {"message": "no such backend", "type": "invalid_request_error", "code": None}}
                return JSONResponse(err, status_code=404)
            return JSONResponse({"draining": url})

        return app


def _length(body: bytes) -> tuple[bytes, bytes]:
    return b"content-length", str(len(body)).encode()


def create_app(settings: Settings, *, rng: random.Random | None = None) -> RouterApp:
    """A fresh router: every test and every process builds its own."""
    return RouterApp(settings, rng=rng)
