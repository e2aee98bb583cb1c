"""Placement shared by router replicas: what one request asks of the shared store, and what its answer
means for the decision. No I/O: the store client (prefix_router/fleet/shared_state.py) runs the claim.

The claim is atomic in the store: the deepest block of the request that has a shared owner is found;
when the follow table says that prefix covers enough of the request, the owner is chosen, else the
backend this replica proposed; unowned blocks get the chosen backend as owner (the first writer wins,
so two replicas never place one prefix twice), and the chosen backend's shared footprint is updated.
Here the answer becomes the decision: the shared owner when this replica may send to it now, else the
local decision and a take-over that hands the blocks the claim gave the owner to the local choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from prefix_router.routing.keys import RoutingKey, block_sizes
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


@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    chosen: str
    depth: int  # blocks of the request that had a shared owner (the deepest owned one, 1-based)
    followed: bool  # the chosen backend is that owner, followed by the table
    # Per listed backend: (backend, bytes placed there, the shared clock's reading of its least
    # recently used entry (-1: empty), entries), as Picker.shared_footprints takes them.
    figures: tuple[tuple[str, int, int, int], ...]


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


def claim_request(key: RoutingKey, local: Decision, picker: Picker, ring: HashRing) -> ClaimRequest:
    """What to claim for a request whose local decision is `local` (key.blocks must not be empty)."""
    blocks = key.blocks
    covers = picker.covers
    follow = "".join("1" if covers(key, d) else "0" for d in range(1, len(blocks) + 1))
    ledgers = picker.ledgers
    capacity = ledgers.capacity(local.backend_id) if ledgers is not None else float(1 << 40)
    return ClaimRequest(
        blocks,
        block_sizes(key.ends)[: len(blocks)],
        follow,
        local.backend_id,
        capacity,
        tuple(itertools.islice(ring.walk(key.ring_hash), ROOM_CHOICES)),
    )


def resolve(
    local: Decision, answer: ClaimAnswer, usable: Collection[str], may_follow: Callable[[str], bool]
) -> Resolution:
    """The final decision: the shared owner when it is usable and under max_inflight, else the
    local decision (and the blocks the claim gave the owner move to it)."""
    chosen = answer.chosen
    if chosen == local.backend_id:
        if answer.followed and local.branch is not Branch.PREFIX_MATCH:
            return Resolution(Decision(chosen, Branch.PREFIX_MATCH), None)
        return Resolution(local, None)
    if chosen in usable and may_follow(chosen):
        return Resolution(Decision(chosen, Branch.PREFIX_MATCH), None)
    # A backend that cannot take requests (gone, ejected, draining) loses every block it owns here;
    # one that is only at its bound keeps what it held before this claim.
    after = answer.depth if chosen in usable else 0
    return Resolution(local, Takeover(chosen, local.backend_id, after))


def parse_answer(reply: object, listed: Sequence[str]) -> ClaimAnswer:
    """The claim script's reply, one newline-joined string: chosen, depth, followed, then bytes used,
    oldest use and entries of each listed backend. Raises ValueError when it is not that shape."""
    if isinstance(reply, bytes):
        reply = reply.decode("utf-8", "surrogateescape")
    if not isinstance(reply, str):
        raise ValueError(f"claim reply is {type(reply).__name__}, not a string")
    items = reply.split("\n")
    if len(items) != 3 + 3 * len(listed) or not items[0]:
        raise ValueError(f"claim reply has {len(items)} items for {len(listed)} backends")
    numbers = [int(item) for item in items[1:]]  # ValueError on anything else
    figures = tuple(
        (backend, numbers[2 + 3 * i], numbers[3 + 3 * i], numbers[4 + 3 * i])
        for i, backend in enumerate(listed)
    )
    return ClaimAnswer(items[0], numbers[0], numbers[1] == 1, figures)
