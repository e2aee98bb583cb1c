"""Placement shared by router replicas: what one request asks of the shared store, and what its answer
means for the decision. No I/O: the store client (prefix_router/fleet/shared_state.py) runs the claim.

The claim is atomic in the store: the deepest block of the request that has a shared owner is found;
when the follow table says that prefix covers enough of the request, or (`continued`) it ends where a
prompt claimed before ended and nothing went on from there since (a conversation's next turn), the
owner is chosen, else the
backend this replica proposed; unowned blocks get the chosen backend as owner (the first writer wins,
so two replicas never place one prefix twice), and the chosen backend's shared footprint is updated.
Here the answer becomes the decision: the shared owner when this replica may send to it now, else the
local decision and a take-over that hands the blocks the claim gave the owner to the local choice.

Two more things travel in the same round trip, because one replica cannot see them alone:
- pending prefills: a streaming request marks the blocks it is the first to claim (`mark`, expiring on
  its own), and a claim that follows an owner whose covering blocks another replica is prefilling right
  now learns that prefill's mark (`wait_for`), to wait, bounded, for its end as one router holds a
  request back for its own prefills (routing/prefill.py);
- load: each claim carries this replica's in-flight counts, and the answer the other replicas' counts
  per backend (`peers`), so the follow limit and the load bound count the fleet's requests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from prefix_router.routing.decision import Candidates
from prefix_router.routing.keys import RoutingKey, block_sizes
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import ROOM_CHOICES, Branch, Decision, Picker
from prefix_router.routing.ring import HashRing


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    blocks: tuple[int, ...]
    sizes: tuple[int, ...]  # bytes of key material of each block
    follow: str  # follow[d - 1] == "1": a shared owner of the first d blocks is followed
    proposed: str  # the backend this replica's own pick chose
    capacity_bytes: float  # the proposed backend's KV capacity, as this replica knows it
    listed: tuple[str, ...]  # backends whose shared footprint the answer reports (the ring walk's first)
    mark: str = ""  # this request prefills the blocks it claims first: they are pending under this mark
    wait: bool = False  # report another replica's pending prefill of the prefix the claim follows
    # An owner followed with this many of the fleet's requests in flight or more is full: the store
    # counts the request on the first holder under it, where `resolve` sends it (0: on the owner).
    follow_limit: int = 0
    # A first placement the store makes (nobody's prefix followed): '1' per listed backend this
    # replica may place on now ('': the proposed backend stands), and each listed one's KV capacity.
    room: str = ""
    capacities: tuple[float, ...] = ()
    # With `room`: the previous turn's prompt end, when that prompt filled no block (nothing of it was
    # claimed) and this turn follows whoever took it (Picker.previous_end_followed); 0: none.
    previous_end: int = 0
    # An owned prefix that ends where a prompt placed before ended, and that nothing went on from since
    # (one prompt's own history: a conversation's next turn, its previous turn placed through another
    # replica), is followed whatever share it covers, as one router follows a prompt its index saw
    # placed and not branched (policies/prefix.py `_continues`): with cache room.
    continued: bool = False


@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    chosen: str
    depth: int  # blocks of the request that had a shared owner (the deepest owned one, 1-based)
    followed: bool  # the chosen backend is that owner, followed by the table
    # Per listed backend: (backend, bytes placed there, the shared clock's reading of its least
    # recently used entry (-1: empty), entries), as Picker.shared_footprints takes them.
    figures: tuple[tuple[str, int, int, int], ...]
    wait_for: str = ""  # the mark of a prefill pending on `chosen` of a prefix covering the request
    marked: bool = False  # blocks were marked pending under the request's mark (its end must be said)
    peers: tuple[tuple[str, int], ...] = ()  # the other replicas' requests in flight, per backend
    added: int = 0  # bytes this claim added to the chosen backend's footprint (in `figures` already)
    holders: tuple[str, ...] = ()  # other listed backends holding the prefix followed, in walk order
    counted_on: str = ""  # where the store counted the request in flight ('' in a hand-made answer: chosen)
    full: frozenset[str] = frozenset()  # listed backends the fleet's counts put at the follow limit
    peers_held: tuple[tuple[str, int], ...] = ()  # bytes the other replicas' requests in flight hold
    # Bytes of KV room the request takes where it is counted: its blocks no request in flight held
    # there (the store's pins), counted as this replica's held bytes until its next write.
    taken: int = 0
    # The first placement went to the backend that took the previous turn (`previous_end`).
    turn_taken: bool = False

    def __post_init__(self) -> None:
        if not self.counted_on:
            object.__setattr__(self, "counted_on", self.chosen)

    def figures_before(self) -> tuple[tuple[str, int, int, int], ...]:
        """`figures` as they stood before this claim: what a first placement compares."""
        if not self.added:
            return self.figures
        return tuple(
            (b, max(0, used - self.added) if b == self.chosen else used, oldest, entries)
            for b, used, oldest, entries in self.figures
        )


@dataclass(frozen=True, slots=True)
class Takeover:
    """The claim gave `source` the request's blocks past `after`; they go to `target`, which the
    request went to instead. With `after` 0 every block `source` owns moves (it cannot take requests)."""

    source: str
    target: str
    after: int


@dataclass(frozen=True, slots=True)
class Resolution:
    decision: Decision
    takeover: Takeover | None
    wait_for: str = ""  # wait (bounded) for the end of this prefill before sending


def claim_request(
    key: RoutingKey,
    local: Decision,
    picker: Picker,
    ring: HashRing,
    mark: str = "",
    wait: bool = False,
    usable: Candidates | None = None,
    load: LoadTracker | None = None,
) -> ClaimRequest:
    """What to claim for a request whose local decision is `local` (key.blocks must not be empty).
    `mark`: the request may open a prefill others wait for (only a streaming one does: a
    non-streaming answer's first byte is its last); `wait`: it may wait for another's. With `usable`
    and `load`, a local first placement by cache room is the store's to make where no owner is
    followed (`room`): among the backends of the walk the local pick could have chosen. A local
    follow is not: the replica's own rules (a conversation's previous turn, a continued prompt)
    follow prefixes the store's table alone would not."""
    blocks = key.blocks
    covers = picker.covers
    follow = "".join("1" if covers(key, d) else "0" for d in range(1, len(blocks) + 1))
    ledgers = picker.ledgers
    capacity = ledgers.capacity(local.backend_id) if ledgers is not None else float(1 << 40)
    listed = tuple(itertools.islice(ring.walk(key.ring_hash), ROOM_CHOICES))
    room, capacities, previous_end = "", tuple[float, ...](), 0
    if (
        usable is not None
        and load is not None
        and ledgers is not None
        and picker.owner_rank is not None
        and local.branch is Branch.CACHE_ROOM
    ):
        room = "".join("1" if ok else "0" for ok in picker.may_place(listed, usable, load))
        capacities = tuple(ledgers.capacity(b) for b in listed)
        previous_end = picker.previous_end_followed(key)
    return ClaimRequest(
        blocks,
        block_sizes(key.ends)[: len(blocks)],
        follow,
        local.backend_id,
        capacity,
        listed,
        mark if key.streaming else "",
        wait,
        int(limit) if math.isfinite(limit := picker.follow_limit) else 0,
        room if "1" in room else "",
        capacities if "1" in room else (),
        previous_end if "1" in room else 0,
        picker.owner_rank is not None,
    )


