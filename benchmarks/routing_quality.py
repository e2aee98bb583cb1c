"""Routing quality on a simulated vLLM fleet: policies x workloads x fleet layouts, with SGLang beside.

Real HTTP end to end: this process runs the simulated fleet and the load driver; each router (ours,
one per policy variant, or SGLang's `cache_aware` when `sglang_router` is installed) runs as its own
subprocess on 127.0.0.1, started fresh for every run so no run inherits another's state.

What a user sees, not one lucky layout:
- layouts: every cell runs on `--layouts` fleets (5 by default, 3 with --quick), each a fresh fleet on
  new ephemeral ports (so our ring's layout differs) with the workload drawn from its own seed;
  every policy of a layout runs on the same fleet, and each metric is reported as the mean and the
  worst over layouts;
- caches that do not hold the working set: the fleet's KV blocks in all are `--cache-ratio` (0.4) of
  the workload's distinct prompt blocks, so even a perfect placement evicts; each backend holds at
  least the longest prompt and its fair share of running prompts, which raises the ratio where a
  workload's prompts are few and long (each table's header states the ratio it ran at); a request
  that does not fit beside the running ones waits for room, as on vLLM;
- workloads shaped like traffic: (a) shared-prefix groups, (b) long documents, (c) multi-turn chats,
  (d) a hot prefix, (e) tenants, (f) chat families sharing a system prompt, (g) one system prompt
  shared by all requests, and `--trace FILE` replaying a production trace in the Mooncake format;
- replicas: `--replicas 3` also runs our router and SGLang's as 3 instances behind round robin (the
  driver alternates requests over them), and `--replicas-shared` ours with
  `routing.shared_state_url` on a loopback redis-server this script starts;
- the peer in the same run: SGLang's `cache_aware`, and the LRU oracle (the best any placement could
  do if requests were served one after another; see `prefix_router.loadgen.workloads`).

The hit rate is the backends' own prefix-cache counters. Per workload: a markdown table (mean and
worst over layouts of hit rate, hit rate / oracle, hit rate - SGLang's, TTFT p50/p99, max/mean load)
with the command that reproduces it, printed and written to benchmarks/results/.

    python benchmarks/routing_quality.py             # 7 workloads x 5 policies x 5 layouts, closed loop
    python benchmarks/routing_quality.py --quick     # fewer requests, 3 layouts
    python benchmarks/routing_quality.py --quick --replicas 3 --replicas-shared
    python benchmarks/routing_quality.py --trace benchmarks/traces/mooncake_conversation_head2000.jsonl
    python benchmarks/routing_quality.py --workloads families --policies prefix prefix_ring \\
        --define-policy 'prefix_t05:routing.follow_threshold=0.5'
    # the same conversations through the Responses API, as a client keeping no state on the server
    python benchmarks/routing_quality.py --workloads multi_turn families --api responses
    # ... and as an agent's turns: each answer a function call, each later question its output
    python benchmarks/routing_quality.py --workloads multi_turn --api responses-tools
    # real vLLM: no layouts but the workload's seed; --reset-url-path empties the caches between runs
    # (vLLM needs VLLM_SERVER_DEV_MODE=1), so every run of a layout serves the same requests;
    # --prompt-scale shrinks every prompt; --tokenizer (the served model's) gives each run the oracle
    # on the engines' own tokens and KV blocks
    python benchmarks/routing_quality.py --backends http://gpu1:8000 http://gpu2:8000 --model MODEL \\
        --reset-url-path /reset_prefix_cache --prompt-scale 0.25 --tokenizer MODEL_PATH
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, package_version, print_header, sglang_router_argv
from _engine_oracle import EngineFleet, chat_tokenizer, read_engine_fleet
from prefix_router import __version__
from prefix_router.loadgen.drivers import (
    RequestResult,
    RunSummary,
    Target,
    balanced_placement,
    client_session,
    measure,
)
from prefix_router.loadgen.traces import (
    TraceError,
    guess_block_tokens,
    guess_time_unit_s,
    read_trace,
    trace_workload,
)
from prefix_router.loadgen.workloads import (
    DEFAULT_MODEL,
    Workload,
    as_responses,
    distinct_blocks,
    families,
    hot_prefix,
    largest_prompt_blocks,
    long_context,
    median_prompt_blocks,
    multi_turn,
    oracle_from_blocks,
    oracle_hit_rate,
    prompt_blocks,
    shared_prefix,
    shared_system,
    tenants,
)
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet

from loopback import eventually, free_port
from processes import clean_env, http_status, log_tail, start_process, stop_processes
from redisserver import RedisServer

MAX_NUM_SEQS = 8  # per simulated backend; the router's max_inflight is twice this
ROUTER_MAX_INFLIGHT = 16
BLOCK_SIZE = 16  # the sim's KV block, vLLM's default
DEFAULT_CACHE_RATIO = 0.4
DEFAULT_LAYOUTS = 5
QUICK_LAYOUTS = 3
ORACLE = "lru_oracle"
# TTFT = 30 ms + 0.1 ms per uncached prompt token: a cold 2k-token prefix costs ~0.23 s against ~45 ms
# warm, so the cache shows in TTFT (llm-d-inference-sim's example uses 0.25 ms; an 8B model on an H100
# is ~0.04 ms, see SimConfig). Decode at 2 ms a token: placement does not change it. Both keep a cell's
# run to seconds, so the grid fits on 2 cores.
PLACEMENT_FLEET = SimConfig(prefill_ms_per_token=0.1, itl_ms=2.0, max_num_seqs=MAX_NUM_SEQS)


# -- policies -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicySpec:
    """One routing policy to run: our router with settings overrides, SGLang's, or no router.

    To compare a new router setting, add a row (or pass --define-policy): `settings` are merged
    over the benchmark's base router config, section by section, e.g.
    `PolicySpec("prefix_t05", {"routing": {"follow_threshold": 0.5}}, replicate=True)`."""

    name: str
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    kind: str = "ours"  # ours | sglang | static (no router: each group on a fixed, balanced backend)
    replicate: bool = False  # also run behind round robin at --replicas N (and shared, for ours)
    note: str = ""


POLICIES: tuple[PolicySpec, ...] = (
    PolicySpec("prefix", {"balancing": {"policy": "prefix"}}, replicate=True, note="ours, defaults"),
    PolicySpec(
        "prefix_ring",
        {"balancing": {"policy": "prefix"}, "routing": {"prefix_index": False}},
        note="ours, no prefix index: the plain bounded-load ring",
    ),
    PolicySpec("random", {"balancing": {"policy": "random"}}),
    PolicySpec("least_loaded", {"balancing": {"policy": "least_loaded"}}),
    PolicySpec(
        "sglang_cache_aware", kind="sglang", replicate=True, note="sglang-router, --policy cache_aware"
    ),
)
# Run only when named with --policies.
EXPERIMENTS: tuple[PolicySpec, ...] = (
    PolicySpec("round_robin", {"balancing": {"policy": "round_robin"}}),
    PolicySpec("prefix_nohold", {"balancing": {"policy": "prefix"}, "routing": {"prefill_wait_s": 0}}),
    PolicySpec("prefix_nospill", {"balancing": {"policy": "prefix", "spill": False}}),
    PolicySpec("prefix_c2", {"balancing": {"policy": "prefix", "load_factor": 2.0}}),
    PolicySpec("prefix_floor16", {"balancing": {"policy": "prefix", "load_floor": 16}}),
    PolicySpec("static_balanced", kind="static", note="every group on one backend, groups balanced"),
)


def parse_policy_definition(text: str) -> PolicySpec:
    """`NAME:section.key=value,section.key=value` (values read as YAML scalars) -> one of ours,
    replicated; `balancing.policy` defaults to prefix."""
    name, sep, assignments = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--define-policy {text!r}: expected NAME:section.key=value[,...]")
    settings: dict[str, dict[str, Any]] = {"balancing": {"policy": "prefix"}}
    for item in filter(None, (a.strip() for a in assignments.split(","))):
        path, eq, raw = item.partition("=")
        section, dot, key = path.strip().partition(".")
        if not eq or not dot or not section or not key:
            raise ValueError(f"--define-policy {text!r}: {item!r} is not section.key=value")
        settings.setdefault(section, {})[key] = yaml.safe_load(raw)
    return PolicySpec(name.strip(), settings, replicate=True, note=f"defined: {assignments}")


@dataclass(frozen=True)
class Setup:
    """How many routers stand in front of the fleet, and whether they share state."""

    replicas: int = 1
    shared: bool = False

    @property
    def name(self) -> str:
        if self.replicas == 1:
            return "1"
        return f"{self.replicas} rr" + (" shared" if self.shared else "")


# -- workloads ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload (made per layout from its seed offset) and how it is driven."""

    name: str
    make: Callable[[int], Workload]  # layout -> the workload (layout 0: the reference seed)
    concurrency: int  # closed loop
    rate_per_s: float  # open loop
    timed: bool = False  # a trace: each request at its own time, whatever the mode
    # Why SGLang's figures on this workload are not comparable with ours, when they are not.
    sglang_caveat: str = ""
    fleet: SimConfig = field(default_factory=lambda: PLACEMENT_FLEET)


