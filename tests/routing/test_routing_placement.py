"""First placements by cache room, known prefixes followed by how much of the request they cover, and
the per-backend ledgers that age owners out at each backend's KV capacity."""

from __future__ import annotations

import random
from collections import Counter

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_router.routing.config import BalanceConfig, FirstPlacement, KeyConfig
from prefix_router.routing.footprint import BackendLedger, FootprintLedgers
from prefix_router.routing.keys import RoutingKey, block_sizes, extract_key
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import ROOM_CHOICES, Branch, Candidates, Picker
from prefix_router.routing.ring import HashRing, Member

from texts import random_text

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "mu", "nu")


def text(seed: int, chars: int) -> str:
    return random_text(random.Random(seed), chars, WORDS)


def chat(*messages: tuple[str, str], tenant: str | None = None) -> RoutingKey:
    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    return extract_key("/v1/chat/completions", orjson.dumps(body), tenant, KeyConfig())


def fleet(n: int, salt: str = "") -> tuple[HashRing, Candidates]:
    ids = [f"http://10.1.{salt}{i}.1:8000" for i in range(n)]
    return HashRing([Member(i) for i in ids], 160), Candidates.of(ids)


def place(picker: Picker, key: RoutingKey, ring: HashRing, cands: Candidates) -> str:
    decision = picker.pick(key, ring, cands, LoadTracker())
    assert decision is not None
    held = picker.chosen(key, decision.backend_id)
    picker.placed(key, decision.backend_id)
    picker.ended(held)
    return decision.backend_id


# -- following a known prefix ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("system_chars", "question_chars", "threshold", "follows"),
    [
        pytest.param(2000, 200, 0.5, True, id="system-prompt-is-most-of-the-request"),
        pytest.param(2000, 12000, 0.5, False, id="shared-prompt-is-a-small-share"),
        pytest.param(2000, 12000, 0.1, True, id="a-low-threshold-follows-it"),
        # Coverage counts whole blocks: the known prefix of a 2,600-character prompt ends at 2,560.
        pytest.param(2600, 2400, 0.5, True, id="just-over-half"),
        pytest.param(2600, 2700, 0.5, False, id="just-under-half"),
        pytest.param(2000, 12000, 0.0, True, id="threshold-zero-follows-any-known-prefix"),
    ],
)
def test_a_known_prefix_is_followed_by_how_much_of_the_request_it_covers(
    system_chars: int, question_chars: int, threshold: float, follows: bool
) -> None:
    ring, cands = fleet(4)
    picker = Picker(BalanceConfig(follow_threshold=threshold))
    system = ("system", text(1, system_chars))
    owner = place(picker, chat(system, ("user", text(2, 50))), ring, cands)
    # A second conversation after it, with a question long enough to leave blocks of its own: the
    # system prompt has branched, so it is a preamble, not a prompt that later requests continue.
    place(picker, chat(system, ("user", text(9999, 3000))), ring, cands)
    # Another question after the same system prompt, with a ring position away from the owner.
    for seed in range(3, 200):
        key = chat(system, ("user", text(seed, question_chars)))
        if ring.primary(key.ring_hash) != owner:
            break
    decision = picker.pick(key, ring, cands, LoadTracker())
    assert decision is not None
    if follows:
        assert (decision.backend_id, decision.branch) == (owner, Branch.PREFIX_MATCH)
    else:
        # The owner already holds a prefix, the others nothing: a new conversation goes elsewhere.
        assert decision.branch is Branch.CACHE_ROOM
        assert decision.backend_id != owner


def test_a_system_prompt_shared_by_all_traffic_does_not_herd_conversations() -> None:
    """The Mooncake shape: every request starts with the same block, then its own conversation."""
    ring, cands = fleet(4)
    picker = Picker(BalanceConfig())
    system = ("system", text(0, 2048))
    homes = {}
    for conv in range(40):
        homes[conv] = place(picker, chat(system, ("user", text(100 + conv, 8000))), ring, cands)
    counts = Counter(homes.values())
    assert sorted(counts.values()) == [10, 10, 10, 10]
    # The next turn of each conversation covers its history: it follows it home.
    for conv in range(40):
        turn2 = chat(system, ("user", text(100 + conv, 8000)), ("assistant", "ok"), ("user", "more"))
        decision = picker.pick(turn2, ring, cands, LoadTracker())
        assert decision is not None
        assert (decision.backend_id, decision.branch) == (homes[conv], Branch.PREFIX_MATCH)


