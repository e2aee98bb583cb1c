"""What every discovery source shares: the `Discovery` protocol the app runs, the publisher that hands a
changed membership to the backend set (and only a changed one), bounded backoff, and the one way a
discovered address becomes a backend URL, so DNS and Kubernetes name the same pod identically on the ring.
"""

from __future__ import annotations

import ipaddress
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from prefix_router.fleet.backends import BackendSpec
from prefix_router.settings import normalise_backend_url

ApplyBackends = Callable[[list[BackendSpec]], None]

logger = logging.getLogger(__name__)


class Discovery(Protocol):
    async def run(self, apply: ApplyBackends) -> None:
        """Runs until cancelled; calls apply(full current list) whenever the set changes (and once at
        start when known)."""
        ...


def backend_url(scheme: str, address: str, port: int) -> str:
    """The ring identity of a discovered endpoint; IPv6 is bracketed and written in its compressed form,
    so the same pod gets the same URL whichever source or text form reported it."""
    host = address
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        pass  # a hostname (an EndpointSlice of addressType FQDN)
    else:
        host = f"[{ip.compressed}]" if ip.version == 6 else ip.compressed
    return normalise_backend_url(f"{scheme}://{host}:{port}")


class MembershipPublisher:
    """Calls `apply` with the full list when the discovered set differs from the last one applied.

    The first known set is always applied (the app may have started from the static list). A failing
    `apply` is logged and retried on the next publish rather than ending discovery.
    """

    def __init__(self, apply: ApplyBackends, source: str, initial: Iterable[str] = ()) -> None:
        self._apply = apply
        self._source = source
        self._current: frozenset[str] = frozenset(initial)
        self._models: Mapping[str, frozenset[str]] = {}
        self._published = False

    @property
    def current(self) -> frozenset[str]:
        """The last set applied (before the first publish: the set the app started from)."""
        return self._current

    def publish(self, urls: Iterable[str], models: Mapping[str, frozenset[str]] | None = None) -> bool:
        """`models`: what the source says some backends serve (a pod label), by URL."""
        wanted = frozenset(urls)
        declared = {url: models[url] for url in wanted if models and models.get(url)}
        if self._published and wanted == self._current and declared == self._models:
            return False
        try:
            self._apply([BackendSpec(url, models=declared.get(url, frozenset())) for url in sorted(wanted)])
        except Exception:
            logger.exception("%s discovery: applying %d backends failed", self._source, len(wanted))
            return False
        added, removed = len(wanted - self._current), len(self._current - wanted)
        logger.info("%s discovery: %d backends (+%d -%d)", self._source, len(wanted), added, removed)
        self._current = wanted
        self._models = declared
        self._published = True
        return True


class Backoff:
    """Bounded exponential delays with jitter, so many router replicas do not retry in step."""

    def __init__(self, initial_s: float = 0.2, max_s: float = 10.0, rng: random.Random | None = None) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError("backoff needs 0 < initial_s <= max_s")
        self._initial_s = initial_s
        self._max_s = max_s
        self._next_s = initial_s
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        delay = self._next_s
        self._next_s = min(self._max_s, self._next_s * 2)
        return max(self._initial_s, delay * self._rng.uniform(0.75, 1.0))

    def reset(self) -> None:
        self._next_s = self._initial_s
