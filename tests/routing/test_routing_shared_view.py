"""The pure half of shared placement: what a claim asks for, how its answer becomes the decision,
and fleet-wide footprints in the cache-room rank."""

from __future__ import annotations

import itertools

import orjson
import pytest

from prefix_router.routing.config import BalanceConfig, FirstPlacement, KeyConfig
from prefix_router.routing.footprint import FootprintLedgers
from prefix_router.routing.keys import RoutingKey, block_sizes, extract_key
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import ROOM_CHOICES, Branch, Candidates, Decision, Picker
from prefix_router.routing.ring import HashRing, Member
from prefix_router.routing.shared_view import (
    ClaimAnswer,
    ClaimRequest,
    Takeover,
    after_prefill,
    claim_request,
    followed_history,
    parse_answer,
    resolve,
    stale_follow,
)


def chat(system: str, question: str) -> RoutingKey:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    return extract_key("/v1/chat/completions", orjson.dumps(body), None, KeyConfig())


def test_the_claim_carries_blocks_sizes_the_follow_table_and_the_walk() -> None:
    ids = [f"http://10.2.0.{i}:8000" for i in range(12)]
    ring = HashRing([Member(i) for i in ids], 160)
    picker = Picker(BalanceConfig())
    picker.set_capacity(ids[3], 5000.0)
    key = chat("s" * 2000, "q" * 300)
    request = claim_request(key, Decision(ids[3], Branch.CACHE_ROOM), picker, ring)
    assert request.blocks == key.blocks
    assert request.sizes == block_sizes(key.ends)[: len(key.blocks)]
    assert sum(request.sizes) <= key.size
    assert request.follow == "".join(
        "1" if picker.covers(key, d) else "0" for d in range(1, len(key.blocks) + 1)
    )
    # The system prompt covers most of the request: its blocks are followed, a first block alone is not.
    assert request.follow.startswith("0") and request.follow.endswith("1")
    assert request.proposed == ids[3] and request.capacity_bytes == 5000.0
    assert request.listed == tuple(itertools.islice(ring.walk(key.ring_hash), ROOM_CHOICES))
    assert (request.mark, request.wait) == ("", False)


def test_only_a_streaming_request_marks_what_it_prefills() -> None:
    ring = HashRing([Member("A"), Member("B")], 160)
    picker = Picker(BalanceConfig())
    body = {"model": "m", "messages": [{"role": "user", "content": "q" * 3000}]}
    plain = extract_key("/v1/chat/completions", orjson.dumps(body), None, KeyConfig())
    streaming = extract_key("/v1/chat/completions", orjson.dumps({**body, "stream": True}), None, KeyConfig())
    local = Decision("A", Branch.CACHE_ROOM)
    # A non-streaming answer's first byte is its last: nobody should wait for it.
    assert claim_request(plain, local, picker, ring, "r:1", True).mark == ""
    marked = claim_request(streaming, local, picker, ring, "r:1", True)
    assert (marked.mark, marked.wait) == ("r:1", True)


LOCAL = Decision("X", Branch.CACHE_ROOM)


def answer(chosen: str, depth: int = 0, followed: bool = False, wait_for: str = "") -> ClaimAnswer:
    return ClaimAnswer(chosen, depth, followed, (), wait_for)


