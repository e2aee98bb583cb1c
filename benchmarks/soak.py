"""Soak: RSS stays flat and the event loop stays responsive over 100,000 mixed requests.

One run starts, each as its own process on 127.0.0.1:
- fake vLLM backends (benchmarks/_soak_backend.py: echo, SSE streams, 503s, 400s, resets mid-stream);
- the router, `python -m prefix_router serve` with a main and a metrics port, so its RSS is read from
  /proc/PID/status without the load generator's memory;
- a prober that sends `GET /healthz` to the router's main and metrics ports every --probe-interval-ms
  on a kept-alive connection, in its own process so the load generator's loop cannot delay it.

This process then drives --requests requests at --concurrency: ~60% non-streaming chat (the body echoed
back, checked byte for byte), ~25% streams (every event names its own request), ~10% clients that read
two events of a long stream and hang up, ~5% errors (503 from every backend after the router's retries,
invalid JSON answered 400 by the backend, bodies over the router's limit answered 413, and streams the
backend resets mid-way). Prompts have distinct prefixes across --families system prompts x --tenants
tenants plus a unique user turn, so the router's prefix index reaches its bound (--index-entries) in
warm-up; the script computes the key blocks itself and reports the request at which the bound was passed.

It reports RSS after warm-up (--warmup-frac of the requests) and at the end, the growth ratio (target
< 10%), the /healthz latency distribution during the load (target max <= 50 ms), and at the end the
router's in-flight gauges (all 0), its open sockets and file descriptors, and each backend's active
handlers (0: no request is left open behind the router). With --pin (default when there are 2+ CPUs)
the router gets CPU 0 to itself and everything else shares the rest.

--trace-leaks runs the router under tracemalloc (slower) and, at warm-up and at the end, makes it dump
a snapshot and a count of live objects by type (SIGUSR1), then prints what grew in between.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import orjson

from _common import busy_seconds, cpu_seconds, markdown_table, package_version, print_header, report_results

from loopback import free_port, wait_until
from processes import RouterProcess, clean_env, launch_router, start_server, stop_processes

CHAT_PATH = "/v1/chat/completions"
TENANT_HEADER = "x-prefix-cache-key"
HERE = Path(__file__).resolve().parent

# kind -> share of requests. "overlimit", "e503", "badjson" and "reset" make up the ~5% of errors.
MIX: dict[str, float] = {
    "chat": 0.60,
    "stream": 0.25,
    "abort": 0.10,
    "e503": 0.02,
    "badjson": 0.012,
    "reset": 0.01,
    "overlimit": 0.008,
}

# The router's child process: optionally under tracemalloc, dumping a snapshot on SIGUSR1.
_ROUTER_WRAPPER = r"""
import gc, os, signal, sys, tracemalloc
from collections import Counter
out = os.environ["SOAK_TRACE_DIR"]
tracemalloc.start(int(os.environ.get("SOAK_TRACE_FRAMES", "12")))
seq = [0]
def dump(signum, frame):
    gc.collect()
    seq[0] += 1
    tracemalloc.take_snapshot().dump(os.path.join(out, f"snap{seq[0]}.tm"))
    counts = Counter(type(o).__qualname__ for o in gc.get_objects())
    with open(os.path.join(out, f"types{seq[0]}.txt"), "w") as f:
        for name, n in counts.most_common(400):
            f.write(f"{n} {name}\n")
    open(os.path.join(out, f"done{seq[0]}"), "w").close()
