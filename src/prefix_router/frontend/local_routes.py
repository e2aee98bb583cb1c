"""What the router answers itself on the main port: /healthz, /readyz, /metrics, and its errors.

This module holds the only table from errors to HTTP statuses; every error body is OpenAI-shaped
(`{"error": {"message", "type", "code", "param"}}`) so SDKs can read it.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from prefix_router import errors
from prefix_router.frontend.exchange import ResponseParts

LOCAL_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Matched on the path as sent: `/%68ealthz` is the backend's to answer, as nginx's exact `location =`
# matches the raw URI; a decoded match would answer for a path the client did not write.
LOCAL_RAW_PATHS = frozenset(p.encode() for p in LOCAL_PATHS)
JSON = b"application/json"

# error class -> (status, OpenAI error type, code). The first match in MRO order wins.
ERROR_TABLE: dict[type[errors.RouterError], tuple[int, str, str]] = {
    errors.BodyTooLarge: (413, "invalid_request_error", "body_too_large"),
    errors.MethodNotAllowed: (405, "invalid_request_error", "bad_request"),
    errors.RequestTimeout: (408, "invalid_request_error", "request_timeout"),
    errors.HeadersTooLarge: (431, "invalid_request_error", "headers_too_large"),
    errors.NotImplementedHere: (501, "invalid_request_error", "not_implemented"),
    errors.VersionNotSupported: (505, "invalid_request_error", "http_version_not_supported"),
    errors.BadRequest: (400, "invalid_request_error", "bad_request"),
    errors.ModelNotFound: (404, "invalid_request_error", "model_not_found"),
    errors.ResponseNotFound: (404, "invalid_request_error", "response_not_found"),
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
    headers = [(b"content-type", JSON), content_length(body)]
    if isinstance(exc, errors.Overloaded):
        headers.append((b"retry-after", str(exc.retry_after_s).encode()))
    if status in (400, 405, 408, 413, 431, 501, 505):
        headers.append((b"connection", b"close"))
    return status, headers, body


def content_length(body: bytes) -> tuple[bytes, bytes]:
    return b"content-length", str(len(body)).encode()


def json_parts(status: int, body: bytes) -> ResponseParts:
    return status, [(b"content-type", JSON), content_length(body)], body


class LocalRoutes:
    """The answers of /healthz, /readyz and /metrics, the same on every port that serves them.

    `not_ready` says why the router is not ready (None: it is); `metrics` renders the exposition as
    (content type, body): the registry is the operator plane's, not the listener's."""

    __slots__ = ("_metrics", "_not_ready")

    def __init__(
        self, not_ready: Callable[[], str | None], metrics: Callable[[], tuple[bytes, bytes]]
    ) -> None:
        self._not_ready = not_ready
        self._metrics = metrics

    def answer(self, path: str) -> ResponseParts:
        if path == "/metrics":
            content_type, body = self._metrics()
            return 200, [(b"content-type", content_type), content_length(body)], body
        if path == "/readyz":
            reason = self._not_ready()
            if reason is not None:
                return json_parts(503, orjson.dumps({"status": reason}))
            return json_parts(200, b'{"status":"ready"}')
        return json_parts(200, b'{"status":"ok"}')
