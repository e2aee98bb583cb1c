"""Throughput, CPU per request and added latency of prefix-router vs direct, nginx and SGLang's router.

One run starts a mock backend (a raw uvloop protocol: a fixed small JSON for non-streaming requests,
an SSE stream of --chunks events for `"stream": true`), then, one target at a time, the proxy under
test in front of it, and drives it with wrk. The mock and wrk share the load CPU(s); the proxy under
test gets the proxy CPU(s) (taskset), so a proxy that saturates its core is measured, not the load
generator. For every target it measures:

- req/s non-streaming and for whole streams, at each --connections value (median of --runs);
- the proxy process's CPU time per request (utime + stime from /proc/PID/stat, all threads);
- p50/p99 latency at one connection, and what the proxy adds over going direct.

--client-compare also runs a ~50-line raw-ASGI relay on uvicorn with httpx.AsyncClient and with
aiohttp.ClientSession as the upstream client, the evidence for the data path's choice of client.

Everything listens on 127.0.0.1; every run is bounded by wrk's -d.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    busy_seconds,
    children_cpu_seconds,
    cpu_seconds,
    markdown_table,
    median,
    package_version,
    print_header,
    report_results,
    sglang_router_argv,
    tool_version,
)

from loopback import free_port, wait_until
from processes import (
    ExitedEarly,
    clean_env,
    launch_router,
    log_tail,
    pinned,
    start_process,
    start_server,
    stop_process,
)

CHAT_PATH = "/v1/chat/completions"
MODEL = "bench-model"
_DEBUG = bool(os.environ.get("MOCK_DEBUG"))

# -- the mock backend ---------------------------------------------------------------------------

_JSON_BODY = (
    b'{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench-model",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"Hello from the mock backend."},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":250,"completion_tokens":8,"total_tokens":258}}'
)
_MODELS_BODY = b'{"object":"list","data":[{"id":"bench-model","object":"model","owned_by":"bench"}]}'


def mock_info_bodies(model_path: str) -> tuple[bytes, bytes]:
    """/model_info and /server_info answers. SGLang's router loads a tokenizer from the worker's
    model_path, and fetches it from Hugging Face unless it is a local directory holding one, so the
    mock names a local directory with a two-word tokenizer.json (see write_tokenizer)."""
    info = {"model_path": model_path, "tokenizer_path": model_path}
    model_info = json.dumps({**info, "is_generation": True}).encode()
    server_info = json.dumps({**info, "version": "0.0.0-mock"}).encode()
    return model_info, server_info


def write_tokenizer(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1}, "unk_token": "[UNK]"},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    return directory


def _sse_event(i: int) -> bytes:
    data = (
        b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"bench-model","choices":[{"index":0,"delta":{"content":"tok%d "},'
        b'"finish_reason":null}]}\n\n' % i
    )
    return b"%x\r\n%s\r\n" % (len(data), data)


_DONE_EVENT = b"%x\r\n%s\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n")


def _response(status: bytes, body: bytes, keep_alive: bool) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + (b"\r\n\r\n" if keep_alive else b"\r\nconnection: close\r\n\r\n")
        + body
    )


class MockProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, Content-Length request bodies, one request at a time per connection."""

    chunks = 20
    model_info = b"{}"
    server_info = b"{}"

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: Any = None  # uvloop's TCPTransport is not an asyncio.Transport subclass
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._serve()

    def _serve(self) -> None:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            length = 0
            at = head.find(b"\r\ncontent-length:")
            if at >= 0:
                eol = head.find(b"\r\n", at + 2)
                length = int(head[at + 17 : eol if eol >= 0 else len(head)])
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            keep_alive = b"\r\nconnection: close" not in head
            parts = head.split(b" ", 2)
            if len(parts) < 3 or not parts[2].startswith(b"http/1"):
                # e.g. an HTTP/2 prior-knowledge preface (SGLang's router tries one first): refuse it.
                self.transport.close()
                return
            path = parts[1]
            if _DEBUG:
                print(head.split(b"\r\n", 1)[0].decode(), flush=True)
            assert self.transport is not None
            if b'"stream":true' in body or b'"stream": true' in body:
                self.busy = True
                self.transport.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                asyncio.get_running_loop().call_soon(self._stream, 0, keep_alive)
                return
            if path.startswith(b"/v1/models"):
                out = _response(b"200 OK", _MODELS_BODY, keep_alive)
            elif path.startswith((b"/get_model_info", b"/model_info")):
                out = _response(b"200 OK", self.model_info, keep_alive)
            elif path.startswith((b"/get_server_info", b"/server_info")):
                out = _response(b"200 OK", self.server_info, keep_alive)
            elif path.startswith(b"/health"):
                out = _response(b"200 OK", b"{}", keep_alive)
            else:
                out = _response(b"200 OK", _JSON_BODY, keep_alive)
            self.transport.write(out)
            if not keep_alive:
                self.transport.close()
                return

    def _stream(self, i: int, keep_alive: bool) -> None:
        """One SSE event per loop iteration, so each leaves in its own write, as a server's would."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if i < self.chunks - 1:
            transport.write(_sse_event(i))
            asyncio.get_running_loop().call_soon(self._stream, i + 1, keep_alive)
            return
        transport.write(_DONE_EVENT + b"0\r\n\r\n")
        self.busy = False
        if not keep_alive:
            transport.close()
        elif self.buf:
            self._serve()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def serve_mock(port: int, chunks: int, model_path: str) -> None:
    import uvloop

    MockProtocol.chunks = chunks
    MockProtocol.model_info, MockProtocol.server_info = mock_info_bodies(model_path)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(MockProtocol, "127.0.0.1", port, backlog=4096, reuse_address=True)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        async with server:
            await stop.wait()

    uvloop.run(main())


# -- the ~50-line relays for --client-compare -----------------------------------------------------


def serve_relay(client: str, port: int, backend: str) -> None:
    """A raw-ASGI relay on uvicorn: read body, send upstream, stream the response back. Nothing else."""
    import uvicorn

    hop = {b"connection", b"keep-alive", b"transfer-encoding", b"host", b"content-length"}
    state: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            if client == "aiohttp":
                import aiohttp

                state["c"] = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=1024, limit_per_host=1024),
                    auto_decompress=False,
                    timeout=aiohttp.ClientTimeout(total=None),
                )
            else:
                import httpx

                limits = (
                    httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
                    if client == "httpx"
                    else httpx.Limits()  # httpx's defaults: 100 connections, 20 kept alive
                )
                state["c"] = httpx.AsyncClient(limits=limits, timeout=None)
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await (state["c"].close() if client == "aiohttp" else state["c"].aclose())
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k not in hop]
        url = backend + scope["path"]
        if client == "aiohttp":
            async with state["c"].request(scope["method"], url, headers=headers, data=body) as r:
                out = [(k.lower(), v) for k, v in r.raw_headers if k.lower() not in hop]
                await send({"type": "http.response.start", "status": r.status, "headers": out})
                async for chunk in r.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        else:
            req = state["c"].build_request(scope["method"], url, headers=headers, content=body)
            r = await state["c"].send(req, stream=True)
            try:
                out = [(k.lower(), v) for k, v in r.headers.raw if k.lower() not in hop]
                await send({"type": "http.response.start", "status": r.status_code, "headers": out})
                async for chunk in r.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finally:
                await r.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on")


# -- wrk ----------------------------------------------------------------------------------------

_WRK_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50_us":%.1f,"p90_us":%.1f,"p99_us":%.1f,"mean_us":%.1f}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
"""