@pytest.mark.parametrize("next_turn", [True, False], ids=["next-turn", "longer-prompt"])
def test_a_conversation_whose_deeper_turns_aged_out_still_follows_its_cached_head(next_turn: bool) -> None:
    """A conversation comes back after its backend's cache has turned over its deeper blocks, as the
    next turn of a chat or, in the trace's shape, as one longer user message. What is still held there
    covers less than the threshold, but the request continues a prompt placed before: the held head
    saves its prefill only on that backend."""
    ring, cands = fleet(4)
    picker = Picker(BalanceConfig())
    system = ("system", text(0, 2048))
    for conv in range(8):  # every backend holds the system prompt
        place(picker, chat(system, ("user", text(200 + conv, 8000))), ring, cands)
    first = chat(system, ("user", text(100, 8000)))
    home = place(picker, first, ring, cands)
    if next_turn:
        turn2 = chat(system, ("user", text(100, 8000)), ("assistant", "ok"), ("user", "more"))
    else:
        turn2 = chat(system, ("user", text(100, 8000) + " and then " + text(101, 300)))
    # Age out all but a head past the system prompt and under half of the next turn.
    keep = max(k for k in range(1, len(first.blocks)) if turn2.covered_bytes(k) < 0.45 * turn2.size)
    assert first.ends[keep - 1] > 2048
    picker.forget_placed(first, home, keep)
    assert picker.index is not None and picker.index.longest_match(turn2.blocks) == (keep, (home,))
    decision = picker.pick(turn2, ring, cands, LoadTracker())
    assert decision is not None
    assert (decision.backend_id, decision.branch, decision.previous_turn) == (
        home,
        Branch.PREFIX_MATCH,
        next_turn,
    )
    # Once only the system prompt is left there, which every conversation went on from its own way,
    # the head is no longer the conversation's: following it (past the load bound, as a held prefix
    # is) would herd. Cache room places the turn.
    in_system = max(k for k in range(1, len(first.blocks)) if first.ends[k - 1] < 2000)
    picker.forget_placed(first, home, in_system)
    decision = picker.pick(turn2, ring, cands, LoadTracker())
    assert decision is not None and decision.branch is Branch.CACHE_ROOM

    # With first placements by the ring the ring key takes the turn back; the index is not asked.
    ring_picker = Picker(BalanceConfig(first_placement=FirstPlacement.RING))
    ring_picker.placed(first, home)
    ring_picker.forget_placed(first, home, keep)
    decision = ring_picker.pick(turn2, ring, cands, LoadTracker())
    assert decision is not None and decision.branch is not Branch.PREFIX_MATCH


def test_a_longer_prompt_that_continues_a_placed_one_follows_it_under_the_threshold() -> None:
    """The trace's shape: a request's single message continues an earlier request's whole prompt with
    more than as much again. The known prefix covers under half of it, but nothing else ever went on
    from that prompt: it is this conversation's, and is followed. A new conversation behind the same
    system prompt, once the prompt has branched, is placed by room."""
    ring, cands = fleet(4)
    picker = Picker(BalanceConfig())
    system = text(0, 2048)
    others = [place(picker, chat(("user", system + text(400 + c, 3000))), ring, cands) for c in range(8)]
    first = chat(("user", system + text(100, 3000)))
    home = place(picker, first, ring, cands)
    longer = chat(("user", system + text(100, 3000) + text(101, 12000)))
    assert not covers_share(longer, first)
    decision = picker.pick(longer, ring, cands, LoadTracker())
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (home, Branch.PREFIX_MATCH)
    new = chat(("user", system + text(999, 3000)))
    decision = picker.pick(new, ring, cands, LoadTracker())
    assert decision is not None and decision.branch is Branch.CACHE_ROOM
    assert len(set(others)) == 4


