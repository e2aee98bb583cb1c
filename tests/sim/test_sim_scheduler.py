"""Admission, queueing and cancellation of the simulated engine, asserted by state, not wall-clock."""

from __future__ import annotations

import asyncio

import pytest

from prefix_router.sim.cache import PrefixCache
from prefix_router.sim.config import SimConfig
from prefix_router.sim.scheduler import Scheduler
from prefix_router.sim.tokens import Prompt, tokenize_text

from loopback import eventually

FAST = SimConfig(overhead_ms=0.0, prefill_ms_per_token=0.0, itl_ms=0.0, block_size=4)


def make_scheduler(config: SimConfig = FAST) -> Scheduler:
    cache = PrefixCache(block_size=config.block_size, capacity_blocks=config.capacity_blocks)
    return Scheduler(config, cache)


async def hold(
    scheduler: Scheduler, prompt: Prompt, release: asyncio.Event, log: list[str], name: str
) -> None:
    async with scheduler.schedule(prompt) as running:
        log.append(f"{name} admitted")
        await running.prefill()
        await release.wait()
        running.finish()


async def test_with_one_slot_a_second_request_waits_until_the_first_ends() -> None:
    scheduler = make_scheduler(SimConfig(max_num_seqs=1, overhead_ms=0.0, prefill_ms_per_token=0.0))
    log: list[str] = []
    release_first, release_second = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(hold(scheduler, tokenize_text("one"), release_first, log, "first"))
    await eventually(lambda: scheduler.num_running == 1)
    second = asyncio.create_task(hold(scheduler, tokenize_text("two"), release_second, log, "second"))
    await eventually(lambda: scheduler.num_waiting == 1)
    assert log == ["first admitted"]
    assert scheduler.num_running == 1

    release_first.set()
    await first
    await eventually(lambda: log == ["first admitted", "second admitted"])
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 0)
    release_second.set()
    await second
    counters = scheduler.counters
    assert (counters.peak_running, counters.peak_waiting, counters.peak_inflight) == (1, 1, 2)
    assert (counters.requests_finished, counters.requests_aborted) == (2, 0)


async def test_waiting_requests_start_first_come_first_served() -> None:
    scheduler = make_scheduler(SimConfig(max_num_seqs=1, overhead_ms=0.0, prefill_ms_per_token=0.0))
    log: list[str] = []
    release = asyncio.Event()
    tasks = []
    for name in ("a", "b", "c", "d"):
        tasks.append(asyncio.create_task(hold(scheduler, tokenize_text(name), release, log, name)))
        await eventually(lambda: scheduler.num_running + scheduler.num_waiting == len(tasks))
    release.set()
    await asyncio.gather(*tasks)
    assert log == ["a admitted", "b admitted", "c admitted", "d admitted"]


async def test_cancelling_a_waiting_request_removes_it_from_the_queue() -> None:
    scheduler = make_scheduler(SimConfig(max_num_seqs=1))
    release = asyncio.Event()
    log: list[str] = []
    first = asyncio.create_task(hold(scheduler, tokenize_text("one"), release, log, "first"))
    await eventually(lambda: scheduler.num_running == 1)
    second = asyncio.create_task(hold(scheduler, tokenize_text("two"), release, log, "second"))
    await eventually(lambda: scheduler.num_waiting == 1)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert scheduler.num_waiting == 0
    release.set()
    await first
    assert log == ["first admitted"]
    assert scheduler.num_running == 0


