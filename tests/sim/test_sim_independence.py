"""The sim stands alone: it imports nothing from prefix_router outside prefix_router.sim."""

from __future__ import annotations

import ast
from pathlib import Path

import prefix_router.sim

SIM_DIR = Path(prefix_router.sim.__file__).parent


def imported_modules(source: Path) -> set[str]:
    tree = ast.parse(source.read_text(), filename=str(source))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{source.name}: relative import"
            names.add(node.module or "")
    return names


def test_sim_imports_only_itself_from_prefix_router() -> None:
    sources = sorted(SIM_DIR.glob("*.py"))
    assert sources
    for source in sources:
        for module in imported_modules(source):
            if module == "prefix_router" or module.startswith("prefix_router."):
                assert module.startswith("prefix_router.sim"), f"{source.name} imports {module}"