signal.signal(signal.SIGUSR1, dump)
from prefix_router.cli import main
sys.exit(main(sys.argv[1:]))
"""


# -- processes ------------------------------------------------------------------------------------


def cpu_list(cpus: set[int] | None) -> str | None:
    return ",".join(map(str, sorted(cpus))) if cpus else None


def start_backends(ports: list[int], cpus: set[int] | None, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(HERE / "_soak_backend.py"), *map(str, ports)]
    return start_server(argv, ports, log, cpus=cpu_list(cpus))


def start_router(
    backend_ports: list[int],
    metrics_port: int,
    config: Path,
    log: Path,
    trace_dir: Path | None,
    cpus: set[int] | None,
) -> RouterProcess:
    flags = ["--config", str(config), "--log-level", "warning"]
    for p in backend_ports:
        flags += ["--backend", f"http://127.0.0.1:{p}"]
    env = clean_env()
    if trace_dir is not None:
        env["SOAK_TRACE_DIR"] = str(trace_dir)
    code = _ROUTER_WRAPPER if trace_dir is not None else None
    router = launch_router(
        flags, log, env=env, cpus=cpu_list(cpus), metrics_port=metrics_port, python_code=code
    )
    try:
        router.wait_ready(timeout_s=180 if trace_dir is not None else 30)  # tracemalloc: imports ~20x slower
    except BaseException:
        router.stop()
        raise
    return router


def write_config(path: Path, args: argparse.Namespace) -> None:
    cfg = {
        "server": {"max_body_bytes": args.max_body_bytes, "drain_timeout_s": 2.0},
        "routing": {"prefix_index_entries": args.index_entries},
        "health": {"interval_s": 1.0},
    }
    path.write_text(json.dumps(cfg))  # JSON is YAML


# -- the router process, seen from outside --------------------------------------------------------


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def hwm_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def sockets_of(pid: int, router_port: int, metrics_port: int, backend_ports: set[int]) -> dict[str, int]:
    """The router's TCP sockets by role and state, from its fds and /proc/PID/net/tcp{,6}."""
    inodes: set[str] = set()
    fds = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        fds += 1
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    states = {"01": "established", "0A": "listen", "06": "time_wait", "08": "close_wait"}
    out: Counter[str] = Counter(fds=fds)
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] not in inodes:
                continue
            local_port = int(cols[1].rsplit(":", 1)[1], 16)
            remote_port = int(cols[2].rsplit(":", 1)[1], 16)
            state = states.get(cols[3], cols[3])
            if state == "listen":
                out["listen"] += 1
            elif remote_port in backend_ports:
                out[f"to_backends_{state}"] += 1
            elif local_port == router_port:
                out[f"from_clients_{state}"] += 1
            elif local_port == metrics_port:
                out[f"metrics_port_{state}"] += 1
            else:
                out[f"other_{state}"] += 1
    return dict(out)


_SAMPLE = re.compile(r"^(prefix_router_[a-z_]+)(?:\{([^}]*)\})? ([0-9.e+-]+)$")


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'([a-z_]+)="([^"]*)"', m.group(2) or ""))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


# -- the /healthz prober (its own process) --------------------------------------------------------


def probe_loop(ports: list[int], interval_s: float, stop: Any, results: Any, max_probes: int) -> None:
    import http.client

    lat: dict[int, list[float]] = {p: [] for p in ports}
    errors: Counter[str] = Counter()
    conns = {p: http.client.HTTPConnection("127.0.0.1", p, timeout=5) for p in ports}
    next_at = time.monotonic()
    for _ in range(max_probes):
        if stop.is_set():
            break
        for p in ports:
            t0 = time.perf_counter()
            try:
                conns[p].request("GET", "/healthz")
                resp = conns[p].getresponse()
                resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException) as exc:
                ok = False
                errors[f"{p}:{type(exc).__name__}"] += 1
                conns[p].close()
                conns[p] = http.client.HTTPConnection("127.0.0.1", p, timeout=5)
            elapsed = time.perf_counter() - t0
            if ok:
                lat[p].append(elapsed)
            else:
                errors[f"{p}:not_ok"] += 1
        next_at += interval_s
        time.sleep(max(0.0, next_at - time.monotonic()))
    for c in conns.values():
        c.close()
    results.put({"latencies": {str(p): v for p, v in lat.items()}, "errors": dict(errors)})


# -- the load ---------------------------------------------------------------------------------------


@dataclass
class Tally:
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    completed: int = 0
    index_bound_at: int | None = None  # the request whose blocks took the distinct count past the bound
    distinct_blocks: set[int] = field(default_factory=set)

    def note(self, kind: str, outcome: str) -> None:
        self.outcomes.setdefault(kind, Counter())[outcome] += 1
        self.completed += 1


