"""The picker: the bound holds whenever it can, affinity and overflow follow the ring walk, the prefix
index follows a conversation, and the baseline policies do what their names say."""

from __future__ import annotations

import random
from collections import Counter

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keykit import bare_key
from prefix_router.routing.config import BalanceConfig, FirstPlacement, KeyConfig, Policy, RingKey
from prefix_router.routing.keys import RoutingKey, extract_key
from prefix_router.routing.load import LoadTracker, load_ok, spill_level
from prefix_router.routing.picker import Branch, Candidates, Picker
from prefix_router.routing.ring import HashRing, Member

IDS = [f"http://10.0.2.{i}:8000" for i in range(8)]
RING = HashRing([Member(i) for i in IDS], 160)
ALL = Candidates.of(IDS)
# The ring walk's own rules (affinity, overflow) apply where first placements follow the ring.
RING_FIRST = FirstPlacement.RING


def tracker_with(loads: dict[str, int]) -> LoadTracker:
    tracker = LoadTracker()
    for backend, n in loads.items():
        for _ in range(n):
            tracker.acquire(backend)
    return tracker


def chat_key(*contents: str) -> RoutingKey:
    system = {"role": "system", "content": "You are a careful assistant. " * 30}
    roles = ["user", "assistant"]
    messages = [system] + [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    # Keyed on the first prefix_chars: a turn's ring position moves, so only the index can follow it.
    config = KeyConfig(ring_key=RingKey.PREFIX)
    return extract_key(
        "/v1/chat/completions", orjson.dumps({"model": "m", "messages": messages}), None, config
    )


def fits(backend: str, load: LoadTracker, candidates: Candidates, config: BalanceConfig) -> bool:
    n = len(candidates.ids)
    return load_ok(
        load.load(backend), load.total_load(), n, config.load_factor, config.max_inflight, config.load_floor
    )


def own(picker: Picker, key: RoutingKey, backend: str, in_flight: bool = True) -> None:
    """The backend took `key` (the index knows it); with `in_flight`, a request there still holds it."""
    held = picker.chosen(key, backend)
    picker.placed(key, backend)
    if not in_flight:
        picker.ended(held)


@settings(max_examples=300)
@given(
    st.lists(st.integers(0, 12), min_size=8, max_size=8),
    st.sets(st.sampled_from(IDS), min_size=1),
    st.integers(0, 2**64 - 1),
    st.sampled_from([1.0, 1.25, 2.0]),
    st.integers(1, 16),
    st.lists(st.tuples(st.integers(1, 6), st.sampled_from(IDS)), max_size=4),
    st.dictionaries(st.sampled_from(IDS), st.integers(0, 10), max_size=3),
    st.booleans(),
)
def test_bounds_hold_whenever_some_backend_is_under_them(
    loads: list[int],
    candidate_ids: set[str],
    ring_hash: int,
    load_factor: float,
    max_inflight: int,
    placements: list[tuple[int, str]],
    external: dict[str, int],
    hold: bool,
) -> None:
    config = BalanceConfig(load_factor=load_factor, max_inflight=max_inflight)
    load = tracker_with(dict(zip(IDS, loads, strict=True)))
    for backend, scraped in external.items():
        load.set_external(backend, float(scraped))
    picker = Picker(config, random.Random(0))
    key = bare_key(ring_hash, blocks=(1, 2, 3, 4, 5, 6))
    for depth, backend in placements:  # the index may point anywhere, even at full or absent backends
        placed = bare_key(0, blocks=key.blocks[:depth])
        picker.chosen(placed, backend)  # in flight there: an owner that holds it may be waited for
        picker.placed(placed, backend)
    candidates = Candidates.of(candidate_ids)

    decision = picker.pick(key, RING, candidates, load, hold=hold)

    assert decision is not None
    assert decision.backend_id in candidate_ids
    if decision.wait_owner:
        # Waited for only when full, another has room, and none is clearly less busy.
        assert hold and load.load(decision.backend_id) + 1 > max_inflight
        assert not any(picker.may_spill_to(b, load) for b in candidate_ids)
        assert any(load.load(b) + 1 <= max_inflight for b in candidate_ids)
        return
    if decision.branch is Branch.PREFIX_MATCH:
        # An owner of the prefix follows up to max_inflight: a warm queue beats a cold prefill.
        assert load.load(decision.backend_id) + 1 <= max_inflight
        return
    any_fits = any(fits(b, load, candidates, config) for b in candidate_ids)
    if any_fits:
        assert fits(decision.backend_id, load, candidates, config)
        assert decision.branch is not Branch.FALLBACK
    else:
        assert decision.branch is Branch.FALLBACK
        assert load.load(decision.backend_id) == min(load.load(b) for b in candidate_ids)


@settings(max_examples=100)
@given(st.integers(0, 2**64 - 1), st.sets(st.sampled_from(IDS), min_size=1))
def test_affinity_is_the_first_usable_backend_of_the_walk(ring_hash: int, candidate_ids: set[str]) -> None:
    picker = Picker(BalanceConfig(first_placement=RING_FIRST), random.Random(0))
    decision = picker.pick(bare_key(ring_hash), RING, Candidates.of(candidate_ids), LoadTracker())
    assert decision is not None
    assert decision.branch is Branch.AFFINITY
    assert decision.backend_id == next(b for b in RING.walk(ring_hash) if b in candidate_ids)


def test_overflow_when_the_first_is_full() -> None:
    config = BalanceConfig(first_placement=RING_FIRST, max_inflight=2)
    walk = list(RING.walk(12345))
    load = tracker_with({walk[0]: 2})
    decision = Picker(config).pick(bare_key(12345), RING, ALL, load)
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (walk[1], Branch.OVERFLOW)
    load = tracker_with({walk[0]: 2, walk[1]: 2})
    decision = Picker(config).pick(bare_key(12345), RING, ALL, load)
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (walk[2], Branch.OVERFLOW)


def test_overflow_under_the_relative_bound() -> None:
    # 8 backends, 7 in flight all on the first, no floor: ceil(1.25 * 8 / 8) = 2, so 7 + 1 > 2.
    walk = list(RING.walk(999))
    load = tracker_with({walk[0]: 7})
    picker = Picker(BalanceConfig(first_placement=RING_FIRST, load_floor=0))
    decision = picker.pick(bare_key(999), RING, ALL, load)
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (walk[1], Branch.OVERFLOW)


def test_the_load_floor_keeps_a_few_requests_on_their_prefix() -> None:
    # The same 7 in flight with the default floor of 8: 7 + 1 <= 8, so the ring's first choice stays.
    walk = list(RING.walk(999))
    load = tracker_with({walk[0]: 7})
    decision = Picker(BalanceConfig(first_placement=RING_FIRST)).pick(bare_key(999), RING, ALL, load)
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (walk[0], Branch.AFFINITY)
    load = tracker_with({walk[0]: 8})
    decision = Picker(BalanceConfig(first_placement=RING_FIRST)).pick(bare_key(999), RING, ALL, load)
    assert decision is not None and decision.branch is Branch.OVERFLOW


def test_fallback_when_all_full_goes_to_least_loaded() -> None:
    config = BalanceConfig(max_inflight=1)
    loads = {b: 1 for b in IDS}
    loads[IDS[3]] = 3
    load = tracker_with(loads)
    decision = Picker(config).pick(bare_key(7), RING, ALL, load)
    assert decision is not None
    assert decision.branch is Branch.FALLBACK
    assert decision.backend_id == next(b for b in RING.walk(7) if b != IDS[3])  # ties: walk order


def test_spill_off_keeps_the_ring_choice() -> None:
    config = BalanceConfig(first_placement=RING_FIRST, max_inflight=1, spill=False)
    walk = list(RING.walk(5))
    decision = Picker(config).pick(bare_key(5), RING, ALL, tracker_with({walk[0]: 50}))
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (walk[0], Branch.AFFINITY)


def test_prefix_index_follows_a_conversation() -> None:
    picker = Picker(BalanceConfig())
    load = LoadTracker()
    turn1 = chat_key("How do I bake bread?")
    first = picker.pick(turn1, RING, ALL, load)
    assert first is not None
    # A new prefix on an empty fleet: every cache has the same room, so the ring's first choice.
    assert (first.backend_id, first.branch) == (RING.primary(turn1.ring_hash), Branch.CACHE_ROOM)
    picker.placed(turn1, first.backend_id)

    # Find a next turn whose own ring position is elsewhere: only the index can bring it back.
    for i in range(100):
        turn2 = chat_key("How do I bake bread?", "Knead it.", f"For how long? ({i})")
        if RING.primary(turn2.ring_hash) != first.backend_id:
            break
    else:
        pytest.fail("no turn with another ring position")
    assert turn2.blocks[: len(turn1.blocks)] == turn1.blocks

    second = picker.pick(turn2, RING, ALL, load)
    assert second is not None
    assert (second.backend_id, second.branch) == (first.backend_id, Branch.PREFIX_MATCH)

    # Without the index, the ring decides.
    plain = Picker(BalanceConfig(prefix_index=False)).pick(turn2, RING, ALL, load)
    assert plain is not None
    assert plain.branch is Branch.AFFINITY
    assert plain.backend_id == RING.primary(turn2.ring_hash)


def test_prefix_match_skips_full_or_absent_owners() -> None:
    config = BalanceConfig(first_placement=RING_FIRST, max_inflight=2)
    picker = Picker(config)
    key = bare_key(42, blocks=(10, 11, 12))
    walk = list(RING.walk(42))
    owner_a, owner_b = walk[-1], walk[-2]
    picker.placed(key, owner_a)
    picker.placed(key, owner_b)
    load = tracker_with({owner_a: 2})  # full
    decision = picker.pick(key, RING, ALL, load)
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (owner_b, Branch.PREFIX_MATCH)
    load = tracker_with({owner_a: 2, owner_b: 2})
    decision = picker.pick(key, RING, ALL, load)
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (walk[0], Branch.AFFINITY)
    decision = picker.pick(key, RING, ALL.without([owner_a, owner_b]), LoadTracker())
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (walk[0], Branch.AFFINITY)
    picker.forget(owner_a)
    picker.forget(owner_b)
    decision = picker.pick(key, RING, ALL, LoadTracker())
    assert decision is not None
    assert decision.branch is Branch.AFFINITY


def test_prefix_match_prefers_the_first_holder_within_the_bound() -> None:
    picker = Picker(BalanceConfig(max_inflight=4))
    key = bare_key(1, blocks=(1, 2))
    picker.placed(key, IDS[0])
    picker.placed(key, IDS[1])
    decision = picker.pick(key, RING, ALL, tracker_with({IDS[0]: 1}))
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (IDS[0], Branch.PREFIX_MATCH)
    # At its bound, the next holder (also warm) takes it before any cold backend of the walk.
    decision = picker.pick(key, RING, ALL, tracker_with({IDS[0]: 4}))
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (IDS[1], Branch.PREFIX_MATCH)


@pytest.mark.parametrize(
    ("in_flight_there", "shared", "owner_load", "follows"),
    [
        pytest.param(True, True, 6, True, id="held-past-the-relative-bound"),
        pytest.param(True, True, 7, True, id="held-just-under-max-inflight"),
        pytest.param(True, True, 8, False, id="held-at-max-inflight"),
        pytest.param(False, True, 0, True, id="cached-within-the-relative-bound"),
        pytest.param(False, True, 6, False, id="shared-prefix-cached-only-past-the-relative-bound"),
        pytest.param(False, False, 6, True, id="own-history-past-the-relative-bound"),
        pytest.param(False, False, 8, False, id="own-history-at-max-inflight"),
    ],
)
def test_an_owner_takes_its_prefix_past_the_relative_bound_while_held_there_or_its_own_history(
    in_flight_there: bool, shared: bool, owner_load: int, follows: bool
) -> None:
    # 8 backends, no floor: with 6 in flight all on the owner the relative bound is
    # ceil(1.25 * 7 / 8) = 2. A prefix a running request holds is surely cached there: a warm queue
    # under max_inflight beats a cold prefill. One only remembered as placed there, that other
    # prompts went on from (a group's shared prompt), may have been evicted by the prompts running on
    # so busy a backend, and following it would pile the group there: it keeps the relative bound.
    # One prompt's own history, nothing else went on from, is one conversation's next turn: it herds
    # nothing, and its owner's queue costs less than prefilling the whole history elsewhere.
    config = BalanceConfig(max_inflight=8, load_floor=0)
    picker = Picker(config)
    key = bare_key(7, blocks=(1, 2, 3))
    owner = list(RING.walk(7))[-1]
    if shared:  # two prompts went on from block 3 in different ways
        for tail in (40, 41):
            own(picker, bare_key(7, blocks=(1, 2, 3, tail)), owner, in_flight_there)
    own(picker, key, owner, in_flight_there)
    decision = picker.pick(key, RING, ALL, tracker_with({owner: owner_load}))
    assert decision is not None
    if follows:
        assert (decision.backend_id, decision.branch) == (owner, Branch.PREFIX_MATCH)
    else:
        assert decision.backend_id != owner
        assert decision.branch is Branch.CACHE_ROOM


@pytest.mark.parametrize(
    ("capacity", "follows"),
    [
        # The history (3 blocks, 768 bytes) is cached there, another request in flight holds 512
        # bytes, and the next turn has 1,024: 1,400 - 512 leaves it no room, 2,000 - 512 does.
        pytest.param(2_000, True, id="room-for-the-turn-follows"),
        pytest.param(1_400, False, id="no-room-for-the-turn-keeps-the-bound"),
    ],
)
def test_a_history_past_the_relative_bound_is_followed_only_where_the_turn_fits_now(
    capacity: int, follows: bool
) -> None:
    """Where the requests in flight leave the owner no KV room for the next turn, it would queue
    there for room and evict what other conversations left: the relative bound holds."""
    picker = Picker(BalanceConfig(max_inflight=8, load_floor=0))
    owner = list(RING.walk(7))[-1]
    picker.set_capacity(owner, capacity)
    own(picker, bare_key(7, blocks=(1, 2, 3)), owner, in_flight=False)
    own(picker, bare_key(9, blocks=(90, 91)), owner, in_flight=True)  # holds 512 bytes there
    turn = bare_key(7, blocks=(1, 2, 3, 4))
    decision = picker.pick(turn, RING, ALL, tracker_with({owner: 6}))
    assert decision is not None
    assert (decision.backend_id == owner) is follows
    assert decision.branch is (Branch.PREFIX_MATCH if follows else Branch.CACHE_ROOM)


@pytest.mark.parametrize(
    ("others_load", "in_flight_there", "hold", "waits"),
    [
        # max_inflight 8, load factor 1.25: a backend clearly less busy than a full owner carries at
        # most 8 / 1.25 = 6.4 with the request placed, so 5 now.
        pytest.param(7, True, True, True, id="every-other-as-busy-waits"),
        pytest.param(6, True, True, True, id="one-over-the-spill-level-waits"),
        pytest.param(5, True, True, False, id="one-clearly-less-busy-takes-it"),
        pytest.param(7, False, True, False, id="not-held-there-any-more-spills"),
        pytest.param(7, True, False, False, id="not-asked-to-hold-spills"),
        pytest.param(8, True, True, False, id="no-room-anywhere-waits-for-any"),
    ],
)
def test_a_full_owner_holding_the_prefix_is_waited_for_while_no_other_is_clearly_less_busy(
    others_load: int, in_flight_there: bool, hold: bool, waits: bool
) -> None:
    """When the owner is at max_inflight and the others are about as busy, a spill starts no
    sooner: it only prefills the prefix again in a cold cache (and evicts what that cache held)."""
    ids = IDS[:3]
    ring = HashRing([Member(i) for i in ids], 160)
    candidates = Candidates.of(ids)
    picker = Picker(BalanceConfig(max_inflight=8))
    key = bare_key(7, blocks=(1, 2, 3))
    owner = list(ring.walk(7))[-1]
    own(picker, key, owner, in_flight_there)
    load = tracker_with({b: 8 if b == owner else others_load for b in ids})
    decision = picker.pick(bare_key(7, blocks=(1, 2, 3, 4)), ring, candidates, load, hold=hold)
    assert decision is not None
    if waits:
        assert decision.backend_id == owner and decision.wait_owner
        assert decision.branch is Branch.PREFIX_MATCH
    elif others_load < 8:
        assert decision.backend_id != owner and not decision.wait_owner
        assert load.load(decision.backend_id) < 8
    else:  # every backend full: the caller waits for the first release anywhere
        assert decision.branch is Branch.FALLBACK and not decision.wait_owner


def test_the_previous_turns_backend_is_waited_for_when_full() -> None:
    picker = Picker(BalanceConfig(max_inflight=4))
    ids = IDS[:2]
    ring = HashRing([Member(i) for i in ids], 160)
    first = chat_key("a question about the invoice " * 20)
    taker = list(ring.walk(first.ring_hash))[-1]
    picker.chosen(first, taker)
    picker.placed(first, taker)
    second = chat_key("a question about the invoice " * 20, "the answer " * 30, "and then?")
    load = tracker_with({b: 4 if b == taker else 3 for b in ids})
    decision = picker.pick(second, ring, Candidates.of(ids), load, hold=True)
    assert decision is not None
    assert (decision.backend_id, decision.wait_owner, decision.previous_turn) == (taker, True, True)


@pytest.mark.parametrize(
    ("max_inflight", "load_factor", "level"),
    [
        pytest.param(32, 1.25, 25.6, id="default"),
        pytest.param(16, 2.0, 8.0, id="loose-factor"),
        pytest.param(8, 1.0, 8.0, id="no-margin-any-room"),
        pytest.param(8, 0.5, 8.0, id="factor-under-one-any-room"),
    ],
)
def test_the_spill_level_is_a_full_owner_over_the_load_factor(
    max_inflight: int, load_factor: float, level: float
) -> None:
    assert spill_level(max_inflight, load_factor) == pytest.approx(level)


FAMILY = "You are the billing assistant of one product. " * 32  # a system prompt 8 chats share
CACHE_ROOM_KEYS = KeyConfig(preamble_share=0.5, cold_preamble_share=0.5)  # as settings build them


def family_turn(chat: int, turns: int) -> RoutingKey:
    """A chat of the family at its `turns`-th turn, each reply long: the family's system prompt is
    most of a first turn and a small part of a later one."""
    messages = [{"role": "system", "content": FAMILY}]
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": f"reply {t} of chat {chat}. " * 120})
        messages.append({"role": "user", "content": f"question {t} of chat {chat}. " * 30})
    body = orjson.dumps({"model": "m", "messages": messages})
    return extract_key("/v1/chat/completions", body, None, CACHE_ROOM_KEYS)


@pytest.mark.parametrize(
    ("minor", "head_elsewhere", "stays"),
    [
        pytest.param(True, False, True, id="minor-preamble-stays-where-it-is-cached"),
        pytest.param(False, False, False, id="fleet-wide-preamble-moves-by-cache-room"),
        pytest.param(True, True, False, id="minor-preamble-moves-where-room-and-head-are"),
    ],
)
def test_a_conversation_whose_own_turns_aged_out_stays_with_its_minor_preamble(
    minor: bool, head_elsewhere: bool, stays: bool
) -> None:
    ids = IDS[:2]
    ring = HashRing([Member(i) for i in ids], 160)
    picker = Picker(BalanceConfig())
    first, later = family_turn(1, 1), family_turn(1, 2)
    taker, other = ids
    placements = [(first, taker), (family_turn(2, 1), taker)]  # the head branches on the taker
    if head_elsewhere:
        placements.append((family_turn(3, 1), other))  # the roomier backend holds the head too
    for key, backend in placements:
        own(picker, key, backend, in_flight=False)
    head = sum(1 for end in later.ends if end <= len(FAMILY))  # blocks of the system prompt alone
    picker.forget_placed(first, taker, head)  # the chat's own blocks aged out of the taker's cache
    assert not picker.covers(later, head), "the head alone is under the follow threshold"
    later.minor_preamble = minor
    decision = picker.pick(later, ring, Candidates.of(ids), LoadTracker())
    assert decision is not None
    if stays:
        assert (decision.backend_id, decision.branch, decision.previous_turn) == (
            taker,
            Branch.PREFIX_MATCH,
            True,
        )
    else:
        assert (decision.backend_id, decision.branch) == (other, Branch.CACHE_ROOM)


def test_a_new_prefix_keeps_the_relative_bound() -> None:
    picker = Picker(BalanceConfig(max_inflight=8, load_floor=0))
    owner = list(RING.walk(7))[-1]
    picker.chosen(bare_key(7, blocks=(1, 2, 3)), owner)
    decision = picker.pick(bare_key(7, blocks=(9,)), RING, ALL, tracker_with({owner: 6}))
    assert decision is not None
    assert decision.backend_id != owner


def test_random_policy() -> None:
    picker = Picker(BalanceConfig(policy=Policy.RANDOM), random.Random(1))
    candidates = Candidates.of(IDS[:5])
    chosen: Counter[str] = Counter()
    for i in range(500):
        decision = picker.pick(bare_key(i), RING, candidates, LoadTracker())
        assert decision is not None
        assert decision.branch is Branch.BALANCED
        chosen[decision.backend_id] += 1
    assert set(chosen) == set(IDS[:5])
    assert max(chosen.values()) < 2 * min(chosen.values())


def test_round_robin_cycles_through_all() -> None:
    picker = Picker(BalanceConfig(policy=Policy.ROUND_ROBIN))
    candidates = Candidates.of(IDS[:5])
    picks = []
    for _ in range(15):
        decision = picker.pick(bare_key(0), RING, candidates, LoadTracker())  # same key every time
        assert decision is not None
        assert decision.branch is Branch.BALANCED
        picks.append(decision.backend_id)
    assert sorted(picks[:5]) == sorted(IDS[:5])
    assert picks[:5] == picks[5:10] == picks[10:15]


@settings(max_examples=100)
@given(st.lists(st.integers(0, 5), min_size=8, max_size=8), st.integers(0, 2**64 - 1))
def test_least_loaded_picks_the_minimum(loads: list[int], ring_hash: int) -> None:
    load = tracker_with(dict(zip(IDS, loads, strict=True)))
    picker = Picker(BalanceConfig(policy=Policy.LEAST_LOADED))
    decision = picker.pick(bare_key(ring_hash), RING, ALL, load)
    assert decision is not None
    assert decision.branch is Branch.BALANCED
    assert load.load(decision.backend_id) == min(loads)
    # Ties go to the earliest of the key's walk, so they are sticky.
    assert decision.backend_id == next(b for b in RING.walk(ring_hash) if load.load(b) == min(loads))


@pytest.mark.parametrize("policy", [pytest.param(p, id=p.value) for p in Policy])
@settings(max_examples=30)
@given(exclude=st.sets(st.sampled_from(IDS)), ring_hash=st.integers(0, 2**64 - 1))
def test_exclude_respected(policy: Policy, exclude: set[str], ring_hash: int) -> None:
    picker = Picker(BalanceConfig(policy=policy), random.Random(0))
    decision = picker.pick(bare_key(ring_hash, (1, 2)), RING, ALL, LoadTracker(), exclude=exclude)
    if exclude == set(IDS):
        assert decision is None
    else:
        assert decision is not None
        assert decision.backend_id not in exclude


@pytest.mark.parametrize("policy", [pytest.param(p, id=p.value) for p in Policy])
def test_none_when_no_candidate(policy: Policy) -> None:
    picker = Picker(BalanceConfig(policy=policy))
    assert picker.pick(bare_key(1), RING, Candidates.of([]), LoadTracker()) is None
    assert picker.pick(bare_key(1), HashRing([], 10), Candidates.of([]), LoadTracker()) is None


def test_exclude_prefix_owner() -> None:
    picker = Picker(BalanceConfig(first_placement=RING_FIRST))
    key = bare_key(3, blocks=(7,))
    owner = list(RING.walk(3))[-1]
    picker.placed(key, owner)
    decision = picker.pick(key, RING, ALL, LoadTracker(), exclude=[owner])
    assert decision is not None
    assert decision.backend_id != owner
    assert decision.branch is Branch.AFFINITY


def test_candidates_value() -> None:
    c = Candidates.of(["b", "a", "b"])
    assert c.ids == ("a", "b")
    assert c.members == frozenset({"a", "b"})
    assert c.without(["a"]).ids == ("b",)


@pytest.mark.parametrize("held_for_prefill", [0, 1, 2])
def test_a_new_prefix_goes_where_fewer_requests_are_held_when_the_ledgers_tie(held_for_prefill: int) -> None:
    # Requests held for a prefill on a backend are bound to go there, though none of their own blocks
    # is placed yet: between caches as roomy by the ledgers, the other one takes a new prefix; with
    # none held, the walk's order decides, as on an empty fleet, however loaded.
    ids = IDS[:2]
    ring = HashRing([Member(i) for i in ids], 160)
    picker = Picker(BalanceConfig())
    key = bare_key(11, blocks=(5,))
    first, second = list(ring.walk(key.ring_hash))
    load = tracker_with({second: 3})  # in flight, its blocks in the ledgers: not what breaks the tie
    for _ in range(held_for_prefill):
        load.prefill_hold_began(first)
    decision = picker.pick(key, ring, Candidates.of(ids), load)
    assert decision is not None and decision.branch is Branch.CACHE_ROOM
    assert decision.backend_id == (second if held_for_prefill else first)


def bare_chat_key(*contents: str) -> RoutingKey:
    """A chat without a system prompt, keyed as settings build it by default."""
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    body = orjson.dumps({"model": "m", "messages": messages})
    return extract_key("/v1/chat/completions", body, None, KeyConfig())


SHORT_QUESTION = "Can you help me plan three days in Lisbon?"  # under the key's first block
REPLY = "Sure. Day one: the Alfama, the castle and a tram ride; day two: Belem. " * 4


@pytest.mark.parametrize(
    ("new_message", "taker_load", "first_placement", "follows"),
    [
        pytest.param("And in May?", 0, FirstPlacement.CACHE_ROOM, True, id="follows-the-taker"),
        pytest.param("And in May?", 3, FirstPlacement.CACHE_ROOM, True, id="busy-within-the-floor"),
        pytest.param("And in May?", 9, FirstPlacement.CACHE_ROOM, False, id="over-the-relative-bound"),
        pytest.param("Itinerary: " + "x" * 1200, 0, FirstPlacement.CACHE_ROOM, False, id="mostly-new"),
        pytest.param("And in May?", 0, FirstPlacement.RING, False, id="the-ring-places-it"),
    ],
)
def test_a_next_turn_follows_a_first_turn_too_short_to_fill_a_block(
    new_message: str, taker_load: int, first_placement: FirstPlacement, follows: bool
) -> None:
    """The index holds no block of a prompt shorter than the key's first block, only who took it (by
    its end). The next turn, that prompt and its reply ahead of a short question, goes there within
    the relative bound, by cache room; a turn mostly new, or one the ring places, is placed anew."""
    picker = Picker(BalanceConfig(first_placement=first_placement))
    first = bare_chat_key(SHORT_QUESTION)
    assert first.blocks == () and first.prompt_end
    second = bare_chat_key(SHORT_QUESTION, REPLY, new_message)
    taker = list(RING.walk(second.ring_hash))[-1]  # the last backend either placement would pick
    own(picker, first, taker, in_flight=False)
    assert picker.index is not None and picker.index.prompt_taker(first.prompt_end) == taker
    decision = picker.pick(second, RING, ALL, tracker_with({taker: taker_load}))
    assert decision is not None
    assert (decision.backend_id == taker, decision.previous_turn) == (follows, follows)
    if follows:
        assert decision.branch is Branch.PREFIX_MATCH