@pytest.mark.parametrize(
    ("claimed", "usable", "fitting", "decision", "takeover", "wait_for"),
    [
        pytest.param(answer("X"), {"X", "Y"}, {"X", "Y"}, LOCAL, None, "", id="no-owner-the-proposal-stands"),
        pytest.param(
            answer("X", 3, True),
            {"X"},
            {"X"},
            Decision("X", Branch.PREFIX_MATCH),
            None,
            "",
            id="the-owner-is-the-proposal",
        ),
        pytest.param(
            answer("Y", 3, True),
            {"X", "Y"},
            {"X", "Y"},
            Decision("Y", Branch.PREFIX_MATCH),
            None,
            "",
            id="the-shared-owner-wins",
        ),
        pytest.param(
            answer("Y", 3, True), {"X", "Y"}, {"X"}, LOCAL, Takeover("Y", "X", 3), "", id="owner-at-its-bound"
        ),
        pytest.param(
            answer("Y", 3, True), {"X"}, {"X"}, LOCAL, Takeover("Y", "X", 0), "", id="owner-not-usable"
        ),
        pytest.param(
            answer("Y", 3, True, "r:7"),
            {"X", "Y"},
            {"X", "Y"},
            Decision("Y", Branch.PREFIX_MATCH),
            None,
            "r:7",
            id="the-owner-is-prefilling-it-wait",
        ),
        pytest.param(
            answer("X", 3, True, "r:7"),
            {"X"},
            {"X"},
            Decision("X", Branch.PREFIX_MATCH),
            None,
            "r:7",
            id="prefilling-on-the-proposal-wait",
        ),
        pytest.param(
            answer("Y", 3, True, "r:7"),
            {"X", "Y"},
            {"X"},
            LOCAL,
            Takeover("Y", "X", 3),
            "",
            id="prefilling-owner-at-its-bound-no-wait",
        ),
    ],
)
def test_the_answer_becomes_the_decision(
    claimed: ClaimAnswer,
    usable: set[str],
    fitting: set[str],
    decision: Decision,
    takeover: Takeover | None,
    wait_for: str,
) -> None:
    resolution = resolve(LOCAL, claimed, usable, fitting.__contains__)
    assert resolution.decision == decision
    assert resolution.takeover == takeover
    assert resolution.wait_for == wait_for


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(b"X\n1\n0\n-\n0", id="too-short"),
        pytest.param(b"\n1\n0\n-\n0\n0\n-\nA\n-\n0\n0\n1\n2\n3", id="no-backend"),
        pytest.param(b"X\n1\n0\n\n0\n0\n-\nX\n-\n0\n0\n1\n2\n3", id="no-mark-field"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\nX\n-\n0\n0\nmany\n2\n3", id="not-a-number"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\nX\n-\n0\n0\n1\n2\n3\nB", id="a-peer-without-a-count"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\nX\n-\n0\n0\n1\n2\n3\nB\n-2", id="a-negative-peer-count"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\nX\n-\n0\n0\n1\n2\n3\nB\nlots", id="a-peer-count-not-a-number"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\nX\n-\n0\n0\n1\n2\n3\nheld \n5", id="bytes-held-on-no-backend"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\nX\n-\n0\n0\n1\n2\n3\nheld B\n-5", id="bytes-held-below-0"),
        pytest.param(b"X\n1\n1\n-\n0\n0\n01\nX\n-\n0\n0\n1\n2\n3", id="holders-for-two-of-one-listed"),
        pytest.param(b"X\n1\n1\n-\n0\n0\n2\nX\n-\n0\n0\n1\n2\n3", id="holders-not-bits"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\n\n-\n0\n0\n1\n2\n3", id="counted-nowhere"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\nX\n10\n0\n0\n1\n2\n3", id="full-for-two-of-one-listed"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\nX\n-\nsome\n0\n1\n2\n3", id="taken-not-a-number"),
        pytest.param(b"X\n1\n0\n-\n0\n0\n-\nX\n-\n0\nyes\n1\n2\n3", id="turn-flag-not-a-bit"),
        pytest.param([b"X", 1, 0, "-", 0, 0, "-", "X", "-", 1, 2, 3], id="not-a-string"),
    ],
)
def test_a_malformed_reply_is_refused(reply: object) -> None:
    with pytest.raises(ValueError):
        parse_answer(reply, ["A"])