def covers_share(key: RoutingKey, earlier: RoutingKey) -> bool:
    """Do the blocks `key` shares with `earlier` cover half of it?"""
    shared = 0
    while shared < min(len(key.blocks), len(earlier.blocks)) and key.blocks[shared] == earlier.blocks[shared]:
        shared += 1
    return key.covered_bytes(shared) >= 0.5 * key.size


def test_blocks_seen_before_do_not_make_a_shared_system_prompt_followed() -> None:
    """Every conversation's system prompt is seen; a new conversation's own blocks are not: it is
    placed by cache room, though owners of the system prompt aged out and came back."""
    ring, cands = fleet(4)
    picker = Picker(BalanceConfig())
    system = ("system", text(0, 2048))
    keys = [chat(system, ("user", text(300 + conv, 8000))) for conv in range(8)]
    homes = [place(picker, key, ring, cands) for key in keys]
    for key, home in zip(keys, homes, strict=True):
        picker.forget_placed(key, home, 1)
    new = chat(system, ("user", text(999, 8000)))
    decision = picker.pick(new, ring, cands, LoadTracker())
    assert decision is not None and decision.branch is Branch.CACHE_ROOM


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 6))
def test_first_seen_groups_spread_evenly_whatever_the_ring_layout(salt: int, backends: int) -> None:
    """Equal groups, seen for the first time, land 'groups / backends' on each backend: the ring's
    luck (7 of 16 groups on one backend in a third of layouts) no longer decides."""
    ring, cands = fleet(backends, salt=f"{salt}.")
    picker = Picker(BalanceConfig())
    groups = backends * 4
    placed = [
        place(picker, chat(("system", text(g, 3000)), ("user", "q")), ring, cands) for g in range(groups)
    ]
    assert sorted(Counter(placed).values()) == [4] * backends


def test_ring_first_placement_keeps_the_ring_choice_for_a_new_prefix() -> None:
    ring, cands = fleet(4)
    picker = Picker(BalanceConfig(first_placement=FirstPlacement.RING))
    for g in range(20):
        key = chat(("system", text(g, 3000)), ("user", "q"))
        decision = picker.pick(key, ring, cands, LoadTracker())
        assert decision is not None
        assert (decision.backend_id, decision.branch) == (ring.primary(key.ring_hash), Branch.AFFINITY)
        picker.placed(key, decision.backend_id)


def test_cache_room_chooses_among_the_first_backends_of_the_walk_only() -> None:
    ring, cands = fleet(40)
    picker = Picker(BalanceConfig())
    key = chat(("system", text(5, 3000)), ("user", "q"))
    first = list(ring.walk(key.ring_hash))[:ROOM_CHOICES]
    # Fill the first choices' ledgers so a backend beyond them would have more room.
    ledgers = picker.ledgers
    assert ledgers is not None
    for i, backend in enumerate(first):
        ledgers.record(backend, (10_000 + i,), (1000 * (i + 1),))
    decision = picker.pick(key, ring, cands, LoadTracker())
    assert decision is not None
    assert decision.backend_id == first[0]  # the least used of the first ROOM_CHOICES
    assert decision.branch is Branch.CACHE_ROOM


def test_a_burst_of_new_prefixes_spreads_as_it_arrives() -> None:
    """Chosen, not answered: sixteen new prefixes picked before any answer still land four apiece."""
    ring, cands = fleet(4)
    picker = Picker(BalanceConfig())
    load = LoadTracker()
    homes = []
    for g in range(16):
        key = chat(("system", text(500 + g, 3000)), ("user", "q"))
        decision = picker.pick(key, ring, cands, load)
        assert decision is not None
        load.acquire(decision.backend_id)  # in flight: no answer yet, nothing placed
        picker.chosen(key, decision.backend_id)
        homes.append(decision.backend_id)
    assert sorted(Counter(homes).values()) == [4, 4, 4, 4]


