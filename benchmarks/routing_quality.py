"""Routing quality on a simulated vLLM fleet: policies x workloads, closed and open loop.

Real HTTP end to end: this process runs the simulated fleet and the load driver; each router (ours,
one per policy variant, or SGLang's cache_aware when `sglang_router` is installed) runs as its own
subprocess on 127.0.0.1, started fresh for every run so no run inherits another's prefix index.
Per cell: hit rate (the backends' own counters) against the oracle, TTFT p50/p99, throughput,
max/mean load, peak in-flight, overflow share, and for the tenants workload the stickiness of each
(tenant, prompt) pair (share of its requests on its most-used backend; min and mean over pairs) and
the pairs' spread (distinct backends holding their placements / fleet).

The simulated fleet (per workload, see `fleet_config`): prefill 0.25 ms per uncached token (the
llm-d-inference-sim example figure; a cold 2k-token prefix costs ~0.5 s, a warm one ~60 ms), a KV
cache that fits ~2x a fair share of the workload's prefixes plus the running prompts, and
max_num_seqs 8, so a backend given more than its share queues and its TTFT shows it.

    python benchmarks/routing_quality.py            # default: ~19 minutes on 2 cores (100 runs), more if busy
    python benchmarks/routing_quality.py --quick    # about half that
    python benchmarks/routing_quality.py --workloads long_context --policies prefix --closed-only
    # the fleet listens on fixed ports (18600..), so every run has the same ring layout; another
    # --base-port is another layout, --base-port 0 a random one per workload
    python benchmarks/routing_quality.py --workloads shared_prefix --policies prefix prefix_nohold \
        --closed-only --base-port 19600
    # real vLLM: no oracle; every (policy, mode) run gets its own workload seed so it cannot hit what an
    # earlier run cached, and --reset-url-path empties the caches too (vLLM needs VLLM_SERVER_DEV_MODE=1);
    # --prompt-scale 0.25 shrinks every prompt for a small model's context window
    python benchmarks/routing_quality.py --backends http://gpu1:8000 http://gpu2:8000 --model MODEL \
        --reset-url-path /reset_prefix_cache --prompt-scale 0.25
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from prefix_router import __version__
from prefix_router.sim.config import SimConfig
from prefix_router.sim.fleet import SimFleet
from prefix_router.sim.loadgen import RunSummary, Target, balanced_placement, client_session, measure
from prefix_router.sim.workloads import (
    DEFAULT_MODEL,
    Workload,
    cache_sensitive_config,
    hot_prefix,
    long_context,
    multi_turn,
    oracle_hit_rate,
    shared_prefix,
    tenants,
)

RESULTS_DIR = Path(__file__).parent / "results"
MAX_NUM_SEQS = 8  # per simulated backend; the router's max_inflight is twice this
ROUTER_MAX_INFLIGHT = 16
# The sim fleet listens on DEFAULT_BASE_PORT, +1, ...: the router hashes backend URLs onto its ring, so
# fixed ports give every run and policy the same ring layout (random ports made single runs noisy).
DEFAULT_BASE_PORT = 18600


@dataclass(frozen=True)
class PolicySpec:
    name: str
    settings: dict[str, Any]  # router settings overrides (ours); empty for sglang
    sglang: bool = False
    static: bool = False  # no router: the driver sends each group to a fixed, balanced backend


POLICIES: tuple[PolicySpec, ...] = (
    PolicySpec("random", {"balancing": {"policy": "random"}}),
    PolicySpec("round_robin", {"balancing": {"policy": "round_robin"}}),
    PolicySpec("least_loaded", {"balancing": {"policy": "least_loaded"}}),
    PolicySpec("prefix_nospill", {"balancing": {"policy": "prefix", "spill": False}}),
    PolicySpec("prefix", {"balancing": {"policy": "prefix"}}),  # the router's defaults: prefill hold on
    # The prefill hold off (routing.prefill_wait_s 0), to isolate its effect.
    PolicySpec("prefix_nohold", {"balancing": {"policy": "prefix"}, "routing": {"prefill_wait_s": 0}}),
    PolicySpec("prefix_ring", {"balancing": {"policy": "prefix"}, "routing": {"prefix_index": False}}),
    # A settings experiment, not a default: a looser bound (c = 2) spills less at small in-flight counts.
    PolicySpec("prefix_c2", {"balancing": {"policy": "prefix", "load_factor": 2.0}}),
)
HOLD_OFF = frozenset(p.name for p in POLICIES if p.settings.get("routing", {}).get("prefill_wait_s", 1) == 0)
SGLANG = PolicySpec("sglang_cache_aware", {}, sglang=True)
# A reference, not a router: every group on one backend, groups balanced by their (known) request
# counts. Under the same concurrency it shows what the serial oracle cannot: prompts that start while
# their prefix is still being prefilled miss whatever the placement. (Not "ideal" for hot_prefix,
# whose hot group it leaves on one backend.)
STATIC = PolicySpec("static_balanced", {}, static=True)
# Settings a user could choose, run only when named with --policies (not part of the default grid).
EXPERIMENTS: tuple[PolicySpec, ...] = (
    PolicySpec("prefix_floor0", {"balancing": {"policy": "prefix", "load_floor": 0}}),  # before 1baad94
    PolicySpec("prefix_floor16", {"balancing": {"policy": "prefix", "load_floor": 16}}),
    PolicySpec(
        "prefix_floor16_c2", {"balancing": {"policy": "prefix", "load_floor": 16, "load_factor": 2.0}}
    ),
    PolicySpec(
        "prefix_ring_floor16",
        {"balancing": {"policy": "prefix", "load_floor": 16}, "routing": {"prefix_index": False}},
    ),
    PolicySpec(
        "prefix_ring_c2",
        {"balancing": {"policy": "prefix", "load_factor": 2.0}, "routing": {"prefix_index": False}},
    ),
)


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload, the shape of the fleet it runs on, and how it is driven."""

    make: Callable[[int], Workload]  # seed offset -> the workload (offset 0: the reference run)
    prefix_tokens: int  # the shared prefix of a group (sizes the cache)
    prompt_tokens: int  # a typical whole prompt
    groups: int  # distinct prefixes
    concurrency: int
    rate_per_s: float  # open loop
    workload: Workload = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "workload", self.make(0))


