"""Which known prefixes are the trunks of conversations: requests branch off them, and come back.

A system prompt that much of the traffic shares is a known prefix that covers most of a first turn,
so the prefix index follows it and sends every new conversation to the backends that took it first:
one cache then holds the fleet's conversations while the others hold little. Whether that costs
anything depends on what follows the shared part. One-shot questions after a shared document gain
nothing from being spread (the document is what is reused, and spreading it fills every cache with a
copy); a conversation is reused turn after turn and needs a cache that keeps it until its next turn.
The request does not say which it is, but the traffic does: a trunk whose branches return (a later
request's known prefix runs past it) is a conversation's trunk, and copying it to a roomier cache costs
one prefill of the trunk, where leaving the conversation in a cache that turns over costs every turn.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

MIN_BRANCHES = 4  # a trunk is judged once this many requests have branched off it
RETURN_SHARE = 0.5  # ... and it is a conversation's trunk when returns reach this share of them
MAX_TRUNKS = 4096  # branch points remembered, least recently branched off forgotten first
COUNT_CAP = 1024  # counts halve at this, so a trunk's character follows its recent traffic


class TrunkStats:
    """Per branch point (the deepest known block of a request that has more blocks after it): how many
    requests branched off it, and how many later requests ran past it. Pure, bounded."""

    __slots__ = ("_max_entries", "_stats")

    def __init__(self, max_entries: int = MAX_TRUNKS) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._max_entries = max_entries
        self._stats: OrderedDict[int, list[int]] = OrderedDict()  # block -> [branches, returns]

    def __len__(self) -> int:
        return len(self._stats)

    def observe(self, blocks: Sequence[int], known: int) -> None:
        """A request was placed whose first `known` blocks were known (to this router, or the store)."""
        if known <= 0:
            return
        stats = self._stats
        if stats:
            for j in range(known - 1):  # the branch points its known prefix runs past
                entry = stats.get(blocks[j])
                if entry is not None:
                    entry[1] += 1
        if known >= len(blocks):
            return  # nothing after the known prefix: a repeat, not a branch
        point = blocks[known - 1]
        entry = stats.get(point)
        if entry is None:
            stats[point] = [1, 0]
            if len(stats) > self._max_entries:
                stats.popitem(last=False)
            return
        stats.move_to_end(point)
        entry[0] += 1
        if entry[0] >= COUNT_CAP:
            entry[0] //= 2
            entry[1] //= 2

    def is_conversational(self, block: int) -> bool:
        """Have enough requests branched off `block`, and have enough of them come back?"""
        entry = self._stats.get(block)
        return entry is not None and entry[0] >= MIN_BRANCHES and entry[1] >= RETURN_SHARE * entry[0]
