"""Many long streams held open through the router: memory per stream, event-loop lag, added delay.

A streaming backend (an SSE event every 50-200 ms per stream, each delay drawn at random, like tokens
of real generations, ~240-byte events, chunked; a subprocess) and a client that opens --streams
concurrent streaming requests and holds them (this process), both on the load CPU; prefix-router as a
subprocess on its own CPU (`prefix-router serve`, limits lifted as below). The same streams run direct
to the backend, then through the router. During the hold it measures:

- every event's delay from the backend's write to the client's read (each event carries its write time
  on CLOCK_MONOTONIC, which both processes share), direct and through the router; the router's added
  delay is the difference of the percentiles;
- the router's RSS (VmRSS) before the streams and at their peak, and so its memory per stream;
- the router's event-loop lag, as the latency of /healthz on its main port (answered in the loop),
  probed every 100 ms on a connection of its own; and this process's own loop lag, which bounds how
  much of any figure is the load generator's.

Each held stream is a socket in the client, one in the backend and two in the router: RLIMIT_NOFILE is
raised to fit where the hard limit allows (streams are capped to what it allows, and the cap printed).
Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    busy_seconds,
    cpu_seconds,
    kernel_cpu_seconds,
    markdown_table,
    package_version,
    print_header,
    report_results,
    runqueue_wait_seconds,
)

from loopback import free_port
from processes import RouterProcess, clean_env, launch_router, start_server, stop_processes

# One event: its write time (perf_counter_ns: CLOCK_MONOTONIC, the same in every process) goes in "t".
EVENT_HEAD = b'data: {"t":'
EVENT_TAIL = (
    b',"id":"chatcmpl-long","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench-model","choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}\n\n'
)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
HEALTH_OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
REQUEST_BODY = (
    b'{"model":"bench-model","stream":true,"max_tokens":100000,'
    b'"messages":[{"role":"user","content":"Tell me a long story."}]}'
)
ROUTER_ENV = {
    # One backend takes every stream here: lift the bounds that exist for GPU batches and for a fleet.
    "PREFIX_ROUTER_BALANCING__MAX_INFLIGHT": "1000000",
    "PREFIX_ROUTER_UPSTREAM__MAX_CONNECTIONS": "1000000",
    "PREFIX_ROUTER_UPSTREAM__MAX_CONNECTIONS_PER_BACKEND": "1000000",
    "PREFIX_ROUTER_SERVER__LOG_LEVEL": "warning",
}


# The router's child process under --trace-loop: a 5 ms timer in its event loop and the garbage
# collector, written down on CLOCK_MONOTONIC (perf_counter, as this process reads it too). For each
# tick more than 10 ms late: how much of the gap the router ran and how much it waited for its CPU
# (/proc/self/schedstat); for each collection: when, how long, which generation.
_LOOP_TRACE_WRAPPER = r"""
import asyncio, gc, json, os, sys, time
out = open(os.environ["LONG_STREAMS_LOOP_TRACE"], "w", buffering=1)
def schedstat():
    with open("/proc/self/schedstat") as f:
        ran, waited = f.read().split()[:2]
    return int(ran) / 1e9, int(waited) / 1e9
gc_started = [0.0]
def on_gc(phase, info):
    now = time.perf_counter()
    if phase == "start":
        gc_started[0] = now
    else:
        out.write(json.dumps(["gc", gc_started[0], now - gc_started[0], info["generation"]]) + "\n")
gc.callbacks.append(on_gc)
def watch(loop, period_s=0.005):
    last = [time.perf_counter(), *schedstat()]
    def tick():
        now = time.perf_counter()
        ran, waited = schedstat()
        late = now - last[0] - period_s
        if late > 0.010:
            out.write(json.dumps(["late", now, late, ran - last[1], waited - last[2]]) + "\n")
        last[:] = [now, ran, waited]
        loop.call_later(period_s, tick)
    loop.call_later(period_s, tick)
import prefix_router.runtime as runtime
tune_gc = runtime.tune_gc
def tune_gc_and_watch():
    tune_gc()
    watch(asyncio.get_running_loop())