def _maker(builder: Callable[..., Workload], seed: int, **kwargs: Any) -> Callable[[int], Workload]:
    return lambda offset: builder(seed=seed + offset, **kwargs)


def build_workloads(quick: bool, prompt_scale: float = 1.0, model: str = DEFAULT_MODEL) -> list[WorkloadSpec]:
    """The five workloads; `prompt_scale` multiplies every prompt size (prefixes, questions, turns)."""
    k = 1 if quick else 2
    groups = 12 if quick else 16
    tenant_count = 16 if quick else 32

    def t(tokens: int) -> int:
        return max(8, round(tokens * prompt_scale))

    return [
        WorkloadSpec(_maker(shared_prefix, 0, groups=groups, prompts_per_group=8 * k, system_tokens=t(2048),
                            question_tokens=t(128), model=model),
                     t(2048), t(2200), groups, 16, 30.0),
        WorkloadSpec(_maker(long_context, 1, documents=4 * k, questions_per_document=8 * k,
                            document_tokens=t(8000), question_tokens=t(64), model=model),
                     t(8000), t(8100), 4 * k, 8, 6.0),
        WorkloadSpec(_maker(multi_turn, 2, conversations=24 * k, system_tokens=t(64),
                            user_median_tokens=t(120), reply_median_tokens=t(200), max_turn_tokens=t(1500),
                            model=model),
                     t(1500), t(3000), 24 * k, 16, 25.0),
        WorkloadSpec(_maker(hot_prefix, 3, requests=160 * k, cold_groups=12 * k, system_tokens=t(1024),
                            question_tokens=t(128), model=model),
                     t(1024), t(1200), 12 * k + 1, 32, 50.0),
        # Many tenants, the same 2 system prompts: each (tenant, prompt) pair is one placement. 30 req/s
        # open loop: 40 saturated the 4-backend fleet (a queueing test, not a placement one).
        WorkloadSpec(_maker(tenants, 4, tenant_count=tenant_count, requests_per_tenant=6 * k,
                            shared_prompts=2, system_tokens=t(1024), question_tokens=t(64), model=model),
                     t(1024), t(1100), 2 * tenant_count, 16, 30.0),
    ]  # fmt: skip


