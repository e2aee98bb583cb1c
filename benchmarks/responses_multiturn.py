"""guidellm's multi-turn Responses API run through several router replicas that share no state.

Each turn after the first is a `POST /v1/responses` naming `previous_response_id`: only the backend
that stored the previous response can answer it. Two simulated vLLM backends (response store on, one
`prefix-router sim` process each), `--replicas` routers in front of both, and nginx round robin over
the routers, so consecutive turns of one conversation reach different replicas. guidellm
(`request_format=/v1/responses,server_history=true`) drives the load, streaming and not.

The control is the same nginx round robin straight over the two backends, no router: a follow-up that
lands on the other backend gets vLLM's 404, which guidellm counts as an errored request (and it drops
the rest of that conversation, so the control's total falls short of --requests).

Everything listens on 127.0.0.1 on ports the kernel picks, and every child is stopped on the way out
(Ctrl-C and SIGTERM included). Needs guidellm (`pip install guidellm`, in a venv of its own if you
like: `--guidellm PATH`), a local tokenizer directory for it (`--tokenizer DIR`, made by
`tools/make_tiny_model.py`) and nginx.

    .venv-gl/bin/python tools/make_tiny_model.py tiny-llama 64 2 2 128    # guidellm's venv has torch
    python benchmarks/responses_multiturn.py --guidellm .venv-gl/bin/guidellm --tokenizer tiny-llama
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BackgroundMeter,
    markdown_table,
    nginx_argv,
    nginx_conf,
    nginx_executable,
    print_header,
    report_results,
    tool_version,
)
from prefix_router import __version__

from loopback import free_port
from processes import (
    RouterProcess,
    clean_env,
    launch_router,
    log_tail,
    start_process,
    start_server,
    stop_processes,
)

BACKENDS = 2
MODEL = "sim-llama"
RUN_TIMEOUT_S = 900.0


@dataclass
class Run:
    path: str
    stream: bool
    totals: dict[str, int]


class Children:
    """Every child this run starts, stopped together on the way out."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def add(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        stop_processes(list(reversed(self.procs)))
        self.procs.clear()