class Workload:
    """Deterministic request shapes; each request carries a unique marker checked in its answer."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._rng = random.Random(args.seed)
        kinds = list(MIX)
        weights = [MIX[k] for k in kinds]
        self.kinds = self._rng.choices(kinds, weights, k=args.requests)
        self._families = [
            f"You are assistant #{i}. " + random.Random(i).randbytes(args.system_bytes // 2).hex()
            for i in range(args.families)
        ]
        self._tenants = args.tenants
        self._user_bytes = args.user_bytes
        self._overlimit = args.max_body_bytes + 4096

    def request(self, i: int, kind: str) -> tuple[dict[str, str], bytes, str]:
        marker = f"soak-{i:08d}"
        rng = random.Random(i)
        headers = {
            "content-type": "application/json",
            TENANT_HEADER: f"tenant-{rng.randrange(self._tenants)}",
        }
        system = self._families[rng.randrange(len(self._families))]
        user = marker + " " + rng.randbytes(self._user_bytes // 2).hex()
        doc: dict[str, Any] = {
            "model": "soak-model",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 16,
            "user": marker,
        }
        if kind in ("stream", "abort", "reset"):
            doc["stream"] = True
        if kind == "stream":
            headers["x-soak-chunks"] = "16"
        elif kind == "abort":
            headers["x-soak-chunks"] = "200"
            headers["x-soak-delay-ms"] = "2"
        elif kind == "reset":
            headers["x-soak-chunks"] = "16"
            headers["x-soak-reset-after"] = "3"
        elif kind == "e503":
            headers["x-soak-mode"] = "503"
        body = orjson.dumps(doc)
        if kind == "badjson":
            body = body[: len(body) // 2]  # cut mid-string: not JSON
        elif kind == "overlimit":
            body = body + b" " * (self._overlimit - len(body))
        return headers, body, marker


async def one_request(
    s: aiohttp.ClientSession, url: str, kind: str, headers: dict[str, str], body: bytes, marker: str
) -> str:
    """Send one request; the outcome name ('ok' when the answer is what this kind must get)."""
    try:
        async with s.post(url, data=body, headers=headers) as resp:
            if kind == "chat":
                got = await resp.read()
                if resp.status != 200:
                    return f"status_{resp.status}"
                return "ok" if got == body else "mismatch"
            if kind == "stream":
                got = await resp.read()
                if resp.status != 200:
                    return f"status_{resp.status}"
                events = got.split(b"\n\n")
                want = b'"id":"' + marker.encode() + b'"'
                data = [e for e in events if e.startswith(b"data: {")]
                if (
                    len(data) != 16
                    or not all(want in e for e in data)
                    or not got.endswith(b"data: [DONE]\n\n")
                ):
                    return "mismatch"
                return "ok"
            if kind == "abort":
                if resp.status != 200:
                    return f"status_{resp.status}"
                first = await resp.content.readuntil(b"\n\n")
                await resp.content.readuntil(b"\n\n")
                resp.close()  # hang up mid-stream
                return "ok" if marker.encode() in first else "mismatch"
            if kind == "reset":
                try:
                    got = await resp.read()
                except aiohttp.ClientPayloadError:
                    return "ok"  # truncated, as it must be
                return "not_truncated" if b"[DONE]" in got else "ok"
            await resp.read()
            expected = {"e503": 503, "badjson": 400, "overlimit": 413}[kind]
            return "ok" if resp.status == expected else f"status_{resp.status}"
    except aiohttp.ClientPayloadError:
        return "payload_error"
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
        # A 413 answered before the body was read closes the connection; the client may see the close.
        return "ok_closed" if kind == "overlimit" else f"exc_{type(exc).__name__}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"exc_{type(exc).__name__}"


async def drive(args: argparse.Namespace, router_url: str, router_pid: int, on_warmup: Any) -> dict[str, Any]:
    workload = Workload(args)
    tally = Tally()
    url = router_url + CHAT_PATH
    n = args.requests
    warmup_at = int(n * args.warmup_frac)
    next_i = 0
    samples: list[tuple[float, int, int]] = []
    warm: dict[str, Any] = {}
    key_config = None
    with contextlib.suppress(ImportError):
        from prefix_router.settings import load_settings

        key_config = load_settings(args.config_path, environ=False).key_config()
    started = time.monotonic()
    deadline = started + args.max_seconds

    def count_blocks(i: int, kind: str, headers: dict[str, str], body: bytes) -> None:
        if key_config is None or tally.index_bound_at is not None or kind not in ("chat", "stream", "abort"):
            return
        from prefix_router.routing.keys import extract_key

        key = extract_key(CHAT_PATH, body, headers[TENANT_HEADER], key_config)
        tally.distinct_blocks.update(key.blocks)
        if len(tally.distinct_blocks) > args.index_entries:
            tally.index_bound_at = i
            tally.distinct_blocks.clear()

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal next_i
        while next_i < n and time.monotonic() < deadline:
            i = next_i
            next_i += 1
            kind = workload.kinds[i]
            headers, body, marker = workload.request(i, kind)
            count_blocks(i, kind, headers, body)
            tally.note(kind, await one_request(s, url, kind, headers, body, marker))

    async def sampler() -> None:
        next_report = n // 10
        while True:
            samples.append((time.monotonic() - started, tally.completed, rss_kb(router_pid)))
            if tally.completed >= next_report:
                print(
                    f"  {tally.completed:,} done, router RSS {samples[-1][2] / 1024:.1f} MiB", file=sys.stderr
                )
                next_report += max(1, n // 10)
            if not warm and tally.completed >= warmup_at:
                warm.update(at=tally.completed, t=time.monotonic() - started, rss_kb=rss_kb(router_pid))
                await asyncio.get_running_loop().run_in_executor(None, on_warmup)
            await asyncio.sleep(args.sample_interval_s)

    connector = aiohttp.TCPConnector(limit=args.concurrency, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    sampling = asyncio.get_running_loop().create_task(sampler())
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
            await asyncio.gather(*(worker(s) for _ in range(args.concurrency)))
    finally:
        elapsed = time.monotonic() - started
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
    return {
        "outcomes": {k: dict(v) for k, v in tally.outcomes.items()},
        "completed": tally.completed,
        "elapsed_s": elapsed,
        "warmup": warm,
        "samples": samples,
        "index_bound_at": tally.index_bound_at,
    }


# -- after the load -------------------------------------------------------------------------------


async def final_checks(metrics_url: str, backend_ports: list[int]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(metrics_url + "/metrics") as resp:
            text = await resp.text()
        stats = []
        for p in backend_ports:
            async with s.get(f"http://127.0.0.1:{p}/_soak/stats") as resp:
                stats.append(await resp.json())
    samples = parse_metrics(text)
    inflight = {lab["backend"]: v for name, lab, v in samples if name == "prefix_router_backend_inflight"}

    def total(metric: str, by: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, lab, v in samples:
            if name == metric:
                out[lab.get(by, "")] = out.get(lab.get(by, ""), 0.0) + v
        return dict(out)

    return {
        "inflight": inflight,
        "requests_by_status": total("prefix_router_requests_total", "status_class"),
        "upstream_errors_by_kind": total("prefix_router_upstream_errors_total", "kind"),
        "retries_by_reason": total("prefix_router_retries_total", "reason"),
        "router_errors_by_code": total("prefix_router_errors_total", "code"),
        "client_disconnects": sum(
            v for name, _, v in samples if name == "prefix_router_client_disconnects_total"
        ),
        "backend_stats": stats,
    }


def trace_report(trace_dir: Path, top: int = 25) -> dict[str, Any]:
    import tracemalloc

    first = tracemalloc.Snapshot.load(str(trace_dir / "snap1.tm"))
    last = tracemalloc.Snapshot.load(str(trace_dir / "snap2.tm"))
    flt = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen*")]
    first, last = first.filter_traces(flt), last.filter_traces(flt)
    diff = last.compare_to(first, "traceback")
    grew = []
    for stat in diff[:top]:
        grew.append(
            {
                "size_diff_kb": round(stat.size_diff / 1024, 1),
                "count_diff": stat.count_diff,
                "size_kb": round(stat.size / 1024, 1),
                "traceback": [f"{f.filename}:{f.lineno}" for f in stat.traceback][-8:],
            }
        )

    def types(name: str) -> dict[str, int]:
        out = {}
        for line in (trace_dir / name).read_text().splitlines():
            count, qual = line.split(" ", 1)
            out[qual] = int(count)
        return out

    t1, t2 = types("types1.txt"), types("types2.txt")
    type_growth = sorted(((t2.get(k, 0) - t1.get(k, 0), k) for k in set(t1) | set(t2)), reverse=True)
    return {
        "traced_kb": [
            round(sum(s.size for s in snap.statistics("filename")) / 1024) for snap in (first, last)
        ],
        "top_growth": grew,
        "object_growth": [(k, d) for d, k in type_growth[:25] if d > 0],
    }


def signal_dump(pid: int, trace_dir: Path, seq: int, timeout_s: float = 120) -> None:
    os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: (trace_dir / f"done{seq}").exists(), timeout_s, "the router's snapshot", 0.1)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--quick", action="store_true", help="20,000 requests")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--warmup-frac", type=float, default=0.10)
    p.add_argument("--families", type=int, default=512, help="distinct system prompts")
    p.add_argument("--tenants", type=int, default=256)
    p.add_argument("--system-bytes", type=int, default=1500)
    p.add_argument("--user-bytes", type=int, default=4400, help="unique text per request")
    p.add_argument("--index-entries", type=int, default=50_000, help="the router's prefix index bound")
    p.add_argument("--max-body-bytes", type=int, default=256 * 1024, help="the router's body limit")
    p.add_argument("--probe-interval-ms", type=float, default=100.0)
    p.add_argument("--target-probe-ms", type=float, default=50.0)
    p.add_argument("--target-growth", type=float, default=0.10)
    p.add_argument("--sample-interval-s", type=float, default=0.5)
    p.add_argument("--settle-s", type=float, default=3.0, help="wait after the load before the end figures")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--max-seconds", type=float, default=3600.0, help="stop issuing requests after this")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2)
    p.add_argument("--trace-leaks", action="store_true", help="router under tracemalloc; diff snapshots")
    args = p.parse_args(argv)
    if args.quick:
        args.requests = 20_000
    return args


@dataclass
class Soak:
    """What one soak run measured, from outside the router process and from its /metrics."""

    port: int
    metrics_port: int
    run: dict[str, Any]
    cpu: dict[str, float]
    load_avg: tuple[float, float]
    probes: dict[str, Any]
    rss_start: int
    rss_end: int
    hwm: int
    warm_sockets: dict[str, int]
    end_sockets: dict[str, int]
    checks: dict[str, Any]
    trace: dict[str, Any] | None
    alive: bool


def pin_cpus(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(the router's CPUs, everything else's); this process moves to the latter at once."""
    ncpu = os.cpu_count() or 1
    router_cpus = {0} if pin else None
    other_cpus = set(range(1, ncpu)) if pin else None
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    return router_cpus, other_cpus