def test_a_reply_parses() -> None:
    parsed = parse_answer(
        b"http://x:1\n2\n1\n-\n0\n0\n-\nhttp://x:1\n-\n0\n0\n300\n17\n3\n0\n-1\n0", ["A", "B"]
    )
    assert parsed == ClaimAnswer("http://x:1", 2, True, (("A", 300, 17, 3), ("B", 0, -1, 0)))
    waiting = parse_answer(b"A\n2\n1\nr9:4\n1\n40\n-\nA\n-\n0\n0\n300\n17\n3\nA\n5\nC\n1", ["A"])
    assert waiting == ClaimAnswer("A", 2, True, (("A", 300, 17, 3),), "r9:4", True, (("A", 5), ("C", 1)), 40)
    assert waiting.figures_before() == (("A", 260, 17, 3),)
    spilled = parse_answer(b"A\n2\n1\n-\n0\n0\n011\nA\n-\n0\n0\n0\n1\n1\n5\n6\n1\n7\n8\n1", ["A", "B", "C"])
    assert spilled.holders == ("B", "C")
    assert spilled.counted_on == "A"
    counted_on_holder = parse_answer(
        b"A\n2\n1\n-\n0\n0\n011\nB\n-\n0\n0\n0\n1\n1\n5\n6\n1\n7\n8\n1", ["A", "B", "C"]
    )
    assert (counted_on_holder.chosen, counted_on_holder.counted_on) == ("A", "B")
    assert counted_on_holder.full == frozenset()
    with_held = parse_answer(
        b"A\n1\n0\n-\n0\n0\n-\nA\n-\n300\n0\n0\n1\n1\nB\n2\nheld B\n700\nheld A\n5", ["A"]
    )
    assert with_held.peers == (("B", 2),)
    assert with_held.peers_held == (("B", 700), ("A", 5))
    assert with_held.taken == 300
    owner_full = parse_answer(
        b"A\n2\n1\n-\n0\n0\n011\nB\n101\n0\n0\n0\n1\n1\n5\n6\n1\n7\n8\n1", ["A", "B", "C"]
    )
    assert not owner_full.turn_taken
    turn = parse_answer(b"B\n0\n0\n-\n0\n300\n-\nB\n-\n300\n1\n300\n5\n1", ["B"])
    assert (turn.chosen, turn.turn_taken, turn.followed) == ("B", True, False)
    assert owner_full.full == {"A", "C"}


def test_shared_footprints_rank_backends_over_what_this_replica_placed() -> None:
    ledgers = FootprintLedgers(1000)
    for b in ("A", "B"):
        ledgers.set_capacity(b, 1000.0)
    ledgers.record("A", [1, 2], [400, 400])  # this replica placed on A only
    assert ledgers.rank("B") < ledgers.rank("A")
    # Other replicas filled B: the shared figures say so, and a local placement does not undo it.
    ledgers.set_shared("B", 900, 5, 3)
    ledgers.set_shared("A", 800, 9, 2)
    ledgers.record("B", [7], [10])
    assert ledgers.rank("A") == (0, -200.0) and ledgers.rank("B") == (0, -100.0)
    ledgers.set_shared("B", 1000, 5, 4)  # full: ranks by the shared clock of its oldest entry
    assert ledgers.rank("B") == (1, 5.0)
    ledgers.forget("B")
    assert ledgers.rank("B") == (0, -ledgers.capacity("B"))


def test_a_shared_owner_is_followed_as_a_local_one_up_to_max_inflight() -> None:
    picker = Picker(BalanceConfig(max_inflight=4, load_floor=1, load_factor=1.0))
    cands = Candidates.of(["A", "B"])
    load = LoadTracker()
    assert picker.may_follow("A", cands, load) and not picker.may_follow("C", cands, load)
    leases = [load.acquire("A") for _ in range(3)]
    assert picker.may_follow("A", cands, load)  # past the relative bound, under max_inflight
    leases.append(load.acquire("A"))
    assert not picker.may_follow("A", cands, load)
    assert picker.may_follow("B", cands, load)
    for lease in leases:
        lease.release()


def test_an_owner_followed_for_its_history_alone_takes_it_within_the_bound_or_where_it_has_room() -> None:
    """The store followed a conversation's own history that covers under the follow threshold
    (`continued`): its owner takes the request as one router admits its own index's owner of it."""
    picker = Picker(BalanceConfig(max_inflight=4, load_floor=1, load_factor=1.0))
    cands = Candidates.of(["A", "B"])
    load = LoadTracker()
    key = chat("s" * 600, "q" * 3000)
    picker.set_capacity("A", 10.0 * key.size)
    leases = [load.acquire("A") for _ in range(2)]
    assert not picker.may_place(("A",), cands, load)[0]  # past the relative bound
    assert picker.may_follow_history("A", key, cands, load)  # its requests in flight leave room
    picker.shared_held([("A", 9 * key.size + 1)])  # other replicas' requests fill it
    assert not picker.may_follow_history("A", key, cands, load)
    assert picker.may_follow("A", cands, load)  # a prefix that covers the request is still followed
    for lease in leases:
        lease.release()
    assert picker.may_follow_history("A", key, cands, load)  # within the bound: room does not matter
    picker.shared_held([])
    leases = [load.acquire("A") for _ in range(4)]
    assert not picker.may_follow_history("A", key, cands, load)  # at max_inflight
    for lease in leases:
        lease.release()


