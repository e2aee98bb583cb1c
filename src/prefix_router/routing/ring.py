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
    __slots__ = ("_members", "_owners", "_points")

    def __init__(self, members: Sequence[Member], vnodes: int) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        pairs: list[tuple[int, str]] = []
        seen: set[str] = set()
        for member in members:
            if member.backend_id in seen:
                raise ValueError(f"duplicate backend {member.backend_id!r}")
            if member.weight <= 0:
                raise ValueError(f"backend {member.backend_id!r}: weight must be positive")
            seen.add(member.backend_id)
            count = max(1, round(vnodes * member.weight))
            pairs.extend((vnode_hash(member.backend_id, i), member.backend_id) for i in range(count))
        # Ties between two backends' points (a 2^-64 event) are broken by id, so order stays deterministic.
        pairs.sort()
        self._points: list[int] = [p for p, _ in pairs]
        self._owners: list[str] = [o for _, o in pairs]
        self._members: tuple[str, ...] = tuple(sorted(seen))

    @property
    def members(self) -> tuple[str, ...]:
        return self._members

    def __len__(self) -> int:
        return len(self._members)

    def primary(self, key_hash: int) -> str | None:
        """The owner of the first point at or after `key_hash`."""
        if not self._points:
            return None
        i = bisect.bisect_left(self._points, key_hash)
        return self._owners[i if i < len(self._points) else 0]

    def walk(self, key_hash: int) -> Iterator[str]:
        """Distinct backends clockwise from `key_hash`; every member exactly once."""
        n = len(self._points)
        if n == 0:
            return
        start = bisect.bisect_left(self._points, key_hash)
        seen: set[str] = set()
        total = len(self._members)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == total:
                    return