def _through_responses(make: Callable[[int], Workload], tool_calls: bool) -> Callable[[int], Workload]:
    return lambda layout: as_responses(make(layout), tool_calls=tool_calls)


def _maker(builder: Callable[..., Workload], seed: int, **kwargs: Any) -> Callable[[int], Workload]:
    return lambda layout: builder(seed=seed + 1000 * layout, **kwargs)


def build_workloads(quick: bool, prompt_scale: float = 1.0, model: str = DEFAULT_MODEL) -> list[WorkloadSpec]:
    """Workloads (a)-(g). `prompt_scale` multiplies every prompt size (prefixes, questions, turns).
    Request counts are kept small enough for the default run to fit ~30 minutes on 2 cores."""

    def t(tokens: int) -> int:
        return max(8, round(tokens * prompt_scale))

    def n(quick_value: int, full_value: int) -> int:
        return quick_value if quick else full_value

    chat = {"user_median_tokens": t(120), "reply_median_tokens": t(200), "max_turn_tokens": t(1500)}
    return [
        WorkloadSpec("shared_prefix", _maker(shared_prefix, 0, groups=n(16, 32), prompts_per_group=n(4, 5),
                     system_tokens=t(2048), question_tokens=t(128), model=model), 8, 30.0),
        WorkloadSpec("long_context", _maker(long_context, 1, documents=n(10, 16),
                     questions_per_document=n(4, 5),
                     document_tokens=t(8000), question_tokens=t(64), model=model), 8, 6.0),
        WorkloadSpec("multi_turn", _maker(multi_turn, 2, conversations=n(24, 32), system_tokens=t(64),
                     model=model, **chat), 8, 25.0),
        # Above one backend's batch: 32 concurrent, half of them on the hot prefix.
        WorkloadSpec("hot_prefix", _maker(hot_prefix, 3, requests=n(96, 160), cold_groups=n(16, 24),
                     system_tokens=t(1024), question_tokens=t(128), model=model), 32, 50.0),
        WorkloadSpec("tenants", _maker(tenants, 4, tenant_count=n(16, 24), requests_per_tenant=n(4, 6),
                     shared_prompts=2, system_tokens=t(1024), question_tokens=t(64), model=model), 8, 30.0,
                     sglang_caveat="SGLang's router does not pass the body's cache_salt on, so its backends "
                     "share one cache across tenants (above the per-tenant oracle): its row and the "
                     "'hit - SGLang' column are not comparable here"),
        WorkloadSpec("families", _maker(families, 5, conversations=24, family_count=3, system_tokens=t(1500),
                     max_turns=n(4, 6), model=model, **chat), 8, 25.0),
        WorkloadSpec("shared_system", _maker(shared_system, 6, conversations=n(32, 48), system_tokens=t(512),
                     max_turns=n(4, 6), model=model, **chat), 8, 25.0),
    ]  # fmt: skip


def trace_spec(args: argparse.Namespace) -> WorkloadSpec:
    path = Path(args.trace)
    limit = args.trace_limit or (500 if args.quick else 1500)
    try:
        records = read_trace(path, limit=limit)
    except (OSError, TraceError) as exc:
        raise SystemExit(f"--trace {path}: {exc}") from exc
    if not records:
        raise SystemExit(f"{path}: no requests")
    block_tokens = args.trace_block_tokens or guess_block_tokens(path)
    unit = args.trace_time_unit_s or guess_time_unit_s(records)

    def make(layout: int) -> Workload:
        # The layout seeds the ids' text, so each layout also hashes to other ring positions.
        return trace_workload(records, block_tokens=block_tokens, time_unit_s=unit,
                              time_scale=args.time_scale,
                              max_output_tokens=args.trace_max_output, seed=layout, model=args.model,
                              name="trace")  # fmt: skip

    # A trace's prompts are long (Mooncake's average ~14k tokens): an H100-like prefill cost keeps the
    # replay's in-flight count within the fleet's slots; see SimConfig.prefill_ms_per_token.
    return WorkloadSpec(
        "trace", make, 0, 0.0, timed=True, fleet=SimConfig(itl_ms=2.0, max_num_seqs=MAX_NUM_SEQS)
    )


@dataclass(frozen=True)
class CacheSizing:
    working_set_blocks: int
    per_backend_blocks: int
    backends: int
    floored: bool  # the per-backend floor (the longest prompt) raised it above the asked ratio

    @property
    def ratio(self) -> float:
        return (
            self.per_backend_blocks * self.backends / self.working_set_blocks
            if self.working_set_blocks
            else 0.0
        )


def size_cache(
    workload: Workload, backends: int, ratio: float, running_per_backend: int, block_size: int = BLOCK_SIZE
) -> CacheSizing:
    """Per-backend KV blocks so that the fleet holds `ratio` of the workload's distinct blocks, but at
    least the longest prompt (vLLM refuses a prompt its cache can never hold) and room for a fair
    share of running prompts (`running_per_backend` median prompts), so that a balanced placement is
    not held back by KV room; a backend given more than its share waits for room, as on vLLM."""
    working = distinct_blocks(workload, block_size=block_size)
    wanted = math.ceil(ratio * working / backends)
    floor = max(
        largest_prompt_blocks(workload, block_size=block_size) + 1,
        running_per_backend * median_prompt_blocks(workload, block_size=block_size),
    )
    return CacheSizing(working, max(wanted, floor, 1), backends, floor > wanted)


