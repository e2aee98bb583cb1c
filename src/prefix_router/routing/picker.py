"""The chooser: holds what the router learns from placements and the policy that reads it.

What is learnt (the prefix index of who took which blocks, the footprint ledgers of what each cache
holds against its capacity, the prefills pending now) lives here, fed by the relay as requests are
sent and answered; the policy (routing/policies/) only chooses. No I/O.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Collection, Iterable

from prefix_router.routing.config import BalanceConfig, FirstPlacement, Policy
from prefix_router.routing.decision import Branch, Candidates, Decision
from prefix_router.routing.footprint import BackendLedger, FootprintLedgers
from prefix_router.routing.keys import RoutingKey, block_sizes
from prefix_router.routing.load import (
    LoadTracker,
    follow_limit,
    least_bound,
    load_bound,
    spill_level,
    spill_ok,
)
from prefix_router.routing.policies import Policy as RoutingPolicy
from prefix_router.routing.policies.baseline import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from prefix_router.routing.policies.prefix import ROOM_CHOICES, PrefixPolicy, covers, follows_previous_end
from prefix_router.routing.preamble_heat import PreambleHeat
from prefix_router.routing.prefill import PendingPrefills
from prefix_router.routing.prefix_index import PrefixIndex
from prefix_router.routing.ring import HashRing

# Decision, Branch and Candidates are defined in routing/decision.py; importable from here as before.
__all__ = ["LEDGER_ENTRIES", "ROOM_CHOICES", "Branch", "Candidates", "Decision", "FootprintHold", "Picker"]

# Blocks each backend's ledger may hold while its capacity is unknown (~100 bytes an entry).
LEDGER_ENTRIES = 50_000


@dataclasses.dataclass(frozen=True, slots=True)
class FootprintHold:
    """What `Picker.chosen` pinned for one request, for `Picker.ended` to let go: the ledger is the
    one it was held on, so an end that comes after its backend left and joined again is ignored."""

    backend_id: str
    entries: tuple[int, ...]
    ledger: BackendLedger


def footprint(key: RoutingKey) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What the request leaves in its backend's cache, as ledger entries and their bytes: its blocks,
    then its own tail under the prompt's end (a key has an own tail only with a prompt end,
    RoutingKey.own_tail), which identical prompts share. Only for a request with blocks: a prompt that
    fills none stays out of the ledgers, so while only such prompts have been placed the ledgers stay
    even, and the ring keeps each one on one backend. (Its end lets go of the entries `chosen` kept.)"""
    sizes = block_sizes(key.ends)[: len(key.blocks)]
    if key.own_tail:
        return (*key.blocks, key.prompt_end), (*sizes, key.own_tail)
    return key.blocks, sizes


