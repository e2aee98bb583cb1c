"""Baseline policies: random, round robin, least loaded. They ignore the prefix, so operators and
benchmarks can see what the prefix policy buys."""

from __future__ import annotations

import random

from prefix_router.routing.decision import Branch, Candidates, Decision
from prefix_router.routing.keys import RoutingKey
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.ring import HashRing

_BALANCED = Branch.BALANCED


class RandomPolicy:
    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(
        self,
        key: RoutingKey,
        ring: HashRing,
        usable: Candidates,
        load: LoadTracker,
        wait: bool,
        hold: bool = False,
    ) -> Decision:
        return Decision(self._rng.choice(usable.ids), _BALANCED)


class RoundRobinPolicy:
    __slots__ = ("_cursor",)

    def __init__(self) -> None:
        self._cursor = 0

    def pick(
        self,
        key: RoutingKey,
        ring: HashRing,
        usable: Candidates,
        load: LoadTracker,
        wait: bool,
        hold: bool = False,
    ) -> Decision:
        self._cursor += 1
        return Decision(usable.ids[self._cursor % len(usable.ids)], _BALANCED)


class LeastLoadedPolicy:
    __slots__ = ()

    def pick(
        self,
        key: RoutingKey,
        ring: HashRing,
        usable: Candidates,
        load: LoadTracker,
        wait: bool,
        hold: bool = False,
    ) -> Decision:
        return Decision(least_loaded(usable.ids, load, ring, key.ring_hash), _BALANCED)


def least_loaded(usable: tuple[str, ...], load: LoadTracker, ring: HashRing, key_hash: int) -> str:
    """Least loaded; ties go to the earliest backend of the key's ring walk, so they stay sticky."""
    best = min(load.load(b) for b in usable)
    tied = {b for b in usable if load.load(b) == best}
    if len(tied) == 1:
        return next(iter(tied))
    for backend in ring.walk(key_hash):
        if backend in tied:
            return backend
    return min(tied)
