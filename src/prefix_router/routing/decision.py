"""What a policy decides: a backend and the branch that chose it, among the candidates of the moment.

Values only, shared by every policy (routing/policies/) and by what records a decision (the relay's
metrics, the shared-state resolution).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum


class Branch(StrEnum):
    AFFINITY = "affinity"  # the ring's first choice
    PREFIX_MATCH = "prefix_match"  # a backend the prefix index says holds the longest known prefix
    OVERFLOW = "overflow"  # a later backend of the walk: the preferred ones were at their bound
    FALLBACK = "fallback"  # every candidate at its bound: the least loaded one
    CACHE_ROOM = "cache_room"  # a new prefix, on the backend whose cache keeps things longest
    BALANCED = "balanced"  # a baseline policy (random, round robin, least loaded) chose
    RETRY = "retry"  # recorded by the relay for an attempt after the first


@dataclass(frozen=True, slots=True)
class Candidates:
    """The backends that may take requests now (healthy, not draining), built once per change."""

    ids: tuple[str, ...]
    members: frozenset[str]

    @classmethod
    def of(cls, ids: Collection[str]) -> Candidates:
        ordered = tuple(sorted(set(ids)))
        return cls(ordered, frozenset(ordered))

    def without(self, exclude: Collection[str]) -> Candidates:
        return Candidates.of([b for b in self.ids if b not in exclude])


@dataclass(slots=True, unsafe_hash=True)  # a value; not frozen, like RoutingKey (0.5 µs a decision)
class Decision:
    backend_id: str
    branch: Branch
    wait_for: int | None = None  # a prefill ticket: the backend is computing this prefix right now
    # The backend took the request's previous turn (this router's index says): its history is there.
    previous_turn: bool = field(default=False, compare=False)
    # The backend holds the prefix but is at max_inflight, and the others with room are about as
    # busy: the caller waits for its capacity rather than send the request to a cold cache as full.
    wait_owner: bool = field(default=False, compare=False)
