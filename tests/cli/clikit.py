"""The `prefix-router` command as a user runs it: a subprocess with a clean environment, its output read
line by line while it runs, Ctrl-C sent to it, and a port held busy."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty, Queue

from processes import clean_env

__all__ = ["CLI", "Running", "busy_port", "clean_env", "run_cli", "running"]

CLI = [sys.executable, "-m", "prefix_router"]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else clean_env(),
    )


@contextmanager
def interruptible_children() -> Iterator[None]:
    """Start children with SIGINT at its default, as a terminal's foreground process has it. A test run
    started as a script's background job ignores SIGINT, and a child inherits an ignored signal
    (a handled one is reset to the default at exec): the child would never see the Ctrl-C sent."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before is not None:  # None: a handler installed outside Python, which cannot be put back
            signal.signal(signal.SIGINT, before)


class Running:
    """A started command whose stdout and stderr lines are collected as they come."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        with interruptible_children():
            self.proc = subprocess.Popen(
                [*CLI, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env if env is not None else clean_env(),
            )
        self.lines: Queue[tuple[str, str]] = Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            (self.stdout if name == "stdout" else self.stderr).append(line.rstrip("\n"))
            self.lines.put((name, line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout_s: float = 60) -> re.Match[str]:
        """The first new line (either stream) matching `pattern`; fails on exit or after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                _, line = self.lines.get(timeout=0.1)
            except Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            if match := re.search(pattern, line):
                return match
        raise AssertionError(
            f"no line matching {pattern!r}; exit {self.proc.poll()}\n"
            + "\n".join(["stdout:", *self.stdout, "stderr:", *self.stderr])
        )

    def interrupt(self, timeout_s: float = 60) -> int:
        """Ctrl-C (SIGINT), then the exit code once both streams are read to their end."""
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=timeout_s)
        for reader in self._readers:
            reader.join(timeout=timeout_s)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def running(*args: str, env: dict[str, str] | None = None) -> Iterator[Running]:
    command = Running(*args, env=env)
    try:
        yield command
    finally:
        command.kill()


@contextmanager
def busy_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port something else is listening on, for as long as the block runs."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        sock.listen()
        yield int(sock.getsockname()[1])