def test_cache_room_respects_the_load_bound() -> None:
    ring, cands = fleet(4)
    picker = Picker(BalanceConfig(max_inflight=2))
    key = chat(("system", text(9, 3000)), ("user", "q"))
    walk = list(ring.walk(key.ring_hash))
    load = LoadTracker()
    for _ in range(2):
        load.acquire(walk[0])
    decision = picker.pick(key, ring, cands, load)
    assert decision is not None
    assert decision.backend_id == walk[1]
    for backend in walk:
        for _ in range(2 - load.inflight(backend)):
            load.acquire(backend)
    decision = picker.pick(key, ring, cands, load)
    assert decision is not None and decision.branch is Branch.FALLBACK


def test_with_no_kv_room_anywhere_a_new_prompt_waits_behind_the_fewest_requests() -> None:
    """Both caches are held whole by their requests in flight. The backend serving a hot system
    prompt holds the fewest bytes (its five requests share the prompt), but a new prompt sent there
    waits behind five requests, against two on the other: it goes where fewer run."""
    ring, cands = fleet(2)
    picker = Picker(BalanceConfig())
    hot, cold = cands.ids
    for backend in cands.ids:
        picker.set_capacity(backend, 5_000)
    load = LoadTracker()
    system = ("system", text(20, 3000))
    for q in range(5):
        question = chat(system, ("user", text(30 + q, 40)))
        picker.chosen(question, hot)
        picker.placed(question, hot)
        load.acquire(hot)
    for g in range(2):
        own = chat(("system", text(40 + g, 2500)), ("user", "q"))
        picker.chosen(own, cold)
        picker.placed(own, cold)
        load.acquire(cold)
    assert picker.ledgers is not None
    assert picker.ledgers.held_bytes(hot) < picker.ledgers.held_bytes(cold)
    new = chat(("system", text(50, 3000)), ("user", "q"))
    decision = picker.pick(new, ring, cands, load)
    assert decision is not None and decision.branch is Branch.CACHE_ROOM
    assert decision.backend_id == cold
    # Two more in flight on the cold one, and the hot one has the fewer requests ahead.
    for _ in range(4):
        load.acquire(cold)
    decision = picker.pick(new, ring, cands, load)
    assert decision is not None and decision.backend_id == hot


def test_new_conversations_behind_a_shared_system_prompt_go_to_its_roomiest_owner() -> None:
    """A system prompt that covers most of a first turn is followed; once two backends hold it,
    each new conversation goes to the owner whose cache has more room (where it will grow), not
    all to the first one, which the load floor would let take every one of them."""
    ring, cands = fleet(3)
    picker = Picker(BalanceConfig())
    for backend in cands.ids:
        picker.set_capacity(backend, 40_000)
    system = ("system", text(7, 3000))
    first, second = cands.ids[0], cands.ids[1]
    for backend in (first, second):
        opening = chat(system, ("user", text(8, 40)))
        held = picker.chosen(opening, backend)
        picker.placed(opening, backend)
        picker.ended(held)
    busy = chat(("system", text(9, 1500)), ("user", "q"))  # the first owner's cache is fuller
    held = picker.chosen(busy, first)
    picker.placed(busy, first)
    picker.ended(held)
    turn = chat(system, ("user", text(10, 1500)))
    decision = picker.pick(turn, ring, cands, LoadTracker())
    assert decision is not None and decision.branch is Branch.PREFIX_MATCH
    assert decision.backend_id == second
    homes = Counter(
        place(picker, chat(system, ("user", text(100 + c, 1500))), ring, cands) for c in range(12)
    )
    assert set(homes) == {first, second} and min(homes.values()) >= 4, homes


# -- the ledgers ------------------------------------------------------------------------------------


def test_an_owner_whose_cache_turned_over_is_no_longer_followed() -> None:
    ring, cands = fleet(2)
    picker = Picker(BalanceConfig())
    first_key = chat(("system", text(1, 4000)), ("user", "q"))
    owner = place(picker, first_key, ring, cands)
    picker.set_capacity(owner, 3 * first_key.size)  # room for about three such prompts
    assert picker.index is not None
    assert picker.index.longest_match(first_key.blocks)[0] == len(first_key.blocks)
    ledgers = picker.ledgers
    assert ledgers is not None
    for g in range(2, 8):  # more new prompts on the owner than its cache holds
        other = chat(("system", text(g, 4000)), ("user", "q"))
        held = picker.chosen(other, owner)
        picker.placed(other, owner)
        picker.ended(held)
    assert picker.index.longest_match(first_key.blocks) == (0, ())
    assert ledgers.ledger(owner).used_bytes <= 3 * first_key.size