def start_sims(children: Children, work: Path) -> list[int]:
    """BACKENDS simulated vLLM servers, one process each on a port of its own."""
    ports = []
    for i in range(BACKENDS):
        port = free_port()
        argv = [sys.executable, "-m", "prefix_router", "sim", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--count", "1", "--model", MODEL, "--responses-store"]
        children.add(start_server(argv, [port], work / f"sim-{i}.log"))
        ports.append(port)
    return ports


def start_routers(children: Children, sims: list[int], replicas: int, work: Path) -> list[int]:
    flags = ["--log-level", "warning"]
    for port in sims:
        flags += ["--backend", f"http://127.0.0.1:{port}"]
    routers: list[RouterProcess] = []
    for i in range(replicas):
        router = launch_router(flags, work / f"router-{i}.log", env=clean_env())
        children.add(router.proc)
        routers.append(router)
    for router in routers:
        router.wait_ready(readyz=True)
    return [r.port for r in routers]


def start_nginx(children: Children, nginx: str, upstreams: list[int], work: Path, name: str) -> int:
    """nginx round robin over 127.0.0.1:upstreams (kept-alive HTTP/1.1, unbuffered, as for streams)."""
    ndir = work / name
    ndir.mkdir()
    port = free_port()
    conf = ndir / "nginx.conf"
    conf.write_text(nginx_conf(ndir, upstreams, port))
    children.add(start_server(nginx_argv(nginx, ndir, conf), [port], ndir / "nginx.log"))
    return port


def run_guidellm(
    children: Children, args: argparse.Namespace, port: int, stream: bool, out: Path
) -> dict[str, int]:
    """One guidellm run against 127.0.0.1:port; its request totals (successful, errored, incomplete)."""
    backend = (
        f"kind=openai_http,target=http://127.0.0.1:{port},model={MODEL},request_format=/v1/responses,"
        f"server_history=true,stream={'true' if stream else 'false'}"
    )
    data = (
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens},"
        f"turns={args.turns},prefix_tokens=64,prefix_count=4"
    )
    argv = [
        args.guidellm, "run", "--backend", backend, "--data", data,
        "--profile", f"kind=concurrent,streams={args.streams}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--tokenizer", f"kind=hf_auto,model={args.tokenizer}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive",
    ]  # fmt: skip
    log = out.with_suffix(".log")
    env = clean_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = children.add(start_process(argv, log, env))
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"guidellm did not finish in {RUN_TIMEOUT_S:g} s:\n{log_tail(log)}") from None
    if code != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited with {code}:\n{log_tail(log)}")
    report: dict[str, Any] = json.loads(out.read_text())
    totals = report["benchmarks"][0]["metrics"]["request_totals"]
    return {k: int(totals[k]) for k in ("successful", "errored", "incomplete", "total")}


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--guidellm", default="guidellm", help="guidellm executable (default: on PATH)")
    parser.add_argument("--tokenizer", type=Path, help="local tokenizer directory for guidellm (required)")
    parser.add_argument("--requests", type=int, default=80, help="requests per run (default: %(default)s)")
    parser.add_argument(
        "--streams", type=int, default=8, help="concurrent conversations (default: %(default)s)"
    )
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default: %(default)s)")
    parser.add_argument("--replicas", type=int, default=2, help="router replicas (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="(default: %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--no-control", action="store_true", help="skip the run with no router")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()

    guidellm = shutil.which(args.guidellm)
    if guidellm is None or args.tokenizer is None or not args.tokenizer.is_dir():
        print(
            "needs guidellm (pip install guidellm; --guidellm PATH if it is not on PATH) and a local "
            "tokenizer directory (--tokenizer DIR, made by tools/make_tiny_model.py)",
            file=sys.stderr,
        )
        return 2
    nginx = nginx_executable()
    if nginx is None:
        print(
            "needs nginx for the round robin in front of the replicas (apt-get install -y nginx)",
            file=sys.stderr,
        )
        return 2
    args.guidellm = guidellm
    args.tokenizer = args.tokenizer.resolve()

    versions = {
        "prefix-router": __version__,
        "guidellm": (tool_version([guidellm, "--version"]) or "").replace("guidellm version: ", "") or None,
        "nginx": (tool_version([nginx, "-v"]) or "").replace("nginx version: nginx/", "") or None,
    }
    title = f"guidellm multi-turn Responses API through {args.replicas} router replicas, no shared state"
    meta = print_header(title, versions)
    print(
        f"{BACKENDS} simulated backends (response store on), {args.requests} requests per run, "
        f"{args.streams} concurrent conversations of {args.turns} turns, nginx round robin in front\n",
        flush=True,
    )

    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    children = Children()
    runs: list[Run] = []
    meter = BackgroundMeter()
    with tempfile.TemporaryDirectory(prefix="responses-multiturn-") as tmp:
        work = Path(tmp)
        try:
            sims = start_sims(children, work)
            routers = start_routers(children, sims, args.replicas, work)
            via_routers = start_nginx(children, nginx, routers, work, "nginx-routers")
            plan = [(f"nginx RR → {args.replicas} routers", via_routers, s) for s in (True, False)]
            if not args.no_control:
                direct = start_nginx(children, nginx, sims, work, "nginx-sims")
                plan += [("nginx RR → backends (no router)", direct, s) for s in (True, False)]
            for i, (path, port, stream) in enumerate(plan):
                totals = run_guidellm(children, args, port, stream, work / f"run-{i}.json")
                runs.append(Run(path, stream, totals))
                print(f"{path}, stream={stream}: {totals}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            print("interrupted: stopping every child", file=sys.stderr)
            return 130
        finally:
            children.stop()
            meter.stop()

    columns = ("successful", "errored", "incomplete", "total")
    rows = [[r.path, r.stream, *(r.totals[k] for k in columns)] for r in runs]
    print(markdown_table(["path", "stream", *columns], rows))
    print(f"\n{meter.note()}")
    payload = {
        **meta,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "background_cpus": meter.cpus,
        "runs": [{"path": r.path, "stream": r.stream, **r.totals} for r in runs],
    }
    report_results("responses_multiturn", payload, save=not args.no_save)
    routed_errors = sum(r.totals["errored"] for r in runs if "routers" in r.path)
    return 1 if routed_errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