def resolve(
    local: Decision,
    answer: ClaimAnswer,
    usable: Collection[str],
    may_follow: Callable[[str], bool],
    repick: Callable[[], Decision | None] | None = None,
    rank: Callable[[str], tuple[int, float]] | None = None,
    placed: bool = False,
) -> Resolution:
    """The final decision: the shared owner when it is usable and under max_inflight, else the
    local decision (and the blocks the claim gave the owner move to it).

    The local decision was taken on the figures of this replica's previous answer; `repick` is the
    local pick again on this answer's (the footprints as they stood before this claim, the other
    replicas' counts now). It decides instead when those put the local choice at max_inflight, and
    for a first placement, nobody's prefix followed: replicas placing new prefixes at the same moment
    would otherwise all take the backend that was roomiest before any of them. A local follow the
    store does not confirm is one too: the store aged the prefix out of that backend (each replica's
    own ledgers count only its own placements, so its index keeps owners the fleet has evicted); the
    caller forgets them (Picker.forget_placed) before `repick` runs.

    A local decision for the backend that took the request's previous turn stands where the store
    says it holds the prefix followed (a system prompt's shared owner knows nothing of the turn).

    With `rank` (the ledgers' rank, on this answer's footprints), a followed prefix that other
    backends hold too goes to the holder whose cache keeps things longest, the owner on a tie, as
    one router ranks its index's owners: a system prompt every conversation starts with has one
    shared owner, and would herd every new conversation there.

    `placed`: the claim let the store make a first placement (its `room`); where it followed no
    owner, it made it, on every replica's placements and holds as of the claim, and that stands
    where the backend may take the request now."""
    chosen = answer.chosen
    mine = local.backend_id
    if placed and not answer.followed and chosen in usable and may_follow(chosen):
        if answer.turn_taken:
            # Where the conversation's previous turn went, which another replica placed.
            turn = Decision(chosen, Branch.PREFIX_MATCH)
            turn.previous_turn = True
            return Resolution(turn, None, answer.wait_for)
        if chosen == mine:
            return Resolution(local, None, answer.wait_for)
        return Resolution(Decision(chosen, Branch.CACHE_ROOM), None, answer.wait_for)
    if (
        local.previous_turn
        and answer.followed
        and mine != chosen
        and mine in answer.holders
        and mine in usable
        and may_follow(mine)
    ):
        # This replica sent the conversation's previous turn there, which holds the prefix the store
        # followed too: the conversation's own history is there, not only what other requests share.
        return Resolution(local, Takeover(chosen, mine, answer.depth if chosen in usable else 0))
    if rank is not None and answer.followed and answer.holders:
        choices = [b for b in (chosen, *answer.holders) if b in usable and may_follow(b)]
        best = min(choices, key=rank, default=chosen)  # the first of the best: the owner on a tie
        if best != chosen:
            after = answer.depth if chosen in usable else 0
            decision = local if best == local.backend_id else Decision(best, Branch.PREFIX_MATCH)
            return Resolution(decision, Takeover(chosen, best, after))
    first = (
        repick is not None
        and chosen == local.backend_id
        and not answer.followed
        and local.branch in (Branch.CACHE_ROOM, Branch.PREFIX_MATCH)
    )
    if chosen == local.backend_id and not first and (repick is None or may_follow(chosen)):
        if answer.followed and local.branch is not Branch.PREFIX_MATCH:
            return Resolution(Decision(chosen, Branch.PREFIX_MATCH), None, answer.wait_for)
        return Resolution(local, None, answer.wait_for)
    if chosen != local.backend_id and chosen in usable and may_follow(chosen):
        return Resolution(Decision(chosen, Branch.PREFIX_MATCH), None, answer.wait_for)
    after = answer.depth if chosen in usable else 0
    if answer.followed:
        # The owner cannot take it: another backend that holds the prefix, in the walk's order (every
        # replica spills a hot prefix to the same one, as one router spills to its index's next owner).
        for holder in answer.holders:
            if holder in usable and may_follow(holder):
                if holder == local.backend_id:
                    return Resolution(local, Takeover(chosen, holder, after))
                return Resolution(Decision(holder, Branch.PREFIX_MATCH), Takeover(chosen, holder, after))
    instead = local
    if repick is not None and (first or not may_follow(local.backend_id)):
        again = repick()
        if (
            again is not None
            and may_follow(again.backend_id)
            and (not first or again.branch is Branch.CACHE_ROOM)
        ):
            instead = again
    if instead.backend_id == chosen:  # the claim's choice stands
        return Resolution(instead, None, answer.wait_for)
    # A backend that cannot take requests (gone, ejected, draining) loses every block it owns here;
    # one that is only at its bound keeps what it held before this claim.
    return Resolution(instead, Takeover(chosen, instead.backend_id, after))


