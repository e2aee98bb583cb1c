"""Our policy: the prefix index, then cache room or the ring walk, within the load bound.

Order of preference:
1. the owners the prefix index knows for the longest known prefix (`prefix_match`), when that prefix
   covers at least `follow_threshold` of the request (SGLang's match ratio, Preble's exploit/explore
   split): a system prompt that all traffic shares is cached everywhere soon enough and must not herd
   new conversations onto the backends that first took it. With cache room, a prefix under that share
   is followed too when the request continues a prompt placed before rather than shares a preamble
   with it (`_continues`: nothing else branched from the held head, and the blocks seen, held or aged
   out since, cover the share or have not branched either), and a conversation's next turn stays
   with the backend that took the previous one, within the relative bound, when only a head it shares
   is still held there and that head is a minor preamble (`RoutingKey.minor_preamble`) the cache-room
   choice holds less of. A previous turn whose whole prompt filled no block of the key has no blocks
   in the index, only its end (`RoutingKey.previous_prompt_end`): with cache room, the next turn
   follows the backend that took it, within the relative bound, when that prompt and its reply cover
   the share. With ledgers, the owner whose cache keeps
   things longest first (every owner has the prefix: the conversation it starts grows where its cache
   has room), the first holder on a tie; without, the first holder first. With `first_placement:
   ring`, only a prefix that reaches the ring key's end is followed (`covers_ring_key`). An owner
   takes the request within the relative bound, and up to `max_inflight` while a request in flight
   there holds the prefix or, with cache room, the prefix is one prompt's own history
   (`_is_own_history`) and the requests in flight there leave KV room for the request: waiting in a
   warm engine's queue costs less than a cold prefill elsewhere, and a hot prefix spread by the
   relative bound over more backends takes their caches from the prefixes placed there. With
   `hold`, an owner at `max_inflight` where a request in flight holds the prefix is waited for
   (`Decision.wait_owner`) while no backend is clearly less busy (`spill_level`): with every
   backend about as full, a spill starts no sooner and only trades a warm queue for a cold one;
2. a prefix no backend holds enough of goes, with `first_placement: cache_room`, to the backend of
   the first ROOM_CHOICES of the key's ring walk whose cache keeps things longest (`cache_room`), ties
   to the one fewer requests are held for a prefill on (`LoadTracker.held_for_prefill`: bound to go
   there, their blocks not placed yet), then the earliest of the walk;
   with `ring`, to the ring walk: its first backend is `affinity`, a later one `overflow`;
3. nothing within the bound: the least loaded candidate (`fallback`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prefix_router.routing.config import BalanceConfig, FirstPlacement
from prefix_router.routing.decision import Branch, Candidates, Decision
from prefix_router.routing.footprint import FootprintLedgers
from prefix_router.routing.keys import RoutingKey
from prefix_router.routing.load import (
    LoadTracker,
    follow_limit,
    least_bound,
    load_bound,
    spill_level,
    spill_ok,
)
from prefix_router.routing.policies.baseline import least_loaded
from prefix_router.routing.prefill import Holders, PendingPrefills
from prefix_router.routing.prefix_index import PrefixIndex
from prefix_router.routing.ring import HashRing

# How many backends of the ring walk a new prefix chooses among by cache room: all of a small fleet,
# and a constant cost at 1,000 backends (the power of d choices balances well from d = 2).
ROOM_CHOICES = 8

_NO_LIMIT = math.inf

# The branches, looked up once: reading an Enum member costs ~0.1 µs on CPython 3.11.
_AFFINITY, _PREFIX_MATCH, _OVERFLOW, _FALLBACK, _CACHE_ROOM = (
    Branch.AFFINITY,
    Branch.PREFIX_MATCH,
    Branch.OVERFLOW,
    Branch.FALLBACK,
    Branch.CACHE_ROOM,
)


def covers(key: RoutingKey, known_blocks: int, threshold: float) -> bool:
    """Is a prefix of `known_blocks` blocks enough of this request to follow its owners?"""
    return known_blocks > 0 and key.covered_bytes(known_blocks) >= threshold * key.size


def _filled_no_block(key: RoutingKey) -> bool:
    """Did the previous turn's whole prompt end before the key's first block did? The index then
    knows who took it by its end alone: no block of it was recorded anywhere."""
    return bool(key.ends) and key.reply[0] < key.ends[0]


def follows_previous_end(key: RoutingKey, threshold: float) -> bool:
    """Does this turn go by its previous prompt's end alone: that prompt filled no block, and it and
    its reply make up `threshold` of the request? Then the backend that took it is followed, if it fits."""
    return bool(key.previous_prompt_end) and _filled_no_block(key) and key.reply[1] >= threshold * key.size


def covers_ring_key(key: RoutingKey, known_blocks: int, threshold: float) -> bool:
    """`covers`, for first placements by the ring: and do the known blocks reach the ring key's end?

    What the ring key holds, the ring places alike on every replica; a replica's index, which knows
    only its own placements, is followed for what lies past it (the later turns of a conversation it
    placed). A system prompt that covers most of a first turn would otherwise take every new
    conversation to wherever each replica first sent one. The blocks alone count: the last reply is
    credited to the backend that took the previous turn, but a replica that knows only the system
    prompt before it, from other conversations, did not take that turn; the ring key, the same over a
    conversation's turns, did."""
    return (
        known_blocks > 0
        and key.ends[known_blocks - 1] >= key.ring_bytes
        and covers(key, known_blocks, threshold)
    )


