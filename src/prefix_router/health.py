"""Active health probes, as a lifespan-owned asyncio task.

Passive ejection (consecutive connect failures) is recorded by the proxy on the data path; this task
probes every backend's health path on an interval, which is also what brings an ejected backend back.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from prefix_router.backends import BackendSet
from prefix_router.settings import HealthSettings
from prefix_router.upstream import Upstream

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
        urls = [b.url for b in self._backends.backends() if not b.removed]
        await asyncio.gather(*(self._probe(url) for url in urls))

    async def _probe(self, url: str) -> None:
        ok = False
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                async with self._upstream.session.get(
                    url + self._settings.path, allow_redirects=False
                ) as resp:
                    await resp.read()
                    ok = 200 <= resp.status < 300
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.debug("probe of %s failed: %s", url, type(exc).__name__)
        before = self._backends.get(url)
        was = before.state if before else None
        if ok:
            self._backends.record_success(url, probe=True)
        else:
            self._backends.record_failure(url, probe=True)
        after = self._backends.get(url)
        if after is not None and was is not None and after.state != was:
            log.warning("backend %s is now %s", url, after.state.value)