def followed_history(request: ClaimRequest, answer: ClaimAnswer) -> bool:
    """Did the store follow an owner for `continued` alone: a prompt's own history covering less of
    the request than the follow table asks? Such an owner takes it as one router's own index owner of
    that history would (Picker.may_follow_history), not up to max_inflight as a covering prefix's."""
    return answer.followed and answer.depth > 0 and request.follow[answer.depth - 1] == "0"


def stale_follow(local: Decision, answer: ClaimAnswer) -> bool:
    """Did this replica follow its own index's owner of a prefix the store no longer places there?"""
    return local.branch is Branch.PREFIX_MATCH and answer.chosen == local.backend_id and not answer.followed


def after_prefill(
    decision: Decision, prefilled_on: str, usable: Collection[str], may_follow: Callable[[str], bool]
) -> Decision:
    """Where a request goes once the prefill it waited for ended on `prefilled_on`: there, when it
    may (the prefill's own request may have moved off the owner the claim named), else as decided."""
    if prefilled_on == decision.backend_id or prefilled_on not in usable or not may_follow(prefilled_on):
        return decision
    return Decision(prefilled_on, Branch.PREFIX_MATCH)


NO_MARK = "-"  # in a reply: no pending prefill to wait for
# Before a backend's name, in the in-flight pairs a replica writes and the answer's: the bytes its
# requests in flight hold there, not their count (a backend's name, a URL, has no space).
HELD = "held "