def test_short_questions_behind_one_cached_prompt_fill_their_backends_ledger() -> None:
    """Every request behind a hot system prompt adds its own question to the engine's cache, whose
    blocks few or none of the key's cover: a backend taking many of them turns its cache over. A new
    prefix then goes to the backend holding one other prompt, not to the one whose blocks are few."""
    ring, cands = fleet(2)
    hot_home, other = cands.ids
    picker = Picker(BalanceConfig())
    for backend in cands.ids:
        picker.set_capacity(backend, 6000)
    hot = text(1, 1528)  # its message ends where the key's fourth block does, at 1,536 bytes
    for q in range(25):
        question = chat(("system", hot), ("user", f"Question {q}: " + text(200 + q, 150)))
        assert question.blocks_end == 1536 and question.own_tail > 0
        held = picker.chosen(question, hot_home)
        picker.placed(question, hot_home)
        picker.ended(held)
    place_on = chat(("system", text(2, 2500)), ("user", "q"))
    held = picker.chosen(place_on, other)
    picker.ended(held)
    ledgers = picker.ledgers
    assert ledgers is not None
    # The blocks alone, the system prompt's, are fewer bytes than the other backend's prompt.
    assert sum(block_sizes(question.ends)[: len(question.blocks)]) < place_on.size
    assert ledgers.rank(other) < ledgers.rank(hot_home)
    decision = picker.pick(chat(("system", text(3, 2500)), ("user", "q")), ring, cands, LoadTracker())
    assert decision is not None and decision.branch is Branch.CACHE_ROOM
    assert decision.backend_id == other


@pytest.mark.parametrize(
    ("reply_chars", "blocks_reach_the_first_prompt"),
    [
        pytest.param(300, False, id="the-next-turns-blocks-end-short-of-the-first-prompt"),
        pytest.param(1200, True, id="the-next-turns-blocks-take-the-first-prompt-over"),
    ],
)
def test_a_conversation_is_counted_once_in_its_backends_ledger(
    reply_chars: int, blocks_reach_the_first_prompt: bool
) -> None:
    """Turn k+1 holds turn k's prompt, reply and a new question. The ledger counts every byte of it
    once: turn k's tail stays its own entry while turn k+1's blocks end short of it (turn k+1's tail
    then starts where turn k's prompt ended), and is dropped once they take it over."""
    picker = Picker(BalanceConfig())
    home = "http://10.1.0.1:8000"
    picker.set_capacity(home, 1_000_000)
    system, question = ("system", text(5, 1200)), ("user", text(6, 400))
    first = chat(system, question)
    second = chat(system, question, ("assistant", text(7, reply_chars)), ("user", "And then?"))
    assert first.own_tail and second.previous_prompt_end == first.prompt_end
    assert (second.blocks_end >= first.size) is blocks_reach_the_first_prompt
    ledgers = picker.ledgers
    assert ledgers is not None
    for turn in (first, second):
        held = picker.chosen(turn, home)
        picker.ended(held)
    assert ledgers.ledger(home).used_bytes == second.size
    assert (first.prompt_end in ledgers.ledger(home)) is not blocks_reach_the_first_prompt


def test_a_tail_a_request_in_flight_holds_is_not_dropped() -> None:
    ledger = BackendLedger(10_000, 100)
    ledger.hold((1, 2), (256, 40))
    ledger.drop(2)
    assert 2 in ledger and ledger.used_bytes == 296
    ledger.let_go((1, 2), clock=1)
    ledger.drop(2)
    assert 2 not in ledger and ledger.used_bytes == 256


