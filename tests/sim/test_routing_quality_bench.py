"""The routing-quality benchmark's own logic: policy table, cache sizing, layouts, rows, shared state."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml

from prefix_router.loadgen.drivers import RequestResult, RunSummary, client_session
from prefix_router.loadgen.workloads import distinct_blocks, largest_prompt_blocks, shared_prefix
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet


@pytest.fixture(scope="module")
def rq() -> Iterator[ModuleType]:
    path = Path(__file__).parents[2] / "benchmarks" / "routing_quality.py"
    spec = importlib.util.spec_from_file_location("routing_quality_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_default_grid_is_ours_the_ring_the_baselines_and_sglang(rq: ModuleType) -> None:
    by_name = {p.name: p for p in rq.POLICIES}
    assert list(by_name) == ["prefix", "prefix_ring", "random", "least_loaded", "sglang_cache_aware"]
    assert by_name["prefix"].settings == {"balancing": {"policy": "prefix"}}  # the router's defaults
    assert by_name["prefix_ring"].settings["routing"] == {"prefix_index": False}
    assert {p.name for p in rq.POLICIES if p.replicate} == {"prefix", "sglang_cache_aware"}
    names = [p.name for p in (*rq.POLICIES, *rq.EXPERIMENTS)]
    assert len(names) == len(set(names))


def test_a_policy_defined_on_the_command_line(rq: ModuleType) -> None:
    spec = rq.parse_policy_definition(
        "cache_room:routing.first_placement=cache_room,routing.follow_threshold=0.5"
    )
    assert spec.name == "cache_room" and spec.kind == "ours" and spec.replicate
    assert spec.settings == {
        "balancing": {"policy": "prefix"},
        "routing": {"first_placement": "cache_room", "follow_threshold": 0.5},
    }
    for bad in ("no-colon", ":routing.x=1", "p:routing=1", "p:x.y"):
        with pytest.raises(ValueError, match="define-policy"):
            rq.parse_policy_definition(bad)


def test_replicated_setups_only_for_replicated_policies(rq: ModuleType) -> None:
    combos = rq.combinations(rq.POLICIES, 3, True)
    setups = [(p.name, s.name) for p, s in combos]
    assert setups[:5] == [(p.name, "1") for p in rq.POLICIES]
    assert setups[5:] == [("prefix", "3 rr"), ("sglang_cache_aware", "3 rr"), ("prefix", "3 rr shared")]
    assert [s.name for _, s in rq.combinations(rq.POLICIES, 1, True)] == ["1"] * 5


@pytest.mark.parametrize(
    ("settings", "replicas", "shared", "first_placement"),
    [
        pytest.param({}, 1, False, None, id="one-router-defaults"),
        pytest.param({}, 3, False, "ring", id="stateless-replicas-as-the-chart-renders"),
        pytest.param({}, 3, True, None, id="shared-replicas-defaults"),
        pytest.param(
            {"routing": {"first_placement": "cache_room"}}, 3, False, "cache_room", id="the-policy-says"
        ),
    ],
)
def test_stateless_replicas_of_ours_run_as_the_chart_renders_them(
    rq: ModuleType, settings: dict[str, Any], replicas: int, shared: bool, first_placement: str | None
) -> None:
    policy = rq.PolicySpec("p", settings, replicate=True)
    with tempfile.TemporaryDirectory() as tmp:
        group = rq.RouterGroup(
            policy,
            ["http://127.0.0.1:1"],
            replicas,
            Path(tmp),
            "t",
            "redis://127.0.0.1:1/0" if shared else None,
        )
        config = yaml.safe_load(Path(group.command.split("--config ")[1]).read_text())
    assert config.get("routing", {}).get("first_placement") == first_placement


@pytest.mark.parametrize(("sim", "max_inflight"), [(True, 16), (False, None)], ids=["sim", "external"])
def test_ours_is_capped_at_twice_the_sims_batch_and_runs_its_default_before_real_engines(
    rq: ModuleType, sim: bool, max_inflight: int | None
) -> None:
    """A cap of 16 in front of two vLLM servers that batch hundreds made the router queue what SGLang's,
    uncapped, sent on: the hot prefix lost its backend to whichever freed a slot."""
    with tempfile.TemporaryDirectory() as tmp:
        group = rq.RouterGroup(rq.PolicySpec("p", {}), ["http://127.0.0.1:1"], 1, Path(tmp), "t", sim=sim)
        config = yaml.safe_load(Path(group.command.split("--config ")[1]).read_text())
    assert config.get("balancing", {}).get("max_inflight") == max_inflight


def test_the_cache_holds_the_asked_share_of_the_working_set_or_the_floor(rq: ModuleType) -> None:
    w = shared_prefix(groups=16, prompts_per_group=4, system_tokens=512, question_tokens=64)
    working = distinct_blocks(w, block_size=16)
    sizing = rq.size_cache(w, 4, 0.4, 1)
    assert sizing.working_set_blocks == working
    assert not sizing.floored and sizing.ratio == pytest.approx(0.4, abs=4 / working)
    tiny = rq.size_cache(w, 4, 0.01, 1)  # below one prompt: raised to hold the longest one
    assert tiny.floored and tiny.per_backend_blocks == largest_prompt_blocks(w, block_size=16) + 1
    busy = rq.size_cache(w, 4, 0.01, 8)  # or eight running prompts
    assert busy.per_backend_blocks > tiny.per_backend_blocks


def _summary(hit: float, oracle: float, p99: float, load: float) -> RunSummary:
    return RunSummary(
        requests=10, errors=0, wall_s=1.0, hit_rate=hit, oracle_hit_rate=oracle, ttft_p50_s=p99 / 2,
        ttft_p99_s=p99, latency_p50_s=p99, throughput_rps=10.0, backend_share={}, max_mean_load=load,
        peak_inflight={"a": 3}, overflow_share=None,
    )  # fmt: skip


def test_rows_give_mean_and_worst_over_layouts_paired_by_layout(rq: ModuleType) -> None:
    Run = rq.Run
    runs = [
        Run("w", "prefix", "1", 0, "closed", _summary(0.6, 0.8, 1.0, 1.2), 0.8, placement=0.72),
        Run("w", "prefix", "1", 1, "closed", _summary(0.4, 0.5, 2.0, 1.6), 0.5, placement=0.5),
        Run("w", "sglang_cache_aware", "1", 0, "closed", _summary(0.5, 0.8, 1.0, 1.1), 0.8),
        Run("w", "sglang_cache_aware", "1", 1, "closed", _summary(0.5, 0.5, 1.0, 1.1), 0.5),
        Run("w", "prefix", "3 rr", 0, "closed", _summary(0.3, 0.8, 1.0, 1.0), 0.8),
        Run("w", "prefix", "3 rr", 1, "closed", _summary(0.4, 0.5, 1.0, 1.0), 0.5),
        Run("w", "prefix", "3 rr shared", 0, "closed", None, 0.8, "unsupported"),
        Run("w", "prefix", "3 rr shared", 1, "closed", None, 0.5, "unsupported"),
    ]
    rows = {(r.policy, r.setup): r for r in rq.aggregate(runs)}
    oracle = rows[("lru_oracle", "-")]
    assert (oracle.hit.mean, oracle.hit.worst) == pytest.approx((0.65, 0.5))
    ours = rows[("prefix", "1")]
    assert (ours.hit.mean, ours.hit.worst) == pytest.approx((0.5, 0.4))
    assert (ours.of_oracle.mean, ours.of_oracle.worst) == pytest.approx(((0.75 + 0.8) / 2, 0.75))
    # Its placement, the engines' arrivals replayed one at a time: 0.72 / 0.8 and 0.5 / 0.5.
    assert (ours.placement_of_oracle.mean, ours.placement_of_oracle.worst) == pytest.approx((0.95, 0.9))
    assert rows[("sglang_cache_aware", "1")].placement_of_oracle is None  # not replayed: not shown
    assert (ours.minus_sglang.mean, ours.minus_sglang.worst) == pytest.approx((0.0, -0.1))
    assert (ours.ttft_p99_s.mean, ours.ttft_p99_s.worst) == pytest.approx((1.5, 2.0))  # worst: highest
    assert (ours.max_mean_load.mean, ours.max_mean_load.worst) == pytest.approx((1.4, 1.6))
    assert ours.of_one_router is None
    replicas = rows[("prefix", "3 rr")]
    assert (replicas.of_one_router.mean, replicas.of_one_router.worst) == pytest.approx(
        ((0.5 + 1.0) / 2, 0.5)
    )
    assert replicas.minus_sglang is None  # no SGLang at 3 routers in this run
    assert rows[("prefix", "3 rr shared")].status == "unsupported"
    text = rq.table(list(rows.values()))
    assert "| prefix | 3 rr shared | 0 | unsupported |" in text
    assert (
        "| prefix | 1 | 2 | 50.0% | 40.0% | 0.77 | 0.75 | 0.95 | 0.90 | +0.0 | -10.0 | - | - "
        "| 750 | 1000 | 1500 | 2000 |" in text
    )
    targets = rq.check_targets(list(rows.values()))
    assert any(
        "MISSED" in t and "worst layout 0.75" in t and "its placement, worst layout: 0.90" in t
        for t in targets
    )
    assert any("n/a" in t and "unsupported" in t for t in targets)


def _args(**overrides: Any) -> argparse.Namespace:
    args = rq_parser().parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def rq_parser() -> argparse.ArgumentParser:
    module = sys.modules["routing_quality_under_test"]
    parser: argparse.ArgumentParser = module.build_parser()
    return parser


def test_the_reproduce_command_names_every_choice(rq: ModuleType) -> None:
    args = _args(quick=True, layouts=3, replicas=3, replicas_shared=True, policies=["prefix"],
                 define_policy=["x:routing.follow_threshold=0.5"])  # fmt: skip
    cmd = rq.reproduce_command(args, "families")
    assert cmd.startswith("python benchmarks/routing_quality.py --quick --workloads families --modes closed")
    for part in ("--layouts 3", "--cache-ratio 0.4", "--replicas 3 --replicas-shared", "--policies prefix",
                 "--define-policy x:routing.follow_threshold=0.5"):  # fmt: skip
        assert part in cmd
    trace = rq.reproduce_command(_args(trace="t.jsonl", layouts=5), "trace")
    assert "--trace t.jsonl --trace-limit 1500 --time-scale 0.1" in trace and "--workloads" not in trace
    assert "--api" not in cmd
    assert rq.reproduce_command(_args(layouts=3, api="responses"), "families").endswith("--api responses")
    tools = rq.reproduce_command(_args(layouts=3, api="responses-tools"), "families")
    assert tools.endswith("--api responses-tools")


async def test_a_setting_the_router_does_not_know_is_unsupported_not_a_crash(rq: ModuleType) -> None:
    policy = rq.parse_policy_definition("future:routing.no_such_setting_yet=1")
    config = SimConfig(overhead_ms=1.0, itl_ms=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        async with SimFleet(config, count=2) as fleet:
            with pytest.raises(rq.Unsupported, match="no_such_setting_yet"):
                async with rq.routers(policy, fleet.urls, 2, Path(tmp)):
                    pytest.fail("the router started with an unknown setting")


async def test_each_layout_is_a_fresh_fleet_on_new_ports(rq: ModuleType) -> None:
    config = SimConfig(overhead_ms=1.0, itl_ms=0.1)
    seen: list[tuple[str, ...]] = []
    for _ in range(3):
        async with SimFleet(config, count=2) as fleet:  # what run_workload does per layout
            seen.append(tuple(fleet.urls))
    assert len(set(seen)) == 3


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
async def test_the_loopback_redis_starts_and_flushes(rq: ModuleType) -> None:
    import asyncio

    async with rq.redis_server() as url:
        assert url.startswith("redis://127.0.0.1:") and url.endswith("/0")
        host_port = url.split("//")[1].split("/")[0]
        host, port = host_port.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n*2\r\n$6\r\nEXISTS\r\n$1\r\nk\r\n")
        assert await reader.readline() == b"+OK\r\n"
        assert await reader.readline() == b":1\r\n"
        await rq.redis_flush(url)
        writer.write(b"*2\r\n$6\r\nEXISTS\r\n$1\r\nk\r\n")
        assert await reader.readline() == b":0\r\n"
        writer.close()
        await writer.wait_closed()


async def test_a_layouts_routers_start_together_and_a_refusal_is_kept_for_its_run(rq: ModuleType) -> None:
    good = rq.PolicySpec("ring", {"balancing": {"policy": "prefix"}, "routing": {"prefix_index": False}})
    bad = rq.parse_policy_definition("future:routing.no_such_setting_yet=1")
    combos = [(good, rq.Setup()), (bad, rq.Setup(2)), (good, rq.Setup(2, True))]
    config = SimConfig(overhead_ms=1.0, itl_ms=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        async with SimFleet(config, count=2) as fleet, client_session() as session:
            early = await rq.start_early(combos, fleet.urls, Path(tmp), "t", set())
            try:
                # The shared-state group is not started early: its Redis is flushed first, at its turn.
                assert set(early) == {("ring", "1"), ("future", "2 rr")}
                assert isinstance(early[("future", "2 rr")], rq.Unsupported)
                group = early[("ring", "1")]
                async with session.get(group.bases[0] + "/readyz") as resp:
                    assert resp.status == 200
            finally:
                for g in early.values():
                    if isinstance(g, rq.RouterGroup):
                        g.stop()


def test_a_workload_sglang_cannot_be_compared_on_is_not_judged_against_it(rq: ModuleType) -> None:
    Run = rq.Run
    runs = [
        Run("tenants", "prefix", "1", 0, "closed", _summary(0.2, 0.2, 1.0, 1.0), 0.2),
        Run("tenants", "sglang_cache_aware", "1", 0, "closed", _summary(0.9, 0.2, 1.0, 1.0), 0.2),
    ]
    rows = rq.aggregate(runs)
    assert any("vs SGLang" in t for t in rq.check_targets(rows))
    assert not any("vs SGLang" in t for t in rq.check_targets(rows, ["tenants"]))
    tenants = next(s for s in rq.build_workloads(quick=True) if s.name == "tenants")
    assert "cache_salt" in tenants.sglang_caveat


# -- the oracle against real engines (--backends with --tokenizer) ----------------------------------------


def _engine_oracle(rq: ModuleType) -> ModuleType:
    return sys.modules[rq.EngineFleet.__module__]  # loaded by routing_quality from benchmarks/


def _chars(messages: Any) -> list[int]:
    """A stand-in tokenizer, one token per character of the messages in order."""
    return [ord(c) for m in messages for c in str(m["content"])]


def test_an_engines_prompt_is_its_full_blocks_chained_and_salted(rq: ModuleType) -> None:
    engine = rq.EngineFleet((4, 4), 4, _chars)
    tokens, first = engine.prompt({"messages": [{"role": "user", "content": "abcdefgh" + "ij"}]})
    assert tokens == 10 and len(first) == 2  # the partial third block is not cached, as on vLLM
    _, other = engine.prompt({"messages": [{"role": "user", "content": "abcdXXXXij"}]})
    assert other[0] == first[0] and other[1] != first[1]
    _, moved = engine.prompt({"messages": [{"role": "user", "content": "XXXXefgh"}]})
    assert moved[1] != first[1]  # a block's hash chains its whole prefix, not only its own tokens
    _, salted = engine.prompt({"messages": [{"role": "user", "content": "abcdefgh"}], "cache_salt": "t1"})
    assert salted[0] != first[0] and salted[1] != first[1]


def test_the_engine_oracle_hits_whole_blocks_and_evicts_beyond_the_fleet(rq: ModuleType) -> None:
    def workload(*texts: str) -> Any:
        bodies = [{"messages": [{"role": "user", "content": t}]} for t in texts]
        return SimpleNamespace(requests=[SimpleNamespace(body=b) for b in bodies])

    engine = rq.EngineFleet((2, 1), 4, _chars)  # 3 blocks of 4 tokens in all
    # The repeat hits floor((9 - 1) / 4) = 2 blocks of its 9 tokens: 8 of 18 prompt tokens.
    assert engine.oracle(workload("a" * 9, "a" * 9)).hit_tokens == 8
    # A prompt's head is its most recent block, so the second prompt leaves the first one's head...
    assert engine.oracle(workload("abcdefgh", "ABCDEFGH", "abcdefgh")).hit_tokens == 4
    # ...and a third pushes it out: 6 blocks through a cache of 3.
    assert engine.oracle(workload("abcdefgh", "ABCDEFGH", "IJKLMNOP", "abcdefgh")).hit_tokens == 0
    assert engine.working_set_blocks(workload("abcdefgh", "abcdEFGH")) == 3


def test_the_engines_blocks_are_read_from_vllms_info_gauge(rq: ModuleType) -> None:
    line = (
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",'
        'num_cpu_blocks="None",num_gpu_blocks="300",num_gpu_blocks_override="300"} 1.0\n'
    )
    head = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    head += "# TYPE vllm:cache_config_info gauge\n"
    oracle = _engine_oracle(rq)
    assert oracle.engine_blocks(head + line) == (300, 32)
    assert (
        oracle.engine_blocks("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")
        is None
    )


async def test_an_external_fleet_states_its_caches_over_http(rq: ModuleType) -> None:
    config = SimConfig(overhead_ms=1.0, itl_ms=0.1, capacity_blocks=77, block_size=16)
    async with SimFleet(config, count=2) as fleet:  # the sim prints vLLM's info gauge
        engine = await asyncio.to_thread(_engine_oracle(rq).read_engine_fleet, fleet.urls, _chars)
    assert (engine.blocks_per_backend, engine.block_size, engine.total_blocks) == ((77, 77), 16, 154)


def test_external_runs_each_with_its_own_oracle_give_the_layouts_mean(rq: ModuleType) -> None:
    Run = rq.Run
    runs = [  # external backends: every run draws its own requests, so its own oracle
        Run("w", "prefix", "1", 0, "closed", _summary(0.36, 0.40, 1.0, 1.0), 0.40),
        Run("w", "random", "1", 0, "closed", _summary(0.20, 0.44, 1.0, 1.0), 0.44),
    ]
    rows = {(r.policy, r.setup): r for r in rq.aggregate(runs)}
    assert rows[("lru_oracle", "-")].hit.mean == pytest.approx(0.42)
    assert rows[("prefix", "1")].of_oracle.mean == pytest.approx(0.9)
    cmd = rq.reproduce_command(_args(backends=["http://127.0.0.1:1"], tokenizer="models/tiny"), "families")
    assert "--backends http://127.0.0.1:1 --tokenizer models/tiny" in cmd
    assert (
        "--cache-ratio" not in cmd and "--fleet" not in cmd
    )  # the sim's own; external backends are as they are


@pytest.mark.parametrize("reset", [True, False], ids=["caches-reset-paired", "caches-kept-fresh-draws"])
def test_external_runs_serve_the_layouts_requests_when_the_caches_are_reset(
    rq: ModuleType, reset: bool
) -> None:
    spec = next(s for s in rq.build_workloads(True) if s.name == "shared_prefix")
    ctx = rq.LayoutContext(spec.make(0), ["http://127.0.0.1:1"], None, None)
    args = _args(backends=ctx.urls, reset_url_path="/reset_prefix_cache" if reset else None)
    ours = rq.requests_for_run(spec, ctx, "prefix", rq.Setup(), 0, "closed", args)
    sglang = rq.requests_for_run(spec, ctx, "sglang_cache_aware", rq.Setup(), 0, "closed", args)
    if reset:
        assert ours is ctx.workload and sglang is ctx.workload
    else:
        bodies = [r.body for r in ours.requests]
        assert bodies != [r.body for r in sglang.requests] and bodies != [
            r.body for r in ctx.workload.requests
        ]


def test_a_placement_replayed_hits_what_each_engine_kept_of_its_own_arrivals(rq: ModuleType) -> None:
    b = rq.BLOCK_SIZE
    shared, other = [1, 2, 3], [7, 8, 9]
    # Engine one: a prompt of 3 blocks twice (the second hits 2 blocks: the last token is recomputed),
    # then another that evicts it from a 3-block cache, then the first again (a miss).
    one = [(3 * b, shared), (3 * b, shared), (3 * b, other), (3 * b, shared)]
    two = [(3 * b + 1, other), (3 * b + 1, other)]  # one token more: all 3 blocks hit
    replay = rq.placement_replay([one, two], 3)
    assert replay == pytest.approx((2 * b + 3 * b) / (4 * 3 * b + 2 * (3 * b + 1)))
    assert rq.placement_replay([[], []], 3) is None


async def test_served_one_at_a_time_the_replay_equals_what_the_engines_counted(rq: ModuleType) -> None:
    config = SimConfig(overhead_ms=0.0, prefill_ms_per_token=0.0, itl_ms=0.0, capacity_blocks=24)
    workload = shared_prefix(groups=3, prompts_per_group=3, system_tokens=160, question_tokens=16, seed=4)
    async with SimFleet(config, count=2) as fleet, client_session() as session:
        for backend in fleet.backends:
            backend.server.scheduler.record_arrivals()
        sent_to: dict[int, str] = {}
        for i, request in enumerate(workload.requests):  # g0, g1, g2 over two engines, one at a time
            url = sent_to[i] = fleet.urls[int(request.group.removeprefix("g")) % 2]
            async with session.post(f"{url}/v1/chat/completions", json=request.body) as resp:
                assert resp.status == 200
        hits = queries = 0
        for backend in fleet.backends:
            stats = backend.server.stats()
            hits += stats["prefix_cache_hits"]
            queries += stats["prefix_cache_queries"]
        arrivals = {b.url: b.server.scheduler.arrivals for b in fleet.backends}
    # A router that names no backend: each request's engine is found from what the engines saw.
    results = [RequestResult(i, r.group, None, 200, sent_s=float(i)) for i, r in enumerate(workload.requests)]
    assert rq.engines_reached(workload, results, arrivals) == sent_to
    assert [len(a) for a in arrivals.values()] != [0, 0]
    assert sum(map(len, arrivals.values())) == len(workload.requests)
    assert 0 < hits < queries
    assert rq.placement_replay(list(arrivals.values()), 24) == pytest.approx(hits / queries)
