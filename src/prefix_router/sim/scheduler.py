"""Admission and timing of requests on one simulated engine: it sleeps, it never computes.

At most `max_num_seqs` requests run; the rest wait first come, first served (vLLM's default
policy). A request is admitted when a slot is free and the KV pool can hold its prompt; the prefix
cache lookup happens at admission and the prompt's blocks are cached when prefill completes.
Simplification: each running sequence sleeps on its own clock instead of stepping in a shared
batch, and prefill does not stall other sequences' decoding.

Cancelling the task that holds a request (aiohttp does on client disconnect) frees its slot and
blocks, whether it was waiting, prefilling or decoding.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

from prefix_router.sim.cache import BlockAllocation, PrefixCache, hash_prompt_blocks
from prefix_router.sim.config import SimConfig
from prefix_router.sim.stats import BackendCounters
from prefix_router.sim.tokens import Prompt


class Scheduler:
    def __init__(
        self,
        config: SimConfig,
        cache: PrefixCache,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.cache = cache
        self.counters = BackendCounters()
        self.clock = clock
        self._num_running = 0
        self._waiting: deque[tuple[ScheduledRequest, asyncio.Future[None]]] = deque()
        # Every prompt that arrived, in order, while recording (None: not recording).
        self._arrivals: list[tuple[int, list[int]]] | None = None

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.cache.usage

    def schedule(self, prompt: Prompt, *, cache_salt: str | None = None) -> ScheduledRequest:
        """A request to enter with `async with`: entering waits for admission, leaving frees it.

        Raises ValueError for a prompt the whole KV pool cannot hold, which would wait forever.
        """
        if not self.cache.can_ever_fit(prompt.num_tokens):
            raise ValueError(
                f"prompt of {prompt.num_tokens} tokens exceeds the KV cache of "
                f"{self.cache.capacity_blocks} blocks of {self.cache.block_size} tokens"
            )
        return ScheduledRequest(self, prompt, cache_salt)

    def record_arrivals(self) -> None:
        """Keep each arriving prompt's (tokens, block hashes) from now on; reset empties the record.

        For the routing benchmark: each engine's arrivals replayed on an LRU of its size measure the
        router's placement apart from what serving cost (blocks pinned by running requests, prefixes
        reused before their prefill was done). Off by default: the record grows with every request."""
        if self._arrivals is None:
            self._arrivals = []

    @property
    def arrivals(self) -> list[tuple[int, list[int]]]:
        """The prompts recorded since the last reset, in arrival order (empty when not recording)."""
        return list(self._arrivals) if self._arrivals is not None else []

    def reset(self) -> None:
        """Zero the counters and drop unreferenced cached blocks; peaks restart from the present."""
        if self._arrivals is not None:
            self._arrivals.clear()
        self.counters = BackendCounters()
        self.counters.note_occupancy(self._num_running, len(self._waiting))
        self.cache.clear()

    def inter_token_latency_s(self) -> float:
        slowdown = 1.0 + self.config.itl_batch_slowdown * max(self._num_running - 1, 0)
        return self.config.itl_ms * slowdown / 1000.0

    async def _admit(self, request: ScheduledRequest) -> None:
        self.counters.requests_arrived += 1
        if self._arrivals is not None:
            self._arrivals.append((request.prompt.num_tokens, request.block_hashes))
        if not self._waiting and self._try_start(request):
            return
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (request, admitted)
        self._waiting.append(entry)
        self.counters.note_occupancy(self._num_running, len(self._waiting))
        try:
            await admitted
        except asyncio.CancelledError:
            if admitted.done() and not admitted.cancelled():
                self._end(request)  # admitted, then cancelled before it could resume
            else:
                self._waiting.remove(entry)
                self._start_waiting()  # it may have been the head blocking the queue
            raise

    def _try_start(self, request: ScheduledRequest) -> bool:
        if self._num_running >= self.config.max_num_seqs:
            return False
        allocation = self.cache.allocate(request.block_hashes, request.prompt.num_tokens)
        if allocation is None:
            return False
        request.allocation = allocation
        request.started_at = self.clock()
        self._num_running += 1
        counters = self.counters
        counters.prefix_cache_queries_tokens += request.prompt.num_tokens
        counters.prefix_cache_hits_tokens += request.cached_tokens
        counters.note_occupancy(self._num_running, len(self._waiting))
        return True

    def _start_waiting(self) -> None:
        waiting = self._waiting
        while waiting and self._try_start(waiting[0][0]):
            _, admitted = waiting.popleft()
            admitted.set_result(None)

    def _end(self, request: ScheduledRequest) -> None:
        allocation = request.allocation
        if allocation is None:
            return
        request.allocation = None
        self.cache.release(allocation)
        self._num_running -= 1
        if request.is_finished:
            self.counters.requests_finished += 1
        else:
            self.counters.requests_aborted += 1
        self._start_waiting()


class ScheduledRequest:
    """One request's life on the engine: wait, prefill, decode tokens, finish."""

    def __init__(self, scheduler: Scheduler, prompt: Prompt, cache_salt: str | None) -> None:
        self._scheduler = scheduler
        self.prompt = prompt
        self.block_hashes = hash_prompt_blocks(prompt, scheduler.cache.block_size, cache_salt)
        self.arrived_at = scheduler.clock()
        self.started_at: float | None = None
        self.allocation: BlockAllocation | None = None
        self.num_generated = 0
        self.is_finished = False
        self._next_token_at = 0.0

    @property
    def cached_tokens(self) -> int:
        allocation = self.allocation
        return 0 if allocation is None else allocation.hit_blocks * self._scheduler.cache.block_size

    async def __aenter__(self) -> ScheduledRequest:
        await self._scheduler._admit(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._scheduler._end(self)

    async def prefill(self) -> None:
        """Sleep through prefill, cache the prompt's blocks and produce the first token."""
        scheduler = self._scheduler
        config = scheduler.config
        uncached_tokens = self.prompt.num_tokens - self.cached_tokens
        delay_s = (config.overhead_ms + uncached_tokens * config.prefill_ms_per_token) / 1000.0
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if self.allocation is not None:
            scheduler.cache.commit(self.allocation)
        now = scheduler.clock()
        counters = scheduler.counters
        counters.ttft.observe(now - self.arrived_at)
        counters.prompt_tokens += self.prompt.num_tokens
        counters.generation_tokens += 1
        self.num_generated = 1
        self._next_token_at = now

    async def decode_token(self) -> None:
        """Sleep one inter-token latency (from the previous token's due time, so sleeps don't drift)."""
        scheduler = self._scheduler
        due_at = self._next_token_at + scheduler.inter_token_latency_s()
        now = scheduler.clock()
        if due_at > now:
            await asyncio.sleep(due_at - now)
        else:
            due_at = now  # fell behind (a slow reader): carry on, do not burst to catch up
        self._next_token_at = due_at
        scheduler.counters.generation_tokens += 1
        self.num_generated += 1

    def finish(self) -> None:
        """Mark the request complete, so leaving counts it as a success rather than an abort."""
        self.is_finished = True