def test_a_full_ledger_ranks_by_how_long_it_keeps_things() -> None:
    ledgers = FootprintLedgers(max_entries=100)
    for backend in ("a", "b"):
        ledgers.set_capacity(backend, 1000)
    ledgers.record("a", (1,), (1000,))  # a's oldest entry: clock 1
    ledgers.record("b", (2,), (1000,))  # b's: clock 2
    ledgers.record("b", (3,), (1000,))  # evicts 2; b's oldest is now clock 3
    assert ledgers.rank("a") < ledgers.rank("b")  # a kept its entry longer: the better home
    ledgers.set_capacity("c", 5000)
    ledgers.record("c", (4,), (1000,))
    assert ledgers.rank("c") < ledgers.rank("a")  # room beats a full cache
    # A backend that never said its capacity counts as the known ones' mean, not as the roomiest.
    assert ledgers.capacity("unseen") == (1000 + 1000 + 5000) / 3
    assert ledgers.rank("c") < ledgers.rank("unseen")


def test_a_ledger_that_evicted_to_just_under_its_capacity_ranks_by_retention() -> None:
    # LRU eviction leaves crumbs of room; ranked by them, the cache that turns over fastest could win.
    ledgers = FootprintLedgers(max_entries=100)
    for backend in ("old", "busy"):
        ledgers.set_capacity(backend, 1000)
    for block in range(12):  # 12 x 90 bytes: one evicted, 990 held, 10 bytes of room
        ledgers.record("old", (block,), (90,))
    for block in range(100, 113):  # later, 13 x 80: one evicted, 960 held, 40 bytes of room
        ledgers.record("busy", (block,), (80,))
    assert ledgers.ledger("old").room_bytes() < ledgers.ledger("busy").room_bytes()
    assert ledgers.rank("old") < ledgers.rank("busy")  # both full: "old" keeps things longer


def test_a_backend_that_never_says_its_capacity_does_not_draw_every_new_prefix() -> None:
    """A backend that is down or exports no cache_config_info: once the others' capacities are
    known it fills like them, instead of ranking first forever with an unbounded ledger."""
    ring, cands = fleet(3)
    picker = Picker(BalanceConfig())
    silent, *known = cands.ids
    for backend in known:
        picker.set_capacity(backend, 20_000)
    homes = Counter(
        place(picker, chat(("system", text(900 + g, 3000)), ("user", "q")), ring, cands) for g in range(30)
    )
    assert homes[silent] <= 12, homes


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=6), st.integers(1, 500))),
    st.integers(1, 2000),
    st.integers(1, 12),
)
def test_a_ledger_holds_what_it_says_within_its_capacity(
    records: list[tuple[list[int], int]], capacity: int, max_entries: int
) -> None:
    ledger = BackendLedger(capacity, max_entries)
    evicted: set[int] = set()
    for clock, (blocks, size) in enumerate(records):
        unique = list(dict.fromkeys(blocks))
        out = ledger.record(unique, [size] * len(unique), clock)
        evicted.update(out)
        evicted.difference_update(b for b in unique if b in ledger)
        assert len(ledger) <= max(1, max_entries)
        assert ledger.used_bytes <= capacity or len(ledger) == 1
        assert not any(b in ledger for b in out)


def test_a_prefix_in_flight_is_not_aged_out_by_the_placements_after_it() -> None:
    """A long prompt still prefilling is pinned in the engine: two more placed there after it must
    not make the ledger forget it and send the requests waiting for that prefill elsewhere."""
    ring, cands = fleet(2)
    picker = Picker(BalanceConfig())
    doc = chat(("system", text(40, 8000)), ("user", "q0"))
    home = cands.ids[0]
    picker.set_capacity(home, 2.2 * doc.size)  # room for two such prompts
    doc_held = picker.chosen(doc, home)  # in flight: no end yet
    picker.placed(doc, home)
    for g in (41, 42):
        other = chat(("system", text(g, 8000)), ("user", "q"))
        held = picker.chosen(other, home)
        picker.placed(other, home)
        picker.ended(held)
    assert picker.index is not None
    assert picker.index.longest_match(doc.blocks) == (len(doc.blocks), (home,))
    again = chat(("system", text(40, 8000)), ("user", "q1"))
    decision = picker.pick(again, ring, cands, LoadTracker())
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (home, Branch.PREFIX_MATCH)
    # Once it ends it ages like any other entry: the placements after it trim it, tail first.
    picker.ended(doc_held)
    for g in (43, 44):
        other = chat(("system", text(g, 8000)), ("user", "q"))
        held = picker.chosen(other, home)
        picker.ended(held)
    assert picker.index.longest_match(doc.blocks)[0] < len(doc.blocks)


