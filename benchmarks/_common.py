"""The benchmarks' harness: what every benchmark prints and saves (the machine, the versions, the command
that reproduces it, one results line), CPU meters, and the peer's command line. Importing it puts tests/
on the path: the benchmarks start, wait for and stop what they measure with the tests' kit (loopback,
processes, rawhttp), so there is one way to do each.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # after the script's folder

from loopback import free_port

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
    }


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def tool_version(argv: Sequence[str]) -> str | None:
    """First line of a tool's version output (stdout or stderr), or None when it is not installed."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def command_line() -> str:
    """The exact command that reproduces this run, from the repository root."""
    script = Path(sys.argv[0])
    try:
        shown = str(script.resolve().relative_to(REPO_ROOT))
    except ValueError:
        shown = str(script)
    return shlex.join(["python", shown, *sys.argv[1:]])


def print_header(title: str, versions: dict[str, str | None]) -> dict[str, Any]:
    info = machine_info()
    print(f"# {title}")
    print()
    print(f"- machine: {info['nproc']} CPUs, {info['cpu_model']}, Linux {info['kernel']}")
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    missing = [k for k, v in versions.items() if not v]
    print(f"- versions: {shown}" + (f" (not installed: {', '.join(missing)})" if missing else ""))
    print(f"- git: {git_revision() or 'unknown'}")
    print(f"- reproduce: `{command_line()}`")
    print(flush=True)
    return {"machine": info, "versions": versions, "git": git_revision(), "command": command_line()}


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = RESULTS_DIR / f"{name}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def report_results(name: str, payload: dict[str, Any], *, save: bool = True) -> None:
    """Every benchmark's last line: where its figures were saved (nothing with --no-save)."""
    if save:
        print(f"\nresults: {write_results(name, payload)}")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return "–" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def sglang_router_argv(
    worker_urls: Sequence[str], port: int, *extra: str, python: str = sys.executable
) -> list[str]:
    """The peer, SGLang's router, with its cache-aware policy on 127.0.0.1:port. Its metrics exporter
    binds 29000 by default: each gets a port of its own, so several can run side by side."""
    return [
        python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
        "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *extra,
    ]  # fmt: skip


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
{servers}
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


def nginx_executable() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def nginx_conf(work: Path, upstream_ports: Sequence[int], port: int) -> str:
    """nginx in the foreground, one worker, on 127.0.0.1:port: round robin over 127.0.0.1:upstream_ports
    with kept-alive HTTP/1.1 upstream connections and no buffering (streams pass through as they come);
    its pid, logs and temp files under `work`."""
    servers = "\n".join(f"        server 127.0.0.1:{p};" for p in upstream_ports)
    return NGINX_CONF.format(work=work, servers=servers, port=port)


def nginx_argv(exe: str, work: Path, conf: Path) -> list[str]:
    return [exe, "-c", str(conf), "-p", str(work), "-e", str(work / "err.log")]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/PID/stat."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    # After the comm field: state is fields[0]; utime and stime are the 14th and 15th stat fields.
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def kernel_cpu_seconds(pid: int) -> float:
    """stime of a process (all its threads): its CPU seconds in the kernel, from /proc/PID/stat."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[12]) / os.sysconf("SC_CLK_TCK")


def runqueue_wait_seconds(pid: int) -> float:
    """Seconds the process's main thread was runnable but waiting for a CPU (another task held it),
    from /proc/PID/schedstat (0.0 where the kernel does not keep schedstats)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def busy_seconds(cpu: int | None = None) -> float:
    """CPU seconds spent busy by all CPUs, or by CPU `cpu` alone, since boot, from /proc/stat."""
    lines = Path("/proc/stat").read_text().splitlines()
    name = "cpu" if cpu is None else f"cpu{cpu}"
    fields = next(line for line in lines if line.split(maxsplit=1)[0] == name).split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """utime + stime of every child process waited for so far (wrk runs, for instance)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class BackgroundMeter:
    """How many CPUs' worth of work other processes did while a benchmark in this process ran.

    The machine may be shared; a figure measured while others kept the CPUs busy is suspect, so
    each script reports this next to its results.
    """

    def __init__(self) -> None:
        self.cpus = 0.0
        self.start()

    def start(self) -> None:
        t = os.times()
        self._own0 = t.user + t.system + t.children_user + t.children_system
        self._busy0 = busy_seconds()
        self._t0 = time.monotonic()

    def stop(self) -> float:
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system - self._own0
        elapsed = max(1e-9, time.monotonic() - self._t0)
        self.cpus = max(0.0, busy_seconds() - self._busy0 - own) / elapsed
        return self.cpus

    def note(self) -> str:
        return (
            f"other processes kept {self.cpus:.2f} of {os.cpu_count()} CPUs busy during the measurements"
            + (" — the machine was shared; treat absolute figures with care" if self.cpus > 0.2 else "")
        )
