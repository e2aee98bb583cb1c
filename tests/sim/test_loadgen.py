"""The load driver against simulated backends: streaming measurements, counters, summaries."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from prefix_router.loadgen.drivers import (
    BackendCounters,
    Progress,
    RequestResult,
    Target,
    balanced_placement,
    client_session,
    fetch_vllm_counters,
    measure,
    parse_router_counters,
    quantile,
    reset_backends,
    reset_sim,
    run_closed_loop,
    run_open_loop,
    run_timed_loop,
    snapshot,
    summarise,
)
from prefix_router.loadgen.traces import parse_record, trace_workload
from prefix_router.loadgen.workloads import (
    as_responses,
    multi_turn,
    oracle_hit_rate,
    prompt_blocks,
    shared_prefix,
)
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet

FAST = SimConfig(overhead_ms=1.0, prefill_ms_per_token=0.001, itl_ms=0.2)


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(FAST, count=2) as running:
        yield running


async def test_closed_loop_against_one_backend_measures_what_the_backend_counted(fleet: SimFleet) -> None:
    url = fleet.urls[0]
    workload = shared_prefix(
        groups=2, prompts_per_group=4, system_tokens=128, question_tokens=16, max_tokens=3
    )
    progress = Progress()
    async with client_session() as session:
        summary, results = await measure(
            session, Target(url, (url,)), workload, concurrency=1, progress=progress
        )
        counters = await fetch_vllm_counters(session, url)
    assert progress.done == len(results) == 8 and summary.errors == 0
    for r in results:
        assert r.ok and r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s
        assert r.prompt_tokens and r.cached_tokens is not None
    # The backend's own counters and the usage the client saw agree, one request at a time.
    assert summary.hit_rate == pytest.approx(
        sum(r.cached_tokens or 0 for r in results) / sum(r.prompt_tokens or 0 for r in results)
    )
    assert summary.hit_rate > 0.5
    assert summary.backend_share == {url: 1.0} and summary.max_mean_load == 1.0
    assert counters.queries_tokens == sum(r.prompt_tokens or 0 for r in results)


async def test_multi_turn_requests_wait_for_their_previous_turn(fleet: SimFleet) -> None:
    workload = multi_turn(conversations=3, min_turns=2, max_turns=3, user_median_tokens=10, max_tokens=2)
    url = fleet.urls[1]
    async with client_session() as session:
        summary, results = await measure(session, Target(url, (url,)), workload, concurrency=8)
    assert summary.errors == 0 and len(results) == len(workload)
    # Every later turn hits at least the earlier turn's full blocks, so it was sent after it ended.
    for r in results:
        if workload.requests[r.index].after is not None:
            assert (r.cached_tokens or 0) > 0


async def test_open_loop_is_bounded_in_count_and_time(fleet: SimFleet) -> None:
    workload = shared_prefix(
        groups=1, prompts_per_group=50, system_tokens=32, question_tokens=4, max_tokens=1
    )
    async with client_session() as session:
        by_count = await run_open_loop(session, fleet.urls[0], workload, rate_per_s=500, max_requests=5)
        by_time = await run_open_loop(session, fleet.urls[0], workload, rate_per_s=20, max_duration_s=0.3)
    assert len(by_count) == 5 and all(r.ok for r in by_count)
    assert 0 <= len(by_time) < 20


async def test_a_workload_through_the_responses_api_serves_the_chat_workloads_prompts() -> None:
    """The Responses form of a workload (`store: false`, each turn's history as `input`): the sim
    renders it as the chat form, so prompt sizes, cached tokens and the oracle are the chat form's;
    the driver reads the Responses events (first text delta, `response.completed` usage)."""
    chats = multi_turn(conversations=3, min_turns=2, max_turns=3, system_tokens=16, max_tokens=2)
    responses = as_responses(chats)
    assert all(
        r.path == "/v1/responses" and "input" in r.body and r.body["store"] is False
        for r in responses.requests
    )
    assert [prompt_blocks(r.body, 16) for r in responses.requests] == [
        prompt_blocks(r.body, 16) for r in chats.requests
    ]
    assert oracle_hit_rate(responses, block_size=16, capacity_blocks=None) == oracle_hit_rate(
        chats, block_size=16, capacity_blocks=None
    )
    served = {}
    for name, workload in (("chat", chats), ("responses", responses)):
        async with SimFleet(FAST, count=1) as one, client_session() as session:
            results = await run_closed_loop(session, one.urls[0], workload, concurrency=1)
        assert all(r.ok and r.ttft_s is not None for r in results), [r.error for r in results]
        served[name] = [(r.prompt_tokens, r.cached_tokens) for r in results]
    assert served["responses"] == served["chat"]
    assert any(cached for _, cached in served["chat"]), "later turns hit their history"


async def test_an_agent_form_of_a_workload_serves_what_the_oracle_renders() -> None:
    """The agent form (`tool_calls`): each answer a function call, each later question its output, so
    every turn after a conversation's first ends with a tool's result; the sim renders the items as
    `prompt_blocks` does, so the oracle counts the prompts the sim serves, and later turns hit their
    history."""
    chats = multi_turn(conversations=3, min_turns=2, max_turns=3, system_tokens=16, max_tokens=2)
    agents = as_responses(chats, tool_calls=True)
    for request in agents.requests:
        items = request.body["input"]
        assert items[0]["role"] == "system" and items[1]["role"] == "user"
        kinds = [item.get("type") for item in items[2:]]
        assert kinds == ["function_call", "function_call_output"] * (len(kinds) // 2)
    assert any(len(r.body["input"]) > 2 for r in agents.requests), "some turns follow a tool call"
    async with SimFleet(FAST, count=1) as one, client_session() as session:
        results = await run_closed_loop(session, one.urls[0], agents, concurrency=1)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.prompt_tokens for r in results] == [prompt_blocks(r.body, 16)[0] for r in agents.requests]
    assert [r.prompt_tokens for r in results] != [prompt_blocks(r.body, 16)[0] for r in chats.requests]
    later = [r for r, req in zip(results, agents.requests, strict=True) if len(req.body["input"]) > 2]
    assert all((r.cached_tokens or 0) > 0 for r in later), "each tool call's turn hits the turn before it"
    assert oracle_hit_rate(agents, block_size=16, capacity_blocks=None).hit_rate > 0


async def test_several_routers_take_requests_round_robin_by_index() -> None:
    # Three backends stand in for three routers: request i must reach URL i mod 3.
    workload = shared_prefix(groups=1, prompts_per_group=9, system_tokens=16, question_tokens=4, max_tokens=1)
    async with SimFleet(FAST, count=3) as three, client_session() as session:
        urls = three.urls
        await reset_sim(session, urls)
        results = await run_closed_loop(session, urls, workload, concurrency=1)
        counts = await snapshot(session, urls)
        # One at a time, in order: each backend's first request is the one that missed.
        firsts = [r.index for r in results if not r.cached_tokens]
    assert [counts[u].requests for u in urls] == [3, 3, 3]
    assert firsts == [0, 1, 2]


async def test_measure_over_router_urls_sums_their_counters(fleet: SimFleet) -> None:
    workload = shared_prefix(groups=2, prompts_per_group=2, system_tokens=16, question_tokens=4, max_tokens=1)
    async with client_session() as session:
        target = Target("", tuple(fleet.urls), router_urls=tuple(fleet.urls))
        summary, results = await measure(session, target, workload, concurrency=2)
    assert summary.errors == 0 and len(results) == 4
    assert summary.backend_share == {fleet.urls[0]: 0.5, fleet.urls[1]: 0.5}
    assert summary.overflow_share is None  # sim backends have no router decisions to sum


async def test_timed_loop_sends_at_the_trace_times_and_after_the_parent_turn(fleet: SimFleet) -> None:
    rows = [
        {"timestamp": 0.0, "chat_id": 1, "parent_chat_id": -1},
        {"timestamp": 0.3, "chat_id": 2, "parent_chat_id": -1},
        {"timestamp": 0.05, "chat_id": 3, "parent_chat_id": 1},  # due before its parent could end
        {"timestamp": 5.0, "chat_id": 4, "parent_chat_id": -1},  # past max_duration_s: never sent
    ]
    records = [
        parse_record({**row, "input_length": 64, "output_length": 30, "hash_ids": [7] if row["chat_id"] != 2
                      else [8]})
        for row in rows
    ]  # fmt: skip
    workload = trace_workload(records, block_tokens=64, time_unit_s=1.0)
    loop = asyncio.get_running_loop()
    async with client_session() as session:
        start = loop.time()
        results = await run_timed_loop(session, fleet.urls[0], workload, max_duration_s=1.0)
        elapsed = loop.time() - start
    assert [r.index for r in results] == [0, 1, 2] and all(r.ok for r in results)
    assert elapsed >= 0.3  # the second request waited for its time
    # The child turn went after its parent ended, so the parent's prompt was cached (same block).
    assert (results[2].cached_tokens or 0) > 0


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 101)], 0.99) == 99.0


def test_summary_of_loads_overflow_and_tenant_stickiness() -> None:
    before = {u: BackendCounters(0, 0, 0, 0) for u in ("a", "b")}
    after = {"a": BackendCounters(100, 60, 3, 2), "b": BackendCounters(100, 20, 1, 1)}
    results = [
        RequestResult(0, "t1", "t1", 200, None, 0.1, 0.2, "a"),
        RequestResult(1, "t1", "t1", 200, None, 0.3, 0.4, "a"),
        RequestResult(2, "t2", "t2", 200, None, 0.2, 0.3, "b"),
        RequestResult(3, "t2", "t2", 200, None, 0.2, 0.3, "a"),
        RequestResult(4, "t2", "t2", 200, None, 0.2, 0.3, "a"),
    ]
    s = summarise(
        results, before, after, wall_s=2.0, oracle_hit_rate=0.8,
        decisions_before={"affinity": 1.0}, decisions_after={"affinity": 4.0, "overflow": 1.0},
    )  # fmt: skip
    assert s.hit_rate == pytest.approx(0.4) and s.oracle_ratio == pytest.approx(0.5)
    assert s.backend_share == {"a": 0.75, "b": 0.25} and s.max_mean_load == pytest.approx(1.5)
    assert s.overflow_share == pytest.approx(0.25) and s.throughput_rps == 2.5
    assert s.tenant_stickiness_min == pytest.approx(2 / 3) and s.tenant_stickiness_mean == pytest.approx(
        5 / 6
    )
    assert s.tenant_spread == 0.5  # both tenants' top backend is "a"
    assert s.tenant_pairs == 2
    assert s.peak_inflight == {"a": 2, "b": 1}


def test_stickiness_is_per_tenant_and_prompt_pair() -> None:
    # One tenant, two system prompts on two backends: each pair is perfectly sticky, and the pairs
    # cover both backends. Per tenant it would read 50% (the old measure's false alarm).
    before = {u: BackendCounters(0, 0, 0, 0) for u in ("a", "b")}
    after = {"a": BackendCounters(10, 5, 2, 1), "b": BackendCounters(10, 5, 3, 1)}
    results = [
        RequestResult(0, "t1/p0", "t1", 200, None, 0.1, 0.2, "a"),
        RequestResult(1, "t1/p1", "t1", 200, None, 0.1, 0.2, "b"),
        RequestResult(2, "t1/p0", "t1", 200, None, 0.1, 0.2, "a"),
        RequestResult(3, "t1/p1", "t1", 200, None, 0.1, 0.2, "b"),
        RequestResult(4, "t2/p0", "t2", 200, None, 0.1, 0.2, "b"),
        RequestResult(5, "g", None, 200, None, 0.1, 0.2, "a"),  # no tenant: not counted
    ]
    s = summarise(results, before, after, wall_s=1.0)
    assert s.tenant_pairs == 3
    assert s.tenant_stickiness_min == 1.0 and s.tenant_stickiness_mean == 1.0
    assert s.tenant_spread == 1.0


async def test_reset_path_empties_external_backends_between_runs(fleet: SimFleet) -> None:
    # Not the sim protocol (sim=False: vLLM-style /metrics counters), with a reset path: the second
    # run starts cold as the first did, so it hits no more than the first.
    url = fleet.urls[0]
    workload = shared_prefix(
        groups=2, prompts_per_group=3, system_tokens=128, question_tokens=16, max_tokens=2
    )
    async with client_session() as session:
        await reset_sim(session, [url])
        cold = Target(url, (url,), sim=False, reset_path="/sim/reset")
        warm = Target(url, (url,), sim=False)
        first, _ = await measure(session, cold, workload, concurrency=1)
        again_warm, _ = await measure(session, warm, workload, concurrency=1)
        again_cold, _ = await measure(session, cold, workload, concurrency=1)
    assert first.requests == again_cold.requests == 6
    assert again_cold.hit_rate == pytest.approx(first.hit_rate)
    assert again_warm.hit_rate > first.hit_rate  # no reset: it hit what the first run cached


async def test_a_reset_whose_pooled_connection_the_engine_closed_is_sent_again() -> None:
    """The engine closes the first connection without an answer, as uvicorn closes one idle for its
    keep-alive timeout just as the next run reuses it: the reset goes again on a new connection
    instead of failing the whole benchmark."""
    connections = 0
    resets: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        if connections > 1:
            resets.append(head.split(b" ", 2)[1])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with client_session() as session:
            await reset_backends(session, [f"http://127.0.0.1:{port}"], "reset_prefix_cache")
    finally:
        server.close()
    assert connections == 2
    assert resets == [b"/reset_prefix_cache"]


def test_balanced_placement_keeps_groups_whole_and_balances_requests() -> None:
    workload = shared_prefix(groups=6, prompts_per_group=4, system_tokens=16, question_tokens=4)
    routes = balanced_placement(workload, ["u1", "u2", "u3"])
    assert sorted(routes) == [f"g{g}" for g in range(6)]
    per_url = {u: sum(routes[r.group] == u for r in workload.requests) for u in ("u1", "u2", "u3")}
    assert per_url == {"u1": 8, "u2": 8, "u3": 8}


async def test_routes_send_each_group_to_its_backend(fleet: SimFleet) -> None:
    workload = shared_prefix(groups=2, prompts_per_group=3, system_tokens=64, question_tokens=8, max_tokens=2)
    routes = {"g0": fleet.urls[0], "g1": fleet.urls[1]}
    async with client_session() as session:
        target = Target(fleet.urls[0], tuple(fleet.urls), routes=routes)
        summary, results = await measure(session, target, workload, concurrency=2)
    assert summary.errors == 0
    assert all(r.backend == routes[r.group] for r in results)
    assert summary.backend_share == {fleet.urls[0]: 0.5, fleet.urls[1]: 0.5}
    assert summary.overflow_share is None  # no router answered /metrics with decisions


def test_router_counters_read_decisions_and_prefill_holds_and_the_summary_diffs_them() -> None:
    registry = CollectorRegistry()
    decisions = Counter("prefix_router_decisions", "d", ["branch"], registry=registry)
    waits = Counter("prefix_router_prefill_waits", "w", ["outcome"], registry=registry)
    decisions.labels("affinity").inc(5)
    waits.labels("ready").inc(3)
    waits.labels("timeout").inc(1)
    counters = parse_router_counters(generate_latest(registry).decode())
    assert counters.decisions == {"affinity": 5.0}
    assert counters.prefill_waits == {"ready": 3.0, "timeout": 1.0}
    assert parse_router_counters("").prefill_waits == {}  # not our router (or no hold yet)
    before = {"a": BackendCounters(0, 0, 0, 0)}
    after = {"a": BackendCounters(10, 5, 2, 1)}
    s = summarise(
        [], before, after, wall_s=1.0,
        prefill_waits_before={"ready": 1.0, "timeout": 1.0}, prefill_waits_after=counters.prefill_waits,
    )  # fmt: skip
    assert s.prefill_waits == {"ready": 2.0}  # no new timeout: left out, as branches are
