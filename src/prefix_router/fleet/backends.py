"""The backend set: membership, health and draining state, and the ring built from them.

Membership changes (discovery, admin drain) build a new HashRing and swap one reference; the load
tracker and the picker's prefix index live outside it and survive the swap, so requests in flight are
neither dropped nor recounted. Health never rebuilds the ring: an unhealthy backend stays a member and
is skipped by the walk, so its keys come back to it when it recovers and nobody else's keys move.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import Candidates
from prefix_router.routing.ring import HashRing, Member


@dataclass(frozen=True, slots=True)
class BackendSpec:
    url: str  # normalised scheme://host:port: the stable identity on the ring
    weight: float = 1.0
    models: frozenset[str] = frozenset()  # declared (config, a pod label) until it lists its own


class HealthState(StrEnum):
    HEALTHY = "healthy"
    EJECTED = "ejected"  # failed unhealthy_threshold times in a row; skipped until it recovers
    DRAINING = "draining"  # takes no new requests; leaves the ring when its last request ends


@dataclass(slots=True)
class Backend:
    url: str
    weight: float
    state: HealthState = HealthState.HEALTHY
    failures: int = 0  # consecutive
    successes: int = 0  # consecutive probe successes while ejected
    recovered_at: float | None = None  # monotonic time of the last recovery (slow start)
    removed: bool = False  # no longer wanted by discovery: leave once drained
    served_at: float | None = None  # monotonic time of the last request served without error
    probed: bool = False  # passed a health probe since it joined: what readiness waits for


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    unhealthy_threshold: int = 3
    healthy_threshold: int = 2
    max_ejected_ratio: float = 0.5
    slow_start_s: float = 10.0
    probe_grace_s: float = 10.0


@dataclass(slots=True)
class _Listeners:
    on_change: list[Callable[[], None]] = field(default_factory=list)


class BackendSet:
    def __init__(
        self,
        specs: Iterable[BackendSpec],
        vnodes: int,
        health: HealthPolicy,
        load: LoadTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._vnodes = vnodes
        self._policy = health
        self._clock = clock
        self.load = load or LoadTracker()
        self._backends: dict[str, Backend] = {}
        self._listeners = _Listeners()
        self._ring = HashRing((), vnodes)
        self._ring_members: tuple[tuple[str, float], ...] = ()
        self._candidates = Candidates.of(())
        self._overridden = False
        self._slow_starting: set[str] = set()  # recovered within slow_start_s: checked per request
        self.replace_members(specs)

    # -- views ---------------------------------------------------------------------------------

    @property
    def ring(self) -> HashRing:
        return self._ring

    @property
    def candidates(self) -> Candidates:
        return self._candidates

    @property
    def all_ejected_override(self) -> bool:
        """True when the ejection cap made the router route to ejected backends (shared fault)."""
        return self._overridden

    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    def live_urls(self) -> list[str]:
        """Members still wanted (not leaving): the ones worth probing and scraping."""
        return [b.url for b in self._backends.values() if not b.removed]

    def get(self, url: str) -> Backend | None:
        return self._backends.get(url)

    def is_ready(self) -> bool:
        """A healthy backend has answered a probe: configured or discovered is not enough, as an
        unreachable backend stays healthy until unhealthy_threshold probes have failed."""
        return any(b.state is HealthState.HEALTHY and b.probed for b in self._backends.values())

    def on_change(self, callback: Callable[[], None]) -> None:
        self._listeners.on_change.append(callback)

    def candidates_now(self, rng: random.Random) -> Candidates:
        """The candidates for one request; a backend in slow start takes a growing share of turns."""
        if not self._slow_starting:
            return self._candidates
        now = self._clock()
        ramp = self._policy.slow_start_s
        skip = []
        for url in list(self._slow_starting):
            backend = self._backends.get(url)
            since = backend.recovered_at if backend is not None else None
            if since is None or now - since >= ramp:
                self._slow_starting.discard(url)
            elif url in self._candidates.members and rng.random() > (now - since) / ramp:
                skip.append(url)
        if not skip or len(skip) == len(self._candidates.ids):
            return self._candidates
        return self._candidates.without(skip)

    # -- membership ----------------------------------------------------------------------------

    def replace_members(self, specs: Iterable[BackendSpec]) -> None:
        """Make the set what discovery says it is; removed backends drain, then leave."""
        wanted = {s.url: s for s in specs}
        for url, spec in wanted.items():
            backend = self._backends.get(url)
            if backend is None:
                self._backends[url] = Backend(url, spec.weight)
            else:
                backend.weight = spec.weight
                if backend.removed:
                    backend.removed = False
                    if backend.state is HealthState.DRAINING:
                        backend.state = HealthState.HEALTHY
        for url, backend in self._backends.items():
            if url not in wanted and not backend.removed:
                backend.removed = True
                backend.state = HealthState.DRAINING
        self._settle()

    def drain(self, url: str) -> bool:
        """Admin drain: no new requests; leaves the ring once its in-flight requests end."""
        backend = self._backends.get(url)
        if backend is None:
            return False
        backend.state = HealthState.DRAINING
        backend.removed = True
        self._settle()
        return True

    def lease_ended(self, url: str) -> None:
        """Called after a lease on `url` is released: a drained backend may now leave."""
        backend = self._backends.get(url)
        if backend is not None and backend.removed and self.load.inflight(url) == 0:
            self._settle()

    # -- health --------------------------------------------------------------------------------

    def record_failure(self, url: str, *, probe: bool) -> None:
        """A connect failure (probe=False) or a failed probe (probe=True).

        A failed probe does not count against a backend that served a request within the last
        `probe_grace_s`: a slow or flapping /health must not eject a backend that works.
        """
        backend = self._backends.get(url)
        if backend is None or backend.state is HealthState.DRAINING:
            return
        if (
            probe
            and backend.state is HealthState.HEALTHY
            and backend.served_at is not None
            and self._clock() - backend.served_at < self._policy.probe_grace_s
        ):
            return
        backend.failures += 1
        backend.successes = 0
        if backend.state is HealthState.HEALTHY and backend.failures >= self._policy.unhealthy_threshold:
            backend.state = HealthState.EJECTED
            backend.recovered_at = None
            self._settle()

    def record_success(self, url: str, *, probe: bool) -> None:
        """A served request (probe=False) or a passed probe (probe=True)."""
        backend = self._backends.get(url)
        if backend is None or backend.state is HealthState.DRAINING:
            return
        backend.failures = 0
        if probe:
            backend.probed = True
        else:
            backend.served_at = self._clock()
        if backend.state is HealthState.EJECTED:
            # Only probes bring a backend back, and only after healthy_threshold in a row.
            if not probe:
                return
            backend.successes += 1
            if backend.successes >= self._policy.healthy_threshold:
                backend.state = HealthState.HEALTHY
                backend.successes = 0
                backend.recovered_at = self._clock()
                if self._policy.slow_start_s > 0:
                    self._slow_starting.add(url)
                self._settle()
        elif (
            backend.recovered_at is not None
            and self._clock() - backend.recovered_at > self._policy.slow_start_s
        ):
            backend.recovered_at = None

    # -- internals -----------------------------------------------------------------------------

    def _settle(self) -> None:
        for url in [u for u, b in self._backends.items() if b.removed and self.load.inflight(u) == 0]:
            del self._backends[url]
        # A draining backend stays on the ring (skipped by the walk, as an unhealthy one is) until its
        # last request ends, so nothing about the placement of other keys changes twice.
        members = tuple(sorted((b.url, b.weight) for b in self._backends.values()))
        if members != self._ring_members:
            self._ring = HashRing([Member(url, weight) for url, weight in members], self._vnodes)
            self._ring_members = members
        self._candidates = self._compute_candidates()
        for callback in self._listeners.on_change:
            callback()

    def _compute_candidates(self) -> Candidates:
        live = [b for b in self._backends.values() if not b.removed]
        healthy = [b.url for b in live if b.state is HealthState.HEALTHY]
        ejected = [b for b in live if b.state is HealthState.EJECTED]
        self._overridden = False
        # The ejection cap: when a shared fault ejects more than max_ejected_ratio of the fleet, the
        # router keeps routing to the least-failing ejected backends rather than to nothing.
        allowed_ejected = int(len(live) * self._policy.max_ejected_ratio)
        if live and len(ejected) > allowed_ejected:
            keep_out = sorted(ejected, key=lambda b: b.failures)
            readmit = len(ejected) - allowed_ejected
            healthy += [b.url for b in keep_out[:readmit]]
            self._overridden = True
        return Candidates.of(healthy)
