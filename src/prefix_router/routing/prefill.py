"""Prefixes a backend is prefilling right now, so a second request for one can wait for it.

An engine caches a prompt's blocks only when its prefill completes. Two requests for one new prefix
sent a moment apart both compute it, and the second finds nothing cached: on the simulated fleet
this was 5-8% of all prompt tokens on shared-prefix workloads, the gap between our placement and the
serial oracle. Holding the second request until the first one's first token (bounded) sends it to a
warm cache instead. Only streaming requests open a prefill: a non-streaming answer's first byte is its
last, so waiting for it would wait for the whole generation.
"""

from __future__ import annotations

from collections.abc import Sequence

# (backend, ticket) of each prefill computing a block now, in the order they began.
Holders = tuple[tuple[str, int], ...]


class PendingPrefills:
    """Which backends are computing which blocks now. One block may be in prefill on several
    backends at once: a hot prefix spilled to a second backend is computed there too, and the
    requests spilled after it should wait for that one rather than compute it a third time."""

    __slots__ = ("_by_block", "_claimed", "_next")

    def __init__(self) -> None:
        self._by_block: dict[int, Holders] = {}
        self._claimed: dict[int, tuple[int, ...]] = {}  # ticket -> the blocks it claimed
        self._next = 0

    def __len__(self) -> int:
        return len(self._claimed)

    def start(self, blocks: Sequence[int], backend_id: str) -> int | None:
        """Claim the blocks this backend is not prefilling yet; a ticket, or None when there were none."""
        by_block = self._by_block
        new = tuple(
            b for b in blocks if b not in by_block or all(held[0] != backend_id for held in by_block[b])
        )
        if not new:
            return None
        self._next += 1
        ticket = self._next
        for block in new:
            by_block[block] = (*by_block.get(block, ()), (backend_id, ticket))
        self._claimed[ticket] = new
        return ticket

    def done(self, ticket: int) -> None:
        """The prefill ended (first byte, or failure): its blocks are no longer pending there."""
        by_block = self._by_block
        for block in self._claimed.pop(ticket, ()):
            holders = by_block.get(block)
            if holders is None:
                continue
            rest = tuple(held for held in holders if held[1] != ticket)
            if rest:
                by_block[block] = rest
            else:
                del by_block[block]

    def deepest(self, blocks: Sequence[int], start: int) -> tuple[int, Holders] | None:
        """(depth, its prefills) of the deepest pending block at index >= start, else None."""
        if not self._by_block:
            return None
        by_block = self._by_block
        for i in range(len(blocks) - 1, start - 1, -1):
            holders = by_block.get(blocks[i])
            if holders is not None:
                return i + 1, holders
        return None