class PrefixPolicy:
    """Reads the index, the ledgers and the pending prefills the picker keeps; never writes them."""

    __slots__ = (
        "_by_room",
        "_config",
        "_enough",
        "_follow_limit",
        "_free_now",
        "_index",
        "_ledgers",
        "_owner_rank",
        "_prefills",
        "_spill_level",
        "_threshold",
        "_under_floor",
    )

    def __init__(
        self,
        config: BalanceConfig,
        index: PrefixIndex | None,
        ledgers: FootprintLedgers | None,
        prefills: PendingPrefills,
    ) -> None:
        self._config = config
        # At or under this a backend fits whatever the fleet's load; without spill, always.
        self._under_floor = least_bound(config.max_inflight, config.load_floor) if config.spill else math.inf
        # An owner of the request's prefix takes it up to this (see the module's docstring).
        self._follow_limit = follow_limit(config.max_inflight, config.spill)
        # A backend at or under this takes a request whose owner is full (load.spill_level).
        self._spill_level = spill_level(config.max_inflight, config.load_factor)
        self._index = index
        self._ledgers = ledgers
        self._free_now: dict[str, float] = ledgers.free_now if ledgers is not None else {}
        self._by_room = ledgers is not None and config.first_placement is FirstPlacement.CACHE_ROOM
        self._owner_rank = ledgers.rank if ledgers is not None and self._by_room else None
        self._threshold = config.follow_threshold
        self._enough = covers_ring_key if config.first_placement is FirstPlacement.RING else covers
        self._prefills = prefills

    def pick(
        self,
        key: RoutingKey,
        ring: HashRing,
        usable: Candidates,
        load: LoadTracker,
        wait: bool,
        hold: bool = False,
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

        follow_limit = self._follow_limit

        def may_follow(backend: str) -> bool:
            return load_of(backend) + 1 <= follow_limit

        if self._by_room and follows_previous_end(key, self._threshold):
            assert self._index is not None
            taker = self._index.prompt_taker(key.previous_prompt_end)
            if taker is not None and taker in usable_set and fits(taker):
                short_turn = Decision(taker, _PREFIX_MATCH)
                short_turn.previous_turn = True
                return short_turn
        if self._index is not None and key.blocks:
            # Owners in the order they took the prefix: the first holder keeps it while it is below
            # max_inflight and no other owner's cache has more room, so one spill does not rotate a
            # group over the fleet (each cache would then have to hold every group).
            known, owners = self._index.longest_match(key.blocks)
            threshold = self._threshold
            enough = self._enough
            prefilling: Holders = ()
            if wait:
                # The index learns a placement at its response head, before the prefill is done,
                # so pending blocks are looked for among the known ones too.
                pending = self._prefills.deepest(key.blocks, 0)
                if pending is not None and enough(key, pending[0], threshold):
                    depth, holders = pending
                    for backend, ticket in holders:
                        if backend in usable_set and may_follow(backend):
                            if depth > known:  # deeper than anything cached: wait for it
                                return Decision(backend, _PREFIX_MATCH, wait_for=ticket)
                            prefilling = holders
                            break

            def admits(owner: str, depth: int) -> bool:
                # Past the relative bound (up to max_inflight) only for a prefix whose owner's queue
                # is the cheaper wait: one a request in flight there holds (surely cached, pinned),
                # or one prompt's own history (`_is_own_history`) where the requests in flight leave
                # KV room for the request. A prefix a group shares keeps the bound: a cache that busy
                # is likely turning over under its running prompts, and piling the group's requests
                # on it queues them for KV room behind cold prefills.
                after = load_of(owner) + 1
                if after <= under_floor:
                    return True
                if after > follow_limit:
                    return False
                block = key.blocks[depth - 1]
                return (
                    fits(owner)
                    or self._holds(owner, block)
                    or (self._is_own_history(block) and self._has_room_now(owner, key.size))
                )

            def waits_for(owner: str, depth: int) -> bool:
                # Full, but surely warm; and another has room, none of them clearly less busy (with
                # no room anywhere, the request waits for any backend, its owner among them).
                return (
                    hold
                    and load_of(owner) + 1 > follow_limit
                    and self._holds(owner, key.blocks[depth - 1])
                    and self._only_as_busy_elsewhere(owner, usable.ids, load_of)
                )

            def follow(owner: str) -> Decision:
                # An owner still computing the prefix is waited for; one that has it cached takes
                # the request now, before a wait for a copy computed elsewhere.
                for backend, ticket in prefilling:
                    if backend == owner:
                        return Decision(owner, _PREFIX_MATCH, wait_for=ticket)
                return Decision(owner, _PREFIX_MATCH)

            if key.previous_prompt_end:
                # The backend that took the previous turn holds its prompt and generated its reply:
                # the conversation's own cache, though the blocks the index knows deepest may be a
                # system prompt that other conversations left on other backends too.
                taker = self._index.prompt_taker(key.previous_prompt_end)
                if taker is not None and taker in usable_set:
                    held = self._index.longest_held(key.blocks, taker)
                    continued = held and self._by_room and self._continues(key, held)
                    if covers(key, held, threshold) or continued:
                        if admits(taker, held):
                            decision = follow(taker)
                        elif waits_for(taker, held):
                            decision = Decision(taker, _PREFIX_MATCH, wait_owner=True)
                        else:
                            decision = None
                        if decision is not None:
                            decision.previous_turn = True
                            return decision
                    elif held and self._by_room and key.minor_preamble and fits(taker):
                        # Its own turns aged out there and a head it shares with other conversations
                        # is all that is still held; that head (a product's system prompt) carries
                        # under one backend's share of the traffic, so it is cached on few backends:
                        # the conversation stays within the relative bound where it saves the
                        # prefill, unless cache room would send it where as much of it is cached. A
                        # head the whole fleet's traffic shares is cached everywhere: such turns
                        # move by cache room, which keeps the fleet balanced.
                        roomiest = self._roomiest(key.ring_hash, key.size, ring, usable_set, fits, load)
                        if roomiest in (None, taker) or self._index.longest_held(key.blocks, roomiest) < held:
                            decision = follow(taker)
                            decision.previous_turn = True
                            return decision
            # Under the threshold, with cache room: the part still held saves its prefill only where
            # it is (a system prompt branches at every new conversation, so it is not followed this
            # way). With the ring, the ring key takes such a request back where its prompt went.
            if enough(key, known, threshold) or (known and self._by_room and self._continues(key, known)):
                if self._owner_rank is not None and len(owners) > 1:
                    # A prompt shared by many conversations has several owners: each new one goes to
                    # the roomiest, not all to the first (herded there up to the load floor).
                    owners = tuple(sorted(owners, key=self._owner_rank))
                for owner in owners:
                    if owner in usable_set and admits(owner, known):
                        return follow(owner)
                for owner in owners:
                    if owner in usable_set and waits_for(owner, known):
                        return Decision(owner, _PREFIX_MATCH, wait_owner=True)
            if prefilling:
                for backend, ticket in prefilling:
                    if backend in usable_set and may_follow(backend):
                        return Decision(backend, _PREFIX_MATCH, wait_for=ticket)
        if self._by_room:
            roomiest = self._roomiest(key.ring_hash, key.size, ring, usable_set, fits, load)
            if roomiest is not None:
                return Decision(roomiest, _CACHE_ROOM)
            return Decision(least_loaded(usable.ids, load, ring, key.ring_hash), _FALLBACK)
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
        return Decision(least_loaded(usable.ids, load, ring, key.ring_hash), _FALLBACK)

    def _continues(self, key: RoutingKey, held: int) -> bool:
        """Does the request continue a prompt placed before, whose head (its first `held` blocks) is
        that prompt's own, not a preamble other prompts share (which, followed past the load bound
        as held blocks are, would herd)?"""
        index = self._index
        assert index is not None
        blocks = key.blocks
        if index.branches(blocks[held - 1]):
            return False
        seen = index.seen_depth(blocks, held)
        return covers(key, seen, self._threshold) or not index.branches(blocks[seen - 1])

    def _only_as_busy_elsewhere(
        self, owner: str, backends: tuple[str, ...], load_of: Callable[[str], float]
    ) -> bool:
        """Has a backend other than the full owner room (under max_inflight), and is none of them
        clearly less busy (at or under the spill level, the request placed)?"""
        least = min((load_of(b) for b in backends if b != owner), default=math.inf)
        return least + 1 <= self._config.max_inflight and not spill_ok(least, self._spill_level)

    def _is_own_history(self, block: int) -> bool:
        """With cache room, is a known prefix ending at `block` one prompt's own history, which nothing
        else went on from? A conversation sends one request at a time, so following it past the
        relative bound herds no group onto the owner; and the ledgers age an owner out once its cache
        has turned over, so the owner still holds it. Its prefill elsewhere costs the whole history
        (a long conversation's next turn is most of its prompt), a place in the owner's queue less."""
        index = self._index
        return self._by_room and index is not None and not index.branches(block)

    def _has_room_now(self, backend: str, size: int) -> bool:
        """Do the requests in flight on the backend leave KV room for a prompt of `size` bytes (as a
        first placement by cache room asks)? Without it the request would queue there for room, and
        evict what other conversations left."""
        return self._ledgers is None or self._ledgers.has_room_now(backend, size)

    def _holds(self, backend: str, block: int) -> bool:
        """Does a request in flight on the backend hold this block (without ledgers: assume so)?"""
        return self._ledgers is None or self._ledgers.is_held(backend, block)

    def _roomiest(
        self,
        key_hash: int,
        size: int,
        ring: HashRing,
        usable: frozenset[str],
        fits: Callable[[str], bool],
        load: LoadTracker,
    ) -> str | None:
        """The best-ranked of the first ROOM_CHOICES usable backends of the walk that fit; ties to the
        one fewer requests are held for a prefill on (the ledgers do not hold their blocks yet), then
        to the walk's order, so an empty fleet places by the ring. A backend whose requests in flight
        leave no room for a prompt of `size` bytes ranks after those that do: the prompt would queue
        there for KV room behind them. Among such backends, the fewest requests in flight or held for
        a prefill first, not the fewest bytes held: the many requests behind one hot prompt hold few
        bytes between them, yet the prompt waits behind every one of them."""
        assert self._ledgers is not None
        rank = self._ledgers.rank
        held_for_prefill = load.held_for_prefill
        free_now = self._free_now
        no_limit = _NO_LIMIT
        best: str | None = None
        best_order: tuple[tuple[int, float], int] | None = None  # (rank, requests held there)
        seen = 0
        for backend in ring.walk(key_hash):
            if backend not in usable:
                continue
            seen += 1
            if fits(backend):
                r = rank(backend)
                held = held_for_prefill(backend)
                if r[0] == 2 or free_now.get(backend, no_limit) < size:
                    r = (2, float(load.load(backend) + held))
                order = (r, held)
                if best_order is None or order < best_order:
                    best, best_order = backend, order
            if seen >= ROOM_CHOICES and best is not None:
                break
        return best
