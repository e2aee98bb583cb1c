"""A bounded longest-prefix index: which backends recently took which chained block hashes.

A fixed-length ring key cannot follow a conversation: each turn changes the first N characters until
the history outgrows them. The index remembers, per block hash, the few backends this router placed it
on (an approximation of their prefix caches, like SGLang's approximate radix tree or llm-d's prefix
scorer), so turn k+1 finds turn k's backend. It learns only from placements this router made; an
owner whose cache has since turned over is dropped (routing/footprint.py), but the block stays known
without owners until the index's own bound evicts it: that a request continues a conversation seen
before says whether to follow it, however much of that conversation is still cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

MAX_OWNERS = 4  # backends remembered per block, in the order they took it; the first is kept


class PrefixIndex:
    __slots__ = ("_branches", "_entries", "_max_entries", "_prompt_ends")

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._max_entries = max_entries
        self._entries: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        # A block -> its branches() (absent: none); bounded by the entries, dropped with its block.
        self._branches: dict[int, int] = {}
        # A prompt's end -> the backend that took the prompt last; as many as block entries at most.
        self._prompt_ends: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def longest_match(self, blocks: Sequence[int]) -> tuple[int, tuple[str, ...]]:
        """(number of leading blocks some backend holds, owners of the deepest one); (0, ()) when none.

        Chained hashes make a held block imply its whole prefix was placed there, and eviction trims
        prefixes from their tails, so the scan stops at the first block nobody holds; the deepest one
        is found by binary search over that monotone property.
        """
        entries = self._entries
        lo, hi = 0, len(blocks)
        if hi == 0 or not entries.get(blocks[0]):
            return 0, ()
        # Invariant: blocks[lo] is held; blocks[hi] (if hi < len) is not, or is beyond the end.
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if entries.get(blocks[mid]):
                lo = mid
            else:
                hi = mid
        return lo + 1, entries[blocks[lo]]

    def seen_depth(self, blocks: Sequence[int], held: int) -> int:
        """How many leading blocks were placed anywhere before, held or aged out since, given that the
        first `held` are held (longest_match): how much of the request continues a known prompt."""
        entries = self._entries
        lo, hi = held - 1, len(blocks)
        if lo < 0:
            if hi == 0 or blocks[0] not in entries:
                return 0
            lo = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if blocks[mid] in entries:
                lo = mid
            else:
                hi = mid
        return lo + 1

    def longest_held(self, blocks: Sequence[int], backend_id: str) -> int:
        """How many leading blocks the index knows `backend_id` holds (binary search, as above: a
        backend that holds a block took its whole prefix, and eviction trims prefixes from the tail)."""
        entries = self._entries
        owners = entries.get(blocks[0]) if blocks else None
        if owners is None or backend_id not in owners:
            return 0
        lo, hi = 0, len(blocks)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            owners = entries.get(blocks[mid])
            if owners is not None and backend_id in owners:
                lo = mid
            else:
                hi = mid
        return lo + 1

    def record(self, blocks: Sequence[int], backend_id: str) -> None:
        """Note that `backend_id` now holds these blocks (it has just been sent them).

        Deepest first, so the shallow blocks end most recently used: eviction then trims prefixes from
        their tails, and a known block keeps implying its parents are known.
        """
        entries = self._entries
        child_new = False  # was the next deeper block unknown before this record?
        for block in reversed(blocks):
            owners = entries.get(block)
            if owners is None:
                entries[block] = (backend_id,)
                child_new = True
                continue
            if child_new:
                # A known prompt continued some new way here: one more branch.
                self._branches[block] = self._branches.get(block, 0) + 1
                child_new = False
            if backend_id not in owners:
                # The first holder stays first; later ones fill the remaining places, newest last.
                owners = (*owners, backend_id) if len(owners) < MAX_OWNERS else (*owners[:-1], backend_id)
                entries[block] = owners
            entries.move_to_end(block)
        while len(entries) > self._max_entries:
            block = entries.popitem(last=False)[0]
            self._branches.pop(block, None)

    def branches(self, block: int) -> int:
        """How many times a prompt recorded through this block went on past it some way not seen
        before, once the block was known (the prompt that first recorded it does not count): a system
        prompt every conversation starts with counts one per new conversation; the last block of a
        prompt counts its first continuation too, and a conversation's inner blocks only a resumption
        from the same point."""
        return self._branches.get(block, 0)

    def record_prompt_end(self, prompt_end: int, backend_id: str) -> None:
        """Note that `backend_id` took the whole prompt ending here (RoutingKey.prompt_end)."""
        ends = self._prompt_ends
        ends[prompt_end] = backend_id
        ends.move_to_end(prompt_end)
        if len(ends) > self._max_entries:
            ends.popitem(last=False)

    def prompt_taker(self, prompt_end: int) -> str | None:
        """The backend that took the prompt ending here last, if still remembered."""
        return self._prompt_ends.get(prompt_end)

    def forget_owner(self, block: int, backend_id: str) -> None:
        """The backend no longer holds this block (it aged out of its cache); the block stays seen."""
        owners = self._entries.get(block)
        if owners is None or backend_id not in owners:
            return
        self._entries[block] = tuple(o for o in owners if o != backend_id)

    def forget_backend(self, backend_id: str) -> None:
        """Drop a backend that left the fleet (its cache is gone with it)."""
        for end in [e for e, taker in self._prompt_ends.items() if taker == backend_id]:
            del self._prompt_ends[end]
        for block in [b for b, owners in self._entries.items() if backend_id in owners]:
            self._entries[block] = tuple(o for o in self._entries[block] if o != backend_id)