runtime.tune_gc = tune_gc_and_watch  # serve() calls it once, in the loop
from prefix_router.cli import main
sys.exit(main(sys.argv[1:]))
"""
TRACE_PERIOD_S = 0.005


def summarize_loop_trace(path: Path, start: float, end: float) -> dict[str, Any]:
    """What the router's late ticks between `start` and `end` were made of (see _LOOP_TRACE_WRAPPER)."""
    late: list[tuple[float, float, float, float]] = []  # (at, late, ran, waited), seconds
    collected: list[tuple[float, float, int]] = []  # (at, took, generation)
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec[0] == "late" and start <= rec[1] <= end:
            late.append((rec[1], rec[2], rec[3], rec[4]))
        elif rec[0] == "gc" and start <= rec[1] <= end:
            collected.append((rec[1], rec[2], rec[3]))
    in_late = sum(
        took for at, took, _ in collected if any(t - gap - TRACE_PERIOD_S <= at <= t for t, gap, _, _ in late)
    )
    ms = 1000.0
    return {
        "late_ticks": len(late),
        "late_ms": sum(gap for _, gap, _, _ in late) * ms,
        "ran_ms": sum(ran for _, _, ran, _ in late) * ms,
        "runqueue_wait_ms": sum(waited for _, _, _, waited in late) * ms,
        "gc_in_late_ms": in_late * ms,
        "gc_collections": [sum(1 for c in collected if c[2] == g) for g in range(3)],
        "gc_longest_ms": max((took for _, took, _ in collected), default=0.0) * ms,
    }


# -- the load: backend and client in one loop, one clock ---------------------------------------------


@dataclass
class Run:
    """What one phase (direct or router) measured."""

    delays: array[float] = field(default_factory=lambda: array("d"))  # seconds
    measuring: bool = False
    heads: int = 0  # streams whose response head arrived
    events: int = 0
    ended: int = 0  # client streams that ended before the run closed them
    failed: int = 0  # streams refused or closed before their head
    first_failure: str = ""
    failures: Counter[str] = field(default_factory=Counter)  # by kind: status line, or how it closed


class StreamBackend(asyncio.Protocol):
    """Answers /health, and any other request with an endless SSE stream, one event every 50-200 ms."""

    def __init__(self, rng: random.Random, interval_ms: tuple[float, float]) -> None:
        self.rng = rng
        self.lo, self.hi = interval_ms[0] / 1000.0, interval_ms[1] / 1000.0
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.timer: asyncio.TimerHandle | None = None
        self.streaming = False
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.streaming:
            return
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end]
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        self.buf = self.buf[end + 4 + length :]
        target = head.split(b" ", 2)[1]
        assert self.transport is not None
        if target.startswith(b"/health"):
            self.transport.write(HEALTH_OK)
            return
        self.streaming = True
        self.transport.write(STREAM_HEAD)
        self.timer = self.loop.call_later(self.rng.uniform(self.lo, self.hi), self.tick)

    def tick(self) -> None:
        assert self.transport is not None
        event = EVENT_HEAD + b"%d" % time.perf_counter_ns() + EVENT_TAIL
        self.transport.write(b"%x\r\n%b\r\n" % (len(event), event))
        self.timer = self.loop.call_later(self.rng.uniform(self.lo, self.hi), self.tick)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


class StreamClient(asyncio.Protocol):
    """One streaming request; every event's arrival time less the write time it carries."""

    def __init__(self, run: Run, stream: int, port: int) -> None:
        self.run = run
        self.stream = stream
        self.port = port
        self.transport: asyncio.Transport | None = None
        self.head_seen = False
        self.rest = b""  # an event not yet whole
        self.established: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = stream = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
        stream.write(
            b"POST /v1/chat/completions?stream=%d HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (self.stream, self.port, len(REQUEST_BODY), REQUEST_BODY)
        )

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        if not self.head_seen:
            end = data.find(b"\r\n\r\n")
            if end < 0 or not data.startswith(b"HTTP/1.1 200"):
                kind = data.split(b"\r\n", 1)[0][:40].decode("latin-1") if end >= 0 else "a head cut short"
                self.fail(f"answer {data[:300]!r}", kind)
                return
            self.head_seen = True
            self.run.heads += 1
            self.established.set_result(None)
            data = data[end + 4 :]
        if self.rest:
            data = self.rest + data
        end = data.rfind(b"\n\n")  # events end with a blank line; chunk framing has none
        whole = end + 2 if end >= 0 else 0
        self.rest = data[whole:]
        run = self.run
        at = data.find(EVENT_HEAD, 0, whole)
        while at >= 0:
            start = at + len(EVENT_HEAD)
            sent = int(data[start : data.find(b",", start)])
            run.events += 1
            if run.measuring:
                run.delays.append((now - sent) / 1e9)
            at = data.find(EVENT_HEAD, start, whole)

    def fail(self, why: str, kind: str) -> None:
        if not self.established.done():
            self.run.failed += 1
            self.run.failures[kind] += 1
            self.run.first_failure = self.run.first_failure or why
            self.established.set_result(None)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.established.done():
            self.fail(f"closed before its head ({exc!r})", f"closed before its head ({type(exc).__name__})")
            return
        if self.transport is not None and not self.transport.is_closing():
            self.run.ended += 1


