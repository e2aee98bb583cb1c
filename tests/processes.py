"""Child processes for tests and benchmarks: started in their own session with their output in a log,
stopped with SIGTERM then SIGKILL and always reaped; and `prefix-router serve` as one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loopback import eventually, free_port, port_answers, wait_until


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """argv under `taskset -c cpus`, or as it is when no CPUs are named."""
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def start_process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A child in its own session (so stop_process reaches its children too), output to `log`."""
    with log.open("wb") as fh:
        return subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log.parent
        )


def _leads_group(proc: subprocess.Popen[bytes]) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_processes(
    procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 10.0, linger_s: float = 10.0
) -> None:
    """SIGTERM to every one at once (they drain side by side), then SIGKILL to any still running
    after `timeout_s`; all reaped. A child started in its own session (start_process) is signalled
    with its whole group, and what is left of the group `linger_s` after it exits is killed (an
    engine's helper processes follow their parent, but not always)."""
    running = [(p, _leads_group(p)) for p in procs if p.poll() is None]
    for proc, group in running:
        _signal(proc, signal.SIGTERM, group)
    deadline = time.monotonic() + timeout_s
    for proc, group in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL, group)
            proc.wait(timeout=timeout_s)
    for proc, group in running:
        if group:
            _reap_group(proc, linger_s)


def _reap_group(proc: subprocess.Popen[bytes], linger_s: float) -> None:
    """Wait up to linger_s for what is left of a child's process group to follow it, then kill it."""
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not _group_alive(proc.pid), linger_s, "the group's exit", 0.1)
    _signal(proc, signal.SIGKILL, True)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0, linger_s: float = 10.0) -> None:
    stop_processes([proc], timeout_s, linger_s)


def log_tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def http_status(url: str, timeout_s: float = 1.0) -> int | None:
    """The status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


class ExitedEarly(RuntimeError):
    """A child ended while we waited for it to serve; the message carries its log's tail."""

    def __init__(self, name: str, returncode: int, log: str) -> None:
        super().__init__(f"{name} exited with {returncode}; log:\n{log}")
        self.log = log


def wait_serving(
    proc: subprocess.Popen[bytes], ports: Sequence[int], log: Path, timeout_s: float = 30.0
) -> None:
    """Block until a child accepts connections on every one of `ports`; ExitedEarly (with its log)
    if it ends first, TimeoutError after timeout_s."""
    argv = proc.args if isinstance(proc.args, list) else [proc.args]
    name = " ".join(str(a) for a in argv)[:120]

    def serving() -> bool:
        if proc.poll() is not None:
            raise ExitedEarly(name, proc.returncode, log_tail(log))
        return all(port_answers(p) for p in ports)

    wait_until(serving, timeout_s, f"{name} serving on 127.0.0.1:{', '.join(map(str, ports))}")


def start_server(
    argv: list[str],
    ports: Sequence[int],
    log: Path,
    env: dict[str, str] | None = None,
    *,
    cpus: str | None = None,
    timeout_s: float = 30.0,
) -> subprocess.Popen[bytes]:
    """start_process, then wait_serving: a server child (a backend, a store, a peer) that listens."""
    proc = start_process(pinned(argv, cpus), log, env)
    try:
        wait_serving(proc, ports, log, timeout_s)
    except BaseException:
        stop_process(proc)
        raise
    return proc


@dataclass
class RouterProcess:
    """`prefix-router serve` as a child process on 127.0.0.1:port."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    metrics_port: int | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        """Raise ExitedEarly if the process has ended."""
        if self.proc.poll() is not None:
            raise ExitedEarly("prefix-router", self.proc.returncode, log_tail(self.log))

    def _ready_now(self, readyz: bool) -> bool:
        self.check()
        if readyz:
            return http_status(f"http://127.0.0.1:{self.metrics_port or self.port}/readyz") == 200
        return port_answers(self.port) and (self.metrics_port is None or port_answers(self.metrics_port))

    def wait_ready(self, *, readyz: bool = False, timeout_s: float = 30.0) -> None:
        """Block until its ports accept connections (or, with readyz, until /readyz answers 200: a
        backend is healthy); ExitedEarly if it dies first, TimeoutError with its log after timeout_s."""
        try:
            wait_until(lambda: self._ready_now(readyz), timeout_s, "ready")
        except TimeoutError:
            raise self._not_ready(timeout_s) from None

    async def ready(self, *, readyz: bool = False, timeout_s: float = 30.0) -> None:
        """wait_ready for a caller whose event loop must keep running (in-process backends)."""
        try:
            await eventually(lambda: asyncio.to_thread(self._ready_now, readyz), timeout_s, "ready", 0.05)
        except AssertionError:
            raise self._not_ready(timeout_s) from None

    def _not_ready(self, timeout_s: float) -> TimeoutError:
        return TimeoutError(f"router on :{self.port} not ready after {timeout_s:g} s:\n{log_tail(self.log)}")

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.proc, timeout_s)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without PREFIX_ROUTER_* (a caller's own settings must not leak into a
    child router, which also refuses variables of that prefix it does not know, such as the vLLM
    tier's PREFIX_ROUTER_VLLM_*), plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_ROUTER_")}, **extra}


def launch_router(
    flags: Sequence[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cpus: str | None = None,
    port: int | None = None,
    metrics_port: int | None = None,
    python_code: str | None = None,
) -> RouterProcess:
    """Start `prefix-router serve --host 127.0.0.1 --port PORT [--metrics-port M] FLAGS…` (a free port
    unless given), not waiting for it: call wait_ready() or ready(). With python_code, the command is
    `python -c CODE serve …` instead of `python -m prefix_router serve …` (a wrapper that prepares
    the process before handing over to the CLI)."""
    port = port or free_port()
    serve = ["serve", "--host", "127.0.0.1", "--port", str(port)]
    if metrics_port is not None:
        serve += ["--metrics-port", str(metrics_port)]
    serve += list(flags)
    head = [sys.executable, "-c", python_code] if python_code else [sys.executable, "-m", "prefix_router"]
    argv = [*head, *serve]
    proc = start_process(pinned(argv, cpus), log, env if env is not None else clean_env())
    return RouterProcess(proc, port, log, metrics_port, argv)
