"""A real `redis-server` on a 127.0.0.1 ephemeral port, for the shared placement state tests and the
benchmarks that use one.

Skipped with a reason when the binary is missing, except under CI (CI=true), where that fails:
.ci/run installs it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile

from loopback import free_port, wait_until
from processes import stop_process


def redis_binary() -> str:
    import pytest  # here, not at the top: the benchmarks start a RedisServer without pytest

    found = shutil.which("redis-server")
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("redis-server is not installed; .ci/run installs Debian's redis-server package")
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    return found


class RedisServer:
    """One redis-server process; `kill()` ends it, `start()` brings a new one up on the same port."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="prefix-router-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--protected-mode", "yes",
        ]  # fmt: skip
        process = self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def answers() -> bool:
            if process.poll() is not None:
                err = process.stderr.read().decode() if process.stderr else ""
                raise RuntimeError(f"redis-server exited: {err}")
            return self._answers()

        wait_until(answers, timeout_s, "redis-server answering PING", 0.02)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """Terminate the server process and wait for it."""
        if self.process is not None:
            stop_process(self.process)
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def close(self) -> None:
        self.kill()
        self._dir.cleanup()


def started_redis() -> RedisServer:
    server = RedisServer(redis_binary())
    server.start()
    return server


__all__ = ["RedisServer", "redis_binary", "started_redis"]
