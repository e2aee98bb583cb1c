"""Routing policies, one file each, behind one protocol: `prefix.py` (ours: the prefix index, cache room
and the ring walk within the load bound), `baseline.py` (random, round robin, least loaded, for
operators and benchmarks to compare against).

A policy only chooses. What the router learns from placements (the prefix index, the footprint
ledgers, the prefills pending) is kept by routing/picker.py and handed to the policy that reads it, so
another source (engine-side cache events) can feed the same index.
"""

from __future__ import annotations

from typing import Protocol

from prefix_router.routing.decision import Candidates, Decision
from prefix_router.routing.keys import RoutingKey
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.ring import HashRing


class Policy(Protocol):
    def pick(
        self,
        key: RoutingKey,
        ring: HashRing,
        usable: Candidates,
        load: LoadTracker,
        wait: bool,
        hold: bool = False,
    ) -> Decision:
        """One backend of `usable`, which is never empty; no I/O, no waiting.

        With `wait`, a policy that knows pending prefills may answer with one's ticket
        (`Decision.wait_for`) for the caller to wait on before it sends. With `hold`, one that
        knows where a prefix is cached may answer with a backend at max_inflight
        (`Decision.wait_owner`) for the caller to wait for, rather than spill the request."""
        ...
