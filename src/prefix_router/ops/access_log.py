"""The access log: one JSON object a line per request, on logger `prefix_router.access`.

The listener (frontend.http1.Listener) tells an `AccessLog` of each request it finished; this module
decides what is written. Fields: `time` (UTC, when the answer ended), `client`, `method`, `path`
(as sent, without the query, which may hold anything), `status` (499 for a client that left first, as
nginx logs it), `duration_s`, `backend` and `branch` (null when no backend was chosen), `model` (the
model routed to when the fleet serves it, else null), and `bytes` (response body bytes sent; null for a
request refused before it was whole). Never a body, a tenant, a query or a header value. Probes and
scrapes (/healthz, /readyz, /metrics) are left out unless asked for: at one probe a second per kubelet
and a scrape every few seconds they would be most of the lines.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from typing import Any

import orjson

from prefix_router.frontend.exchange import Exchange

LOGGER_NAME = "prefix_router.access"
MAX_PATH_CHARS = 1024  # a path is bounded by the head limit (64 KiB); a log line need not be


def _utc_now() -> datetime:
    return datetime.now(UTC)


class JsonAccessLog:
    """frontend.exchange.AccessLog as JSON lines, but for `skip_paths` (the local routes, by default)."""

    def __init__(
        self,
        logger: logging.Logger,
        skip_paths: Collection[str] = (),
        clock: Callable[[], datetime] = _utc_now,
    ) -> None:
        self._logger = logger
        self._skip = frozenset(skip_paths)
        self._clock = clock

    def answered(self, ex: Exchange, duration_s: float) -> None:
        if ex.path in self._skip:
            return
        self._write(
            {
                "client": ex.client_ip,
                "method": ex.method,
                "path": ex.raw_path[:MAX_PATH_CHARS].decode("latin-1"),
                "status": 499 if ex.client_gone else ex.status,
                "duration_s": round(duration_s, 6),
                "backend": ex.backend,
                "branch": ex.branch,
                "model": ex.model,
                "bytes": ex.sent,
            }
        )

    def refused(self, client_ip: str | None, target: bytes, status: int) -> None:
        """A request the listener refused before it was whole (400, 408, 413, 431)."""
        path = target.partition(b"?")[0][:MAX_PATH_CHARS].decode("latin-1")
        self._write(
            {
                "client": client_ip,
                "method": None,
                "path": path or None,
                "status": status,
                "duration_s": None,
                "backend": None,
                "branch": None,
                "model": None,
                "bytes": None,
            }
        )

    def _write(self, fields: dict[str, Any]) -> None:
        time = self._clock().isoformat(timespec="milliseconds").replace("+00:00", "Z")
        line = orjson.dumps({"time": time, **fields}).decode()
        # Handed to the handlers whatever the logger's level: an access log that was asked for is
        # written even under `log_level: warning`, and no logger's level is changed to get there.
        record = self._logger.makeRecord(self._logger.name, logging.INFO, __file__, 0, line, (), None)
        self._logger.handle(record)


def route_to_stdout(logger: logging.Logger) -> None:
    """Write the access log's lines to stdout, bare: JSON lines for a log shipper, apart from the
    process's own log (stderr, with timestamps and levels)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