def soak(args: argparse.Namespace) -> Soak:
    """Start the backends, the router and the prober, drive the load, measure, stop everything."""
    router_cpus, other_cpus = pin_cpus(args.pin)
    backend_ports = [free_port() for _ in range(args.backends)]
    metrics_port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    args.config_path = tmp / "router.yaml"
    write_config(args.config_path, args)
    trace_dir = tmp if args.trace_leaks else None
    children: list[subprocess.Popen[bytes]] = []
    prober = None
    ctx = mp.get_context("spawn")
    stop_probe = ctx.Event()
    probe_results = ctx.Queue()
    try:
        backends = start_backends(backend_ports, other_cpus, tmp / "backends.log")
        children.append(backends)
        router = start_router(
            backend_ports, metrics_port, args.config_path, tmp / "router.log", trace_dir, router_cpus
        )
        children.append(router.proc)
        port = router.port
        print(f"- router pid {router.pid}, backends on ports {backend_ports}, temp dir {tmp}", flush=True)
        rss_start = rss_kb(router.pid)
        cpu0, load_cpu0, backends_cpu0 = (
            cpu_seconds(router.pid),
            time.process_time(),
            cpu_seconds(backends.pid),
        )
        busy0, load_avg0 = busy_seconds(), os.getloadavg()[0]
        max_probes = int(args.max_seconds * 1000 / args.probe_interval_ms) + 10
        prober = ctx.Process(
            target=probe_loop,
            args=([port, metrics_port], args.probe_interval_ms / 1000, stop_probe, probe_results, max_probes),
            daemon=True,
        )
        prober.start()

        warm_sockets: dict[str, int] = {}

        def on_warmup() -> None:
            warm_sockets.update(sockets_of(router.pid, port, metrics_port, set(backend_ports)))
            if trace_dir is not None:
                signal_dump(router.pid, trace_dir, 1)

        run = asyncio.run(drive(args, router.url, router.pid, on_warmup))
        cpu = {
            "router": cpu_seconds(router.pid) - cpu0,
            "backends": cpu_seconds(backends.pid) - backends_cpu0,
            "load_generator": time.process_time() - load_cpu0,
        }
        # What the rest of the machine took meanwhile (other jobs compete for the same CPUs).
        cpu["everything_else"] = max(0.0, busy_seconds() - busy0 - sum(cpu.values()))
        load_avg = (load_avg0, os.getloadavg()[0])
        stop_probe.set()
        probes = probe_results.get(timeout=30)
        prober.join(10)
        time.sleep(args.settle_s)
        rss_end = rss_kb(router.pid)
        end_sockets = sockets_of(router.pid, port, metrics_port, set(backend_ports))
        checks = asyncio.run(final_checks(f"http://127.0.0.1:{metrics_port}", backend_ports))
        hwm = hwm_kb(router.pid)
        trace = None
        if trace_dir is not None:
            signal_dump(router.pid, trace_dir, 2)
            trace = trace_report(trace_dir)
        alive = router.proc.poll() is None
    finally:
        if prober is not None and prober.is_alive():
            stop_probe.set()
            prober.join(5)
            if prober.is_alive():
                prober.kill()
        stop_processes(children)
    return Soak(
        port, metrics_port, run, cpu, load_avg, probes, rss_start, rss_end, hwm,
        warm_sockets, end_sockets, checks, trace, alive,
    )  # fmt: skip


