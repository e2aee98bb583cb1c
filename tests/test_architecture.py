"""The module map holds: routing/ is pure, each plane imports only what docs/architecture.md allows,
and every module is on the map."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import prefix_router

PACKAGE_DIR = Path(prefix_router.__file__).parent
MAP_FILE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
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


# Each plane (a top-level module or folder of the package) and the planes it may import besides itself.
# docs/architecture.md states the same table and why; change both together.
EVERYTHING = "*"
# The composition root wires every plane but the commands, the demo and the simulated fleet.
COMPOSED = {
    "__init__",
    "errors",
    "routing",
    "settings",
    "frontend",
    "upstream",
    "placement",
    "relay",
    "fleet",
    "ops",
    "tcp",
    "waiters",
}
PLANE_MAY_IMPORT: dict[str, set[str] | str] = {
    "routing": set(),
    "errors": set(),
    "tcp": set(),
    "waiters": set(),
    "frontend": {"errors", "tcp"},
    "upstream": {"errors", "tcp", "waiters"},
    "placement": {"errors", "routing", "waiters", "fleet"},
    "fleet": {"errors", "routing", "settings", "upstream"},
    "ops": {"errors", "routing", "fleet", "frontend", "settings", "__init__"},
    "relay": {
        "errors",
        "routing",
        "settings",
        "frontend",
        "upstream",
        "placement",
        "fleet",
        "ops",
        "waiters",
    },
    "settings": {"errors", "routing", "upstream"},
    "router": COMPOSED,
    "runtime": COMPOSED | {"router"},
    "cli": EVERYTHING,
    "demo": EVERYTHING,
    "__main__": {"cli"},
    "__init__": set(),
    "sim": set(),
    "loadgen": {"sim"},
}
# Checked over the transitive closure of our own imports: these planes stay free of the web framework and
# the metrics client, so another front end or transport can reuse them.
FRAMEWORK_FREE = {"frontend", "upstream", "placement"}
FRAMEWORKS = {"fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "pydantic_settings"}

ALL_SOURCES = sorted(PACKAGE_DIR.rglob("*.py"))


def plane_of(module: str) -> str:
    """`prefix_router.fleet.health` -> `fleet`; `prefix_router` itself -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _ours(module: str) -> bool:
    return module == "prefix_router" or module.startswith("prefix_router.")


def resolve(name: str) -> str:
    """The module a name imports from: `prefix_router.__version__` is the package's attribute."""
    while "." in name and _source_of(name) is None:
        name = name.rpartition(".")[0]
    return name


def plane_allows(importer: str, imported: str) -> bool:
    here, there = plane_of(importer), plane_of(resolve(imported))
    if here == there:
        return True
    allowed = PLANE_MAY_IMPORT[here]
    return allowed == EVERYTHING or there in allowed


@pytest.mark.parametrize(
    "source", [pytest.param(p, id=p.relative_to(PACKAGE_DIR).as_posix()) for p in ALL_SOURCES]
)
def test_module_imports_only_what_its_plane_may(source: Path) -> None:
    module = _module_name(source)
    assert plane_of(module) in PLANE_MAY_IMPORT, f"{module} is in no plane: add it to PLANE_MAY_IMPORT"
    # `from prefix_router import errors` also names the package itself, which every import loads anyway.
    names = imported_modules(source) - {"prefix_router"}
    bad = sorted(m for m in names if _ours(m) and not plane_allows(module, m))
    assert not bad, f"{source.relative_to(PACKAGE_DIR)} ({plane_of(module)}) imports {bad}"


def _source_of(module: str) -> Path | None:
    if module == "prefix_router":
        return PACKAGE_DIR / "__init__.py"
    rel = Path(*module.split(".")[1:])
    for candidate in (PACKAGE_DIR / rel.with_suffix(".py"), PACKAGE_DIR / rel / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def transitive_imports(source: Path) -> set[str]:
    """Everything `source` imports, following our own modules (what loading it loads)."""
    seen: set[Path] = set()
    found: set[str] = set()
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imported_modules(path):
            found.add(name)
            if _ours(name):
                target = _source_of(name)
                if target is not None:
                    todo.append(target)
    return found


FRAMEWORK_FREE_SOURCES = [p for p in ALL_SOURCES if plane_of(_module_name(p)) in FRAMEWORK_FREE]
FRAMEWORK_FREE_SOURCES_PLANES = {plane_of(_module_name(p)) for p in FRAMEWORK_FREE_SOURCES}


@pytest.mark.parametrize(
    "source", [pytest.param(p, id=p.relative_to(PACKAGE_DIR).as_posix()) for p in FRAMEWORK_FREE_SOURCES]
)
def test_data_path_planes_load_no_framework(source: Path) -> None:
    bad = sorted(m for m in transitive_imports(source) if _top(m) in FRAMEWORKS)
    assert not bad, f"{source.relative_to(PACKAGE_DIR)} loads {bad}"


def test_plane_rules_reject_what_they_should() -> None:
    # The checker itself must be able to fail.
    assert not plane_allows("prefix_router.placement", "prefix_router.frontend.http1")
    assert not plane_allows("prefix_router.placement", "prefix_router.upstream.client")
    assert not plane_allows("prefix_router.fleet.health", "prefix_router.relay")
    assert not plane_allows("prefix_router.fleet.backends", "prefix_router.placement")
    assert not plane_allows("prefix_router.upstream.pool", "prefix_router.placement")
    assert not plane_allows("prefix_router.relay", "prefix_router.router")
    assert not plane_allows("prefix_router.sim.server", "prefix_router.routing.ring")
    assert not plane_allows("prefix_router.routing.keys", "prefix_router.errors")
    assert plane_allows("prefix_router.router", "prefix_router.relay")
    assert plane_allows("prefix_router.demo.run", "prefix_router.sim.fleet")
    assert plane_allows("prefix_router.ops.metrics", "prefix_router.__version__")
    assert not plane_allows("prefix_router.fleet.backends", "prefix_router.__version__")
    assert {"frontend", "upstream", "placement"} <= FRAMEWORK_FREE_SOURCES_PLANES


def test_transitive_check_sees_what_a_module_loads() -> None:
    # settings.py uses pydantic: anything that imports it loads pydantic.
    loaded = transitive_imports(PACKAGE_DIR / "fleet" / "health.py")
    assert "pydantic" in {_top(m) for m in loaded}


def mapped_paths(text: str) -> set[str]:
    """Module paths named in the first column of the module map's table."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w/]+\.py)` \|", section, flags=re.MULTILINE))


def test_every_module_is_on_the_map() -> None:
    on_disk = {p.relative_to(PACKAGE_DIR).as_posix() for p in ALL_SOURCES}
    mapped = mapped_paths(MAP_FILE.read_text())
    assert not on_disk - mapped, f"missing from docs/architecture.md: {sorted(on_disk - mapped)}"
    assert not mapped - on_disk, (
        f"docs/architecture.md names modules that do not exist: {sorted(mapped - on_disk)}"
    )


def test_map_reader_reads_the_table() -> None:
    text = (
        "# x\n## Module map\n\n| module | job |\n|---|---|\n"
        "| `a.py` | one |\n| `b/c.py` | two |\n## Next\n| `d.py` | no |\n"
    )
    assert mapped_paths(text) == {"a.py", "b/c.py"}