class Picker:
    """Holds what a policy remembers between requests (index, ledgers, pending prefills) and the
    policy; no I/O."""

    __slots__ = (
        "_by_ring",
        "_config",
        "_follow_limit",
        "_heat",
        "_index",
        "_ledgers",
        "_policy",
        "_prefills",
        "_spill_level",
    )

    def __init__(self, config: BalanceConfig, rng: random.Random | None = None) -> None:
        self._config = config
        self._follow_limit = follow_limit(config.max_inflight, config.spill)
        self._spill_level = spill_level(config.max_inflight, config.load_factor)
        ours = config.policy is Policy.PREFIX
        self._index = PrefixIndex(config.prefix_index_entries) if config.prefix_index else None
        # The ledgers exist with the index: what ages out of a backend's cache leaves its owners.
        self._ledgers = (
            FootprintLedgers(LEDGER_ENTRIES, self._index.forget_owner)
            if self._index is not None and ours
            else None
        )
        self._prefills = PendingPrefills()
        # How much of the traffic each preamble carries: placed by the ring, a key takes its
        # preamble's own ring position while that is cold; by cache room, a conversation behind a
        # minor one stays where it is cached.
        self._heat = PreambleHeat() if ours else None
        self._by_ring = config.first_placement is FirstPlacement.RING
        self._policy: RoutingPolicy
        if ours:
            self._policy = PrefixPolicy(config, self._index, self._ledgers, self._prefills)
        elif config.policy is Policy.RANDOM:
            self._policy = RandomPolicy(rng or random.Random())
        elif config.policy is Policy.ROUND_ROBIN:
            self._policy = RoundRobinPolicy()
        else:
            self._policy = LeastLoadedPolicy()

    @property
    def index(self) -> PrefixIndex | None:
        return self._index

    @property
    def ledgers(self) -> FootprintLedgers | None:
        return self._ledgers

    @property
    def owner_rank(self) -> Callable[[str], tuple[int, float]] | None:
        """How the policy ranks a prefix's owners (cache room, with `first_placement: cache_room`),
        for the owners the shared store names; None: the first holder first."""
        if self._ledgers is None or self._config.first_placement is not FirstPlacement.CACHE_ROOM:
            return None
        return self._ledgers.rank

    @property
    def prefilling(self) -> int:
        """Prefills pending now (claims not yet ended)."""
        return len(self._prefills)

    def set_capacity(self, backend_id: str, capacity_bytes: float | None) -> None:
        """A backend's KV capacity in bytes of key material (None: unknown)."""
        if self._ledgers is not None:
            self._ledgers.set_capacity(backend_id, capacity_bytes)

    @property
    def follow_limit(self) -> float:
        """The most in flight on an owner that takes one more follower (routing.load.follow_limit)."""
        return self._follow_limit

    def may_spill_to(self, backend_id: str, load: LoadTracker) -> bool:
        """Is the backend clearly less busy than a full owner (routing.load.spill_level): may a
        request waiting for its owner's capacity go there instead?"""
        return spill_ok(load.load(backend_id), self._spill_level)

    def may_follow(self, backend_id: str, usable: Candidates, load: LoadTracker) -> bool:
        """May `backend_id`, an owner of the request's prefix found elsewhere (the shared store), take
        it now: a candidate under max_inflight, as the prefix policy follows its own owners."""
        return backend_id in usable.members and load.load(backend_id) + 1 <= self._follow_limit

    def may_follow_history(
        self, backend_id: str, key: RoutingKey, usable: Candidates, load: LoadTracker
    ) -> bool:
        """May `backend_id`, which holds one prompt's own history the shared store followed under the
        follow threshold (ClaimRequest.continued), take the request now: within the load bound, or up
        to max_inflight where the requests in flight there leave KV room for it, as the prefix policy
        admits its own index's owner of such a history (policies/prefix.py `admits`)."""
        if not self.may_follow(backend_id, usable, load):
            return False
        if self.may_place((backend_id,), usable, load)[0]:
            return True
        return self._ledgers is not None and self._ledgers.has_room_now(backend_id, key.size)

    def may_place(self, backends: Iterable[str], usable: Candidates, load: LoadTracker) -> tuple[bool, ...]:
        """Which of `backends` a prefix nobody holds may go to now: candidates within the load bound,
        as the prefix policy places one (for the shared store, which makes first placements). The
        bound is computed once for them all."""
        cfg = self._config
        floor = least_bound(cfg.max_inflight, cfg.load_floor) if cfg.spill else math.inf
        limit = load_bound(
            load.total_load(), len(usable.ids), cfg.load_factor, cfg.max_inflight, cfg.load_floor
        )
        members = usable.members
        return tuple(
            b in members and ((after := load.load(b) + 1) <= floor or after <= limit) for b in backends
        )

    def shared_footprints(self, figures: Iterable[tuple[str, int, int, int]]) -> None:
        """Fleet-wide footprints (backend, bytes used, oldest use, entries), so cache-room ranks count
        what every replica placed."""
        if self._ledgers is not None:
            for backend_id, used, oldest, entries in figures:
                self._ledgers.set_shared(backend_id, used, oldest, entries)

    def shared_held(self, figures: Iterable[tuple[str, int]]) -> None:
        """The bytes the other replicas' requests in flight hold per backend (empty: none, or not
        known), so a new prompt is not sent where the fleet's requests leave it no KV room."""
        if self._ledgers is not None:
            self._ledgers.set_peers_held(figures)

    def held_by_backend(self) -> dict[str, int]:
        """The bytes this replica's requests in flight hold per backend, for the shared store."""
        return self._ledgers.held_by_backend() if self._ledgers is not None else {}

    def covers(self, key: RoutingKey, known_blocks: int) -> bool:
        """Is a prefix of `known_blocks` blocks enough of this request to follow its owners?"""
        return covers(key, known_blocks, self._config.follow_threshold)

    def previous_end_followed(self, key: RoutingKey) -> int:
        """The previous turn's prompt end, when this turn follows whoever took that prompt by its end
        alone (the prompt filled no block; policies/prefix.py), placing by cache room; else 0. Such a
        prompt claims nothing in the shared store: who took it is noted there by its end
        (`notes_prompt_end`), for the replica that gets the next turn."""
        if self._ledgers is None or self._by_ring:
            return 0
        return key.previous_prompt_end if follows_previous_end(key, self._config.follow_threshold) else 0

    def notes_prompt_end(self, key: RoutingKey) -> bool:
        """Is who takes this request's prompt noted by its end alone (`previous_end_followed`)?"""
        return self._ledgers is not None and not self._by_ring and not key.blocks and bool(key.prompt_end)

    @property
    def counts_preambles(self) -> bool:
        """Does settle_key count requests (the prefix policy)?"""
        return self._heat is not None

    def settle_key(self, key: RoutingKey, backends: int) -> RoutingKey:
        """The key a request is placed by, once per request before its first pick, its preamble
        counted (routing/preamble_heat.py, over a fleet of `backends`). With first placements by the
        ring, a key whose preamble is cold is placed by the preamble alone, so every replica sends the
        requests behind it to one backend; a hot one keeps the first message in its ring key, which
        spreads them. By cache room, a key whose preamble carries less than one backend's share of
        the traffic is marked `minor_preamble` (set here, as the key is completed, before any use)."""
        heat = self._heat
        if heat is None:
            return key
        preamble = key.preamble_ring_hash
        heat.observe(preamble)
        if not preamble:
            return key
        if not self._by_ring:
            key.minor_preamble = heat.share(preamble) < 1.0 / max(1, backends)
            return key
        if preamble == key.ring_hash or heat.is_hot(preamble, backends):
            return key  # (the ring key is the preamble already: nothing to place it by instead)
        return dataclasses.replace(key, ring_hash=preamble, ring_bytes=key.preamble_bytes)

    def pick(
        self,
        key: RoutingKey,
        ring: HashRing,
        candidates: Candidates,
        load: LoadTracker,
        exclude: Collection[str] = (),
        wait: bool = False,
        hold: bool = False,
    ) -> Decision | None:
        """A backend among `candidates` not in `exclude`; None when there is none.

        With `wait`, a request whose longest prefix another request is prefilling right now gets
        that backend and the prefill's ticket, to wait on before it is sent. With `hold`, one whose
        prefix a backend at max_inflight holds may get that backend (`Decision.wait_owner`), to wait
        for its capacity, while no other is clearly less busy.
        """
        usable = candidates.without(exclude) if exclude else candidates
        if not usable.ids:
            return None
        return self._policy.pick(key, ring, usable, load, wait, hold)

    def chosen(self, key: RoutingKey, backend_id: str) -> FootprintHold | None:
        """A request is being sent to the backend: its cache will hold these blocks.

        Counted when the choice is final, not when the answer comes: a burst of new prefixes then
        spreads as it arrives, and a backend that fails every request fills its ledger like any other
        instead of always looking the roomiest. Held until `ended`: the caller passes what this
        returns to it once (None: nothing was held)."""
        ledgers = self._ledgers
        if ledgers is None or not key.blocks:
            return None
        entries, sizes = footprint(key)
        ledger = ledgers.hold(backend_id, entries, sizes)
        if key.previous_prompt_end and key.blocks_end >= key.reply[0]:
            # The previous turn's prompt, its own tail too, is in this turn's blocks now: not twice.
            # (Short of them, it is still its own entry, and this turn's tail starts where it ended.)
            ledgers.drop(backend_id, key.previous_prompt_end)
        return FootprintHold(backend_id, entries, ledger)

    def ended(self, held: FootprintHold | None) -> None:
        """The request `chosen` sent there has ended, however: its blocks are no longer pinned there
        and age from now on, as the engine frees them (routing/footprint.py)."""
        if held is not None and self._ledgers is not None:
            self._ledgers.let_go(held.backend_id, held.entries, held.ledger)

    def placed(self, key: RoutingKey, backend_id: str) -> None:
        """Learn from a placement that reached the backend (its answer began well). The prompt's end
        is noted even when the prompt filled no block: the next turn finds its taker by it alone."""
        index = self._index
        if index is None:
            return
        if key.blocks:
            index.record(key.blocks, backend_id)
        if key.prompt_end:
            index.record_prompt_end(key.prompt_end, backend_id)

    def forget_placed(self, key: RoutingKey, backend_id: str, after: int) -> None:
        """The backend no longer holds the request's blocks past the first `after` (the shared store,
        which counts every replica's placements, aged or moved them out)."""
        if self._index is not None:
            forget = self._index.forget_owner
            for block in key.blocks[after:]:
                forget(block, backend_id)

    def prefill_started(self, key: RoutingKey, backend_id: str) -> int | None:
        """A streaming request is being sent: its new blocks are pending until prefill_done."""
        if self._index is None or not key.streaming or not key.blocks:
            return None
        # Only what this backend is not known to hold yet is being computed there: a cached system
        # prompt followed by a new question must not hold requests that share only the system prompt,
        # and a prefix another backend holds is computed afresh on this one.
        known = self._index.longest_held(key.blocks, backend_id)
        return self._prefills.start(key.blocks[known:], backend_id)

    def prefill_done(self, ticket: int) -> None:
        self._prefills.done(ticket)

    def forget(self, backend_id: str) -> None:
        if self._index is not None:
            self._index.forget_backend(backend_id)
        if self._ledgers is not None:
            self._ledgers.forget(backend_id)
