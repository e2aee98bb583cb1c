"""An immutable consistent-hash ring of backends.

Each backend owns `vnodes × weight` points at hash(f"{url}\\x00{i}"), so placement depends only on the
set of URLs, never on list order: every replica with the same members builds the same ring. A change of
membership builds a new ring (Envoy's ring hash works so); in-flight counts live elsewhere.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prefix_router.routing.hashing import vnode_hash


@dataclass(frozen=True, slots=True)
class Member:
    backend_id: str  # the backend's stable identity: its URL
    weight: float = 1.0


class HashRing:
    __slots__ = ("_bucket_shift", "_bucket_starts", "_members", "_owners", "_points")

    def __init__(self, members: Sequence[Member], vnodes: int) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        owner_of: dict[int, str] = {}
        seen: set[str] = set()
        for member in members:
            backend = member.backend_id
            if backend in seen:
                raise ValueError(f"duplicate backend {backend!r}")
            if member.weight <= 0:
                raise ValueError(f"backend {backend!r}: weight must be positive")
            seen.add(backend)
            for i in range(max(1, round(vnodes * member.weight))):
                point = vnode_hash(backend, i)
                # Two backends on one point (a 2^-64 event): the smaller id keeps it, whatever the order.
                held = owner_of.get(point)
                if held is None or backend < held:
                    owner_of[point] = backend
        # Sorting plain ints, not (point, id) tuples: a 1,000-backend ring builds in a fraction of the time.
        self._points: list[int] = sorted(owner_of)
        self._owners: list[str] = [owner_of[p] for p in self._points]
        self._members: tuple[str, ...] = tuple(sorted(seen))
        # Where each range of the top 12 bits starts among the points (a point or two a range at 32
        # backends, ~40 at 1,000), so a lookup bisects one range instead of the whole ring: each probe
        # reads an int elsewhere in memory, and after a request's body has been read those are cache
        # misses (0.9 against 0.5 µs per lookup at 32 backends, measured with the caches thrashed).
        bits = min(12, max(1, len(self._points).bit_length()))
        self._bucket_shift = 64 - bits
        self._bucket_starts: list[int] = [
            bisect.bisect_left(self._points, b << self._bucket_shift) for b in range((1 << bits) + 1)
        ]

    @property
    def members(self) -> tuple[str, ...]:
        return self._members

    def __len__(self) -> int:
        return len(self._members)

    def primary(self, key_hash: int) -> str | None:
        """The owner of the first point at or after `key_hash`."""
        if not self._points:
            return None
        i = self._first_at_or_after(key_hash)
        return self._owners[i if i < len(self._points) else 0]

    def _first_at_or_after(self, key_hash: int) -> int:
        bucket = key_hash >> self._bucket_shift
        starts = self._bucket_starts
        if 0 <= bucket < len(starts) - 1:
            return bisect.bisect_left(self._points, key_hash, starts[bucket], starts[bucket + 1])
        return bisect.bisect_left(self._points, key_hash)  # not a 64-bit hash: still a defined answer

    def walk(self, key_hash: int) -> Iterator[str]:
        """Distinct backends clockwise from `key_hash`; every member exactly once."""
        n = len(self._points)
        if n == 0:
            return
        start = self._first_at_or_after(key_hash)
        seen: set[str] = set()
        total = len(self._members)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == total:
                    return
