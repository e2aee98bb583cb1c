"""`prefix-router demo` as a user runs it: a subprocess, its banner, the OpenAI client, Ctrl-C;
and `demo --load` with a tiny workload, whose table must show prefix affinity beating random."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from queue import Empty, Queue

import openai

from loopback import free_port

DEMO = [sys.executable, "-m", "prefix_router", "demo"]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PREFIX_ROUTER_")}


def test_demo_serves_until_sigint() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*DEMO, "--port", str(port), "--count", "2", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
    )  # fmt: skip
    lines: Queue[str] = Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def pump() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        base_url = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except Empty:
                break
            if match := re.search(r'base_url="([^"]+)"', line):
                base_url = match.group(1)
            if "Ctrl-C to stop" in line:
                break
        assert base_url == f"http://127.0.0.1:{port}/v1", "no banner within 30 s"
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=5, timeout=10)
        reply = client.chat.completions.create(
            model="sim-llama", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _percent_row(output: str, label: str) -> list[float]:
    line = next(line for line in output.splitlines() if line.startswith(label))
    return [float(v) for v in re.findall(r"([\d.]+)%", line)]


def test_demo_load_prints_a_table_where_prefix_beats_random() -> None:
    done = subprocess.run(
        [*DEMO, "--load", "--count", "2", "--groups", "6", "--prompts", "6", "--concurrency", "4",
         "--system-tokens", "512"],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "[prefix]" in out and "req/s" in out  # progress lines
    header = next(
        line for line in out.splitlines() if "prefix" in line and "random" in line and "[" not in line
    )
    assert header.split() == ["prefix", "random"]
    prefix_hit, random_hit = _percent_row(out, "prefix-cache hit rate")
    assert prefix_hit > random_hit
    assert "TTFT p50" in out and "TTFT p99" in out and "share backend 0" in out
