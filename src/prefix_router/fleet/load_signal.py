"""The backends' own load figures, scraped from vLLM's /metrics, so several replicas share one bound.

Each router replica counts only its own in-flight requests; N replicas could each fill a backend to
max_inflight. vLLM's `vllm:num_requests_running + vllm:num_requests_waiting` counts everyone's, so the
picker's load becomes this replica's count plus the other replicas' share at the last scrape (see
routing/load.py, LoadTracker). A failed scrape falls back to local counts alone.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from prefix_router.fleet.backends import BackendSet
from prefix_router.settings import LoadSignalSettings
from prefix_router.upstream.client import Upstream

LOAD_METRICS = (b"vllm:num_requests_running", b"vllm:num_requests_waiting")


def parse_vllm_load(text: bytes) -> float | None:
    """running + waiting summed over every series (engines, models); None if neither is present.

    A sample line is `name[{labels}] value [timestamp]`; label values may hold spaces, so the value is
    the first token after the closing brace. Non-finite values are skipped: a NaN would fail the bound
    for every backend.
    """
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(b"vllm:num_requests_"):
            continue
        for name in LOAD_METRICS:
            if not line.startswith(name):
                continue
            rest = line[len(name) :]
            if rest[:1] == b"{":
                close = rest.rfind(b"}")
                if close < 0:
                    break
                rest = rest[close + 1 :]
            elif rest[:1] not in (b" ", b"\t"):
                break
            fields = rest.split()
            try:
                value = float(fields[0])
            except (IndexError, ValueError):
                break
            if math.isfinite(value):
                total += value
                found = True
            break
    # Finite values can still sum past the largest float; that figure says nothing either.
    return total if found and math.isfinite(total) else None


class LoadSignalScraper:
    def __init__(
        self,
        settings: LoadSignalSettings,
        backends: BackendSet,
        upstream: Upstream,
        on_scraped: Callable[[], None] | None = None,
    ) -> None:
        self._settings = settings
        self._backends = backends
        self._upstream = upstream
        self._on_scraped = on_scraped  # lower figures may free capacity that waiting requests want

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self._settings.interval_s)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(url) for url in self._backends.live_urls()))
        self._backends.load.estimate_replicas()
        if self._on_scraped is not None:
            self._on_scraped()

    async def _scrape(self, url: str) -> None:
        # This replica's count as the request leaves: what the backend's figure can include of ours.
        local_then = self._backends.load.inflight(url)
        answer = await self._upstream.fetch(url + self._settings.path, self._settings.timeout_s)
        load = parse_vllm_load(answer[1]) if answer is not None and answer[0] == 200 else None
        if load is None:
            self._backends.load.clear_external(url)
        else:
            self._backends.load.set_external(url, load, local_then)
