"""The module map holds: routing/ is pure, and only the CLI and the demo reach into sim/."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import prefix_router

PACKAGE_DIR = Path(prefix_router.__file__).parent
ROUTING_DIR = PACKAGE_DIR / "routing"

ROUTING_MAY_IMPORT = {"xxhash", "orjson", "msgspec"}  # pure, no I/O: hashing, JSON encode, JSON parse
NEVER_IN_ROUTING = {
    "asyncio",
    "fastapi",
    "starlette",
    "aiohttp",
    "httpx",
    "prometheus_client",
    "pydantic",
    "pydantic_settings",
    "uvicorn",
    "socket",
    "ssl",
    "selectors",
    "threading",
    "subprocess",
    "urllib",
    "http",
    "os",
}
# The CLI and the demo run the simulated fleet; loadgen/ builds workloads on the sim.
MAY_IMPORT_SIM = {"cli.py", "demo/run.py", "demo/load.py", "loadgen/workloads.py", "loadgen/traces.py"}


def _module_name(source: Path) -> str:
    rel = source.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: Path) -> set[str]:
    package = _module_name(source)
    if source.name != "__init__.py":
        package = package.rpartition(".")[0]
    return imports_in(source.read_text(), package)


def imports_in(text: str, package: str) -> set[str]:
    """Absolute names of everything `text` imports, at any depth (function-level imports included)."""
    tree = ast.parse(text)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            # `from prefix_router import sim` imports a module too.
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            names.add("<dynamic __import__>")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
        ):
            names.add("<dynamic import_module>")
    return names


def _top(module: str) -> str:
    return module.split(".")[0]


def _routing_allows(module: str) -> bool:
    if module == "prefix_router.routing" or module.startswith("prefix_router.routing."):
        return True
    top = _top(module)
    if top in NEVER_IN_ROUTING:
        return False
    return top in ROUTING_MAY_IMPORT or top in sys.stdlib_module_names or module == "__future__"


ROUTING_SOURCES = sorted(ROUTING_DIR.glob("*.py"))


def test_routing_modules_exist() -> None:
    names = {p.stem for p in ROUTING_SOURCES}
    expected = {"hashing", "canonical", "keys", "ring", "load", "prefix_index", "picker", "config"}
    assert expected <= names


@pytest.mark.parametrize("source", [pytest.param(p, id=p.stem) for p in ROUTING_SOURCES])
def test_routing_is_pure(source: Path) -> None:
    imports = imported_modules(source)
    bad = sorted(m for m in imports if not _routing_allows(m))
    assert not bad, f"routing/{source.name} imports {bad}"


def test_routing_allow_list_rejects_what_it_should() -> None:
    # The checker itself must be able to fail.
    for name in ("asyncio", "fastapi.routing", "aiohttp", "httpx", "prometheus_client", "pydantic"):
        assert not _routing_allows(name)
    for name in ("uvicorn", "socket", "prefix_router.fleet.backends", "prefix_router.sim.fleet", "numpy"):
        assert not _routing_allows(name)
    for name in ("bisect", "xxhash", "orjson", "prefix_router.routing.ring", "__future__", "collections.abc"):
        assert _routing_allows(name)


def test_checker_sees_relative_nested_and_dynamic_imports() -> None:
    text = (
        "def f():\n"
        "    import asyncio\n"
        "    from ..sim import fleet\n"
        "    from . import ring\n"
        "    __import__('socket')\n"
    )
    names = imports_in(text, "prefix_router.routing")
    assert {"asyncio", "prefix_router.sim", "prefix_router.sim.fleet", "prefix_router.routing.ring"} <= names
    assert "<dynamic __import__>" in names
    assert not all(_routing_allows(m) for m in names)


def _imports_sim(module: str) -> bool:
    return module == "prefix_router.sim" or module.startswith("prefix_router.sim.")


OUTSIDE_SIM = sorted(
    p
    for p in PACKAGE_DIR.rglob("*.py")
    if "sim" not in p.relative_to(PACKAGE_DIR).parts[:1]
    and p.relative_to(PACKAGE_DIR).as_posix() not in MAY_IMPORT_SIM
)


def test_outside_sim_list_is_sane() -> None:
    rel = {p.relative_to(PACKAGE_DIR).as_posix() for p in OUTSIDE_SIM}
    assert "relay.py" in rel
    assert "routing/keys.py" in rel
    assert not any(r.startswith("sim/") for r in rel)
    assert not rel & MAY_IMPORT_SIM


@pytest.mark.parametrize(
    "source", [pytest.param(p, id=p.relative_to(PACKAGE_DIR).as_posix()) for p in OUTSIDE_SIM]
)
def test_core_never_imports_sim(source: Path) -> None:
    bad = sorted(m for m in imported_modules(source) if _imports_sim(m))
    assert not bad, f"{source.relative_to(PACKAGE_DIR)} imports {bad}"
