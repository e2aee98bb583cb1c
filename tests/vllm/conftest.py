"""The session's two real vLLM servers (see vllmkit.py for the setup), started once and stopped at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllmkit import START_TIMEOUT_S, VllmServer, model_dir, start_server, stop_server, wait_healthy, warm_up


@pytest.fixture(scope="session")
def vllm_servers() -> Iterator[list[VllmServer]]:
    model = model_dir()
    workdir = Path(tempfile.mkdtemp(prefix="vllm-real-"))
    servers: list[VllmServer] = []
    try:
        for cpu in (0, 1):
            servers.append(start_server(model, cpu, workdir))
        wait_healthy(servers, START_TIMEOUT_S)
        for server in servers:
            warm_up(server.url)
        yield servers
    finally:
        for server in servers:
            stop_server(server)
        shutil.rmtree(workdir, ignore_errors=True)
