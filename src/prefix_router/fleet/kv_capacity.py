"""Each backend's KV-cache capacity, learnt from vLLM's `vllm:cache_config_info` (or configured), so
first placements know how much each cache can hold and the prefix index can age stale owners out.

vLLM exports the engine's cache configuration as an info gauge whose labels carry `num_gpu_blocks`
and `block_size`; their product is the capacity in tokens. Key material is counted in bytes, so the
router converts with each backend's bytes per token (bytes_per_token.py, or `routing.bytes_per_token`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from prefix_router.fleet.backends import BackendSet
from prefix_router.upstream.client import Upstream

INFO_METRIC = b"vllm:cache_config_info{"
_LABEL = re.compile(rb'(\w+)="((?:[^"\\]|\\.)*)"')
KNOWN_INTERVAL_S = 60.0  # a known capacity is looked at again this often (a restarted engine may differ)


def parse_kv_capacity_tokens(text: bytes) -> int | None:
    """num_gpu_blocks * block_size summed over every engine's series; None when none says."""
    total = 0
    found = False
    for line in text.splitlines():
        if not line.startswith(INFO_METRIC):
            continue
        close = line.rfind(b"}")
        if close < 0:
            continue
        labels = dict(_LABEL.findall(line[len(INFO_METRIC) : close]))
        try:
            blocks = int(labels[b"num_gpu_blocks"])
            block_size = int(labels[b"block_size"])
        except (KeyError, ValueError):
            continue
        if blocks > 0 and block_size > 0:
            total += blocks * block_size
            found = True
    return total if found else None


class KvCapacityProbe:
    """Reads each live backend's capacity at start (the router awaits `probe_due` before it listens),
    within `interval_s` of a later joining, then every KNOWN_INTERVAL_S."""

    def __init__(
        self,
        backends: BackendSet,
        upstream: Upstream,
        set_capacity: Callable[[str, float | None], None],
        *,
        metrics_path: str,
        bytes_per_token: Callable[[str], float],
        configured_tokens: int | None,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._backends = backends
        self._upstream = upstream
        self._set_capacity = set_capacity
        self._path = metrics_path
        self._bytes_per_token = bytes_per_token
        self._configured = configured_tokens
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock = clock or asyncio.get_running_loop().time
        self._checked: dict[str, float] = {}  # url -> when its capacity was last learnt
        self._tokens: dict[str, int | None] = {}  # url -> its capacity in tokens, as last learnt

    async def run(self) -> None:
        # One interval first, like the health prober's: a new backend is read within an interval.
        while True:
            await asyncio.sleep(self._interval_s)
            await self.probe_due()

    async def probe_due(self) -> None:
        now = self._clock()
        live = self._backends.live_urls()
        for gone in set(self._checked) - set(live):
            del self._checked[gone]
            self._tokens.pop(gone, None)
        due = [u for u in live if now - self._checked.get(u, -KNOWN_INTERVAL_S) >= KNOWN_INTERVAL_S]
        await asyncio.gather(*(self._probe(url, now) for url in due))

    async def _probe(self, url: str, now: float) -> None:
        tokens = self._configured
        if tokens is None:
            answer = await self._upstream.fetch(url + self._path, self._timeout_s)
            if answer is None or answer[0] != 200:
                return  # asked again at the next round
            tokens = parse_kv_capacity_tokens(answer[1])
        self._checked[url] = now
        self._tokens[url] = tokens
        self._set_capacity(url, None if tokens is None else tokens * self._bytes_per_token(url))

    def bytes_per_token_changed(self, url: str) -> None:
        """The backend's capacity in bytes again, from the tokens last learnt and its new ratio."""
        tokens = self._tokens.get(url)
        if tokens is not None:
            self._set_capacity(url, tokens * self._bytes_per_token(url))