async def test_cancelling_a_running_request_frees_its_slot_and_counts_an_abort() -> None:
    scheduler = make_scheduler(SimConfig(max_num_seqs=1))
    never = asyncio.Event()
    task = asyncio.create_task(hold(scheduler, tokenize_text("x" * 100), never, [], "stuck"))
    await eventually(lambda: scheduler.num_running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert scheduler.num_running == 0
    assert scheduler.kv_cache_usage == 0.0
    assert (scheduler.counters.requests_finished, scheduler.counters.requests_aborted) == (0, 1)


async def test_a_full_kv_pool_holds_requests_back_even_with_free_slots() -> None:
    config = SimConfig(
        block_size=4, capacity_blocks=4, max_num_seqs=8, overhead_ms=0.0, prefill_ms_per_token=0.0
    )
    scheduler = make_scheduler(config)
    release = asyncio.Event()
    log: list[str] = []
    first = asyncio.create_task(hold(scheduler, Prompt(b"a" * 48), release, log, "first"))  # 3 blocks
    await eventually(lambda: scheduler.num_running == 1)
    second = asyncio.create_task(hold(scheduler, Prompt(b"b" * 48), release, log, "second"))
    await eventually(lambda: scheduler.num_waiting == 1)
    assert scheduler.kv_cache_usage == 0.75
    release.set()
    await asyncio.gather(first, second)
    assert log == ["first admitted", "second admitted"]


async def test_prefix_cache_is_looked_up_at_admission_and_filled_at_prefill() -> None:
    scheduler = make_scheduler()
    prompt = tokenize_text("z" * 4 * 40)  # 40 tokens, 10 blocks of 4
    async with scheduler.schedule(prompt) as running:
        assert running.cached_tokens == 0
        await running.prefill()
        running.finish()
    async with scheduler.schedule(prompt) as running:
        assert running.cached_tokens == 36
        await running.prefill()
        for _ in range(3):
            await running.decode_token()
        running.finish()
    counters = scheduler.counters
    assert (counters.prefix_cache_queries_tokens, counters.prefix_cache_hits_tokens) == (80, 36)
    assert (counters.prompt_tokens, counters.generation_tokens) == (80, 5)
    assert counters.ttft.count == 2


def test_inter_token_latency_grows_with_the_running_batch() -> None:
    scheduler = make_scheduler(SimConfig(itl_ms=10.0, itl_batch_slowdown=0.5))
    assert scheduler.inter_token_latency_s() == pytest.approx(0.010)
    scheduler._num_running = 3
    assert scheduler.inter_token_latency_s() == pytest.approx(0.010 * (1 + 0.5 * 2))


def test_a_prompt_larger_than_the_pool_is_refused_up_front() -> None:
    scheduler = make_scheduler(SimConfig(block_size=4, capacity_blocks=2))
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        scheduler.schedule(Prompt(b"x" * 4 * 9))


async def test_reset_zeroes_counters_and_forgets_cached_prefixes() -> None:
    scheduler = make_scheduler()
    prompt = tokenize_text("y" * 200)
    for _ in range(2):
        async with scheduler.schedule(prompt) as running:
            await running.prefill()
            running.finish()
    assert scheduler.counters.prefix_cache_hits_tokens > 0
    scheduler.reset()
    assert scheduler.counters.requests_arrived == 0
    async with scheduler.schedule(prompt) as running:
        assert running.cached_tokens == 0


async def test_arrivals_are_recorded_in_arrival_order_only_when_asked_and_reset_empties_them() -> None:
    scheduler = make_scheduler(
        SimConfig(max_num_seqs=1, overhead_ms=0.0, prefill_ms_per_token=0.0, block_size=4)
    )
    first, second = tokenize_text("a" * 40), tokenize_text("b" * 24)
    async with scheduler.schedule(first) as running:
        running.finish()
    assert scheduler.arrivals == []  # off by default: a long-running sim keeps no record
    scheduler.record_arrivals()
    log: list[str] = []
    release = asyncio.Event()
    holder = asyncio.create_task(hold(scheduler, first, release, log, "first"))
    await eventually(lambda: scheduler.num_running == 1)
    waiter = asyncio.create_task(hold(scheduler, second, asyncio.Event(), log, "second"))
    await eventually(lambda: scheduler.num_waiting == 1)
    # Recorded as it arrived, not when admitted: the second is still waiting for the only slot.
    assert scheduler.arrivals == [
        (first.num_tokens, scheduler.schedule(first).block_hashes),
        (second.num_tokens, scheduler.schedule(second).block_hashes),
    ]
    waiter.cancel()
    release.set()
    await holder
    scheduler.reset()
    assert scheduler.arrivals == []
    async with scheduler.schedule(second) as running:
        running.finish()
    assert [tokens for tokens, _ in scheduler.arrivals] == [second.num_tokens]  # still recording