def test_an_end_from_before_a_backend_left_does_not_unpin_what_is_held_there_since_it_rejoined() -> None:
    """A backend leaves (discovery, a failed probe) while a request runs there and joins again; the
    same prompt is sent there anew. The old request's late end must not let go of the new one's
    blocks: a pinned prompt would otherwise age out and the index stop following it mid-request."""
    picker = Picker(BalanceConfig())
    home = "http://10.1.9.1:8000"
    doc = chat(("system", text(60, 3000)), ("user", "q"))
    before = picker.chosen(doc, home)
    picker.forget(home)
    picker.ended(before)  # no ledger there now: nothing to let go, none made
    assert picker.ledgers is not None
    assert picker.ledgers.held_bytes(home) == 0
    stale = picker.chosen(doc, home)
    picker.forget(home)
    since = picker.chosen(doc, home)  # joined again: a fresh ledger, held by this request only
    held = picker.ledgers.held_bytes(home)
    assert held > 0
    picker.ended(stale)
    assert picker.ledgers.held_bytes(home) == held
    assert all(picker.ledgers.is_held(home, block) for block in doc.blocks)
    picker.ended(since)
    assert picker.ledgers.held_bytes(home) == 0


def test_a_cache_held_whole_by_requests_in_flight_ranks_last_for_a_new_prefix() -> None:
    """Its oldest entry may be the oldest of the fleet, but nothing there can be evicted: a new
    prompt sent there waits for room in the engine's queue. The roomiest free cache takes it."""
    ledgers = FootprintLedgers(max_entries=100)
    for backend in ("pinned", "free"):
        ledgers.set_capacity(backend, 1000)
    first = ledgers.hold("pinned", (1,), (500,))  # clock 1, in flight
    ledgers.hold("pinned", (2,), (500,))  # clock 2, in flight: full
    ledgers.record("free", (3,), (500,))
    ledgers.record("free", (4,), (500,))  # full, all of it evictable
    assert ledgers.rank("free") < ledgers.rank("pinned")
    ledgers.let_go("pinned", (1,), first)  # one ends: the engine may evict it now; its end is its last use
    assert ledgers.ledger("pinned").held_bytes == 500
    assert ledgers.rank("free") < ledgers.rank("pinned") < (2, 0.0)