def chat_body(stream: bool, body_bytes: int) -> bytes:
    system = "You are a helpful assistant for the prefix-router benchmark. "
    user = ("Summarise the following text. " + "lorem ipsum dolor sit amet " * 4096)[
        : max(0, body_bytes - 300)
    ]
    doc = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 16,
        "stream": stream,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def write_lua(directory: Path, name: str, body: bytes) -> Path:
    path = directory / f"{name}.lua"
    text = body.decode()
    assert "]==]" not in text
    path.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [==[{text}]==]\n{_WRK_DONE}"
    )
    return path


@dataclass
class WrkResult:
    rps: float
    requests: int
    errors: int
    p50_us: float
    p99_us: float
    cpu_us_per_req: float | None
    background_cpus: float  # CPUs' worth of busy time spent by processes outside this benchmark


# Set once the mock is running: its CPU time is ours, not background.
MOCK_PID: int | None = None


def run_wrk(
    port: int, lua: Path, connections: int, duration_s: float, load_cpus: str | None, proxy_pid: int | None
) -> WrkResult:
    seconds = max(1, round(duration_s))
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s"]
    argv += ["-s", str(lua), f"http://127.0.0.1:{port}{CHAT_PATH}"]
    if load_cpus:
        argv = ["taskset", "-c", load_cpus, *argv]
    ours = [pid for pid in (proxy_pid, MOCK_PID) if pid]
    cpu0 = cpu_seconds(proxy_pid) if proxy_pid else 0.0
    ours0 = sum(cpu_seconds(pid) for pid in ours) + children_cpu_seconds()
    busy0, t0 = busy_seconds(), time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60, check=False)
    busy1, t1 = busy_seconds(), time.monotonic()
    ours1 = sum(cpu_seconds(pid) for pid in ours) + children_cpu_seconds()
    cpu1 = cpu_seconds(proxy_pid) if proxy_pid else 0.0
    background = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (t1 - t0)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk gave no summary (rc={out.returncode}): {out.stdout}\n{out.stderr}")
    s = json.loads(line[len("WRKJSON ") :])
    errors = s["connect"] + s["read"] + s["write"] + s["status"] + s["timeout"]
    good = max(1, s["requests"])
    return WrkResult(
        rps=s["requests"] / (s["duration_us"] / 1e6),
        requests=s["requests"],
        errors=errors,
        p50_us=s["p50_us"],
        p99_us=s["p99_us"],
        cpu_us_per_req=(cpu1 - cpu0) / good * 1e6 if proxy_pid else None,
        background_cpus=background,
    )