def test_the_answer_says_whether_the_store_followed_a_history_for_continued_alone() -> None:
    request = ClaimRequest((1, 2, 3), (10, 10, 10), "001", "Y", 1.0, (), continued=True)
    history = ClaimAnswer("X", 2, True, ())
    assert followed_history(request, history)
    assert not followed_history(request, ClaimAnswer("X", 3, True, ()))  # the table followed it
    assert not followed_history(request, ClaimAnswer("Y", 2, False, ()))  # nothing followed


FOLLOWED = Decision("X", Branch.PREFIX_MATCH)  # this replica's own index followed its owner X
ROOM_Y = Decision("Y", Branch.CACHE_ROOM)


@pytest.mark.parametrize(
    ("local", "claimed", "fitting", "again", "decision", "takeover", "picks"),
    [
        pytest.param(
            FOLLOWED, answer("X", 3, True), {"X", "Y"}, ROOM_Y, FOLLOWED, None, 0,
            id="a-follow-that-fits-stands",
        ),
        pytest.param(
            LOCAL, answer("X", 2, False), {"X", "Y"}, ROOM_Y, ROOM_Y, Takeover("X", "Y", 2), 1,
            id="a-first-placement-moves-where-the-fresh-footprints-have-more-room",
        ),
        pytest.param(
            LOCAL, answer("X"), {"X", "Y"}, Decision("X", Branch.CACHE_ROOM), LOCAL, None, 1,
            id="a-first-placement-the-fresh-footprints-confirm",
        ),
        pytest.param(
            LOCAL, answer("X"), {"X", "Y"}, Decision("Y", Branch.PREFIX_MATCH), LOCAL, None, 1,
            id="a-first-placement-moves-only-by-cache-room",
        ),
        pytest.param(
            FOLLOWED, answer("X", 1, False), {"X", "Y"}, ROOM_Y, ROOM_Y, Takeover("X", "Y", 1), 1,
            id="a-local-follow-the-store-does-not-confirm-is-a-first-placement",
        ),
        pytest.param(
            FOLLOWED, answer("X", 2, True), {"Y"}, ROOM_Y, ROOM_Y, Takeover("X", "Y", 2), 1,
            id="the-local-choice-is-full-on-these-counts",
        ),
        pytest.param(
            LOCAL, answer("Z", 3, True), {"Y"}, ROOM_Y, ROOM_Y, Takeover("Z", "Y", 3), 1,
            id="the-owner-and-the-local-choice-are-full",
        ),
        pytest.param(
            FOLLOWED, answer("X", 3, True), set(), ROOM_Y, FOLLOWED, None, 1,
            id="nothing-fits-the-claim-stands",
        ),
        pytest.param(
            LOCAL, answer("X", 3, True, "r:1"), {"X"}, ROOM_Y, FOLLOWED, None, 0, id="the-followed-owner-fits"
        ),
    ],
)  # fmt: skip
def test_the_answers_own_figures_pick_again_where_the_local_pick_was_stale(
    local: Decision,
    claimed: ClaimAnswer,
    fitting: set[str],
    again: Decision,
    decision: Decision,
    takeover: Takeover | None,
    picks: int,
) -> None:
    picked: list[int] = []

    def repick() -> Decision:
        picked.append(1)
        return again

    resolution = resolve(local, claimed, {"X", "Y", "Z"}, fitting.__contains__, repick)
    assert (resolution.decision, resolution.takeover) == (decision, takeover)
    assert len(picked) == picks