def running_share(spec: WorkloadSpec, backends: int) -> int:
    """Running requests a backend holds under a balanced placement (closed loop), at most half its batch."""
    return max(1, min(MAX_NUM_SEQS // 2, math.ceil(spec.concurrency / backends)))


# -- routers and redis as subprocesses --------------------------------------------------------------------


class Unsupported(RuntimeError):
    """The router under test refused a setting of this policy (e.g. an older build)."""


def router_command(
    policy: PolicySpec,
    urls: Sequence[str],
    port: int,
    workdir: Path,
    tag: str,
    shared_url: str | None,
    stateless_replica: bool = False,
    sim: bool = True,
) -> list[str]:
    if policy.kind == "sglang":
        return sglang_router_argv(urls, port)
    config: dict[str, Any] = {
        # backend_header: the tenants workload's stickiness is read from it
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning", "backend_header": True},
        "backends": [{"url": u} for u in urls],
        "health": {"interval_s": 2.0},
    }
    if sim:
        # Twice the simulated engines' batch. Real engines batch far more (vLLM's max_num_seqs): in
        # front of them the router runs its own default, as a user would, not a cap the engine lacks.
        config["balancing"] = {"max_inflight": ROUTER_MAX_INFLIGHT}
    for section, values in policy.settings.items():
        config.setdefault(section, {}).update(values)
    if shared_url:
        config.setdefault("routing", {})["shared_state_url"] = shared_url
    elif stateless_replica:
        # As the Helm chart renders several replicas without shared state, unless the policy says.
        config.setdefault("routing", {}).setdefault("first_placement", "ring")
    path = workdir / f"router-{policy.name}-{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "prefix_router", "serve", "--config", str(path)]


async def wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    def ready() -> bool:
        if proc.poll() is not None:
            log = log_tail(log_path, 2000)
            if "config error" in log:  # a setting this build does not know, e.g. routing.shared_state_url
                raise Unsupported(f"the router refused its settings: {log.strip()[-300:]}")
            raise RuntimeError(f"router exited with {proc.returncode}: {log.strip()[-500:]}")
        return http_status(url) == 200

    await eventually(lambda: asyncio.to_thread(ready), 30, f"router ready at {url}")


class RouterGroup:
    """`replicas` router processes of one policy for one run; each lists the backends in its own
    rotated order, as discovery may. Started early (a layout's routers start side by side, which
    halves the wall time spent importing) but each serves exactly one run, so no run inherits state."""

    def __init__(
        self, policy: PolicySpec, urls: Sequence[str], replicas: int, workdir: Path, tag: str,
        shared_url: str | None = None, sim: bool = True,
    ) -> None:  # fmt: skip
        self.policy = policy
        self._plan: list[tuple[list[str], str, Path]] = []
        for i in range(replicas):
            port = free_port()
            listed = list(urls[i:]) + list(urls[:i])
            cmd = router_command(policy, listed, port, workdir, f"{tag}-{i}", shared_url, replicas > 1, sim)
            self._plan.append(
                (cmd, f"http://127.0.0.1:{port}", workdir / f"router-{policy.name}-{tag}-{i}.log")
            )
        self.bases = [base for _, base, _ in self._plan]
        self.command = shlex.join(self._plan[0][0])
        self._started: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        env = clean_env()
        self._started = [start_process(cmd, log_path, env) for cmd, _, log_path in self._plan]

    async def ready(self) -> None:
        path = "/readiness" if self.policy.kind == "sglang" else "/readyz"
        await asyncio.gather(*(
            wait_ready(base + path, proc, log_path)
            for proc, (_, base, log_path) in zip(self._started, self._plan, strict=True)
        ))  # fmt: skip
        if self.policy.kind == "sglang":
            await asyncio.sleep(1.0)  # its workers register asynchronously after /readiness

    def stop(self) -> None:
        stop_processes(self._started)
        self._started = []


@contextlib.asynccontextmanager
async def routers(
    policy: PolicySpec,
    urls: Sequence[str],
    replicas: int,
    workdir: Path,
    shared_url: str | None = None,
) -> AsyncIterator[RouterGroup]:
    """One started, ready RouterGroup, stopped on the way out."""
    group = RouterGroup(policy, urls, replicas, workdir, f"{time.monotonic_ns()}", shared_url)
    try:
        group.start()
        await group.ready()
        yield group
    finally:
        group.stop()


@contextlib.asynccontextmanager
async def redis_server() -> AsyncIterator[str]:
    """A throwaway redis-server on a loopback port (no persistence); yields its redis:// URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--replicas-shared needs redis-server (apt-get install -y redis-server)")
    server = RedisServer(binary)
    try:
        await asyncio.to_thread(server.start)
        yield server.url
    finally:
        server.close()


async def redis_flush(url: str) -> None:
    """FLUSHDB on the URL's database, so a run starts from empty shared state."""
    hostport = url.split("://", 1)[1].split("/", 1)
    host, _, port = hostport[0].rpartition(":")
    db = hostport[1] if len(hostport) > 1 and hostport[1] else "0"
    reader, writer = await asyncio.open_connection(host or "127.0.0.1", int(port or 6379))
    try:
        for command in (["SELECT", db], ["FLUSHDB"]):
            writer.write(f"*{len(command)}\r\n".encode() + b"".join(
                f"${len(part)}\r\n{part}\r\n".encode() for part in command))  # fmt: skip
            await writer.drain()
            reply = await reader.readline()
            if not reply.startswith(b"+"):
                raise RuntimeError(f"redis {command[0]}: {reply!r}")
    finally:
        writer.close()
        await writer.wait_closed()


def sglang_available() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


# -- runs -----------------------------------------------------------------------------------------------


@dataclass
class Run:
    workload: str
    policy: str
    setup: str
    layout: int
    mode: str
    summary: RunSummary | None  # None when the run could not happen (status says why)
    oracle: float | None
    status: str = "ok"  # ok | unsupported | failed: ...
    router_command: str = ""
    backend_urls: list[str] = field(default_factory=list)
    placement: float | None = None  # the engines' arrivals replayed (placement_replay); sim only


@dataclass
class LayoutContext:
    workload: Workload
    urls: list[str]
    oracle: float | None
    sizing: CacheSizing | None
    engine: EngineFleet | None = None  # external vLLM backends with --tokenizer: their caches
    fleet: SimFleet | None = None  # the sim's own fleet, recording what arrives at each engine
    _engine_oracle: float | None = None  # of `workload`, once computed

    def engine_oracle(self, workload: Workload) -> float:
        """The oracle of `workload` on the external engines' blocks (the layout's own: computed once)."""
        assert self.engine is not None
        if workload is not self.workload:
            return self.engine.oracle(workload).hit_rate
        if self._engine_oracle is None:
            self._engine_oracle = self.engine.oracle(workload).hit_rate
        return self._engine_oracle


def requests_for_run(
    spec: WorkloadSpec, ctx: LayoutContext, policy: str, setup: Setup, layout: int, mode: str,
    args: argparse.Namespace,
) -> Workload:  # fmt: skip
    """The requests one run serves: the layout's. External caches persist, so without --reset-url-path
    each run draws its own, and no run hits what another left; emptied before each run, every run of
    a layout serves the same requests, as on the sim, and the policies compare on one draw."""
    if args.backends and not args.reset_url_path:
        return spec.make(layout + 1 + run_seed_offset(policy, setup, mode))
    return ctx.workload


async def run_one(
    session: aiohttp.ClientSession,
    spec: WorkloadSpec,
    ctx: LayoutContext,
    policy: PolicySpec,
    setup: Setup,
    layout: int,
    mode: str,
    workdir: Path,
    args: argparse.Namespace,
    shared_url: str | None,
    group: RouterGroup | BaseException | None = None,
) -> Run:
    """One (policy, setup) run on this layout's fleet, through `group` when it was started early."""
    sim = not args.backends
    workload = requests_for_run(spec, ctx, policy.name, setup, layout, mode, args)
    oracle = ctx.oracle
    if not sim and ctx.engine is not None:
        oracle = ctx.engine_oracle(workload)
    target = Target(base_url="", backend_urls=tuple(ctx.urls), sim=sim,
                    reset_path=None if sim else args.reset_url_path)  # fmt: skip
    run = Run(spec.name, policy.name, setup.name, layout, mode, None, oracle, backend_urls=ctx.urls)

    async def drive(run_target: Target) -> RunSummary:
        summary, results = await measure(
            session, run_target, workload,
            concurrency=spec.concurrency if mode == "closed" and not spec.timed else None,
            rate_per_s=spec.rate_per_s if mode == "open" and not spec.timed else None,
            timed=spec.timed, max_duration_s=args.open_duration if mode == "open" else None,
            oracle_hit_rate=oracle,
        )  # fmt: skip
        # What reached each simulated engine, read once for the replay and the diagnosis.
        arrivals = {b.url: b.server.scheduler.arrivals for b in ctx.fleet.backends} if ctx.fleet else {}
        if arrivals and ctx.sizing is not None:
            run.placement = placement_replay(list(arrivals.values()), ctx.sizing.per_backend_blocks)
        if args.diagnose:
            engines = engines_reached(workload, results, arrivals)
            write_diagnosis(Path(args.diagnose), spec, ctx, policy, setup, layout, mode, summary, results,
                            run.placement, engines)  # fmt: skip
        return summary

    if policy.kind == "static":
        routes = balanced_placement(workload, ctx.urls)
        run.summary = await drive(dataclasses.replace(target, base_url=ctx.urls[0], routes=routes))
        run.router_command = "(no router: static balanced placement)"
        return run
    try:
        if group is None:  # started at its turn: shared state is flushed first
            if shared_url and setup.shared:
                await redis_flush(shared_url)
            group = RouterGroup(policy, ctx.urls, setup.replicas, workdir, f"{layout}-{mode}-{setup.name}",
                                shared_url if setup.shared else None, sim)  # fmt: skip
            group.start()
            await group.ready()
        elif isinstance(group, BaseException):
            raise group
        run.router_command = group.command
        run.summary = await drive(
            dataclasses.replace(target, base_url=group.bases[0], router_urls=tuple(group.bases))
        )
    except Unsupported as exc:
        run.status = "unsupported"
        run.router_command = str(exc)
    except RuntimeError as exc:  # a router that would not start: say so in the table, run the rest
        run.status = "failed"
        run.router_command = str(exc)
    finally:
        if isinstance(group, RouterGroup):
            group.stop()
    return run


def placement_replay(
    arrivals: Sequence[Sequence[tuple[int, Sequence[int]]]], per_backend_blocks: int
) -> float | None:
    """The run's placement served again one request at a time: each engine's prompts in the order they
    arrived there (the sim records them), on an LRU cache of its size (the oracle's rules, per
    backend). Against the oracle it measures the placement, whichever router made it; against the
    run's own hit rate, what serving cost (blocks pinned by running requests, prefixes reused before
    their prefill was done). None when no prompt arrived."""
    hits = total = 0
    for prompts in arrivals:
        served = oracle_from_blocks(prompts, block_size=BLOCK_SIZE, capacity_blocks=per_backend_blocks)
        hits += served.hit_tokens
        total += served.prompt_tokens
    return hits / total if total else None


def engines_reached(
    workload: Workload,
    results: Sequence[RequestResult],
    arrivals: Mapping[str, Sequence[tuple[int, Sequence[int]]]],
) -> dict[int, str]:
    """Per request (its index), the sim engine its prompt arrived at, found by its block hashes in the
    engines' records, for routers that do not name the backend. Two identical prompts sent to two
    engines may be swapped, which changes nothing either engine holds. A prompt the router changed on
    the way (a `cache_salt` it set) is not found."""
    arrived: dict[tuple[int, ...], deque[str]] = {}
    for url, prompts in arrivals.items():
        for _, hashes in prompts:
            arrived.setdefault(tuple(hashes), deque()).append(url)
    engines: dict[int, str] = {}
    for r in sorted(results, key=lambda r: r.sent_s):
        urls = arrived.get(tuple(prompt_blocks(workload.requests[r.index].body, BLOCK_SIZE)[1]))
        if urls:
            engines[r.index] = urls.popleft()
    return engines


def write_diagnosis(
    folder: Path, spec: WorkloadSpec, ctx: LayoutContext, policy: PolicySpec, setup: Setup, layout: int,
    mode: str, summary: RunSummary, results: Sequence[RequestResult], replay: float | None,
    engines: Mapping[int, str],
) -> None:  # fmt: skip
    """One run's requests as they went (backend, the sim engine it reached, cached tokens, times), for
    an offline look at where a placement lost hits: `--diagnose DIR` writes one JSON file per run and
    prints the run's placement replayed (see placement_replay) beside its hit rate and the oracle."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {
        "workload": spec.name, "policy": policy.name, "setup": setup.name, "layout": layout, "mode": mode,
        "per_backend_blocks": ctx.sizing.per_backend_blocks if ctx.sizing else None,
        "backends": ctx.urls, "oracle": ctx.oracle, "placement_replay": replay, "summary": summary.as_dict(),
        "requests": [dataclasses.asdict(r) | {"engine": engines.get(r.index)} for r in results],
    }  # fmt: skip
    name = f"{spec.name}-{mode}-{policy.name}-{setup.name.replace(' ', '_')}-{layout}.json"
    (folder / name).write_text(json.dumps(doc))
    if replay and ctx.oracle:
        print(f"  {'':6} {'':30} diagnose: served {summary.hit_rate:.1%}, its placement replayed in order "
              f"{replay:.1%}, oracle {ctx.oracle:.1%} (placement {replay / ctx.oracle:.2f} of the oracle, "
              f"served {summary.hit_rate / replay:.2f} of the replay)", flush=True)  # fmt: skip


def run_seed_offset(policy: str, setup: Setup, mode: str) -> int:
    """External backends: a workload seed per (policy, setup, mode), stable whatever is selected."""
    names = [p.name for p in (*POLICIES, *EXPERIMENTS)]
    index = names.index(policy) if policy in names else len(names) + sum(map(ord, policy))
    return 100 * (1 + 4 * index + 2 * (setup.replicas > 1) + setup.shared) + (mode == "open")


def combinations(
    policies: Sequence[PolicySpec], replicas: int, shared: bool
) -> list[tuple[PolicySpec, Setup]]:
    out = [(p, Setup()) for p in policies]
    if replicas > 1:
        out += [(p, Setup(replicas)) for p in policies if p.replicate]
        if shared:
            out += [(p, Setup(replicas, True)) for p in policies if p.replicate and p.kind == "ours"]
    return out


async def start_early(
    combos: list[tuple[PolicySpec, Setup]],
    urls: Sequence[str],
    workdir: Path,
    tag: str,
    skip: set[tuple[str, str]],
    sim: bool = True,
) -> dict[tuple[str, str], RouterGroup | BaseException]:
    """Start every router of a layout side by side (not the shared-state ones: their Redis is flushed
    just before each starts) and wait until all are ready; a failure is kept for its run to report."""
    groups: dict[tuple[str, str], RouterGroup] = {}
    for policy, setup in combos:
        key = (policy.name, setup.name)
        if policy.kind != "static" and not setup.shared and key not in skip:
            groups[key] = RouterGroup(
                policy, urls, setup.replicas, workdir, f"{tag}-{setup.replicas}", sim=sim
            )
            groups[key].start()
    outcomes = await asyncio.gather(*(g.ready() for g in groups.values()), return_exceptions=True)
    early: dict[tuple[str, str], RouterGroup | BaseException] = {}
    for (key, group), outcome in zip(groups.items(), outcomes, strict=True):
        if isinstance(outcome, BaseException):
            group.stop()
            early[key] = outcome
        else:
            early[key] = group
    return early


async def run_layout(
    session: aiohttp.ClientSession,
    spec: WorkloadSpec,
    ctx: LayoutContext,
    combos: list[tuple[PolicySpec, Setup]],
    layout: int,
    mode: str,
    workdir: Path,
    args: argparse.Namespace,
    shared_url: str | None,
    unsupported: set[tuple[str, str]],
) -> list[Run]:
    """Every (policy, setup) of one layout and mode, one after another on the layout's fleet."""
    runs: list[Run] = []
    early = await start_early(combos, ctx.urls, workdir, f"{layout}-{mode}", unsupported, not args.backends)
    try:
        for policy, setup in combos:
            label = f"{policy.name} [{setup.name}]"
            if (policy.name, setup.name) in unsupported:
                runs.append(Run(spec.name, policy.name, setup.name, layout, mode, None, ctx.oracle,
                                "unsupported", backend_urls=ctx.urls))  # fmt: skip
                continue
            t0 = time.monotonic()
            group = early.pop((policy.name, setup.name), None)
            run = await run_one(
                session, spec, ctx, policy, setup, layout, mode, workdir, args, shared_url, group
            )
            runs.append(run)
            if run.summary is None:
                if run.status == "unsupported":  # the same build refuses it on every layout
                    unsupported.add((policy.name, setup.name))
                print(f"  {mode:6} {label:30} {run.status}: {run.router_command[:200]}", flush=True)
                continue
            sm = run.summary
            placed = "" if run.placement is None else f"placement {run.placement:6.1%}  "
            print(f"  {mode:6} {label:30} hit {sm.hit_rate:6.1%}  {placed}p50 {_ms(sm.ttft_p50_s):>5} ms  "
                  f"p99 {_ms(sm.ttft_p99_s):>5} ms  max/mean {sm.max_mean_load:4.2f}  errors {sm.errors}  "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
    finally:  # a group whose run never came (an error above) is stopped all the same
        for leftover in early.values():
            if isinstance(leftover, RouterGroup):
                leftover.stop()
    return runs


async def run_workload(
    session: aiohttp.ClientSession,
    spec: WorkloadSpec,
    combos: list[tuple[PolicySpec, Setup]],
    modes: list[str],
    workdir: Path,
    args: argparse.Namespace,
    shared_url: str | None,
) -> tuple[list[Run], list[LayoutContext]]:
    runs: list[Run] = []
    contexts: list[LayoutContext] = []
    unsupported: set[tuple[str, str]] = set()
    for layout in range(args.layouts):
        workload = spec.make(layout)
        if args.backends:
            ctx = LayoutContext(workload, list(args.backends), None, None, args.engine_fleet)
            fleet_cm: Any = contextlib.nullcontext()
        else:
            sizing = size_cache(workload, args.fleet, args.cache_ratio, running_share(spec, args.fleet))
            config = dataclasses.replace(spec.fleet, capacity_blocks=sizing.per_backend_blocks,
                                         block_size=BLOCK_SIZE, model=args.model)  # fmt: skip
            total = sizing.per_backend_blocks * args.fleet
            oracle = oracle_hit_rate(workload, block_size=BLOCK_SIZE, capacity_blocks=total).hit_rate
            fleet_cm = SimFleet(config, count=args.fleet)  # ephemeral ports: a new ring layout
            ctx = LayoutContext(workload, [], oracle, sizing)
        async with fleet_cm as fleet:
            if fleet is not None:
                ctx.urls = fleet.urls
                ctx.fleet = fleet
                for backend in fleet.backends:
                    backend.server.scheduler.record_arrivals()
            contexts.append(ctx)
            s = ctx.sizing
            print(f"\n== {spec.name} layout {layout + 1}/{args.layouts}: {workload.description}; backends "
                  f"{ctx.urls}" + (f", {s.per_backend_blocks} KV blocks each = {s.ratio:.0%} of the working "
                  f"set of {s.working_set_blocks} blocks; oracle {ctx.oracle:.1%}" if s else ""),
                  flush=True)  # fmt: skip
            for mode in ["trace"] if spec.timed else modes:
                runs += await run_layout(session, spec, ctx, combos, layout, mode, workdir, args, shared_url,
                                         unsupported)  # fmt: skip
    return runs, contexts


# -- aggregation and tables --------------------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    mean: float
    worst: float

    @classmethod
    def of(cls, values: Sequence[float], worst: Callable[[Iterable[float]], float]) -> Stat | None:
        return cls(statistics.fmean(values), worst(values)) if values else None


@dataclass
class Row:
    workload: str
    mode: str
    policy: str
    setup: str
    layouts: int
    status: str
    hit: Stat | None = None
    of_oracle: Stat | None = None
    placement_of_oracle: Stat | None = None
    minus_sglang: Stat | None = None
    of_one_router: Stat | None = None
    ttft_p50_s: Stat | None = None
    ttft_p99_s: Stat | None = None
    max_mean_load: Stat | None = None
    peak_inflight: int | None = None
    errors: int = 0


def aggregate(runs: list[Run]) -> list[Row]:
    """One row per (workload, mode, policy, setup) over its layouts, plus the oracle's row. Ratios to
    SGLang (same number of routers) and to one router (same policy) pair runs of the same layout."""
    by_key: dict[tuple[str, str, str, str], dict[int, Run]] = {}
    for r in runs:
        by_key.setdefault((r.workload, r.mode, r.policy, r.setup), {})[r.layout] = r
    # Per layout, the mean of its runs' oracles: one value on the sim; external runs each draw their own.
    layout_oracles: dict[tuple[str, str], dict[int, list[float]]] = {}
    for r in runs:
        if r.oracle is not None:
            layout_oracles.setdefault((r.workload, r.mode), {}).setdefault(r.layout, []).append(r.oracle)
    rows: list[Row] = []
    seen_oracle: set[tuple[str, str]] = set()
    for (workload, mode, policy, setup), layouts in by_key.items():
        if (workload, mode) not in seen_oracle:
            seen_oracle.add((workload, mode))
            if oracles := layout_oracles.get((workload, mode)):
                rows.append(Row(workload, mode, ORACLE, "-", len(oracles), "ok",
                                hit=Stat.of([statistics.fmean(v) for v in oracles.values()], min),
                                of_oracle=Stat(1.0, 1.0), placement_of_oracle=Stat(1.0, 1.0)))  # fmt: skip
        ok = _summaries(layouts)
        statuses = {r.status for r in layouts.values() if r.summary is None}
        row = Row(workload, mode, policy, setup, len(ok), "ok" if ok else ", ".join(sorted(statuses)))
        rows.append(row)
        if not ok:
            continue
        sm = list(ok.values())
        row.hit = Stat.of([s.hit_rate for s in sm], min)
        row.of_oracle = Stat.of([s.oracle_ratio for s in sm if s.oracle_ratio is not None], min)
        row.placement_of_oracle = Stat.of(
            [r.placement / r.oracle for lay, r in layouts.items() if lay in ok and r.placement is not None
             and r.oracle], min,
        )  # fmt: skip
        sgl = _summaries(by_key.get((workload, mode, "sglang_cache_aware", setup), {}))
        row.minus_sglang = Stat.of(
            [s.hit_rate - sgl[lay].hit_rate for lay, s in ok.items() if lay in sgl], min
        )
        if setup != "1":
            one = _summaries(by_key.get((workload, mode, policy, "1"), {}))
            row.of_one_router = Stat.of(
                [s.hit_rate / one[lay].hit_rate for lay, s in ok.items() if lay in one and one[lay].hit_rate],
                min,
            )
        row.ttft_p50_s = Stat.of([s.ttft_p50_s for s in sm if s.ttft_p50_s is not None], max)
        row.ttft_p99_s = Stat.of([s.ttft_p99_s for s in sm if s.ttft_p99_s is not None], max)
        row.max_mean_load = Stat.of([s.max_mean_load for s in sm], max)
        peaks = [max(s.peak_inflight.values()) for s in sm if s.peak_inflight]
        row.peak_inflight = max(peaks) if peaks else None
        row.errors = sum(s.errors for s in sm)
    return rows


def _summaries(layouts: Mapping[int, Run]) -> dict[int, RunSummary]:
    return {lay: r.summary for lay, r in layouts.items() if r.summary is not None}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _pair(stat: Stat | None, fmt: Callable[[float], str]) -> list[str]:
    return ["-", "-"] if stat is None else [fmt(stat.mean), fmt(stat.worst)]


HEADERS = [
    "policy", "routers", "layouts", "hit rate mean", "worst", "hit / oracle mean", "worst",
    "placement / oracle mean", "worst",
    "hit - SGLang (pt) mean", "worst", "hit / 1 router mean", "worst", "TTFT p50 ms mean", "worst",
    "TTFT p99 ms mean", "worst", "max/mean load mean", "worst", "peak in-flight", "errors",
]  # fmt: skip


def table(rows: list[Row]) -> str:
    pct = lambda v: f"{v:.1%}"  # noqa: E731
    ratio = lambda v: f"{v:.2f}"  # noqa: E731
    pt = lambda v: f"{v * 100:+.1f}"  # noqa: E731
    ms = lambda v: f"{v * 1000:.0f}"  # noqa: E731
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in rows:
        if r.status != "ok":
            cells = [r.policy, r.setup, str(r.layouts), r.status] + ["-"] * (len(HEADERS) - 4)
        else:
            cells = [r.policy, r.setup, str(r.layouts), *_pair(r.hit, pct), *_pair(r.of_oracle, ratio),
                     *_pair(r.placement_of_oracle, ratio),
                     *_pair(r.minus_sglang, pt), *_pair(r.of_one_router, ratio), *_pair(r.ttft_p50_s, ms),
                     *_pair(r.ttft_p99_s, ms), *_pair(r.max_mean_load, ratio),
                     "-" if r.peak_inflight is None else str(r.peak_inflight),
                     "-" if r.policy == ORACLE else str(r.errors)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(spec: WorkloadSpec, contexts: list[LayoutContext], mode: str, args: argparse.Namespace) -> str:
    w = contexts[0].workload
    drive = ("trace times" if spec.timed
             else f"closed loop, {spec.concurrency} concurrent" if mode == "closed"
             else f"open loop, Poisson {spec.rate_per_s:g}/s")  # fmt: skip
    out = f"{w.description}; {len(w)} requests; {drive}"
    sizings = [c.sizing for c in contexts if c.sizing is not None]
    if sizings:
        blocks = sorted({s.per_backend_blocks for s in sizings})
        ratios = [s.ratio for s in sizings]
        floored = (
            " (raised to hold the longest prompt or a fair share of running ones per backend)"
            if any(s.floored for s in sizings)
            else ""
        )
        out += (f"; {args.fleet} sim backends x {blocks[0]}" + (f"-{blocks[-1]}" if len(blocks) > 1 else "")
                + f" KV blocks of {BLOCK_SIZE} tokens: the fleet holds {min(ratios):.0%}"
                + (f"-{max(ratios):.0%}" if max(ratios) - min(ratios) >= 0.005 else "")
                + f" of the working set (asked {args.cache_ratio:.0%}){floored}; "
                f"max_num_seqs {MAX_NUM_SEQS}, "
                f"router max_inflight {ROUTER_MAX_INFLIGHT}")  # fmt: skip
    elif engines := [c.engine for c in contexts if c.engine is not None]:
        engine = engines[0]
        ratios = [engine.total_blocks / max(1, engine.working_set_blocks(c.workload)) for c in contexts]
        per_backend = "/".join(map(str, engine.blocks_per_backend))
        out += (f"; external backends {list(args.backends)} x {per_backend} "
                f"KV blocks of {engine.block_size} tokens (their vllm:cache_config_info): the fleet holds "
                f"{min(ratios):.0%}" + (f"-{max(ratios):.0%}" if max(ratios) - min(ratios) >= 0.005 else "")
                + f" of a run's working set, tokenized with {args.tokenizer}; each run's oracle on its own "
                "requests; router max_inflight its default")  # fmt: skip
    else:
        out += f"; external backends {list(args.backends)}, no oracle; router max_inflight its default"
    if spec.sglang_caveat:
        out += f". Note: {spec.sglang_caveat}"
    return out


def reproduce_command(args: argparse.Namespace, workload: str) -> str:
    cmd = ["python", "benchmarks/routing_quality.py"]
    if args.quick:
        cmd.append("--quick")
    if workload == "trace":
        limit = args.trace_limit or (500 if args.quick else 1500)
        cmd += ["--trace", str(args.trace), "--trace-limit", str(limit),
                "--time-scale", f"{args.time_scale:g}"]  # fmt: skip
        if args.trace_max_output is not None:
            cmd += ["--trace-max-output", str(args.trace_max_output)]
        if args.trace_block_tokens:
            cmd += ["--trace-block-tokens", str(args.trace_block_tokens)]
        if args.trace_time_unit_s:
            cmd += ["--trace-time-unit-s", f"{args.trace_time_unit_s:g}"]
    else:
        cmd += ["--workloads", workload, "--modes", *args.modes]
    cmd += ["--layouts", str(args.layouts)]
    if not args.backends:  # the sim's own fleet; external backends are what they are
        cmd += ["--cache-ratio", f"{args.cache_ratio:g}", "--fleet", str(args.fleet)]
    if args.policies:
        cmd += ["--policies", *args.policies]
    for definition in args.define_policy or ():
        cmd += ["--define-policy", definition]
    if args.replicas > 1:
        cmd += ["--replicas", str(args.replicas)]
        if args.replicas_shared:
            cmd.append("--replicas-shared")
    if args.no_sglang:
        cmd.append("--no-sglang")
    if args.prompt_scale != 1.0:
        cmd += ["--prompt-scale", f"{args.prompt_scale:g}"]
    if args.model != DEFAULT_MODEL:
        cmd += ["--model", args.model]
    if args.api != "chat":
        cmd += ["--api", args.api]
    if args.backends:
        cmd += ["--backends", *args.backends]
        if args.reset_url_path:
            cmd += ["--reset-url-path", args.reset_url_path]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
    return shlex.join(cmd)


# -- targets -------------------------------------------------------------------------------------------


def check_targets(rows: list[Row], not_comparable: Iterable[str] = ()) -> list[str]:
    """The routing-quality targets, met or missed, from the mean and worst over layouts; workloads in
    `not_comparable` are not judged against SGLang."""
    skip_sglang = set(not_comparable)
    get: Callable[[str, str, str, str], Row | None] = lambda w, m, p, s: next(  # noqa: E731
        (r for r in rows if (r.workload, r.mode, r.policy, r.setup) == (w, m, p, s) and r.hit), None
    )
    out: list[str] = []

    def verdict(ok: bool, text: str) -> None:
        out.append(f"- [{'met' if ok else 'MISSED'}] {text}")

    for workload, mode in dict.fromkeys((r.workload, r.mode) for r in rows):
        ours, sgl = get(workload, mode, "prefix", "1"), get(workload, mode, "sglang_cache_aware", "1")
        if ours is None or ours.hit is None:
            continue
        where = f"{workload} ({mode})"
        if sgl is not None and sgl.hit is not None and workload not in skip_sglang:
            verdict(ours.hit.mean >= sgl.hit.mean - 0.01,
                    f"{where}: hit rate {ours.hit.mean:.1%} vs SGLang {sgl.hit.mean:.1%} "
                    "(target >= SGLang - 1 pt)")  # fmt: skip
            if sgl.of_oracle is not None and sgl.of_oracle.mean >= 0.95 and ours.of_oracle is not None:
                verdict(ours.of_oracle.mean >= 0.95,
                        f"{where}: {ours.of_oracle.mean:.2f} of the oracle where SGLang reaches "
                        f"{sgl.of_oracle.mean:.2f} (target >= 0.95)")  # fmt: skip
        if ours.of_oracle is not None:
            placed = ours.placement_of_oracle
            placed_note = "" if placed is None else f"; its placement, worst layout: {placed.worst:.2f}"
            verdict(
                ours.of_oracle.worst >= 0.9,
                f"{where}: worst layout {ours.of_oracle.worst:.2f} of the oracle (target >= 0.9)"
                + placed_note,
            )
        for row in rows:
            if (row.workload, row.mode, row.policy) == (workload, mode, "prefix") and row.setup != "1":
                if row.of_one_router is None:
                    out.append(f"- [n/a] {where}: prefix [{row.setup}] {row.status}")
                    continue
                goal = 0.98 if "shared" in row.setup else 0.9
                verdict(row.of_one_router.mean >= goal,
                        f"{where}: prefix [{row.setup}] {row.of_one_router.mean:.2f} of one router's "
                        "hit rate "
                        f"(target >= {goal})")  # fmt: skip
    for mode in dict.fromkeys(r.mode for r in rows if r.workload == "hot_prefix"):
        ours, ll = get("hot_prefix", mode, "prefix", "1"), get("hot_prefix", mode, "least_loaded", "1")
        if ours is None:
            continue
        if ours.peak_inflight is not None:
            verdict(ours.peak_inflight <= ROUTER_MAX_INFLIGHT,
                    f"hot_prefix ({mode}): peak in-flight {ours.peak_inflight} "
                    f"(max_inflight {ROUTER_MAX_INFLIGHT})")  # fmt: skip
        if ll is not None and ours.ttft_p99_s and ll.ttft_p99_s and ll.ttft_p99_s.mean:
            x = ours.ttft_p99_s.mean / ll.ttft_p99_s.mean
            verdict(x <= 1.3, f"hot_prefix ({mode}): TTFT p99 {x:.2f}x least_loaded's (target <= 1.3x)")
    return out


# -- main -----------------------------------------------------------------------------------------------


def select_policies(args: argparse.Namespace) -> list[PolicySpec]:
    try:
        defined = [parse_policy_definition(d) for d in args.define_policy or ()]
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    known = {p.name: p for p in (*POLICIES, *EXPERIMENTS, *defined)}
    if args.policies:
        if unknown := sorted(set(args.policies) - set(known)):
            raise SystemExit(f"unknown policies {unknown}; known: {sorted(known)}")
        chosen = [known[name] for name in dict.fromkeys(args.policies)]
        chosen += [p for p in defined if p.name not in args.policies]
    else:
        chosen = [*POLICIES, *defined]
    if any(p.kind == "sglang" for p in chosen) and (args.no_sglang or not sglang_available()):
        if not args.no_sglang:
            print("sglang_router is not installed (pip install sglang-router): no SGLang rows")
        chosen = [p for p in chosen if p.kind != "sglang"]
    return chosen


async def run(args: argparse.Namespace) -> int:
    # SGLang's router probes workers with an HTTP/2 preface first; the sim's aiohttp logs each one.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    if args.prompt_scale <= 0 or args.time_scale <= 0 or args.cache_ratio <= 0:
        raise SystemExit("--prompt-scale, --time-scale and --cache-ratio must be positive")
    if args.reset_url_path and not args.backends:
        raise SystemExit("--reset-url-path applies to --backends (the sim is always reset)")
    if args.api != "chat" and (args.backends or args.trace):
        raise SystemExit(
            f"--api {args.api} runs the workloads on the sim (its oracle renders as the sim does)"
        )
    if args.tokenizer and not args.backends:
        raise SystemExit("--tokenizer applies to --backends (the sim's oracle uses the sim's tokenizer)")
    args.engine_fleet = (
        read_engine_fleet(args.backends, chat_tokenizer(args.tokenizer)) if args.tokenizer else None
    )
    args.layouts = args.layouts or (QUICK_LAYOUTS if args.quick else DEFAULT_LAYOUTS)
    if args.layouts < 1:
        raise SystemExit("--layouts must be at least 1")
    specs = build_workloads(args.quick, args.prompt_scale, args.model)
    names = {s.name for s in specs}
    if args.workloads and (unknown := sorted(set(args.workloads) - names)):
        raise SystemExit(f"unknown workloads {unknown}; known: {sorted(names)}")
    if args.workloads:
        specs = [s for s in specs if s.name in args.workloads]
    if args.api != "chat":
        tool_calls = args.api == "responses-tools"
        specs = [dataclasses.replace(s, make=_through_responses(s.make, tool_calls)) for s in specs]
    if not args.workloads and args.trace:
        specs = []  # --trace alone replays the trace only; name workloads to run them too
    if args.trace:
        specs.append(trace_spec(args))
    policies = select_policies(args)
    combos = combinations(policies, args.replicas, args.replicas_shared)
    header = print_header("routing quality", {
        "prefix-router": __version__, "sglang-router": package_version("sglang-router"),
        "aiohttp": package_version("aiohttp"),
    })  # fmt: skip
    runs: list[Run] = []
    sections: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="routing-quality-") as tmp:
        workdir = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            shared_url = args.shared_state_url
            if args.replicas > 1 and args.replicas_shared and not shared_url:
                shared_url = await stack.enter_async_context(redis_server())
            session = await stack.enter_async_context(client_session())
            for spec in specs:
                spec_runs, contexts = await run_workload(
                    session, spec, combos, args.modes, workdir, args, shared_url
                )
                runs += spec_runs
                for mode in dict.fromkeys(r.mode for r in spec_runs):
                    rows = [r for r in aggregate(spec_runs) if r.mode == mode]
                    section = (f"### {spec.name} ({mode})\n\n{describe(spec, contexts, mode, args)}.\n\n"
                               f"Reproduce: `{reproduce_command(args, spec.name)}`\n\n"
                               f"{table(rows)}\n")  # fmt: skip
                    sections.append(section)
                    print("\n" + section, flush=True)
    rows = aggregate(runs)
    targets = check_targets(rows, [s.name for s in specs if s.sglang_caveat])
    elapsed = time.monotonic() - started
    notes = [
        f"Mean and worst over {args.layouts} layouts (fresh fleets on new ephemeral ports; workload seed per "
        "layout). Worst: lowest hit rate and ratios, highest TTFT and load. 'hit - SGLang': against SGLang's "
        "cache_aware with the same number of routers, same layout; 'hit / 1 router': against the same policy "
        "as one router, same layout. The oracle is an LRU over the whole fleet's cache, requests in order. "
        "'placement / oracle': each engine's prompts, in the order they arrived there, served again one at a "
        "time on an LRU of its size, against the oracle: how well the router placed, apart from what serving "
        "cost (blocks pinned by running requests, prefixes reused before their prefill was done).",
        f"Whole run: {elapsed / 60:.1f} minutes.",
    ]
    text = "\n".join(sections) + "\n" + "\n".join(notes) + "\n\nTargets:\n" + "\n".join(targets) + "\n"
    print("\n" + "\n".join(notes) + "\n\nTargets:\n" + "\n".join(targets))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"routing_quality-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = {
        **header,
        "elapsed_s": elapsed,
        "rows": [dataclasses.asdict(r) for r in rows],
        "runs": [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "summary"},
                  "summary": r.summary.as_dict() if r.summary else None} for r in runs],
        "targets": targets,
    }  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    out.with_suffix(".md").write_text(text)
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests per cell and 3 layouts (~10 minutes)")
    p.add_argument(
        "--layouts",
        type=int,
        default=0,
        help=f"fleet layouts per cell (default {DEFAULT_LAYOUTS}, --quick {QUICK_LAYOUTS})",
    )
    p.add_argument(
        "--cache-ratio",
        type=float,
        default=DEFAULT_CACHE_RATIO,
        help="the fleet's KV cache as a share of the workload's distinct prompt blocks "
        "(default: %(default)s)",
    )
    p.add_argument("--fleet", type=int, default=4, help="simulated backends (default: %(default)s)")
    p.add_argument("--workloads", nargs="+", metavar="NAME", help="only these workloads")
    p.add_argument(
        "--policies",
        nargs="+",
        metavar="NAME",
        help="only these policies; also the experiments, not run by default: "
        + ", ".join(p.name for p in EXPERIMENTS),
    )
    p.add_argument(
        "--define-policy",
        action="append",
        metavar="NAME:SECTION.KEY=VALUE[,...]",
        help="another of our router's settings to run as a policy, e.g. "
        "'prefix_t05:routing.follow_threshold=0.5' (repeatable; replicated with --replicas)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=("closed", "open"),
        default=["closed"],
        help="closed loop and/or open loop (Poisson) for the workloads (default: closed)",
    )
    p.add_argument(
        "--open-duration",
        type=float,
        default=60.0,
        help="open loop: stop arrivals after this many seconds (default: %(default)s)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="also run the replicated policies (ours, SGLang) as this many routers behind round "
        "robin (default: %(default)s, none)",
    )
    p.add_argument(
        "--replicas-shared",
        action="store_true",
        help="with --replicas: also ours with routing.shared_state_url on a loopback redis-server",
    )
    p.add_argument(
        "--shared-state-url",
        metavar="URL",
        help="with --replicas-shared: use this Redis (redis://host:port/db) instead of starting one",
    )
    p.add_argument(
        "--diagnose",
        metavar="DIR",
        help="write each run's requests (backend, sim engine reached, cached tokens, times) as JSON into DIR",
    )
    p.add_argument("--no-sglang", action="store_true", help="skip SGLang's router even if installed")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="replay a Mooncake-format trace (JSON lines); alone, it "
        "runs the trace only, with --workloads those too",
    )
    p.add_argument(
        "--trace-limit", type=int, default=0, help="the trace's first N requests (1500, --quick 500)"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=0.1,
        help="replay the trace at its times x this (0.1: ten times faster) (default: %(default)s)",
    )
    p.add_argument(
        "--trace-max-output",
        type=int,
        default=16,
        help="cap each trace request's output tokens (default: %(default)s)",
    )
    p.add_argument(
        "--trace-block-tokens",
        type=int,
        default=0,
        help="tokens per hash id (default: from a 'blksz_N' file name, else Mooncake's 512)",
    )
    p.add_argument(
        "--trace-time-unit-s",
        type=float,
        default=0.0,
        help="seconds per timestamp unit (default: 1 when records carry chat_id, else 0.001)",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        metavar="URL",
        help="run against these external OpenAI servers (e.g. vLLM) instead of the sim",
    )
    p.add_argument(
        "--reset-url-path",
        metavar="PATH",
        help="with --backends: POST this path on every backend before each run, e.g. "
        "/reset_prefix_cache (vLLM with VLLM_SERVER_DEV_MODE=1)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH_OR_NAME",
        help="with --backends (vLLM): the served model's tokenizer (needs transformers); the oracle then "
        "runs on the engines' own tokens, block size and KV blocks from their vllm:cache_config_info",
    )
    p.add_argument(
        "--prompt-scale",
        type=float,
        default=1.0,
        help="multiply every prompt size, e.g. 0.25 for a small model's context (default: %(default)s)",
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="the model name requests carry (default: %(default)s)"
    )
    p.add_argument(
        "--api",
        choices=("chat", "responses", "responses-tools"),
        default="chat",
        help="send the workloads' conversations as chat completions, or through the Responses API as a "
        "client keeping no state on the server does (store: false, the whole history as input; the sim "
        "only); responses-tools: as an agent's turns, each answer a function call and each later "
        "question its output (default: %(default)s)",
    )
    return p  # fmt: skip


def main() -> int:
    return asyncio.run(run(build_parser().parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
