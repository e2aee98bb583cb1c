"""Choose a backend for a key: the prefix index, then the ring walk, within the load bound.

Order of preference for our policy:
1. the owners the prefix index knows for the longest known prefix (`prefix_match`), first holder
   first, when that prefix covers at least `follow_threshold` of the request (SGLang's match ratio,
   Preble's exploit/explore split): a system prompt that all traffic shares is cached everywhere
   soon enough and must not herd new conversations onto the backends that first took it;
2. a prefix no backend holds enough of goes, with `first_placement: cache_room`, to the backend of
   the first ROOM_CHOICES of the key's ring walk whose cache keeps things longest (`cache_room`), ties
   to the earliest of the walk; with `ring`, to the ring walk: its first backend is `affinity`, a later
   one `overflow`;
3. nothing within the bound: the least loaded candidate (`fallback`).
Baseline policies (random, round robin, least loaded) exist so operators and benchmarks can compare.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum

from prefix_router.routing.config import BalanceConfig, FirstPlacement, Policy
from prefix_router.routing.footprint import FootprintLedgers
from prefix_router.routing.keys import RoutingKey, block_sizes
from prefix_router.routing.load import LoadTracker, least_bound, load_bound
from prefix_router.routing.prefill import PendingPrefills
from prefix_router.routing.prefix_index import PrefixIndex
from prefix_router.routing.ring import HashRing


class Branch(StrEnum):
    AFFINITY = "affinity"  # the ring's first choice
    PREFIX_MATCH = "prefix_match"  # a backend the prefix index says holds the longest known prefix
    OVERFLOW = "overflow"  # a later backend of the walk: the preferred ones were at their bound
    FALLBACK = "fallback"  # every candidate at its bound: the least loaded one
    CACHE_ROOM = "cache_room"  # a new prefix, on the backend whose cache keeps things longest
    BALANCED = "balanced"  # a baseline policy (random, round robin, least loaded) chose
    RETRY = "retry"  # recorded by the proxy for an attempt after the first


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


# The branches of our policy, looked up once: reading an Enum member costs ~0.1 µs on CPython 3.11.
_AFFINITY, _PREFIX_MATCH, _OVERFLOW, _FALLBACK, _CACHE_ROOM = (
    Branch.AFFINITY,
    Branch.PREFIX_MATCH,
    Branch.OVERFLOW,
    Branch.FALLBACK,
    Branch.CACHE_ROOM,
)

# How many backends of the ring walk a new prefix chooses among by cache room: all of a small fleet,
# and a constant cost at 1,000 backends (the power of d choices balances well from d = 2).
ROOM_CHOICES = 8
# Blocks each backend's ledger may hold while its capacity is unknown (~100 bytes an entry).
LEDGER_ENTRIES = 50_000


@dataclass(slots=True, unsafe_hash=True)  # a value; not frozen, like RoutingKey (0.5 µs a decision)
class Decision:
    backend_id: str
    branch: Branch
    wait_for: int | None = None  # a prefill ticket: the backend is computing this prefix right now


class Picker:
    """Holds what a policy remembers between requests (index, round-robin cursor, rng); no I/O."""

    __slots__ = (
        "_by_room",
        "_config",
        "_cursor",
        "_index",
        "_ledgers",
        "_ours",
        "_prefills",
        "_rng",
        "_threshold",
        "_under_floor",
    )

    def __init__(self, config: BalanceConfig, rng: random.Random | None = None) -> None:
        self._config = config
        self._ours = config.policy is Policy.PREFIX
        # At or under this a backend fits whatever the fleet's load; without spill, always.
        self._under_floor = least_bound(config.max_inflight, config.load_floor) if config.spill else math.inf
        self._index = PrefixIndex(config.prefix_index_entries) if config.prefix_index else None
        # The ledgers exist with the index: what ages out of a backend's cache leaves its owners.
        self._ledgers = (
            FootprintLedgers(LEDGER_ENTRIES, self._index.forget_owner)
            if self._index is not None and self._ours
            else None
        )
        self._by_room = self._ledgers is not None and config.first_placement is FirstPlacement.CACHE_ROOM
        self._threshold = config.follow_threshold
        self._prefills = PendingPrefills()
        self._rng = rng or random.Random()
        self._cursor = 0

    @property
    def index(self) -> PrefixIndex | None:
        return self._index

    @property
    def ledgers(self) -> FootprintLedgers | None:
        return self._ledgers

    def set_capacity(self, backend_id: str, capacity_bytes: float | None) -> None:
        """A backend's KV capacity in bytes of key material (None: unknown)."""
        if self._ledgers is not None:
            self._ledgers.set_capacity(backend_id, capacity_bytes)

    def fits(self, backend_id: str, usable: Candidates, load: LoadTracker) -> bool:
        """May `backend_id` take one more request now: a candidate, under max_inflight and within the
        bound (what _pick_prefix's fits() says, for a backend chosen elsewhere)."""
        if backend_id not in usable.members:
            return False
        cfg = self._config
        after = load.load(backend_id) + 1
        if after > cfg.max_inflight:
            return False
        if after <= self._under_floor:
            return True
        bound = load_bound(
            load.total_load(), len(usable.ids), cfg.load_factor, cfg.max_inflight, cfg.load_floor
        )
        return after <= bound

    def shared_footprints(self, figures: Iterable[tuple[str, int, int, int]]) -> None:
        """Fleet-wide footprints (backend, bytes used, oldest use, entries), so cache-room ranks count
        what every replica placed."""
        if self._ledgers is not None:
            for backend_id, used, oldest, entries in figures:
                self._ledgers.set_shared(backend_id, used, oldest, entries)

    def covers(self, key: RoutingKey, known_blocks: int) -> bool:
        """Is a prefix of `known_blocks` blocks enough of this request to follow its owners?"""
        return known_blocks > 0 and key.covered_bytes(known_blocks) >= self._threshold * key.size

    def pick(
        self,
        key: RoutingKey,
        ring: HashRing,
        candidates: Candidates,
        load: LoadTracker,
        exclude: Collection[str] = (),
        wait: bool = False,
    ) -> Decision | None:
        """A backend among `candidates` not in `exclude`; None when there is none.

        With `wait`, a request whose longest prefix another request is prefilling right now gets
        that backend and the prefill's ticket, to wait on before it is sent.
        """
        usable = candidates.without(exclude) if exclude else candidates
        if not usable.ids:
            return None
        if self._ours:
            return self._pick_prefix(key, ring, usable, load, wait)
        policy = self._config.policy
        if policy is Policy.RANDOM:
            return Decision(self._rng.choice(usable.ids), Branch.BALANCED)
        if policy is Policy.ROUND_ROBIN:
            self._cursor += 1
            return Decision(usable.ids[self._cursor % len(usable.ids)], Branch.BALANCED)
        return Decision(_least_loaded(usable.ids, load, ring, key.ring_hash), Branch.BALANCED)

    def _pick_prefix(
        self, key: RoutingKey, ring: HashRing, usable: Candidates, load: LoadTracker, wait: bool
    ) -> Decision:
        cfg = self._config
        usable_set = usable.members
        # load_ok, with its bound computed at most once a pick, and not at all while the backend stays
        # at or under least_bound.
        under_floor = self._under_floor
        limit: float | None = None
        load_of = load.load

        def fits(backend: str) -> bool:
            nonlocal limit
            after = load_of(backend) + 1
            if after <= under_floor:
                return True
            if limit is None:
                limit = load_bound(
                    load.total_load(), len(usable.ids), cfg.load_factor, cfg.max_inflight, cfg.load_floor
                )
            return after <= limit

        if self._index is not None and key.blocks:
            # Owners in the order they took the prefix: the first holder keeps it while it is within
            # the bound, so one spill does not rotate a group over the fleet (each cache would then
            # have to hold every group).
            known, owners = self._index.longest_match(key.blocks)
            if wait:
                # The index learns a placement at its response head, before the prefill is done,
                # so pending blocks are looked for among the known ones too.
                pending = self._prefills.deepest(key.blocks, 0)
                if (
                    pending is not None
                    and pending[1] in usable_set
                    and self.covers(key, pending[0])
                    and fits(pending[1])
                ):
                    return Decision(pending[1], _PREFIX_MATCH, wait_for=pending[2])
            if self.covers(key, known):
                for owner in owners:
                    if owner in usable_set and fits(owner):
                        return Decision(owner, _PREFIX_MATCH)
        if self._by_room:
            roomiest = self._roomiest(key.ring_hash, ring, usable_set, fits)
            if roomiest is not None:
                return Decision(roomiest, _CACHE_ROOM)
            return Decision(_least_loaded(usable.ids, load, ring, key.ring_hash), _FALLBACK)
        # The ring's first choice takes most requests: looked up alone, without starting a walk.
        primary = ring.primary(key.ring_hash)
        if primary is not None and primary in usable_set and fits(primary):
            return Decision(primary, _AFFINITY)
        first = True
        for backend in ring.walk(key.ring_hash):
            if backend not in usable_set:
                continue
            if fits(backend):
                return Decision(backend, _AFFINITY if first else _OVERFLOW)
            first = False
        return Decision(_least_loaded(usable.ids, load, ring, key.ring_hash), _FALLBACK)

    def _roomiest(
        self, key_hash: int, ring: HashRing, usable: frozenset[str], fits: Callable[[str], bool]
    ) -> str | None:
        """The best-ranked of the first ROOM_CHOICES usable backends of the walk that fit; the walk's
        order breaks ties, so an empty fleet places by the ring."""
        assert self._ledgers is not None
        rank = self._ledgers.rank
        best: str | None = None
        best_rank: tuple[int, float] | None = None
        seen = 0
        for backend in ring.walk(key_hash):
            if backend not in usable:
                continue
            seen += 1
            if fits(backend):
                r = rank(backend)
                if best_rank is None or r < best_rank:
                    best, best_rank = backend, r
            if seen >= ROOM_CHOICES and best is not None:
                break
        return best

    def chosen(self, key: RoutingKey, backend_id: str) -> None:
        """A request is being sent to the backend: its cache will hold these blocks.

        Counted when the choice is final, not when the answer comes: a burst of new prefixes then
        spreads as it arrives, and a backend that fails every request fills its ledger like any other
        instead of always looking the roomiest."""
        if self._ledgers is not None and key.blocks:
            blocks = key.blocks
            self._ledgers.record(backend_id, blocks, block_sizes(key.ends)[: len(blocks)])

    def placed(self, key: RoutingKey, backend_id: str) -> None:
        """Learn from a placement that reached the backend (its answer began well)."""
        if self._index is not None and key.blocks:
            self._index.record(key.blocks, backend_id)

    def prefill_started(self, key: RoutingKey, backend_id: str) -> int | None:
        """A streaming request is being sent: its new blocks are pending until prefill_done."""
        if self._index is None or not key.streaming or not key.blocks:
            return None
        # Only what no backend is known to hold yet is being computed: a cached system prompt
        # followed by a new question must not hold requests that share only the system prompt.
        known, _ = self._index.longest_match(key.blocks)
        return self._prefills.start(key.blocks[known:], backend_id)

    def prefill_done(self, ticket: int) -> None:
        self._prefills.done(ticket)

    def forget(self, backend_id: str) -> None:
        if self._index is not None:
            self._index.forget_backend(backend_id)
        if self._ledgers is not None:
            self._ledgers.forget(backend_id)


def _least_loaded(usable: tuple[str, ...], load: LoadTracker, ring: HashRing, key_hash: int) -> str:
    """Least loaded; ties go to the earliest backend of the key's ring walk, so they stay sticky."""
    best = min(load.load(b) for b in usable)
    tied = {b for b in usable if load.load(b) == best}
    if len(tied) == 1:
        return next(iter(tied))
    for backend in ring.walk(key_hash):
        if backend in tied:
            return backend
    return min(tied)