# -- the targets --------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    port: int
    proc: subprocess.Popen[bytes] | None  # None: the mock itself
    workdir: Path | None = None
    log: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def wait_http_ready(port: int, path: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Wait until `path` answers 200 through the target (so its backend is registered and healthy)."""
    import http.client

    last = "no answer"

    def ready() -> bool:
        nonlocal last
        if proc.poll() is not None:
            raise ExitedEarly("target", proc.returncode, log_tail(log))
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request(
                "POST", path, body=chat_body(False, 1024), headers={"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            answer = resp.read()
            conn.close()
        except OSError as exc:
            last = repr(exc)
            return False
        last = f"status {resp.status}: {answer[:300]!r}"
        return resp.status == 200

    try:
        wait_until(ready, timeout_s, f"target on :{port}", 0.2)
    except TimeoutError:
        raise TimeoutError(
            f"target on :{port} not ready after {timeout_s:g} s ({last}); log:\n{log_tail(log)}"
        ) from None


ROUTER_ENV = {
    # One backend takes every connection here: lift the per-backend concurrency bound (default 32)
    # and its queue, which exist for GPU batches, not for a proxy benchmark.
    "PREFIX_ROUTER_BALANCING__MAX_INFLIGHT": "100000",
}
UVLOOP_CLI = "import sys, uvloop; uvloop.install(); from prefix_router.cli import main; sys.exit(main())"


def start_router(work: Path, backend_port: int, cpus: str | None, *, uvloop: bool = False) -> Target:
    """`prefix-router serve`, as shipped; with uvloop=True, the same CLI with uvloop's event loop
    installed first (what the shipped CLI would do with `asyncio.Runner(loop_factory=uvloop...)`)."""
    name = "router-uvloop" if uvloop else "prefix-router"
    flags = ["--backend", f"http://127.0.0.1:{backend_port}", "--log-level", "warning"]
    router = launch_router(
        flags,
        work / f"{name}.log",
        env=clean_env(**ROUTER_ENV),
        cpus=cpus,
        python_code=UVLOOP_CLI if uvloop else None,
    )
    wait_http_ready(router.port, CHAT_PATH, router.proc, router.log, 30)
    env = " ".join(f"{k}={v}" for k, v in ROUTER_ENV.items())
    return Target(name, router.port, router.proc, log=router.log, extra={"env": env})


NGINX_CONF = """\
worker_processes 1;
master_process off;
daemon off;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    client_max_body_size 64m;
    keepalive_requests 1000000;
    upstream backend {{
        server 127.0.0.1:{backend_port};
        keepalive 1024;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(work: Path, backend_port: int, cpus: str | None) -> Target | None:
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if exe is None:
        print("nginx is not installed: skipping (apt-get install -y nginx)", file=sys.stderr)
        return None
    port = free_port()
    ndir = work / "nginx"
    ndir.mkdir()
    conf = ndir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(work=ndir, backend_port=backend_port, port=port))
    log = ndir / "nginx.log"
    proc = start_process(
        pinned([exe, "-c", str(conf), "-p", str(ndir), "-e", str(ndir / "err.log")], cpus), log
    )
    wait_http_ready(port, CHAT_PATH, proc, log, 20)
    return Target("nginx", port, proc, workdir=ndir, log=log, extra={"conf": conf.read_text()})


def start_sglang(work: Path, backend_port: int, cpus: str | None) -> Target | None:
    if package_version("sglang-router") is None:
        print("sglang-router is not installed: skipping (pip install sglang-router)", file=sys.stderr)
        return None
    port = free_port()
    extra = ["--log-dir", str(work / "sglang-logs"), "--tokenizer-path", str(work / MODEL)]
    argv = sglang_router_argv([f"http://127.0.0.1:{backend_port}"], port, *extra)
    log = work / "sglang.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = start_process(pinned(argv, cpus), log, env)
    wait_http_ready(port, CHAT_PATH, proc, log, 60)
    return Target("sglang-router", port, proc, log=log, extra={"argv": argv})


def start_relay(work: Path, client: str, backend_port: int, cpus: str | None) -> Target:
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--serve-relay", client, "--relay-port", str(port)]
    argv += ["--relay-backend", f"http://127.0.0.1:{backend_port}"]
    log = work / f"relay-{client}.log"
    proc = start_process(pinned(argv, cpus), log)
    wait_http_ready(port, CHAT_PATH, proc, log, 30)
    return Target(f"relay[{client}]", port, proc, log=log)


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Plan:
    connections: list[int]
    runs: int
    duration_s: float
    latency_duration_s: float
    warmup_s: float
    load_cpus: str | None
    proxy_cpus: str | None
    max_background: float = 0.1
    retries: int = 1


def measure_cell(target: Target, lua: Path, conns: int, duration_s: float, plan: Plan) -> dict[str, Any]:
    results: list[WrkResult] = []
    retried = 0
    for _ in range(plan.runs):
        # The machine may be shared: a run during which other processes kept more than
        # --max-background CPUs busy is repeated (at most --retries times per cell), and the
        # background load of the runs kept is reported with the cell.
        while True:
            r = run_wrk(target.port, lua, conns, duration_s, plan.load_cpus, target.pid)
            if r.background_cpus <= plan.max_background or retried >= plan.retries:
                break
            retried += 1
            time.sleep(1.0)
        results.append(r)
    cpu = [r.cpu_us_per_req for r in results if r.cpu_us_per_req is not None]
    return {
        "background_cpus": round(max(r.background_cpus for r in results), 3),
        "retried": retried,
        "rps": median([r.rps for r in results]),
        "rps_runs": [round(r.rps, 1) for r in results],
        "errors": sum(r.errors for r in results),
        "requests": sum(r.requests for r in results),
        "p50_us": median([r.p50_us for r in results]),
        "p99_us": median([r.p99_us for r in results]),
        "cpu_us_per_req": median(cpu) if cpu else None,
    }


def measure_target(target: Target, luas: dict[str, Path], plan: Plan, modes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": target.name, "cells": {}}
    # Warm-up: connection pools filled, code paths hot, before anything is recorded.
    for mode in modes:
        run_wrk(target.port, luas[mode], max(plan.connections), plan.warmup_s, plan.load_cpus, None)
    for mode in modes:
        for conns in plan.connections:
            cell = measure_cell(target, luas[mode], conns, plan.duration_s, plan)
            out["cells"][f"{mode}@{conns}"] = cell
            cpu = f"{cell['cpu_us_per_req']:.0f} µs CPU/req" if cell["cpu_us_per_req"] is not None else ""
            err = f" ERRORS={cell['errors']}" if cell["errors"] else ""
            bg = f"  background {cell['background_cpus']:.2f} CPU"
            print(
                f"  {target.name:>16} {mode:>10} c={conns:<4} {cell['rps']:>9.0f} req/s  {cpu}{err}{bg}",
                flush=True,
            )
    if "plain" in modes:
        cell = measure_cell(target, luas["plain"], 1, plan.latency_duration_s, plan)
        out["cells"]["latency@1"] = cell
        print(
            f"  {target.name:>16} {'latency':>10} c=1    "
            f"p50 {cell['p50_us']:.0f} µs  p99 {cell['p99_us']:.0f} µs",
            flush=True,
        )
    return out


@contextlib.contextmanager
def running(target: Target | None) -> Iterator[Target | None]:
    try:
        yield target
    finally:
        if target is not None and target.proc is not None:
            stop_process(target.proc)
            if target.log is not None and "huggingface" in target.log.read_text(errors="replace").lower():
                print(f"warning: {target.name} tried to reach Hugging Face (see its log)", file=sys.stderr)


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}x"


MODES = (("plain", "non-streaming"), ("stream", "stream (whole)"))
PEERS = ("direct", "nginx", "sglang-router")


@dataclass
class Figures:
    """The measured cells of every target, by "mode@connections" (and "latency@1")."""

    results: dict[str, dict[str, Any]]
    plan: Plan

    @property
    def names(self) -> list[str]:
        return list(self.results)

    def cell(self, name: str, key: str) -> dict[str, Any] | None:
        cell: dict[str, Any] | None = self.results.get(name, {}).get("cells", {}).get(key)
        return cell

    def rps(self, name: str, key: str) -> float | None:
        cell = self.cell(name, key)
        return None if cell is None else cell["rps"]

    def cpu(self, name: str, key: str) -> float | None:
        cell = self.cell(name, key)
        return None if cell is None else cell["cpu_us_per_req"]

    def cells(self, modes: Sequence[tuple[str, str]] = MODES) -> list[tuple[str, str, int]]:
        """(key, label, connections) of every throughput cell, in table order."""
        return [(f"{mode}@{conns}", label, conns) for mode, label in modes for conns in self.plan.connections]


def throughput_cell(cell: dict[str, Any] | None) -> str | None:
    if cell is None:
        return None
    txt = f"{cell['rps']:,.0f}"
    if cell["cpu_us_per_req"] is not None:
        txt += f" ({cell['cpu_us_per_req']:.0f} µs)"
    if cell["errors"]:
        txt += f" [{cell['errors']} err]"
    return txt


def throughput_table(f: Figures) -> str:
    rows: list[list[Any]] = [
        [label, conns, *(throughput_cell(f.cell(n, key)) for n in f.names)] for key, label, conns in f.cells()
    ]
    bg_row: list[Any] = ["background CPUs (max)", ""]
    for n in f.names:
        bgs = [c["background_cpus"] for c in f.results[n]["cells"].values()]
        bg_row.append(f"{max(bgs):.2f}" if bgs else None)
    rows.append(bg_row)
    return "req/s, median of runs (proxy CPU µs per request in brackets):\n\n" + markdown_table(
        ["workload", "conns", *f.names], rows
    )


def cpu_table(f: Figures, proxies: list[str]) -> str:
    # On a shared machine req/s measures the CPU share a proxy got; CPU time per request is what
    # it costs, and 1e6 / (CPU µs per request) is what one whole core would sustain at that cost.
    def per_cpu(c: float | None) -> str | None:
        return None if not c else f"{c:.0f} µs → {1e6 / c:,.0f}/s"

    rows = [[label, conns, *(per_cpu(f.cpu(n, key)) for n in proxies)] for key, label, conns in f.cells()]
    return "proxy CPU per request → requests per CPU-second (1e6 / CPU µs):\n\n" + markdown_table(
        ["workload", "conns", *proxies], rows
    )


def ratio_table(f: Figures) -> tuple[str, dict[str, Any]]:
    ratios: dict[str, Any] = {}
    rows = []
    for key, label, conns in f.cells((("plain", "non-streaming"), ("stream", "stream"))):
        vals = [ratio(f.rps("prefix-router", key), f.rps(o, key)) for o in PEERS]
        # CPU-normalised: the other's CPU per request over ours (> 1: we are cheaper).
        cvals = [ratio(f.cpu(o, key), f.cpu("prefix-router", key)) for o in ("nginx", "sglang-router")]
        ratios[key] = {
            **dict(zip([f"rps/{o}" for o in PEERS], vals, strict=True)),
            **dict(zip(["cpu/nginx", "cpu/sglang-router"], cvals, strict=True)),
        }
        rows.append([label, conns, *vals, *cvals])
    head = ["workload", "conns", "router/direct", "router/nginx", "router/sglang"]
    text = "prefix-router as a ratio (req/s measured; and per CPU-second, the other's CPU/req ÷ ours):\n\n"
    return text + markdown_table([*head, "per-CPU vs nginx", "per-CPU vs sglang"], rows), ratios


def latency_table(f: Figures) -> str | None:
    direct = f.cell("direct", "latency@1")
    rows = []
    for n in f.names:
        cell = f.cell(n, "latency@1")
        if cell is None:
            continue
        added = [f"{cell[p] - direct[p]:+.0f}" if direct else None for p in ("p50_us", "p99_us")]
        rows.append([n, f"{cell['p50_us']:.0f}", f"{cell['p99_us']:.0f}", *added, f"{cell['rps']:,.0f}"])
    if not rows:
        return None
    return "latency at 1 connection, non-streaming (µs; added = target − direct):\n\n" + markdown_table(
        ["target", "p50", "p99", "added p50", "added p99", "req/s"], rows
    )


Check = tuple[str, str, bool]


def at_least(what: str, unit: str, ours: float | None, theirs: float | None, bound: float) -> list[Check]:
    """The check "ours / theirs >= bound" against SGLang, or none when either figure is missing."""
    if not ours or not theirs:
        return []
    return [(f"{what} >= {bound}x SGLang ({unit})", f"{ours / theirs:.2f}x", ours / theirs >= bound)]


def target_checks(f: Figures) -> list[Check]:
    if "prefix-router" not in f.results:
        return []
    checks: list[Check] = []

    def versus_sglang(what: str, key: str, bound: float) -> None:
        # per CPU: their CPU per request over ours, so > 1 means we are cheaper
        us, them = "prefix-router", "sglang-router"
        checks.extend(at_least(what, "req/s", f.rps(us, key), f.rps(them, key), bound))
        checks.extend(at_least(what, "per CPU", f.cpu(them, key), f.cpu(us, key), bound))

    if "sglang-router" in f.results:
        c64 = max((c for c in f.plan.connections if c <= 64), default=None)
        if c64 is not None:
            versus_sglang(f"non-streaming @{c64}", f"plain@{c64}", 0.7)
        for conns in f.plan.connections:
            versus_sglang(f"streaming @{conns}", f"stream@{conns}", 1.5)
    ours, direct = f.cell("prefix-router", "latency@1"), f.cell("direct", "latency@1")
    if ours and direct:
        add = (ours["p50_us"] - direct["p50_us"]) / 1000
        checks.append(("added p50 at 1 conn <= 0.3 ms", f"{add:.3f} ms", add <= 0.3))
    return checks


def report(results: dict[str, dict[str, Any]], plan: Plan) -> tuple[str, dict[str, Any]]:
    f = Figures(results, plan)
    sections = [throughput_table(f)]
    proxies = [n for n in f.names if n != "direct"]
    if proxies:
        sections.append(cpu_table(f, proxies))
    ratios: dict[str, Any] = {}
    if "prefix-router" in results:
        text, ratios = ratio_table(f)
        sections.append(text)
    if (latency := latency_table(f)) is not None:
        sections.append(latency)
    checks = target_checks(f)
    if checks:
        rows = [[t, m, "yes" if ok else "NO"] for t, m, ok in checks]
        sections.append("targets:\n\n" + markdown_table(["target", "measured", "met"], rows))
    return "\n\n".join(sections), {"ratios": ratios, "checks": [list(c) for c in checks]}


def client_compare(work: Path, mock_port: int, luas: dict[str, Path], plan: Plan) -> dict[str, Any]:
    conns = 64
    out: dict[str, Any] = {}
    for client in ("aiohttp", "httpx", "httpx-default-limits"):
        with running(start_relay(work, client, mock_port, plan.proxy_cpus)) as target:
            assert target is not None
            for mode in ("plain", "stream"):
                run_wrk(target.port, luas[mode], conns, plan.warmup_s, plan.load_cpus, None)
                cell = measure_cell(target, luas[mode], conns, plan.duration_s, plan)
                out[f"{client}/{mode}"] = cell
                err = f" ERRORS={cell['errors']}" if cell["errors"] else ""
                print(
                    f"  {target.name:>28} {mode:>6} c={conns} {cell['rps']:>8.0f} req/s "
                    f"{cell['cpu_us_per_req']:.0f} µs CPU/req p99 {cell['p99_us'] / 1000:.1f} ms{err}",
                    flush=True,
                )
            cell = measure_cell(target, luas["plain"], 1, plan.latency_duration_s, plan)
            out[f"{client}/latency@1"] = cell
            print(
                f"  {target.name:>28} c=1 p50 {cell['p50_us']:.0f} µs p99 {cell['p99_us']:.0f} µs", flush=True
            )
    return out


def client_table(cmp: dict[str, Any]) -> str:
    rows = []
    for client in ("aiohttp", "httpx", "httpx-default-limits"):
        row: list[Any] = [client]
        for mode in ("plain", "stream"):
            cell = cmp.get(f"{client}/{mode}")
            if cell is None:
                row += [None, None, None]
                continue
            errs = f" [{cell['errors']} err]" if cell["errors"] else ""
            row += [
                f"{cell['rps']:,.0f}{errs}",
                f"{cell['cpu_us_per_req']:.0f}",
                f"{cell['p99_us'] / 1000:.1f}",
            ]
        rows.append(row)
    head = [
        "relay client",
        "non-stream req/s",
        "CPU µs/req",
        "p99 ms",
        "stream req/s",
        "CPU µs/req",
        "p99 ms",
    ]
    return "raw-ASGI relay on uvicorn at 64 connections, by upstream client:\n\n" + markdown_table(head, rows)


def default_cpus() -> tuple[str | None, str | None]:
    n = os.cpu_count() or 1
    if n < 2 or shutil.which("taskset") is None:
        return None, None
    half = n // 2
    load = "0" if half == 1 else f"0-{half - 1}"
    proxy = str(half) if n - half == 1 else f"{half}-{n - 1}"
    return load, proxy


def main() -> int:
    load_default, proxy_default = default_cpus()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--targets", default="direct,router,nginx,sglang", help="comma list (default: %(default)s)"
    )
    p.add_argument("--connections", default="16,64,256", help="comma list (default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="runs per cell, the median is reported (default 3)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run (default 5)")
    p.add_argument("--latency-duration", type=float, default=5.0, help="seconds of the 1-connection run")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per target and workload")
    p.add_argument(
        "--chunks", type=int, default=20, help="SSE events per stream, [DONE] included (default 20)"
    )
    p.add_argument(
        "--body-bytes", type=int, default=1024, help="size of the chat request body (default 1024)"
    )
    p.add_argument("--load-cpus", default=load_default, help="CPUs of the mock and wrk (default %(default)s)")
    p.add_argument("--proxy-cpus", default=proxy_default, help="CPUs of the proxy (default %(default)s)")
    p.add_argument(
        "--max-background",
        type=float,
        default=0.1,
        help="repeat a run when other processes used more than this many CPUs during it (default 0.1)",
    )
    p.add_argument("--retries", type=int, default=1, help="repeats per cell allowed for that (default 1)")
    p.add_argument("--quick", action="store_true", help="1 run per cell, 2 s runs: a smoke test in ~1 min")
    p.add_argument("--client-compare", action="store_true", help="also compare relays on httpx vs aiohttp")
    p.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/*.json")
    p.add_argument("--serve-mock", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--mock-model-path", help=argparse.SUPPRESS)
    p.add_argument(
        "--serve-relay", choices=["aiohttp", "httpx", "httpx-default-limits"], help=argparse.SUPPRESS
    )
    p.add_argument("--relay-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--relay-backend", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.serve_mock is not None:
        serve_mock(args.serve_mock, args.chunks, args.mock_model_path or MODEL)
        return 0
    if args.serve_relay is not None:
        serve_relay(args.serve_relay, args.relay_port, args.relay_backend)
        return 0

    if shutil.which("wrk") is None:
        print("wrk is not installed: apt-get install -y wrk", file=sys.stderr)
        return 2
    if args.quick:
        args.runs, args.duration, args.latency_duration, args.warmup = 1, 2.0, 2.0, 1.0
        args.retries = 0
    plan = Plan(
        connections=[int(c) for c in args.connections.split(",") if c],
        runs=args.runs,
        duration_s=args.duration,
        latency_duration_s=args.latency_duration,
        warmup_s=args.warmup,
        load_cpus=args.load_cpus or None,
        proxy_cpus=args.proxy_cpus or None,
        max_background=args.max_background,
        retries=args.retries,
    )
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    versions = {
        "python": sys.version.split()[0],
        "prefix-router": package_version("prefix-router"),
        "uvicorn": package_version("uvicorn"),
        "uvloop": package_version("uvloop"),
        "httptools": package_version("httptools"),
        "aiohttp": package_version("aiohttp"),
        "httpx": package_version("httpx"),
        "nginx": (tool_version(["nginx", "-v"]) or "").replace("nginx version: ", "") or None,
        "sglang-router": package_version("sglang-router"),
        "wrk": (tool_version(["wrk", "-v"]) or "").split(" [")[0] or None,
    }
    meta = print_header("proxy throughput: prefix-router vs direct, nginx, SGLang router", versions)
    print(
        f"- pinning: mock + wrk on CPU {plan.load_cpus}, proxy on CPU {plan.proxy_cpus}; wrk -t1; "
        f"{plan.runs} run(s) x {plan.duration_s:g} s per cell; body {args.body_bytes} B; "
        f"stream = {args.chunks} SSE events\n",
        flush=True,
    )

    results: dict[str, dict[str, Any]] = {}
    cmp: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="prefix-router-bench-") as tmp:
        work = Path(tmp)
        luas = {
            "plain": write_lua(work, "plain", chat_body(False, args.body_bytes)),
            "stream": write_lua(work, "stream", chat_body(True, args.body_bytes)),
        }
        mock_port = free_port()
        mock_argv = [sys.executable, str(Path(__file__).resolve()), "--serve-mock", str(mock_port)]
        # The mock reports model_path "bench-model": SGLang's router, started in `work`, finds the
        # tokenizer there (a relative path) and requests naming model "bench-model" match its worker.
        write_tokenizer(work / MODEL)
        mock_argv += ["--chunks", str(args.chunks), "--mock-model-path", MODEL]
        mock = start_server(mock_argv, [mock_port], work / "mock.log", cpus=plan.load_cpus)
        global MOCK_PID
        MOCK_PID = mock.pid
        try:
            starters = {
                "direct": lambda: Target("direct", mock_port, None),
                "router": lambda: start_router(work, mock_port, plan.proxy_cpus),
                "router-uvloop": lambda: start_router(work, mock_port, plan.proxy_cpus, uvloop=True),
                "nginx": lambda: start_nginx(work, mock_port, plan.proxy_cpus),
                "sglang": lambda: start_sglang(work, mock_port, plan.proxy_cpus),
            }
            for name in wanted:
                if name not in starters:
                    print(f"unknown target {name!r}", file=sys.stderr)
                    continue
                with running(starters[name]()) as target:
                    if target is None:
                        continue
                    results[target.name] = measure_target(target, luas, plan, ["plain", "stream"])
                    if target.name == "prefix-router":
                        results[target.name]["settings_env"] = target.extra.get("env")
            if args.client_compare:
                print("\nclient comparison (raw-ASGI relay on uvicorn):", flush=True)
                cmp = client_compare(work, mock_port, luas, plan)
        finally:
            stop_process(mock)

    print()
    text, summary = report(results, plan)
    print(text)
    if cmp is not None:
        print()
        print(client_table(cmp))
    payload = {
        **meta,
        "plan": plan.__dict__,
        "body_bytes": args.body_bytes,
        "chunks": args.chunks,
        "results": results,
        "summary": summary,
        "client_compare": cmp,
    }
    report_results("proxy_throughput", payload, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