def mix_table(run: dict[str, Any]) -> tuple[str, int]:
    """The outcome of each kind of request, and how many were not as expected."""
    rows = []
    bad = 0
    for kind in MIX:
        got = run["outcomes"].get(kind, {})
        total = sum(got.values())
        good = got.get("ok", 0) + got.get("ok_closed", 0)
        bad += total - good
        others = ", ".join(f"{k} {v}" for k, v in sorted(got.items()) if k not in ("ok", "ok_closed"))
        share = f"{100 * total / max(1, run['completed']):.1f}%"
        rows.append([kind, total, share, good, others or "–"])
    return markdown_table(["kind", "requests", "share", "as expected", "other outcomes"], rows), bad


def probe_summaries(args: argparse.Namespace, m: Soak) -> dict[str, dict[str, Any]]:
    out = {}
    for label, p in (("main port /healthz", m.port), ("metrics port /healthz", m.metrics_port)):
        ms = [v * 1000 for v in m.probes["latencies"][str(p)]]
        out[label] = {
            "count": len(ms),
            "p50_ms": statistics.median(ms) if ms else None,
            "p99_ms": pct(ms, 0.99),
            "max_ms": max(ms) if ms else None,
            "over_target": sum(1 for v in ms if v > args.target_probe_ms),
        }
    return out