@pytest.mark.parametrize(
    ("prefilled_on", "usable", "fitting", "decision"),
    [
        pytest.param("X", {"X", "Y"}, {"X", "Y"}, LOCAL, id="where-it-was-going"),
        pytest.param("Y", {"X", "Y"}, {"X", "Y"}, Decision("Y", Branch.PREFIX_MATCH), id="it-moved-go-there"),
        pytest.param("Y", {"X", "Y"}, {"X"}, LOCAL, id="it-moved-to-a-backend-at-its-bound"),
        pytest.param("Y", {"X"}, {"X", "Y"}, LOCAL, id="it-moved-to-a-backend-not-usable"),
        pytest.param("", {"X", "Y"}, {"X", "Y"}, LOCAL, id="nobody-said-where"),
    ],
)
def test_a_request_goes_where_the_prefill_it_waited_for_ended(
    prefilled_on: str, usable: set[str], fitting: set[str], decision: Decision
) -> None:
    assert after_prefill(LOCAL, prefilled_on, usable, fitting.__contains__) == decision


def test_a_local_follow_the_store_aged_out_is_forgotten() -> None:
    picker = Picker(BalanceConfig())
    key = chat("s" * 2000, "q" * 300)
    picker.placed(key, "X")
    picker.placed(key, "Y")
    index = picker.index
    assert index is not None and index.longest_match(key.blocks) == (len(key.blocks), ("X", "Y"))
    followed = Decision("X", Branch.PREFIX_MATCH)
    assert stale_follow(followed, answer("X", 2, False))
    assert not stale_follow(followed, answer("X", 5, True))  # the store confirms it
    assert not stale_follow(followed, answer("Y", 5, True))  # the store follows another owner
    assert not stale_follow(Decision("X", Branch.CACHE_ROOM), answer("X"))
    picker.forget_placed(key, "X", 2)
    assert index.longest_match(key.blocks[:2]) == (2, ("X", "Y"))  # what the store still has there
    assert index.longest_match(key.blocks) == (len(key.blocks), ("Y",))


def test_an_owner_at_its_bound_spills_to_the_next_holder_of_the_prefix_in_the_walk() -> None:
    holders = ClaimAnswer("X", 3, True, (), holders=("Z", "Y"))
    usable = {"X", "Y", "Z"}

    def none() -> Decision | None:
        return None

    spill = resolve(LOCAL, holders, usable, {"Y", "Z"}.__contains__, none)
    assert spill.decision == Decision("Z", Branch.PREFIX_MATCH) and spill.takeover == Takeover("X", "Z", 3)
    past = resolve(LOCAL, holders, usable, {"Y"}.__contains__, none)  # Z is at its bound too
    assert past.decision == Decision("Y", Branch.PREFIX_MATCH) and past.takeover == Takeover("X", "Y", 3)
    # None of them can take it: the local decision, as before.
    assert resolve(LOCAL, holders, usable, set().__contains__, none).decision == LOCAL
    # Not followed (the prefix covers too little): holders do not matter.
    thin = ClaimAnswer("Y", 1, False, (), holders=("Z",))
    assert resolve(LOCAL, thin, usable, {"X", "Z"}.__contains__, none).decision == LOCAL


def test_a_followed_prefix_other_backends_hold_goes_to_the_roomiest_holder() -> None:
    """One system prompt shared by every conversation has one shared owner: each replica ranks its
    holders by cache room, as one router ranks its index's owners, so new conversations spread."""
    holders = ClaimAnswer("X", 3, True, (), holders=("Z", "Y"))
    usable = {"X", "Y", "Z"}
    anyone = usable.__contains__
    ranks = {"X": (0, -100.0), "Y": (0, -500.0), "Z": (0, -300.0)}

    def none() -> Decision | None:
        return None

    roomiest = resolve(LOCAL, holders, usable, anyone, none, ranks.__getitem__)
    assert roomiest.decision == Decision("Y", Branch.PREFIX_MATCH)
    assert roomiest.takeover == Takeover("X", "Y", 3)  # the conversation's own blocks go with it
    # The owner wins a tie, with its pending prefill's mark.
    waiting = ClaimAnswer("X", 3, True, (), "r:7", holders=("Z", "Y"))
    tie = {"X": (0, -300.0), "Y": (0, -300.0), "Z": (0, -300.0)}
    kept = resolve(
        Decision("X", Branch.PREFIX_MATCH), waiting, usable, {"X", "Z"}.__contains__, none, tie.__getitem__
    )
    assert (kept.decision.backend_id, kept.takeover, kept.wait_for) == ("X", None, "r:7")
    # A holder at its bound is passed over.
    assert resolve(
        LOCAL, holders, usable, {"X", "Z"}.__contains__, none, ranks.__getitem__
    ).decision == Decision("Z", Branch.PREFIX_MATCH)
    # Without ranks (first_placement: ring), the owner keeps it.
    assert resolve(LOCAL, holders, usable, anyone, none).decision == Decision("X", Branch.PREFIX_MATCH)


