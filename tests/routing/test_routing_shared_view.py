"""The pure half of shared placement: what a claim asks for, how its answer becomes the decision,
and fleet-wide footprints in the cache-room rank."""

from __future__ import annotations

import itertools

import orjson
import pytest

from prefix_router.routing.config import BalanceConfig, KeyConfig
from prefix_router.routing.footprint import FootprintLedgers
from prefix_router.routing.keys import RoutingKey, block_sizes, extract_key
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import ROOM_CHOICES, Branch, Candidates, Decision, Picker
from prefix_router.routing.ring import HashRing, Member
from prefix_router.routing.shared_view import (
    ClaimAnswer,
    Takeover,
    claim_request,
    parse_answer,
    resolve,
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


LOCAL = Decision("X", Branch.CACHE_ROOM)


def answer(chosen: str, depth: int = 0, followed: bool = False) -> ClaimAnswer:
    return ClaimAnswer(chosen, depth, followed, ())


@pytest.mark.parametrize(
    ("claimed", "usable", "fitting", "decision", "takeover"),
    [
        pytest.param(answer("X"), {"X", "Y"}, {"X", "Y"}, LOCAL, None, id="no-owner-the-proposal-stands"),
        pytest.param(
            answer("X", 3, True),
            {"X"},
            {"X"},
            Decision("X", Branch.PREFIX_MATCH),
            None,
            id="the-owner-is-the-proposal",
        ),
        pytest.param(
            answer("Y", 3, True),
            {"X", "Y"},
            {"X", "Y"},
            Decision("Y", Branch.PREFIX_MATCH),
            None,
            id="the-shared-owner-wins",
        ),
        pytest.param(
            answer("Y", 3, True), {"X", "Y"}, {"X"}, LOCAL, Takeover("Y", "X", 3), id="owner-at-its-bound"
        ),
        pytest.param(answer("Y", 3, True), {"X"}, {"X"}, LOCAL, Takeover("Y", "X", 0), id="owner-not-usable"),
    ],
)
def test_the_answer_becomes_the_decision(
    claimed: ClaimAnswer, usable: set[str], fitting: set[str], decision: Decision, takeover: Takeover | None
) -> None:
    resolution = resolve(LOCAL, claimed, usable, fitting.__contains__)
    assert resolution.decision == decision
    assert resolution.takeover == takeover


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(b"X\n1\n0", id="too-short"),
        pytest.param(b"\n1\n0\n1\n2\n3", id="no-backend"),
        pytest.param(b"X\n1\n0\nmany\n2\n3", id="not-a-number"),
        pytest.param([b"X", 1, 0, 1, 2, 3], id="not-a-string"),
    ],
)
def test_a_malformed_reply_is_refused(reply: object) -> None:
    with pytest.raises(ValueError):
        parse_answer(reply, ["A"])


def test_a_reply_parses() -> None:
    parsed = parse_answer(b"http://x:1\n2\n1\n300\n17\n3\n0\n-1\n0", ["A", "B"])
    assert parsed == ClaimAnswer("http://x:1", 2, True, (("A", 300, 17, 3), ("B", 0, -1, 0)))


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