def fleet_config(spec: WorkloadSpec, backends: int) -> SimConfig:
    return cache_sensitive_config(
        prefix_tokens=spec.prefix_tokens,
        prompt_tokens=spec.prompt_tokens,
        prefixes_per_backend=2 * spec.groups / backends,
        running_per_backend=min(MAX_NUM_SEQS, math.ceil(spec.concurrency / backends) + 2),
        max_num_seqs=MAX_NUM_SEQS,
    )


# -- routers as subprocesses ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def sim_fleet(config: SimConfig, count: int, base_port: int) -> AsyncIterator[SimFleet]:
    """The sim fleet on base_port.. (one ring layout for every run); ephemeral ports, with a warning,
    when one of them is busy (or base_port is 0)."""
    fleet = SimFleet(config, count=count, base_port=base_port)
    try:
        await fleet.start()
    except OSError as exc:
        if not base_port:
            raise
        print(f"WARNING: ports {base_port}..{base_port + count - 1} unavailable ({exc}); the fleet takes "
              "ephemeral ports, so this run's ring layout differs from other runs'", flush=True)  # fmt: skip
        fleet = SimFleet(config, count=count, base_port=0)
        await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"router not ready at {url}")


def router_command(policy: PolicySpec, urls: list[str], port: int, workdir: Path) -> list[str]:
    if policy.sglang:
        return [
            sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
        ]  # fmt: skip
    config: dict[str, Any] = {
        # backend_header: the tenants workload's stickiness is read from it
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning", "backend_header": True},
        "backends": [{"url": u} for u in urls],
        "balancing": {"max_inflight": ROUTER_MAX_INFLIGHT},
        "health": {"interval_s": 2.0},
    }
    for section, values in policy.settings.items():
        config.setdefault(section, {}).update(values)
    path = workdir / f"router-{policy.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "prefix_router", "serve", "--config", str(path)]


