"""Asks each backend's `/v1/models` what it serves: at start, on the health probes' interval, and at once
for a backend that joins. A failed or unparseable answer keeps the last listing (a slow `/v1/models`
must not take a backend off its model's ring and move that model's keys); a backend that never
answered one stays a backend that said nothing.
"""

from __future__ import annotations

import asyncio
import logging

from prefix_router.fleet.backends import BackendSet
from prefix_router.fleet.models import ModelDirectory, parse_model_list
from prefix_router.upstream.client import Upstream

log = logging.getLogger("prefix_router.models")


class ModelProber:
    def __init__(
        self,
        directory: ModelDirectory,
        backends: BackendSet,
        upstream: Upstream,
        *,
        path: str,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self._directory = directory
        self._backends = backends
        self._upstream = upstream
        self._path = path
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._wake = asyncio.Event()

    def joined(self) -> None:
        """Membership changed: ask the backends with no listing yet now, not at the next interval."""
        self._wake.set()

    async def run(self, asked: bool = False) -> None:
        """Until cancelled: every backend each interval, the silent ones whenever woken (`asked`: the
        first round is done already)."""
        loop = asyncio.get_running_loop()
        next_full = loop.time() + (self._interval_s if asked else 0.0)
        while True:
            self._wake.clear()  # before probing: a backend that joins meanwhile is asked next
            if loop.time() >= next_full:
                await self.probe(self._backends.live_urls())
                next_full = loop.time() + self._interval_s
            else:
                silent = [u for u in self._backends.live_urls() if not self._directory.has_report(u)]
                await self.probe(silent)
            try:
                async with asyncio.timeout(max(0.0, next_full - loop.time())):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def probe(self, urls: list[str]) -> None:
        await asyncio.gather(*(self._probe(url) for url in urls))

    async def _probe(self, url: str) -> None:
        answer = await self._upstream.fetch(url + self._path, self._timeout_s)
        if answer is None or answer[0] != 200:
            return
        cards = parse_model_list(answer[1])
        if cards is None:
            return
        if self._directory.report(url, cards):
            log.info("backend %s serves %s", url, ", ".join(c.id for c in cards) or "no model")