def test_the_backend_that_took_the_previous_turn_keeps_it_where_the_store_says_it_holds_the_prefix() -> None:
    """The store follows a system prompt's shared owner; the replica that sent the conversation's
    previous turn to Y knows its history is there, and Y holds that prompt too."""
    answer = ClaimAnswer("X", 3, True, (), holders=("Z", "Y"))
    usable = {"X", "Y", "Z"}
    ranks = {"X": (0, -100.0), "Y": (0, -300.0), "Z": (0, -500.0)}  # Z the roomiest

    def none() -> Decision | None:
        return None

    previous = Decision("Y", Branch.PREFIX_MATCH, previous_turn=True)
    kept = resolve(previous, answer, usable, usable.__contains__, none, ranks.__getitem__)
    assert kept.decision.backend_id == "Y" and kept.takeover == Takeover("X", "Y", 3)
    # Without the previous turn there, the roomiest holder, as for a new conversation.
    other = resolve(
        Decision("Y", Branch.PREFIX_MATCH), answer, usable, usable.__contains__, none, ranks.__getitem__
    )
    assert other.decision.backend_id == "Z"
    # Where the store does not say Y holds the prefix, or Y may take no more, the store's rules decide.
    elsewhere = ClaimAnswer("X", 3, True, (), holders=("Z",))
    assert (
        resolve(previous, elsewhere, usable, usable.__contains__, none, ranks.__getitem__).decision.backend_id
        == "Z"
    )
    full = {"X", "Z"}.__contains__
    assert resolve(previous, answer, usable, full, none, ranks.__getitem__).decision.backend_id == "Z"


def test_a_first_placement_by_cache_room_lets_the_store_choose_among_the_walks_backends_that_fit() -> None:
    ids = ["A", "B", "C", "D"]
    ring = HashRing([Member(i) for i in ids], 160)
    picker = Picker(BalanceConfig(max_inflight=4, load_floor=1))
    for i, backend in enumerate(ids):
        picker.set_capacity(backend, 1000.0 * (i + 1))
    key = chat("s" * 2000, "q" * 300)
    load = LoadTracker()
    leases = [load.acquire("B") for _ in range(4)]  # B is at max_inflight: no new prefix goes there
    everyone = Candidates.of(ids)
    request = claim_request(key, Decision("A", Branch.CACHE_ROOM), picker, ring, usable=everyone, load=load)
    assert request.room == "".join("0" if b == "B" else "1" for b in request.listed)
    assert request.capacities == tuple(1000.0 * (ids.index(b) + 1) for b in request.listed)
    # Only the backends the replica may use now: one that is not a candidate is never chosen.
    without_c = Candidates.of(["A", "B", "D"])
    narrow = claim_request(key, Decision("A", Branch.CACHE_ROOM), picker, ring, usable=without_c, load=load)
    assert narrow.room == "".join("1" if b in ("A", "D") else "0" for b in narrow.listed)
    # A local follow keeps its own rules (the previous turn, a continued prompt), which the store's
    # table alone does not know; a ring placement is the ring's.
    assert not claim_request(
        key, Decision("A", Branch.PREFIX_MATCH), picker, ring, usable=everyone, load=load
    ).room
    assert not claim_request(
        key, Decision("A", Branch.AFFINITY), picker, ring, usable=everyone, load=load
    ).room
    assert not claim_request(key, Decision("A", Branch.CACHE_ROOM), picker, ring).room  # nothing to say
    ring_first = Picker(BalanceConfig(first_placement=FirstPlacement.RING))
    assert not claim_request(
        key, Decision("A", Branch.CACHE_ROOM), ring_first, ring, usable=everyone, load=load
    ).room
    for lease in leases:
        lease.release()