@contextlib.asynccontextmanager
async def router_process(
    session: aiohttp.ClientSession, policy: PolicySpec, urls: list[str], workdir: Path
) -> AsyncIterator[tuple[str, list[str]]]:
    port = free_port()
    cmd = router_command(policy, urls, port, workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIX_ROUTER_")}
    # Opening a local file and spawning a process do not block the loop for long; benchmark code.
    log = open(workdir / f"router-{policy.name}.log", "ab")  # noqa: SIM115, ASYNC230 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)  # noqa: ASYNC220
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(session, base + ("/readiness" if policy.sglang else "/readyz"), proc)
        if policy.sglang:
            await asyncio.sleep(1.0)  # its workers register asynchronously after /readiness
        yield base, cmd
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def sglang_available() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


# -- runs -----------------------------------------------------------------------------------------------


@dataclass
class Cell:
    workload: str
    policy: str
    mode: str  # closed | open
    summary: RunSummary
    command: str
    extra: dict[str, Any] = field(default_factory=dict)


async def run_cell(
    session: aiohttp.ClientSession,
    policy: PolicySpec,
    spec: WorkloadSpec,
    urls: list[str],
    mode: str,
    oracle: float | None,
    workdir: Path,
    args: argparse.Namespace,
) -> Cell:
    sim = not args.backends
    # External backends keep their caches between runs: each (policy, mode) run gets its own seed, so
    # no run hits prefixes an earlier one left (and --reset-url-path, when given, empties them too).
    offset = 0 if sim else run_seed_offset(policy.name, mode)
    workload = spec.make(offset) if offset else spec.workload
    target = Target(base_url="", backend_urls=tuple(urls), sim=sim,
                    reset_path=None if sim else args.reset_url_path)  # fmt: skip
    extra = {"workload_seed": workload.params.get("seed"), "workload_params": workload.params,
             "backend_urls": urls}  # fmt: skip

    async def drive(run_target: Target) -> RunSummary:
        summary, _ = await measure(
            session,
            run_target,
            workload,
            concurrency=spec.concurrency if mode == "closed" else None,
            rate_per_s=spec.rate_per_s if mode == "open" else None,
            max_duration_s=args.open_duration,
            oracle_hit_rate=oracle,
        )
        return summary

    if policy.static:
        routes = balanced_placement(workload, urls)
        summary = await drive(dataclasses.replace(target, base_url=urls[0], routes=routes))
        return Cell(
            workload.name, policy.name, mode, summary, "(no router: static balanced placement)", extra
        )
    async with router_process(session, policy, urls, workdir) as (base, cmd):
        summary = await drive(dataclasses.replace(target, base_url=base))
    return Cell(workload.name, policy.name, mode, summary, shlex.join(cmd), extra)


def run_seed_offset(policy: str, mode: str) -> int:
    """A workload seed offset per (policy, mode), stable whatever --policies selects."""
    names = [p.name for p in (*POLICIES, SGLANG, *EXPERIMENTS, STATIC)]
    return 100 * (1 + 2 * names.index(policy) + (mode == "open"))


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _holds(cell: Cell) -> str:
    """prefix_router_prefill_waits_total over the run: ready/timeout ('-' when the hold is off or the
    endpoint is not our router)."""
    s = cell.summary
    if s.overflow_share is None or cell.policy in HOLD_OFF:
        return "-"
    return f"{s.prefill_waits.get('ready', 0):.0f}/{s.prefill_waits.get('timeout', 0):.0f}"


def markdown_table(cells: list[Cell]) -> str:
    head = (
        "| workload | mode | policy | hit rate | oracle | hit/oracle | TTFT p50 ms | TTFT p99 ms | req/s "
        "| max/mean load | peak in-flight | overflow | holds ready/timeout | sticky min | sticky mean "
        "| spread | errors |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        s = c.summary
        peak = max(s.peak_inflight.values()) if s.peak_inflight else None
        lines.append(
            f"| {c.workload} | {c.mode} | {c.policy} | {s.hit_rate:.1%} | {_pct(s.oracle_hit_rate)} "
            f"| {_pct(s.oracle_ratio)} | {_ms(s.ttft_p50_s)} | {_ms(s.ttft_p99_s)} | {s.throughput_rps:.1f} "
            f"| {s.max_mean_load:.2f} | {'-' if peak is None else peak} | {_pct(s.overflow_share)} "
            f"| {_holds(c)} "
            f"| {_pct(s.tenant_stickiness_min)} | {_pct(s.tenant_stickiness_mean)} | {_pct(s.tenant_spread)} "
            f"| {s.errors} |"
        )
    return "\n".join(lines)


def plot(cells: list[Cell], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): skipping plots")
        return []
    written: list[Path] = []
    for mode in ("closed", "open"):
        chosen = [c for c in cells if c.mode == mode]
        if not chosen:
            continue
        workloads = list(dict.fromkeys(c.workload for c in chosen))
        policies = list(dict.fromkeys(c.policy for c in chosen))
        fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
        width = 0.8 / len(policies)
        for i, policy in enumerate(policies):
            by_w = {c.workload: c.summary for c in chosen if c.policy == policy}
            xs = [w + i * width for w in range(len(workloads))]
            axes[0].bar(xs, [(by_w[w].oracle_ratio or 0) if w in by_w else 0 for w in workloads], width,
                        label=policy)  # fmt: skip
            axes[1].bar(xs, [(by_w[w].ttft_p50_s or 0) * 1000 if w in by_w else 0 for w in workloads], width,
                        label=policy)  # fmt: skip
        for ax, title in zip(axes, ("hit rate / oracle", "TTFT p50 (ms)"), strict=True):
            ax.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))], workloads)
            ax.set_title(f"{title}, {mode} loop")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        path = out.with_name(f"{out.stem}-{mode}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# -- targets -------------------------------------------------------------------------------------------


def check_targets(cells: list[Cell]) -> list[str]:
    """Each target of the issue, met or missed, with its figures (closed-loop cells)."""
    get: Callable[[str, str], RunSummary | None] = lambda w, p: next(  # noqa: E731
        (c.summary for c in cells if c.workload == w and c.policy == p and c.mode == "closed"), None
    )
    out: list[str] = []

    def verdict(ok: bool, text: str) -> None:
        out.append(f"- [{'met' if ok else 'MISSED'}] {text}")

    for w in ("shared_prefix", "long_context"):
        ours, rnd, sgl = get(w, "prefix"), get(w, "random"), get(w, "sglang_cache_aware")
        if ours is None or rnd is None:
            continue
        r = ours.oracle_ratio or 0
        ref = get(w, STATIC.name)
        ref_text = ""
        if ref is not None and ref.hit_rate:
            ref_text = (f"; static balanced placement {ref.hit_rate:.1%} = {ref.oracle_ratio or 0:.0%} of "
                        f"oracle, ours {ours.hit_rate / ref.hit_rate:.0%} of it")  # fmt: skip
        verdict(r >= 0.95, f"{w}: hit rate {ours.hit_rate:.1%} = {r:.0%} of oracle (target >= 95%){ref_text}")
        if ours.ttft_p50_s and rnd.ttft_p50_s:
            x = rnd.ttft_p50_s / ours.ttft_p50_s
            verdict(x >= 3, f"{w}: TTFT p50 {x:.1f}x lower than random (target >= 3x)")
        if sgl is not None:
            text = f"{w}: hit rate {ours.hit_rate:.1%} vs SGLang cache_aware {sgl.hit_rate:.1%}"
            verdict(ours.hit_rate >= sgl.hit_rate, text)
    ours, ring = get("multi_turn", "prefix"), get("multi_turn", "prefix_ring")
    if ours is not None:
        r = ours.oracle_ratio or 0
        ring_r = f"; plain ring {ring.oracle_ratio or 0:.0%}" if ring is not None else ""
        verdict(r >= 0.90, f"multi_turn: hit rate {r:.0%} of oracle (target >= 90%){ring_r}")
    ours, ll = get("hot_prefix", "prefix"), get("hot_prefix", "least_loaded")
    if ours is not None and ll is not None:
        peak = max(ours.peak_inflight.values()) if ours.peak_inflight else 0
        verdict(
            peak <= ROUTER_MAX_INFLIGHT,
            f"hot_prefix: peak in-flight {peak} (max_inflight {ROUTER_MAX_INFLIGHT})",
        )
        if ours.ttft_p99_s and ll.ttft_p99_s:
            x = ours.ttft_p99_s / ll.ttft_p99_s
            verdict(x <= 1.3, f"hot_prefix: TTFT p99 {x:.2f}x least_loaded's (target <= 1.3x)")
        r = ours.oracle_ratio or 0
        verdict(r >= 0.80, f"hot_prefix: hit rate {r:.0%} of oracle (target >= 80%)")
    ours = get("tenants", "prefix")
    if ours is not None and ours.tenant_stickiness_min is not None:
        text = (
            f"tenants: least sticky (tenant, prompt) pair {ours.tenant_stickiness_min:.0%} on its top "
            f"backend, mean {ours.tenant_stickiness_mean or 0:.0%} over {ours.tenant_pairs} pairs"
        )
        verdict(ours.tenant_stickiness_min >= 0.99, text)
        verdict((ours.tenant_spread or 0) >= 0.99 and ours.max_mean_load <= 1.5,
                f"tenants: the pairs' top backends cover {ours.tenant_spread:.0%} of the fleet, max/mean "
                f"load {ours.max_mean_load:.2f}")  # fmt: skip
    out += hold_effect(cells)
    return out


def hold_effect(cells: list[Cell]) -> list[str]:
    """prefix (prefill hold on) against prefix_nohold, per workload and mode: not targets, context."""
    out: list[str] = []
    for c in cells:
        if c.policy != "prefix":
            continue
        off = next((o.summary for o in cells if o.policy == "prefix_nohold" and o.workload == c.workload
                    and o.mode == c.mode), None)  # fmt: skip
        if off is None:
            continue
        on = c.summary
        gain = (on.hit_rate - off.hit_rate) * 100
        out.append(
            f"- [hold] {c.workload} {c.mode}: hit {on.hit_rate:.1%} vs {off.hit_rate:.1%} without the hold "
            f"({gain:+.1f} pt; {_pct(on.oracle_ratio)} vs {_pct(off.oracle_ratio)} of oracle), "
            f"TTFT p50 {_ms(on.ttft_p50_s)} vs {_ms(off.ttft_p50_s)} ms, "
            f"p99 {_ms(on.ttft_p99_s)} vs {_ms(off.ttft_p99_s)} ms, "
            f"{on.throughput_rps:.1f} vs {off.throughput_rps:.1f} req/s; holds ready/timeout {_holds(c)}"
        )
    return out


# -- main -----------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    # SGLang's router probes workers with an HTTP/2 preface first; the sim's aiohttp logs each one.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    if args.prompt_scale <= 0:
        raise SystemExit("--prompt-scale must be positive")
    if args.reset_url_path and not args.backends:
        raise SystemExit("--reset-url-path applies to --backends (the sim is always reset)")
    specs = build_workloads(args.quick, args.prompt_scale, args.model)
    if args.workloads:
        specs = [s for s in specs if s.workload.name in args.workloads]
    policies = [p for p in POLICIES if not args.policies or p.name in args.policies]
    policies += [p for p in EXPERIMENTS if args.policies and p.name in args.policies]
    if not args.policies or STATIC.name in args.policies:
        policies.append(STATIC)
    known = {p.name for p in (*POLICIES, *EXPERIMENTS, SGLANG, STATIC)}
    if unknown := sorted(set(args.policies or ()) - known):
        raise SystemExit(f"unknown policies {unknown}; known: {sorted(known)}")
    if not args.no_sglang and sglang_available() and (not args.policies or SGLANG.name in args.policies):
        policies.append(SGLANG)
    elif not args.no_sglang:
        print("sglang_router is not installed (pip install sglang-router): no SGLang column")
    modes = ["closed"] if args.closed_only else ["closed", "open"]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS_DIR / f"routing_quality-{stamp}"
    cells: list[Cell] = []
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"prefix-router {__version__}")  # fmt: skip
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    with tempfile.TemporaryDirectory(prefix="routing-quality-") as tmp:
        workdir = Path(tmp)
        async with client_session() as session:
            for spec in specs:
                cells += await run_workload(session, spec, policies, modes, workdir, args)
                print(markdown_table([c for c in cells if c.workload == spec.workload.name]), flush=True)
    table = markdown_table(cells)
    targets = check_targets(cells)
    print("\n" + table + "\n\nTargets:\n" + "\n".join(targets))
    doc = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()
        },
        "cells": [
            {"workload": c.workload, "policy": c.policy, "mode": c.mode, "router_command": c.command,
             **c.extra, **c.summary.as_dict()}
            for c in cells
        ],
        "targets": targets,
    }  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    out.with_suffix(".md").write_text(table + "\n\nTargets:\n" + "\n".join(targets) + "\n")
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    for path in plot(cells, out):
        print(f"wrote {path}")
    return 0


