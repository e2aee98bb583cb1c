"""The side ports, served by FastAPI under uvicorn: the metrics port and the admin API.

Off the data path: an operator's scrape or drain never waits behind client traffic, and the main port's
listener never loads the web framework.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, SecretStr

from prefix_router.fleet.backends import BackendSet
from prefix_router.fleet.models import ModelDirectory
from prefix_router.ops.metrics import FleetSnapshot
from prefix_router.settings import normalise_backend_url

LocalAnswer = Callable[[str], tuple[int, list[tuple[bytes, bytes]], bytes]]


class DrainRequest(BaseModel):
    url: str


def build_metrics_app(local_answer: LocalAnswer) -> FastAPI:
    """/healthz, /readyz and /metrics for the metrics port: the main port's answers, unchanged."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def answer(path: str) -> Response:
        status, headers, body = local_answer(path)
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


def _error(status: int, message: str, kind: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": kind, "code": None}}, status_code=status)


def build_admin_app(
    token: SecretStr | None,
    backends: BackendSet,
    models: ModelDirectory,
    snapshot: Callable[[], FleetSnapshot],
) -> FastAPI:
    """GET /admin/backends (state, load, KV capacity, bytes per token, models of each) and POST
    /admin/backends/drain."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def authorised(request: Request) -> bool:
        if token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token.get_secret_value()}".encode())

    @app.get("/admin/backends")
    async def list_backends(request: Request) -> Response:
        if not authorised(request):
            return _error(401, "admin token required", "authentication_error")
        snap = snapshot()
        return JSONResponse(
            {
                "backends": [
                    {
                        "url": s.url,
                        "state": s.state,
                        "inflight": s.inflight,
                        "load": s.load,
                        "kv_capacity_bytes": s.kv_capacity_bytes,
                        "bytes_per_token": s.bytes_per_token,
                        "models": sorted(models.served_by(s.url) or ()),
                    }
                    for s in snap.backends
                ],
                "ring_members": list(backends.ring.members),
                "ejection_cap_active": snap.ejection_cap_active,
            }
        )

    @app.post("/admin/backends/drain")
    async def drain(request: Request, body: DrainRequest) -> Response:
        if not authorised(request):
            return _error(401, "admin token required", "authentication_error")
        try:
            url = normalise_backend_url(body.url)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        if not backends.drain(url):
            return _error(404, "no such backend", "invalid_request_error")
        return JSONResponse({"draining": url})

    return app