def probe_table(args: argparse.Namespace, summaries: dict[str, dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}"

    rows = [
        [label, s["count"], ms(s["p50_ms"]), ms(s["p99_ms"]), ms(s["max_ms"]), s["over_target"]]
        for label, s in summaries.items()
    ]
    head = ["probe", "probes", "p50 ms", "p99 ms", "max ms", f"> {args.target_probe_ms:g} ms"]
    return markdown_table(head, rows)


def resources_table(args: argparse.Namespace, m: Soak, growth: float | None) -> str:
    warm = m.run["warmup"]
    checks = m.checks
    inflight_nonzero = {k: v for k, v in checks["inflight"].items() if v}
    bound_at = m.run["index_bound_at"]
    rows: list[list[Any]] = [
        ["router RSS at start", f"{m.rss_start / 1024:.1f} MiB"],
        [
            f"router RSS after warm-up ({warm.get('at', 0):,} requests)",
            f"{(warm.get('rss_kb') or 0) / 1024:.1f} MiB",
        ],
        [f"router RSS at the end (+{args.settle_s:g} s)", f"{m.rss_end / 1024:.1f} MiB"],
        ["RSS growth after warm-up", f"{100 * growth:+.2f}%" if growth is not None else "–"],
        ["router peak RSS (VmHWM)", f"{m.hwm / 1024:.1f} MiB"],
        ["prefix index bound passed at request", f"{bound_at:,}" if bound_at else "never"],
        ["router fds (warm-up → end)", f"{m.warm_sockets.get('fds')} → {m.end_sockets.get('fds')}"],
        [
            "router sockets at the end",
            ", ".join(f"{k} {v}" for k, v in sorted(m.end_sockets.items()) if k != "fds"),
        ],
        ["prefix_router_backend_inflight ≠ 0", inflight_nonzero or "none"],
        ["backend handlers still active", backend_active(m)],
        ["backend handlers cancelled (client left)", sum(b["cancelled"] for b in checks["backend_stats"])],
        ["router client_disconnects_total", int(checks["client_disconnects"])],
        ["router requests by status class", checks["requests_by_status"]],
        ["router errors by code", checks["router_errors_by_code"]],
        ["retries by reason", checks["retries_by_reason"]],
        ["upstream errors by kind", checks["upstream_errors_by_kind"]],
        ["router alive at the end", m.alive],
    ]
    return markdown_table(["figure", "value"], rows)


def backend_active(m: Soak) -> int:
    return sum(b["active"] for b in m.checks["backend_stats"])


def print_trace(trace: dict[str, Any]) -> None:
    print("\n## tracemalloc: what grew between warm-up and the end (router process)\n")
    print(f"traced KiB at warm-up and end: {trace['traced_kb']}")
    for g in trace["top_growth"][:15]:
        where = " <- ".join(reversed(g["traceback"][-3:]))
        print(f"- {g['size_diff_kb']:+.1f} KiB ({g['count_diff']:+d} blocks): {where}")
    print("\nlive objects by type, growth:", trace["object_growth"][:15])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    versions = {
        "prefix-router": package_version("prefix-router"),
        "aiohttp": package_version("aiohttp"),
        "uvicorn": package_version("uvicorn"),
        "uvloop": package_version("uvloop"),
    }
    header = print_header("Soak: RSS and event-loop responsiveness under mixed load", versions)
    m = soak(args)
    run = m.run
    rss_warm = run["warmup"].get("rss_kb")
    growth = (m.rss_end - rss_warm) / rss_warm if rss_warm else None
    mix, bad = mix_table(run)
    rate = run["completed"] / run["elapsed_s"]
    print(
        f"## Mix ({run['completed']:,} requests in {run['elapsed_s']:.1f} s, {rate:,.0f}/s, "
        f"{args.concurrency} concurrent)"
    )
    print()
    busy = ", ".join(f"{k} {100 * v / run['elapsed_s']:.0f}%" for k, v in m.cpu.items())
    print(f"CPU busy during the load (of one CPU): {busy}; pinned: {args.pin}")
    print(
        "machine load average (1 min) at the start and end of the load: "
        f"{m.load_avg[0]:.2f}, {m.load_avg[1]:.2f}"
    )
    print()
    print(mix)
    print()
    probe_summary = probe_summaries(args, m)
    print(f"## Event loop: /healthz every {args.probe_interval_ms:g} ms during the load")
    print()
    print(probe_table(args, probe_summary))
    if m.probes["errors"]:
        print(f"\nprobe errors: {m.probes['errors']}")
    print()
    print("## Resources")
    print()
    print(resources_table(args, m, growth))
    print()

    verdict = {
        "rss_growth_ok": growth is not None and growth < args.target_growth,
        "loop_ok": all((s["max_ms"] or 1e9) <= args.target_probe_ms for s in probe_summary.values()),
        "no_leaks": not any(m.checks["inflight"].values()) and backend_active(m) == 0,
        "answers_ok": bad == 0 and run["completed"] == args.requests,
    }
    print("## Verdict")
    print()
    print(markdown_table(["check", "pass"], [[k, "yes" if v else "NO"] for k, v in verdict.items()]))
    if m.trace is not None:
        print_trace(m.trace)
    payload = {
        **header,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "mix": MIX,
        "run": {k: v for k, v in run.items() if k != "samples"},
        "rss_samples": run["samples"],
        "rss_kb": {"start": m.rss_start, "warmup": rss_warm, "end": m.rss_end, "hwm": m.hwm},
        "rss_growth": growth,
        "cpu_s": m.cpu,
        "load_average": m.load_avg,
        "probes": probe_summary,
        "probe_errors": m.probes["errors"],
        "sockets": {"warmup": m.warm_sockets, "end": m.end_sockets},
        "checks": m.checks,
        "trace": m.trace,
        "verdict": verdict,
    }
    report_results("soak", payload)
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
