"""A model of vLLM's automatic prefix caching: chained block hashes, a block pool, LRU eviction.

Pure bookkeeping, no I/O and no clock. As in vLLM (https://docs.vllm.ai/en/latest/design/prefix_caching.html):
- a prompt is cut into blocks of `block_size` tokens; only full blocks are hashed and cached;
- block k's hash covers its parent's hash and its own tokens, so a hit on block k implies hits on
  all blocks before it; `cache_salt` is mixed into the first block only, which isolates the chain;
- a lookup never covers the last prompt token (it must be recomputed to produce logits), so a
  repeated prompt of n tokens hits floor((n - 1) / B) * B tokens;
- blocks held by running requests are pinned (reference-counted) and never evicted; unreferenced
  cached blocks are evicted least recently used first, and a finished request's blocks are queued
  tail first, so a shared prefix outlives the private suffixes behind it.
Simplification: a request holds blocks for its prompt only; decode tokens take no KV blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from prefix_router.sim.tokens import BYTES_PER_TOKEN, Prompt

_HASH_SEED = 0x5EED_CAC4E
# The parent of a prompt's first block, like vLLM's NONE_HASH.
_ROOT_HASH = xxhash.xxh3_64_intdigest(b"prefix_router.sim root block", seed=_HASH_SEED)


def hash_prompt_blocks(prompt: Prompt, block_size: int, cache_salt: str | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks: h_k = xxh3(h_{k-1} || [salt if k == 0] || tokens_k).

    The parent is a fixed 8 bytes and the salt is length-prefixed, so the encoding is unambiguous.
    """
    block_bytes = block_size * BYTES_PER_TOKEN
    data = prompt.data
    num_full_blocks = prompt.num_tokens // block_size
    salt = (cache_salt or "").encode("utf-8", "surrogatepass")
    hashes: list[int] = []
    parent = _ROOT_HASH
    for index in range(num_full_blocks):
        block = data[index * block_bytes : (index + 1) * block_bytes]
        if index == 0:
            encoded = parent.to_bytes(8, "little") + len(salt).to_bytes(4, "little") + salt + block
        else:
            encoded = parent.to_bytes(8, "little") + block
        parent = xxhash.xxh3_64_intdigest(encoded, seed=_HASH_SEED)
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class BlockAllocation:
    """The KV blocks one request holds from admission until it ends."""

    block_hashes: Sequence[int]
    num_tokens: int
    hit_blocks: int
    private_blocks: int
    """Blocks held outside the cache: the uncached part of the prompt, until prefill commits it."""
    pinned_hashes: list[int] = field(default_factory=list)
    """Cached blocks this request holds a reference to, in prompt order."""
    is_committed: bool = False


class PrefixCache:
    """A pool of `capacity_blocks` KV blocks shared by cached prefixes and running requests."""

    def __init__(self, *, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be at least 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._ref_counts: dict[int, int] = {}
        # Cached blocks no request references, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._private_blocks = 0

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by running requests: what vLLM reports as KV cache usage."""
        return len(self._ref_counts) + self._private_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._ref_counts) + len(self._evictable)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.capacity_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.capacity_blocks

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._ref_counts or block_hash in self._evictable

    def allocate(self, block_hashes: Sequence[int], num_tokens: int) -> BlockAllocation | None:
        """Pin the longest cached prefix and reserve blocks for the rest; None if the pool is full.

        A None leaves the cache untouched, so the caller can retry when blocks are released.
        """
        max_hit_blocks = min(len(block_hashes), max(num_tokens - 1, 0) // self.block_size)
        hit_blocks = 0
        revived_blocks = 0
        for block_hash in block_hashes[:max_hit_blocks]:
            if block_hash in self._ref_counts:
                hit_blocks += 1
            elif block_hash in self._evictable:
                hit_blocks += 1
                revived_blocks += 1
            else:
                break
        private_blocks = self.blocks_needed(num_tokens) - hit_blocks
        if self.num_used_blocks + revived_blocks + private_blocks > self.capacity_blocks:
            return None
        allocation = BlockAllocation(block_hashes, num_tokens, hit_blocks, private_blocks)
        for block_hash in block_hashes[:hit_blocks]:
            self._pin(block_hash)
            allocation.pinned_hashes.append(block_hash)
        self._private_blocks += private_blocks
        self._evict_to_capacity()
        return allocation

    def commit(self, allocation: BlockAllocation) -> None:
        """Prefill finished: the prompt's full uncached blocks become cached (still pinned)."""
        if allocation.is_committed:
            return
        allocation.is_committed = True
        for block_hash in allocation.block_hashes[allocation.hit_blocks :]:
            # Another request may have cached the same block meanwhile; then share it, as
            # vLLM would on the next lookup, and give the private copy back.
            self._pin(block_hash)
            allocation.pinned_hashes.append(block_hash)
            allocation.private_blocks -= 1
            self._private_blocks -= 1
        self._evict_to_capacity()

    def release(self, allocation: BlockAllocation) -> None:
        """The request ended (finished or aborted); idempotent."""
        # Tail first, so the tail is evicted before the prefix others may share (as vLLM frees).
        for block_hash in reversed(allocation.pinned_hashes):
            remaining = self._ref_counts[block_hash] - 1
            if remaining:
                self._ref_counts[block_hash] = remaining
            else:
                del self._ref_counts[block_hash]
                self._evictable[block_hash] = None
        allocation.pinned_hashes.clear()
        self._private_blocks -= allocation.private_blocks
        allocation.private_blocks = 0

    def clear(self) -> int:
        """Drop every unreferenced cached block (blocks of running requests stay); returns the count."""
        dropped = len(self._evictable)
        self._evictable.clear()
        return dropped

    def _pin(self, block_hash: int) -> None:
        if block_hash in self._ref_counts:
            self._ref_counts[block_hash] += 1
        else:
            self._evictable.pop(block_hash, None)
            self._ref_counts[block_hash] = 1

    def _evict_to_capacity(self) -> None:
        excess = self.num_cached_blocks + self._private_blocks - self.capacity_blocks
        for _ in range(max(excess, 0)):
            self._evictable.popitem(last=False)