@pytest.mark.parametrize(
    ("local", "claimed", "fitting", "decision", "takeover"),
    [
        pytest.param(
            LOCAL, answer("Y"), {"X", "Y"}, Decision("Y", Branch.CACHE_ROOM), None, id="elsewhere-stands"
        ),
        pytest.param(LOCAL, answer("X"), {"X", "Y"}, LOCAL, None, id="the-local-choice-stands"),
        # Where another replica sent the conversation's previous turn, too short to claim anything.
        pytest.param(
            LOCAL,
            ClaimAnswer("Y", 0, False, (), turn_taken=True),
            {"X", "Y"},
            Decision("Y", Branch.PREFIX_MATCH),
            None,
            id="the-previous-turns-taker",
        ),
        # The fleet moved on since the claim: the local choice, and the blocks follow it.
        pytest.param(
            LOCAL, answer("Y"), {"X"}, LOCAL, Takeover("Y", "X", 0), id="the-stores-choice-now-full"
        ),
    ],
)
def test_a_first_placement_the_store_made_stands_where_the_backend_may_take_the_request(
    local: Decision, claimed: ClaimAnswer, fitting: set[str], decision: Decision, takeover: Takeover | None
) -> None:
    def repick() -> Decision:
        raise AssertionError("the store placed it: no pick again")

    resolution = resolve(local, claimed, {"X", "Y", "Z"}, fitting.__contains__, repick, placed=True)
    assert (resolution.decision, resolution.takeover) == (decision, takeover)
    assert resolution.decision.previous_turn == claimed.turn_taken


SHORT_OPENED = ("Hi?", "An answer. " * 40, "More?")


def _turns(first: str, reply: str, second: str) -> RoutingKey:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": first},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": second},
        ],
    }
    return extract_key("/v1/chat/completions", orjson.dumps(body), None, KeyConfig())


@pytest.mark.parametrize(
    ("turn", "first_placement", "local_branch", "carried"),
    [
        pytest.param(SHORT_OPENED, "cache_room", "cache_room", True, id="short-opened"),
        # The previous prompt filled a block: its blocks are claimed, and their owner followed.
        pytest.param(("q" * 600, "An answer. " * 40, "More?"), "cache_room", "cache_room", False, id="long"),
        # Mostly new: the previous turn is a minor part of this one, placed anew.
        pytest.param(("Hi?", "Ok.", "x" * 2000), "cache_room", "cache_room", False, id="mostly-new"),
        # Not a first placement: the replica follows the taker it knows itself.
        pytest.param(SHORT_OPENED, "cache_room", "prefix_match", False, id="local-follow"),
        pytest.param(SHORT_OPENED, "ring", "cache_room", False, id="ring-placement"),
    ],
)
def test_a_first_placement_carries_the_end_of_a_previous_prompt_too_short_to_claim(
    turn: tuple[str, str, str], first_placement: str, local_branch: str, carried: bool
) -> None:
    ids = ["A", "B", "C"]
    ring = HashRing([Member(i) for i in ids], 160)
    picker = Picker(BalanceConfig(first_placement=FirstPlacement(first_placement)))
    key = _turns(*turn)
    assert key.blocks and key.previous_prompt_end
    request = claim_request(
        key, Decision("A", Branch(local_branch)), picker, ring, usable=Candidates.of(ids), load=LoadTracker()
    )
    assert request.previous_end == (key.previous_prompt_end if carried else 0)
    first = extract_key(
        "/v1/chat/completions",
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": turn[0]}]}),
        None,
        KeyConfig(),
    )
    # Who takes a prompt is noted in the store where its next turn would look for it.
    assert picker.notes_prompt_end(first) == (not first.blocks and first_placement == "cache_room")