class HealthProbe(asyncio.Protocol):
    """GET /healthz, one at a time on one kept-alive connection: its latency is the target's loop lag."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        length = 0
        for line in self.buf[:end].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buf) >= end + 4 + length:
            self.buf = self.buf[end + 4 + length :]
            if not self.waiter.done():
                self.waiter.set_result(None)

    async def get(self) -> float:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        self.transport.write(b"GET /healthz HTTP/1.1\r\nhost: router\r\n\r\n")
        await self.waiter
        return time.perf_counter() - start


async def probe_health(port: int, stop: asyncio.Event, out: list[float]) -> None:
    loop = asyncio.get_running_loop()
    _, probe = await loop.create_connection(HealthProbe, "127.0.0.1", port)
    try:
        while not stop.is_set():
            out.append(await probe.get())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
    finally:
        if probe.transport is not None:
            probe.transport.close()


async def watch_own_lag(stop: asyncio.Event, out: list[float]) -> None:
    """How late a 10 ms sleep wakes in this process: the load generator's own share of every delay."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        out.append(time.perf_counter() - start - 0.01)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wakeups(pid: int) -> int:
    """The process's voluntary context switches: how often it slept (in epoll) and was woken."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def run_phase(
    name: str,
    port: int,
    run: Run,
    args: argparse.Namespace,
    backend_pid: int,
    router_pid: int | None,
    loop_trace: Path | None = None,
) -> dict[str, Any]:
    """Open --streams streams to `port`, hold them --hold-s seconds while measuring, then close them."""
    loop = asyncio.get_running_loop()
    clients: list[asyncio.Transport] = []
    rss0 = rss_bytes(router_pid) if router_pid else 0
    ramp_start = time.perf_counter()
    gate = asyncio.Semaphore(args.connect_concurrency)

    async def open_one(i: int) -> None:
        # Held until the stream's head arrives: no more than the gate's worth of connections wait in
        # an accept queue, so none is dropped there and retried a second later.
        async with gate:
            transport, client = await loop.create_connection(
                lambda: StreamClient(run, i, port), "127.0.0.1", port
            )
            clients.append(transport)
            await client.established

    progress = loop.create_task(report_ramp(name, run, args.streams))
    try:
        await asyncio.gather(*(open_one(i) for i in range(args.streams)))
    finally:
        progress.cancel()
    ramp_s = time.perf_counter() - ramp_start
    await asyncio.sleep(args.settle_s)

    stop = asyncio.Event()
    health: list[float] = []
    own_lag: list[float] = []
    watchers = [loop.create_task(watch_own_lag(stop, own_lag))]
    if router_pid:
        watchers.append(loop.create_task(probe_health(port, stop, health)))
    rss_peak = rss0
    events0 = run.events
    busy0, own0 = busy_seconds(), own_cpu_seconds() + cpu_seconds(backend_pid)
    router_cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
    router_sys0 = kernel_cpu_seconds(router_pid) if router_pid else 0.0
    router_wait0 = runqueue_wait_seconds(router_pid) if router_pid else 0.0
    router_wakeups0 = wakeups(router_pid) if router_pid else 0
    # Others on the router's own CPU take it from the router: its run-queue wait says how long.
    router_cpu_id = int(args.router_cpus) if args.router_cpus and args.router_cpus.isdigit() else None
    router_core0 = busy_seconds(router_cpu_id) if router_cpu_id is not None else 0.0
    run.measuring = True
    started = time.perf_counter()
    while time.perf_counter() - started < args.hold_s:
        await asyncio.sleep(0.5)
        if router_pid:
            rss_peak = max(rss_peak, rss_bytes(router_pid))
    run.measuring = False
    held_s = time.perf_counter() - started
    router_cpu = (cpu_seconds(router_pid) - router_cpu0) if router_pid else 0.0
    router_sys = (kernel_cpu_seconds(router_pid) - router_sys0) if router_pid else 0.0
    router_wait = (runqueue_wait_seconds(router_pid) - router_wait0) if router_pid else 0.0
    router_wakeups = (wakeups(router_pid) - router_wakeups0) if router_pid else 0
    on_router_core = busy_seconds(router_cpu_id) - router_core0 if router_cpu_id is not None else None
    own_cpu = own_cpu_seconds() + cpu_seconds(backend_pid) - own0
    others = max(0.0, busy_seconds() - busy0 - own_cpu - router_cpu) / held_s
    fds = open_fds(router_pid) if router_pid else 0
    stop.set()
    await asyncio.gather(*watchers)
    events = run.events - events0
    ended = run.ended
    for transport in clients:
        transport.abort()
    deadline = loop.time() + 60
    while router_pid and open_fds(router_pid) > 64 and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)  # the router closes its side of every stream
    await asyncio.sleep(1.0)

    delays = sorted(run.delays)
    ms = 1000.0
    out: dict[str, Any] = {
        "name": name,
        "streams": args.streams,
        "heads": run.heads,
        "failed": run.failed,
        "first_failure": run.first_failure,
        "failures": dict(run.failures),
        "ended_early": ended,
        "ramp_s": ramp_s,
        "events_per_s": events / held_s,
        "delay_p50_ms": pct(delays, 0.50) * ms,
        "delay_p99_ms": pct(delays, 0.99) * ms,
        "delay_p999_ms": pct(delays, 0.999) * ms,
        "delay_max_ms": delays[-1] * ms if delays else 0.0,
        "loadgen_lag_p99_ms": pct(sorted(own_lag), 0.99) * ms,
        "loadgen_cpus": own_cpu / held_s,
        "router_cpus": router_cpu / held_s,
        "other_cpus": others,
    }
    if router_pid:
        out.update(
            router_rss_before_mib=rss0 / 2**20,
            router_rss_peak_mib=rss_peak / 2**20,
            router_rss_per_stream_kib=(rss_peak - rss0) / args.streams / 1024,
            router_fds=fds,
            router_lag_p50_ms=statistics.median(health) * ms if health else None,
            router_lag_p99_ms=pct(sorted(health), 0.99) * ms if health else None,
            router_lag_max_ms=max(health) * ms if health else None,
            healthz_probes=len(health),
            # CPU per relayed event, from the router's own CPU seconds: robust to what else runs.
            router_us_per_event=router_cpu / max(1, events) * 1e6,
            router_kernel_us_per_event=router_sys / max(1, events) * 1e6,
            router_runqueue_wait=router_wait / held_s,
            router_events_per_wakeup=events / max(1, router_wakeups),
            others_on_router_cpu=(
                max(0.0, on_router_core - router_cpu) / held_s if on_router_core is not None else None
            ),
        )
    if loop_trace is not None:
        out["loop_trace"] = summarize_loop_trace(loop_trace, started, started + held_s)
    return out


async def report_ramp(name: str, run: Run, streams: int) -> None:
    """A line on stderr every 5 s while streams open: a ramp that crawls (a saturated load CPU) or
    refusals show while they happen, not only in the report at the end."""
    while True:
        await asyncio.sleep(5.0)
        kinds = ", ".join(f"{n} {kind}" for kind, n in run.failures.most_common())
        print(
            f"{name}: {run.heads:,} of {streams:,} streams open; refused {run.failed:,} {kinds}",
            file=sys.stderr,
        )


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def pct(ordered: Any, q: float) -> float:
    if not len(ordered):
        return 0.0
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


# -- the run --------------------------------------------------------------------------------------------


def raise_fd_limit(needed: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, max(hard, needed)))  # root may raise hard
        return needed
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def start_router(work: Path, backend_port: int, cpus: str | None, loop_trace: Path | None) -> RouterProcess:
    flags = ["--backend", f"http://127.0.0.1:{backend_port}"]
    env = clean_env(**ROUTER_ENV)
    if loop_trace is not None:
        env["LONG_STREAMS_LOOP_TRACE"] = str(loop_trace)
    code = _LOOP_TRACE_WRAPPER if loop_trace is not None else None
    router = launch_router(flags, work / "prefix-router.log", env=env, cpus=cpus, python_code=code)
    router.wait_ready()
    return router


async def serve_backend(port: int, seed: int, interval_ms: tuple[float, float]) -> None:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: StreamBackend(rng, interval_ms), "127.0.0.1", port, backlog=4096
    )
    async with server:
        await server.serve_forever()


def start_backend(work: Path, args: argparse.Namespace) -> tuple[Any, int]:
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--serve-backend", str(port)]
    argv += ["--seed", str(args.seed), "--min-interval-ms", str(args.min_interval_ms)]
    argv += ["--max-interval-ms", str(args.max_interval_ms)]
    return start_server(argv, [port], work / "backend.log", cpus=args.load_cpus), port


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="long-streams-"))
    results: list[dict[str, Any]] = []
    procs = []
    try:
        backend, backend_port = start_backend(work, args)
        procs.append(backend)
        results.append(await run_phase("direct", backend_port, Run(), args, backend.pid, None))
        trace = work / "loop-trace.jsonl" if args.trace_loop else None
        router = await asyncio.to_thread(start_router, work, backend_port, args.router_cpus, trace)
        procs.append(router.proc)
        await asyncio.sleep(1.0)  # its start-up health probe
        results.append(
            await run_phase("prefix-router", router.port, Run(), args, backend.pid, router.pid, trace)
        )
    finally:
        stop_processes(procs)
        shutil.rmtree(work, ignore_errors=True)
    return results


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # so that main_async's finally stops the backend and the router


def run_uvloop(main: Any) -> Any:
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        return runner.run(main)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=10_000, help="concurrent streams (default 10,000)")
    p.add_argument("--hold-s", type=float, default=20.0, help="seconds measured while all are open")
    p.add_argument("--settle-s", type=float, default=2.0, help="seconds after the ramp before measuring")
    p.add_argument("--min-interval-ms", type=float, default=50.0, help="shortest gap between events")
    p.add_argument("--max-interval-ms", type=float, default=200.0, help="longest gap between events")
    p.add_argument("--connect-concurrency", type=int, default=256, help="connects in flight in the ramp")
    p.add_argument("--load-cpus", default="0", help="CPUs of this process, backend and client (default 0)")
    p.add_argument("--router-cpus", default="1", help="CPUs of the router (default 1: one core)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="1,000 streams held 5 s: a smoke run")
    p.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/*.json")
    p.add_argument(
        "--trace-loop",
        action="store_true",
        help="time a 5 ms timer in the router's loop and its garbage collections: what each late tick was",
    )
    p.add_argument("--serve-backend", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_backend is not None:
        raise_fd_limit(args.streams + 1024)
        run_uvloop(serve_backend(args.serve_backend, args.seed, (args.min_interval_ms, args.max_interval_ms)))
        return 0
    if args.quick:
        args.streams, args.hold_s = 1000, 5.0
    if os.cpu_count() == 1 or shutil.which("taskset") is None:
        args.load_cpus = args.router_cpus = None
    if args.load_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.load_cpus.split(",")})
    # The router holds two sockets a stream, and a few of its own (listeners, the event loop, logs).
    limit = raise_fd_limit(2 * args.streams + 1024)
    most = (limit - 64) // 2
    if args.streams > most:
        print(f"RLIMIT_NOFILE allows {limit} files a process: {most:,} streams, not {args.streams:,}")
        args.streams = most

    versions = {
        "prefix-router": package_version("prefix-router"),
        "uvloop": package_version("uvloop"),
        "httptools": package_version("httptools"),
    }
    meta = print_header("Long streams held open through the router", versions)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    results = run_uvloop(main_async(args))

    direct, routed = results
    print(
        f"{args.streams:,} streams, an event every {args.min_interval_ms:g}-{args.max_interval_ms:g} ms "
        f"each, held {args.hold_s:g} s; load on CPU {args.load_cpus}, router on CPU {args.router_cpus}; "
        f"router env: {' '.join(f'{k}={v}' for k, v in ROUTER_ENV.items())}\n"
    )
    rows = [
        [
            r["name"],
            f"{r['heads']:,}",
            f"{r['failed']:,}",
            f"{r['ramp_s']:.1f}",
            f"{r['events_per_s']:,.0f}",
            f"{r['delay_p50_ms']:.2f}",
            f"{r['delay_p99_ms']:.2f}",
            f"{r['delay_p999_ms']:.2f}",
            f"{r['delay_max_ms']:.1f}",
            f"{r['loadgen_lag_p99_ms']:.2f}",
            f"{r['loadgen_cpus']:.2f} / {r['router_cpus']:.2f} / {r['other_cpus']:.2f}",
        ]
        for r in results
    ]
    head = ["path", "streams open", "refused", "ramp s", "events/s", "delay p50 ms", "p99 ms", "p99.9 ms"]
    head.append("max ms")
    print(markdown_table([*head, "load-gen lag p99 ms", "CPUs: load-gen / router / others"], rows))
    for r in results:
        if r["first_failure"]:
            kinds = "; ".join(
                f"{n:,} × {kind}" for kind, n in sorted(r["failures"].items(), key=lambda f: -f[1])
            )
            print(f"\n{r['name']}: refused {kinds}; the first: {r['first_failure']}")
    added_p50 = routed["delay_p50_ms"] - direct["delay_p50_ms"]
    added_p99 = routed["delay_p99_ms"] - direct["delay_p99_ms"]
    print()
    print(
        markdown_table(
            [
                "router RSS before",
                "at peak",
                "per stream",
                "fds",
                "loop lag (/healthz) p50",
                "p99",
                "max",
                "added delay p50",
                "added delay p99",
            ],
            [
                [
                    f"{routed['router_rss_before_mib']:.0f} MiB",
                    f"{routed['router_rss_peak_mib']:.0f} MiB",
                    f"{routed['router_rss_per_stream_kib']:.1f} KiB",
                    f"{routed['router_fds']:,}",
                    f"{routed['router_lag_p50_ms']:.2f} ms",
                    f"{routed['router_lag_p99_ms']:.2f} ms",
                    f"{routed['router_lag_max_ms']:.1f} ms",
                    f"{added_p50:+.2f} ms",
                    f"{added_p99:+.2f} ms",
                ]
            ],
        )
    )
    others = routed["others_on_router_cpu"]
    print()
    print(
        markdown_table(
            [
                "router CPU per event",
                "of it in the kernel",
                "events per wake-up",
                "router's run-queue wait",
                "others on its CPU",
            ],
            [
                [
                    f"{routed['router_us_per_event']:.1f} µs",
                    f"{routed['router_kernel_us_per_event']:.1f} µs",
                    f"{routed['router_events_per_wakeup']:.1f}",
                    f"{routed['router_runqueue_wait'] * 1000:.0f} ms/s",
                    f"{others:.2f} CPUs" if others is not None else "n/a",
                ]
            ],
        )
    )
    print(
        "\nrun-queue wait: time the router was ready to run while another process held its CPU; "
        "delays it explains are the machine's, not the router's."
    )
    trace = routed.get("loop_trace")
    if trace is not None:
        n0, n1, n2 = trace["gc_collections"]
        print(
            f"\nloop trace (hold): {trace['late_ticks']} ticks of a 5 ms timer more than 10 ms late, "
            f"{trace['late_ms']:.0f} ms late in all: {trace['runqueue_wait_ms']:.0f} ms of it waiting for "
            f"the CPU, {trace['ran_ms']:.0f} ms running, {trace['gc_in_late_ms']:.0f} ms collecting; "
            f"collections {n0} / {n1} / {n2} (gen 0 / 1 / 2), the longest {trace['gc_longest_ms']:.1f} ms"
        )
    report_results("long_streams", {**meta, "args": vars(args), "results": results}, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
