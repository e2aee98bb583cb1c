"""Active health probes, as a lifespan-owned asyncio task.

Passive ejection (consecutive connect failures) is recorded by the proxy on the data path; this task
probes every backend's health path on an interval, which is also what brings an ejected backend back.
"""

from __future__ import annotations

import asyncio
import logging

from prefix_router.fleet.backends import BackendSet
from prefix_router.settings import HealthSettings
from prefix_router.upstream.client import Upstream

log = logging.getLogger("prefix_router.health")


class HealthProber:
    def __init__(self, settings: HealthSettings, backends: BackendSet, upstream: Upstream) -> None:
        self._settings = settings
        self._backends = backends
        self._upstream = upstream

    async def run(self) -> None:
        """Probe every backend each interval, until cancelled."""
        while True:
            await self.probe_all()
            await asyncio.sleep(self._settings.interval_s)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(url) for url in self._backends.live_urls()))

    async def _probe(self, url: str) -> None:
        answer = await self._upstream.fetch(url + self._settings.path, self._settings.timeout_s)
        ok = answer is not None and 200 <= answer[0] < 300
        before = self._backends.get(url)
        was = before.state if before else None
        if ok:
            self._backends.record_success(url, probe=True)
        else:
            self._backends.record_failure(url, probe=True)
        after = self._backends.get(url)
        if after is not None and was is not None and after.state != was:
            log.warning("backend %s is now %s", url, after.state.value)