@pytest.mark.parametrize(
    "held_by",
    [
        pytest.param("this-replica", id="held-here"),
        pytest.param("this-replica-shared-figures", id="held-here-shared-figures"),
        pytest.param("another-replica", id="held-by-another-replica"),
    ],
)
def test_a_new_prefix_goes_where_it_can_be_admitted_now(held_by: str) -> None:
    """A cache with room left on paper but held by a long prompt in flight cannot take another
    prompt before that one ends: a full cache with nothing held takes it instead. With shared
    placement state the ranks come from the fleet's footprints, and the bytes held are this
    replica's and those the store says the other replicas' requests hold."""
    ring, cands = fleet(2)
    picker = Picker(BalanceConfig())
    busy, free = cands.ids
    prompt = chat(("system", text(70, 3000)), ("user", "q"))
    long_prompt = chat(("system", text(71, 7500)), ("user", "q"))

    def placed_bytes(key: RoutingKey) -> int:  # what a ledger counts: the key material its blocks cover
        return key.covered_bytes(len(key.blocks))

    # The long one in flight leaves room for half the new prompt.
    capacity = placed_bytes(long_prompt) + placed_bytes(prompt) // 2
    for backend in cands.ids:
        picker.set_capacity(backend, capacity)
    if held_by != "this-replica":  # the fleet's figures: the long prompt alone on busy, free full
        long_entries = len(long_prompt.blocks)
        picker.shared_footprints([(busy, placed_bytes(long_prompt), 1, long_entries), (free, capacity, 2, 9)])
    if held_by == "another-replica":
        picker.shared_held([(busy, placed_bytes(long_prompt))])
    else:
        picker.chosen(long_prompt, busy)  # in flight here
    for g in (72, 73, 74):  # served and done: evictable
        done = chat(("system", text(g, 3000)), ("user", "q"))
        held = picker.chosen(done, free)
        picker.ended(held)
    ledgers = picker.ledgers
    assert ledgers is not None
    assert ledgers.rank(busy) < ledgers.rank(free), "on room and retention alone, busy looks better"
    decision = picker.pick(prompt, ring, cands, LoadTracker())
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (free, Branch.CACHE_ROOM)
    if held_by == "another-replica":  # that request ended: the store's next answer holds nothing there
        picker.shared_held([])
        again = picker.pick(prompt, ring, cands, LoadTracker())
        assert again is not None and again.backend_id == busy


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=6), st.integers(1, 500), st.booleans())
    ),
    st.integers(1, 2000),
)
def test_held_blocks_stay_until_let_go_and_the_holds_balance(
    requests: list[tuple[list[int], int, bool]], capacity: int
) -> None:
    """Whatever the order of ends: a held block is never evicted, holds balance back to zero, and
    once nothing is held the ledger is within its capacity again at its next change."""
    ledger = BackendLedger(capacity, 1000)
    sizes: dict[int, int] = {}
    in_flight: list[list[int]] = []
    for clock, (blocks, size, ends_now) in enumerate(requests):
        unique = [b for b in dict.fromkeys(blocks)]
        for b in unique:
            sizes.setdefault(b, size)
        out = ledger.hold(unique, [sizes[b] for b in unique])
        in_flight.append(unique)
        held = {b for r in in_flight for b in r}
        assert not held & set(out)
        assert all(b in ledger for b in held)
        if ends_now:
            ledger.let_go(in_flight.pop(0), clock)
    for clock, blocks in enumerate(in_flight, start=len(requests)):
        ledger.let_go(blocks, clock)
    assert ledger.held_bytes == 0
    ledger.record([10_000], [1], len(requests) * 2)
    assert ledger.used_bytes <= capacity or len(ledger) == 1


def test_block_sizes_span_the_key_material() -> None:
    key = chat(("system", text(3, 20_000)))
    sizes = block_sizes(key.ends)[: len(key.blocks)]
    assert sum(sizes) == key.covered_bytes(len(key.blocks))
    assert key.covered_bytes(len(key.blocks)) <= key.size


@pytest.mark.parametrize("reply_chars", [pytest.param(n, id=f"reply-{n}") for n in (10, 600, 3000, 12000)])
def test_a_conversation_follows_its_history_however_long_the_reply(reply_chars: int) -> None:
    """The previous turn's prompt is what the index knows; its reply was generated on the same backend
    and is cached there too, so a long answer does not make the next turn look new."""
    ring, cands = fleet(4)
    picker = Picker(BalanceConfig())
    system, question = ("system", "be brief"), ("user", text(1, 400))
    home = place(picker, chat(system, question), ring, cands)
    turn2 = chat(system, question, ("assistant", text(2, reply_chars)), ("user", text(3, 200)))
    decision = picker.pick(turn2, ring, cands, LoadTracker())
    assert decision is not None
    assert (decision.backend_id, decision.branch) == (home, Branch.PREFIX_MATCH)


@pytest.mark.parametrize(
    ("messages", "span_text"),
    [
        pytest.param((("user", "hi"),), None, id="no-reply"),
        pytest.param((("user", "hi"), ("assistant", "hello there")), "hello there", id="last-message"),
        pytest.param((("user", "hi"), ("assistant", "é"), ("user", "ok")), "é", id="non-ascii"),
        pytest.param(
            (("assistant", "a"), ("user", "b"), ("assistant", "ünï"), ("user", "c")), "ünï", id="last-one"
        ),
    ],
)
def test_the_reply_span_is_the_last_assistant_message(
    messages: tuple[tuple[str, str], ...], span_text: str | None
) -> None:
    key = chat(*messages)
    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    from prefix_router.routing.keys import openai_text

    encoded = openai_text("/v1/chat/completions", body).encode()
    start, end = key.reply
    if span_text is None:
        assert (start, end) == (0, 0)
    else:
        assert encoded[start:end].endswith(span_text.encode())
        assert encoded[start:end].startswith(b"\x1eassistant")