async def run_workload(
    session: aiohttp.ClientSession,
    spec: WorkloadSpec,
    policies: list[PolicySpec],
    modes: list[str],
    workdir: Path,
    args: argparse.Namespace,
) -> list[Cell]:
    name = spec.workload.name
    cells: list[Cell] = []
    if args.backends:
        urls = list(args.backends)
        oracle = None
        print(f"\n== {name}: {spec.workload.description}; external backends {urls} (no oracle)")
        fleet_ctx: Any = contextlib.nullcontext()
        cfg = None
    else:
        cfg = fleet_config(spec, args.fleet)
        fleet_ctx = sim_fleet(cfg, args.fleet, args.base_port)
    async with fleet_ctx as fleet:
        if fleet is not None:
            urls = fleet.urls
            total = cfg.capacity_blocks * args.fleet if cfg else None
            oracle = oracle_hit_rate(spec.workload, block_size=16, capacity_blocks=total).hit_rate
            print(f"\n== {name}: {spec.workload.description}; {args.fleet} sim backends {urls}, "
                  f"{cfg.capacity_blocks if cfg else '?'} KV blocks each, max_num_seqs {MAX_NUM_SEQS}; "
                  f"oracle {oracle:.1%}", flush=True)  # fmt: skip
        for mode in modes:
            for policy in policies:
                t0 = time.monotonic()
                cell = await run_cell(session, policy, spec, urls, mode, oracle, workdir, args)
                s = cell.summary
                print(f"  {mode:6} {policy.name:20} hit {s.hit_rate:6.1%}  p50 {_ms(s.ttft_p50_s):>5} ms  "
                      f"p99 {_ms(s.ttft_p99_s):>5} ms  {s.throughput_rps:5.1f} req/s  errors {s.errors}  "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
                print(f"    router: {cell.command}")
                print(f"    reproduce: {reproduce_command(args, name, policy.name, mode)}")
                cells.append(cell)
    return cells


def reproduce_command(args: argparse.Namespace, workload: str, policy: str, mode: str) -> str:
    cmd = [sys.executable, "benchmarks/routing_quality.py", "--workloads", workload, "--policies", policy]
    if args.quick:
        cmd.append("--quick")
    if args.prompt_scale != 1.0:
        cmd += ["--prompt-scale", str(args.prompt_scale)]
    if args.model != DEFAULT_MODEL:
        cmd += ["--model", args.model]
    if mode == "closed":
        cmd.append("--closed-only")
    if args.backends:
        cmd += ["--backends", *args.backends]
        if args.reset_url_path:
            cmd += ["--reset-url-path", args.reset_url_path]
    else:
        cmd += ["--fleet", str(args.fleet), "--base-port", str(args.base_port)]
    return shlex.join(cmd)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads: a few minutes")
    parser.add_argument("--fleet", type=int, default=4, help="simulated backends (default: %(default)s)")
    parser.add_argument(
        "--backends", nargs="+", metavar="URL",
        help="run against these external OpenAI servers (e.g. vLLM) instead of the sim",
    )  # fmt: skip
    parser.add_argument(
        "--reset-url-path", metavar="PATH",
        help="with --backends: POST this path on every backend before each run, e.g. /reset_prefix_cache "
        "(vLLM with VLLM_SERVER_DEV_MODE=1); without it, runs rely on their distinct workload seeds",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-scale", type=float, default=1.0,
        help="multiply every prompt size, e.g. 0.25 for a small model's context (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="the model name the requests carry (default: %(default)s)"
    )
    parser.add_argument(
        "--base-port", type=int, default=DEFAULT_BASE_PORT,
        help="the sim fleet listens on this port and the next ones, so the ring layout is the same in "
        "every run; 0: ephemeral ports (a different layout each time) (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--workloads", nargs="+", help="only these workloads")
    parser.add_argument(
        "--policies", nargs="+",
        help="only these policies; also the settings experiments, not run by default: "
        + ", ".join(p.name for p in EXPERIMENTS),
    )  # fmt: skip
    parser.add_argument("--closed-only", action="store_true", help="skip the open-loop (Poisson) runs")
    parser.add_argument("--no-sglang", action="store_true", help="skip SGLang's router even if installed")
    parser.add_argument(
        "--open-duration", type=float, default=60.0,
        help="open loop: stop arrivals after this many seconds (default: %(default)s)",
    )  # fmt: skip
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
