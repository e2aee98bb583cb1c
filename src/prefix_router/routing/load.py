"""In-flight counts, leases, and the bounded-load predicate.

Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2016): with m requests in
flight over n backends and a load factor c, no backend may hold more than ceil(c * (m + 1) / n) once
the new request is placed. The `+ 1` is that new request. An absolute `max_inflight` bounds each
backend too, because a GPU's batch has a size whatever the mean is. The relative bound never falls
below `floor`: at a handful of requests in flight, spilling a prefix to a cold cache costs a full
prefill to save nothing, since the engine batches them all anyway.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def load_ok(
    load: float, total: float, n_backends: int, load_factor: float, max_inflight: int, floor: int = 0
) -> bool:
    """May a backend carrying `load` take one more request, with `total` in flight over the fleet?"""
    return load + 1 <= load_bound(total, n_backends, load_factor, max_inflight, floor)


def load_bound(total: float, n_backends: int, load_factor: float, max_inflight: int, floor: int = 0) -> float:
    """The most one backend may carry once the new request is placed (load_ok's right-hand side), so
    a pick that checks several backends computes it once."""
    if n_backends <= 0:
        return -math.inf
    relative = load_factor * (total + 1) / n_backends
    if not math.isfinite(relative):  # a total near the largest float: only the absolute bound is left
        return max_inflight
    # The epsilon keeps float rounding from lifting the ceiling: 1.1 * 100 / 2 is 55.000000000000007.
    return min(max_inflight, max(math.ceil(relative - 1e-9), floor))


def follow_limit(max_inflight: int, spill: bool) -> float:
    """The most a backend holding the request's prefix may carry once it takes it: max_inflight, not
    the relative bound (a warm queue costs less than a cold prefill elsewhere); without spill, no limit."""
    return max_inflight if spill else math.inf


def spill_level(max_inflight: int, load_factor: float) -> float:
    """The most a backend may carry, the request placed, to take one whose owner (a backend holding
    its prefix in a request in flight) is at max_inflight: clearly less busy than the owner, by the
    load factor (SGLang's balance rule, max > ratio x min, at the owner's full load). Above it every
    backend is about as busy as the owner, so spilling there buys no earlier start and costs a cold
    prefill: the request waits for its owner (the capacity queue, bounded) instead."""
    if load_factor <= 1.0:
        return float(max_inflight)  # no margin asked: any backend under max_inflight takes it
    return max_inflight / load_factor


def spill_ok(load: float, level: float) -> bool:
    """May a backend carrying `load` take a request whose owner is full (at or under spill_level's
    `level` once it is placed)?"""
    return load + 1 <= level


def least_bound(max_inflight: int, floor: int = 0) -> int:
    """The least load_bound can be over a fleet of one backend or more, whatever its load: a backend
    that stays at or under it fits without the fleet's total being looked at."""
    return min(max_inflight, floor)


class Lease:
    """One request's claim on a backend; released exactly once, whatever the exit path."""

    __slots__ = ("_released", "_tracker", "backend_id")

    def __init__(self, tracker: LoadTracker, backend_id: str) -> None:
        self._tracker = tracker
        self.backend_id = backend_id
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._tracker._decrement(self.backend_id)


class LoadTracker:
    """Per-backend in-flight counts of this replica, plus an optional load signal from the backends.

    The backends' own figure (vLLM's running + waiting, scraped) includes this replica's requests as
    they stood at the scrape, so the other replicas' share is max(0, scraped - local_at_scrape). Until
    the next scrape the others keep placing too: with one ring and clients spread over the replicas,
    each places about as many on a backend as this one does, so every placement here since the scrape
    also counts (replicas - 1) times for the others, the number of replicas estimated from the scrape
    (fleet-wide scraped load over this replica's share of it). Releases are not extrapolated, so the
    estimate errs towards a fuller backend, and the next scrape corrects it.

    With shared placement state, the other replicas' own in-flight counts come with each answer of
    the store (`set_peers`): a figure that needs no estimate. While it is known it replaces the scraped
    share of the others (which it would mostly count twice), until `clear_peers`.
    """

    __slots__ = (
        "_external",
        "_external_extra",
        "_held_for_prefill",
        "_inflight",
        "_others",
        "_peers",
        "_peers_known",
        "_peers_total",
        "_since",
        "_since_total",
        "_total",
    )

    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._external: dict[str, tuple[float, int]] = {}
        self._total = 0  # kept with every change, so a pick costs the same for 4 or 1,000 backends
        self._external_extra = 0.0
        self._since: dict[str, int] = {}  # placements since the backend's last scrape
        self._since_total = 0
        self._others = 0.0  # estimated other replicas (replicas - 1)
        self._peers: dict[str, int] = {}  # the other replicas' requests in flight, as the store said
        self._peers_total = 0
        self._peers_known = False
        # Requests held for a prefill on the backend: bound to go there, not yet in flight.
        self._held_for_prefill: dict[str, int] = {}

    def prefill_hold_began(self, backend_id: str) -> None:
        self._held_for_prefill[backend_id] = self._held_for_prefill.get(backend_id, 0) + 1

    def prefill_hold_ended(self, backend_id: str) -> None:
        left = self._held_for_prefill.get(backend_id, 0) - 1
        if left > 0:
            self._held_for_prefill[backend_id] = left
        else:
            self._held_for_prefill.pop(backend_id, None)

    def held_for_prefill(self, backend_id: str) -> int:
        """Requests held for a prefill on the backend: bound to go there next, though none of their
        own blocks is placed yet."""
        return self._held_for_prefill.get(backend_id, 0)

    def acquire(self, backend_id: str) -> Lease:
        self._inflight[backend_id] = self._inflight.get(backend_id, 0) + 1
        self._total += 1
        if backend_id in self._external:
            self._since[backend_id] = self._since.get(backend_id, 0) + 1
            self._since_total += 1
        return Lease(self, backend_id)

    def _decrement(self, backend_id: str) -> None:
        left = self._inflight.get(backend_id, 0) - 1
        self._total -= 1
        if left > 0:
            self._inflight[backend_id] = left
        else:
            self._inflight.pop(backend_id, None)

    def inflight(self, backend_id: str) -> int:
        return self._inflight.get(backend_id, 0)

    def local_counts(self) -> dict[str, int]:
        """This replica's requests in flight per backend (backends with none left out)."""
        return dict(self._inflight)

    def set_peers(self, counts: Iterable[tuple[str, int]]) -> None:
        """The other replicas' requests in flight per backend, all of them (a backend left out has
        none); replaces the previous figures."""
        peers = {backend: count for backend, count in counts if count > 0}
        self._peers = peers
        self._peers_total = sum(peers.values())
        self._peers_known = True

    def set_peer(self, backend_id: str, count: int) -> None:
        """The other replicas' requests in flight on one backend, heard since the last set_peers (a
        prefill's end): replaces that backend's figure, while the others' are known at all."""
        if not self._peers_known:
            return
        old = self._peers.pop(backend_id, 0)
        if count > 0:
            self._peers[backend_id] = count
        self._peers_total += max(count, 0) - old

    def clear_peers(self) -> None:
        """The other replicas' counts are no longer known (the store is down): back to the scraped
        signal, or local counts only."""
        self._peers = {}
        self._peers_total = 0
        self._peers_known = False

    def total_inflight(self) -> int:
        return self._total

    def set_external(self, backend_id: str, scraped: float, local_then: int | None = None) -> None:
        """Record a backend's own load figure; `local_then` is this replica's count when it was asked.

        A figure that is not a finite number is no figure: kept, it would poison the fleet's totals
        for good (inf - inf is NaN once it is replaced)."""
        self.clear_external(backend_id)
        if not math.isfinite(scraped):
            return
        if local_then is None:
            local_then = self.inflight(backend_id)
        self._external[backend_id] = (scraped, local_then)
        self._external_extra += max(0.0, scraped - local_then)

    def clear_external(self, backend_id: str) -> None:
        old = self._external.pop(backend_id, None)
        if old is not None:
            self._external_extra -= max(0.0, old[0] - old[1])
        self._since_total -= self._since.pop(backend_id, 0)

    def estimate_replicas(self) -> float:
        """Set the replica estimate from the latest scrapes; returns it (1 with no signal)."""
        scraped = sum(figure for figure, _ in self._external.values())
        ours = sum(local_then for _, local_then in self._external.values())
        replicas = 1.0 if ours == 0 else min(8.0, max(1.0, scraped / ours))
        self._others = replicas - 1.0
        return replicas

    def load(self, backend_id: str) -> float:
        local = self._inflight.get(backend_id, 0)
        if self._peers_known:
            return local + self._peers.get(backend_id, 0)
        ext = self._external.get(backend_id)
        if ext is None:
            return local
        scraped, local_then = ext
        return local + max(0.0, scraped - local_then) + self._others * self._since.get(backend_id, 0)

    def total_load(self) -> float:
        """Load over every backend tracked (in-flight plus other replicas' known or estimated share)."""
        if self._peers_known:
            return self._total + self._peers_total
        return self._total + self._external_extra + self._others * self._since_total
