"""What this router has placed on each backend, and how much of it the backend's cache can still hold.

A prefix nobody holds (or holds too little of) is worth placing where it will stay cached longest.
Each backend's ledger is an LRU of the blocks placed there, in bytes of key material, bounded by the
backend's KV capacity (vLLM's `num_gpu_blocks * block_size` tokens, times bytes per token): what
falls out of the ledger has most likely fallen out of the engine's cache too, and the caller drops
that backend as an owner of those blocks so the prefix index does not follow a stale owner. The blocks
of requests still in flight are held, as the engine pins a running request's blocks: never evicted,
and last used when the last request holding them ends.

Two measures rank backends for a new prefix:
- room: capacity minus what the ledger holds, while the ledger is not full (under FULL_SHARE);
- once it is full, retention: how many placements ago the ledger's oldest entry was last used. Under
  LRU a cache keeps things for about capacity / inflow; placing where the oldest entry is oldest
  evens out that time over the fleet (what SGLang's "smallest tree" does while its trees never evict);
- last, a cache that requests in flight hold (nearly) whole: a new prompt there waits for room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

# A backend whose capacity is not known gets the mean of those that are known (a backend that does
# not say, or cannot be reached, must not look the roomiest and draw every new prefix), or this
# figure while none is known, so they rank by what they hold; the entry bound keeps memory bounded.
UNKNOWN_CAPACITY_BYTES = float(1 << 40)
# A ledger this full ranks by retention. LRU eviction leaves a full ledger just under its capacity, so
# "any room left" would rank every full cache by the crumbs its last eviction happened to leave.
FULL_SHARE = 15 / 16


def is_full(used: float, capacity: float, entries: int, max_entries: int) -> bool:
    return used >= FULL_SHARE * capacity or entries >= max_entries


class BackendLedger:
    """An LRU of the blocks placed on one backend. Blocks of requests still in flight are held (pinned,
    as vLLM pins a running request's blocks): they are not evicted, and they take their place in the
    LRU when the last request holding them ends, as the engine frees them then."""

    __slots__ = ("_blocks", "_capacity", "_held", "_held_bytes", "_max_entries", "_used")

    def __init__(self, capacity_bytes: float, max_entries: int) -> None:
        # Evictable entries, least recently used first: block -> (bytes, last use).
        self._blocks: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._held: dict[int, list[int]] = {}  # block -> [bytes, requests in flight holding it]
        self._held_bytes = 0
        self._capacity = capacity_bytes
        self._max_entries = max_entries
        self._used = 0  # held and evictable

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    @property
    def capacity_bytes(self) -> float:
        return self._capacity

    def __len__(self) -> int:
        return len(self._blocks) + len(self._held)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks or block in self._held

    def is_full(self) -> bool:
        return is_full(self._used, self._capacity, len(self), self._max_entries)

    def is_held(self, block: int) -> bool:
        return block in self._held

    def room_bytes(self) -> float:
        return max(0.0, self._capacity - self._used)

    def oldest_use(self) -> int:
        """The clock reading of the least recently used evictable entry; -1 when there is none."""
        if not self._blocks:
            return -1
        return next(iter(self._blocks.values()))[1]

    def record(self, blocks: Sequence[int], sizes: Sequence[int], clock: int) -> list[int]:
        """A placement whose request has already ended: its blocks held and let go at `clock` at once
        (so used then, shallow ones most recently), then the ledger brought within its capacity;
        returns the blocks evicted. A block another request holds stays held."""
        evicted = self.hold(blocks, sizes)
        self.let_go(blocks, clock)
        return evicted + self._within_bounds()

    def hold(self, blocks: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """A request in flight uses these blocks: they stay until `let_go`; returns the blocks evicted
        to make room (only evictable ones: over capacity, the engine queues rather than evicts)."""
        entries = self._blocks
        held = self._held
        used = self._used
        held_bytes = self._held_bytes
        for i in range(len(blocks)):
            block = blocks[i]
            entry = held.get(block)
            if entry is not None:
                entry[1] += 1
                continue
            old = entries.pop(block, None)
            if old is None:
                size = sizes[i]
                used += size
            else:
                size = old[0]
            held[block] = [size, 1]
            held_bytes += size
        self._used = used
        self._held_bytes = held_bytes
        return self._within_bounds()

    def let_go(self, blocks: Sequence[int], clock: int) -> None:
        """The request that held these blocks ended: the last holder's end is their last use. Deepest
        first, like `record`; a block this ledger does not hold is ignored."""
        entries = self._blocks
        held = self._held
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            entry = held.get(block)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del held[block]
                self._held_bytes -= entry[0]
                entries[block] = (entry[0], clock)

    def drop(self, block: int) -> None:
        """The entry no longer stands for bytes of its own (a later entry covers them); one that a
        request in flight holds stays until it is let go."""
        entry = self._blocks.pop(block, None)
        if entry is not None:
            self._used -= entry[0]

    def set_capacity(self, capacity_bytes: float) -> list[int]:
        self._capacity = capacity_bytes
        return self._shrink()

    def _within_bounds(self) -> list[int]:
        if self._used > self._capacity or len(self._blocks) + len(self._held) > self._max_entries:
            return self._shrink()
        return []

    def _shrink(self) -> list[int]:
        entries = self._blocks
        held = len(self._held)
        evicted: list[int] = []
        # One entry always stays: a prompt larger than the whole cache still leaves its head cached.
        while (
            entries
            and len(entries) + held > 1
            and (self._used > self._capacity or len(entries) + held > self._max_entries)
        ):
            block, (size, _) = entries.popitem(last=False)
            self._used -= size
            evicted.append(block)
        return evicted


class FootprintLedgers:
    """One ledger per backend and a shared clock; `on_evict(block, backend)` drops stale owners."""

    __slots__ = (
        "_capacity_of",
        "_clock",
        "_free_now",
        "_ledgers",
        "_max_entries",
        "_on_evict",
        "_peers_held",
        "_ranks",
        "_shared",
    )

    def __init__(self, max_entries: int, on_evict: Callable[[int, str], None] | None = None) -> None:
        self._ledgers: dict[str, BackendLedger] = {}
        self._capacity_of: dict[str, float] = {}
        self._max_entries = max_entries
        self._on_evict = on_evict
        self._clock = 0
        self._ranks: dict[str, tuple[int, float]] = {}  # kept with every change: a pick only reads
        # Capacity minus the bytes requests in flight hold, per backend with a local ledger or with
        # the other replicas' holds known: what a new prompt can be admitted to now (absent: no limit
        # known).
        self._free_now: dict[str, float] = {}
        # The bytes the other replicas' requests in flight hold per backend, as the shared store
        # last said: replicas placing new prompts at once must not all fill one engine's KV room.
        self._peers_held: dict[str, int] = {}
        # Fleet-wide figures from the shared store (bytes used, oldest use, entries): while a backend
        # has one, it ranks by it, on the shared clock, rather than by what this replica placed.
        self._shared: dict[str, tuple[int, int, int]] = {}

    def ledger(self, backend_id: str) -> BackendLedger:
        ledger = self._ledgers.get(backend_id)
        if ledger is None:
            capacity = self.capacity(backend_id)
            ledger = self._ledgers[backend_id] = BackendLedger(capacity, self._max_entries)
        return ledger

    def set_capacity(self, backend_id: str, capacity_bytes: float | None) -> None:
        """The backend's KV capacity in bytes of key material; None: not known."""
        if capacity_bytes is None:
            self._capacity_of.pop(backend_id, None)
        else:
            self._capacity_of[backend_id] = max(0.0, capacity_bytes)
        # The figure of every backend whose capacity is unknown follows the known ones' mean.
        for other, ledger in self._ledgers.items():
            if other == backend_id or other not in self._capacity_of:
                self._evicted(ledger.set_capacity(self.capacity(other)), other)
                self._rerank(other)
        self._rerank(backend_id)

    def set_shared(self, backend_id: str, used_bytes: int, oldest_use: int, entries: int) -> None:
        """The backend's footprint as every replica's placements made it (shared placement state)."""
        self._shared[backend_id] = (used_bytes, oldest_use, entries)
        self._rerank(backend_id)

    def capacity(self, backend_id: str) -> float:
        known = self._capacity_of.get(backend_id)
        if known is not None:
            return known
        if self._capacity_of:
            return sum(self._capacity_of.values()) / len(self._capacity_of)
        return UNKNOWN_CAPACITY_BYTES

    def record(self, backend_id: str, blocks: Sequence[int], sizes: Sequence[int]) -> None:
        self._clock += 1
        evicted = self.ledger(backend_id).record(blocks, sizes, self._clock)
        if evicted:
            self._evicted(evicted, backend_id)
        self._rerank(backend_id)

    def hold(self, backend_id: str, blocks: Sequence[int], sizes: Sequence[int]) -> BackendLedger:
        """A request is sent there: its blocks are used now and stay until `let_go` (see BackendLedger).
        Returns the ledger they are held on, for `let_go` to name."""
        self._clock += 1
        ledger = self.ledger(backend_id)
        evicted = ledger.hold(blocks, sizes)
        if evicted:
            self._evicted(evicted, backend_id)
        self._rerank(backend_id)
        return ledger

    def drop(self, backend_id: str, block: int) -> None:
        """See BackendLedger.drop; nothing is evicted, so no owner is forgotten."""
        ledger = self._ledgers.get(backend_id)
        if ledger is not None and block in ledger:
            ledger.drop(block)
            self._rerank(backend_id)

    def set_peers_held(self, figures: Iterable[tuple[str, int]]) -> None:
        """The bytes the other replicas' requests in flight hold per backend (shared placement
        state); replaces what was said before, and none at all says nobody else holds anything."""
        old = self._peers_held
        new = {backend: held for backend, held in figures if held > 0}
        if new == old:
            return
        self._peers_held = new
        for backend_id in old.keys() | new.keys():
            self._rerank(backend_id)

    @property
    def free_now(self) -> dict[str, float]:
        """Per backend, its capacity minus what requests in flight hold there, this replica's and, with
        shared state, the others' (summed: two replicas' holds of one prefix count twice, erring
        towards a fuller engine): a prompt of more bytes cannot be admitted now. Kept with every
        change, one dict for the ledgers' life, for a pick to read (never to write); a backend absent
        from it has no known limit."""
        return self._free_now

    def has_room_now(self, backend_id: str, size: int) -> bool:
        """Do the requests in flight on the backend leave KV room for a prompt of `size` bytes?"""
        return self._free_now.get(backend_id, float("inf")) >= size

    def held_by_backend(self) -> dict[str, int]:
        """The bytes this replica's requests in flight hold, per backend holding any."""
        return {b: ledger.held_bytes for b, ledger in self._ledgers.items() if ledger.held_bytes > 0}

    def held_bytes(self, backend_id: str) -> int:
        ledger = self._ledgers.get(backend_id)
        return 0 if ledger is None else ledger.held_bytes

    def is_held(self, backend_id: str, block: int) -> bool:
        """Does a request in flight on that backend hold this block now?"""
        ledger = self._ledgers.get(backend_id)
        return ledger is not None and ledger.is_held(block)

    def let_go(self, backend_id: str, blocks: Sequence[int], held_on: BackendLedger) -> None:
        """The request that `hold` noted on `held_on` has ended. A backend forgotten since is ignored,
        also once it has joined again: its new ledger's holds are other requests' (the same prompt
        sent there after the rejoin holds the same blocks), and a late end must not unpin them."""
        ledger = self._ledgers.get(backend_id)
        if ledger is None or ledger is not held_on:
            return
        self._clock += 1
        ledger.let_go(blocks, self._clock)
        self._rerank(backend_id)

    def rank(self, backend_id: str) -> tuple[int, float]:
        """Smaller is a better home for a new prefix: (0, -room) while there is room, then
        (1, last use of the oldest entry): the cache that keeps things longest; last (2, bytes held)
        while requests in flight hold (nearly) all of it: a new prefix there waits for room."""
        rank = self._ranks.get(backend_id)
        return rank if rank is not None else (0, -self.capacity(backend_id))

    def _rerank(self, backend_id: str) -> None:
        self._ranks[backend_id] = self._rank_now(backend_id)
        ledger = self._ledgers.get(backend_id)
        peers = self._peers_held.get(backend_id, 0)
        if ledger is not None:
            self._free_now[backend_id] = ledger.capacity_bytes - ledger.held_bytes - peers
        elif peers:
            self._free_now[backend_id] = self.capacity(backend_id) - peers
        else:
            self._free_now.pop(backend_id, None)

    def _rank_now(self, backend_id: str) -> tuple[int, float]:
        shared = self._shared.get(backend_id)
        if shared is not None:
            used, oldest, entries = shared
            capacity = self.capacity(backend_id)
            if not is_full(used, capacity, entries, self._max_entries):
                return (0, -(capacity - used))
            return (1, float(oldest))
        ledger = self._ledgers.get(backend_id)
        if ledger is None:
            return (0, -self.capacity(backend_id))
        if not ledger.is_full():
            return (0, -ledger.room_bytes())
        if ledger.held_bytes >= FULL_SHARE * ledger.capacity_bytes or ledger.oldest_use() < 0:
            return (2, float(ledger.held_bytes))
        return (1, float(ledger.oldest_use()))

    def forget(self, backend_id: str) -> None:
        self._free_now.pop(backend_id, None)
        self._peers_held.pop(backend_id, None)
        self._ledgers.pop(backend_id, None)
        self._capacity_of.pop(backend_id, None)
        self._ranks.pop(backend_id, None)
        self._shared.pop(backend_id, None)

    def _evicted(self, blocks: list[int], backend_id: str) -> None:
        if self._on_evict is not None:
            for block in blocks:
                self._on_evict(block, backend_id)