def parse_answer(reply: object, listed: Sequence[str]) -> ClaimAnswer:
    """The claim script's reply, one newline-joined string: chosen, depth, followed, the mark to wait
    for (NO_MARK: none), marked, bytes added to the chosen backend's footprint, the listed backends
    that hold the prefix followed ('0'/'1' each, NO_MARK: none followed), the backend the request was
    counted on, the listed backends at the follow limit (bits as the holders', NO_MARK: no limit),
    the bytes the request takes there, whether it went to the previous turn's taker ('0'/'1');
    bytes used, oldest use and entries of each listed backend;
    then pairs of backend and the other replicas' requests in flight there, or of HELD and the
    backend's name and the bytes they hold there. Raises ValueError when it is not that shape."""
    if isinstance(reply, bytes):
        reply = reply.decode("utf-8", "surrogateescape")
    if not isinstance(reply, str):
        raise ValueError(f"claim reply is {type(reply).__name__}, not a string")
    items = reply.split("\n")
    head = 11 + 3 * len(listed)
    if len(items) < head or (len(items) - head) % 2 or not items[0] or not items[3] or not items[7]:
        raise ValueError(f"claim reply has {len(items)} items for {len(listed)} backends")
    # int() raises ValueError on anything but a number
    depth, followed, marked, added = int(items[1]), int(items[2]), int(items[4]), int(items[5])
    taken = int(items[9])
    if items[10] not in ("0", "1"):
        raise ValueError(f"claim reply's previous-turn flag is {items[10]!r}")
    numbers = [int(item) for item in items[11:head]]
    holders = _listed_by_bits(items[6], listed, "holders")
    full = frozenset(_listed_by_bits(items[8], listed, "full backends"))
    figures = tuple(
        (backend, numbers[3 * i], numbers[1 + 3 * i], numbers[2 + 3 * i]) for i, backend in enumerate(listed)
    )
    rest = items[head:]
    pairs = [(rest[i], int(rest[i + 1])) for i in range(0, len(rest), 2)]
    if any(not backend or count < 0 or backend == HELD for backend, count in pairs):
        raise ValueError("claim reply names a backend without a name or a count below 0")
    peers = tuple((b, n) for b, n in pairs if not b.startswith(HELD))
    peers_held = tuple((b[len(HELD) :], n) for b, n in pairs if b.startswith(HELD))
    wait_for = "" if items[3] == NO_MARK else items[3]
    return ClaimAnswer(
        items[0], depth, followed == 1, figures, wait_for, marked == 1, peers, added, holders, items[7], full,
        peers_held, taken, items[10] == "1",
    )  # fmt: skip


def _listed_by_bits(bits: str, listed: Sequence[str], what: str) -> tuple[str, ...]:
    """The listed backends whose bit is '1' (NO_MARK: none)."""
    if bits == NO_MARK:
        return ()
    if len(bits) != len(listed) or bits.strip("01"):
        raise ValueError(f"claim reply's {what} do not match the backends listed")
    return tuple(b for b, bit in zip(listed, bits, strict=True) if bit == "1")
