"""docs/configuration.md is generated from the settings' descriptions, and is never out of date; every
field has a description, and it is the only place a field is documented in settings.py."""

from __future__ import annotations

import ast
import importlib.util
import io
import subprocess
import sys
import tokenize
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel

import prefix_router.settings as settings_module
from prefix_router.settings import BackendSettings, Settings

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "gen_config_reference.py"
DOC = REPO / "docs" / "configuration.md"


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sections() -> dict[str, type[BaseModel]]:
    out: dict[str, type[BaseModel]] = {"backends": BackendSettings}
    for name, info in Settings.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out[name] = info.annotation
    return out


def test_the_reference_is_up_to_date() -> None:
    assert DOC.read_text(encoding="utf-8") == load_tool().render(), (
        "docs/configuration.md is out of date: run python tools/gen_config_reference.py"
    )
    done = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(DOC.read_text(encoding="utf-8").replace("| `port` |", "| `prot` |"), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(TOOL), "--check", "--output", str(stale)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "out of date" in done.stderr


@pytest.mark.parametrize("section", sorted(sections()))
def test_every_field_has_a_description_in_the_reference(section: str) -> None:
    text = DOC.read_text(encoding="utf-8")
    assert Settings.model_fields[section].description, section
    for name, info in sections()[section].model_fields.items():
        assert info.description and len(info.description) >= 12, f"{section}.{name} has no description"
        assert info.description.rstrip().endswith((".", ")")), f"{section}.{name}: a sentence"
        env = f"`PREFIX_ROUTER_{section.upper()}__{name.upper()}`" if section != "backends" else "-"
        assert f"| `{name}` | {env} |" in text, f"{section}.{name} missing from the reference"


def test_no_field_is_documented_by_a_comment_beside_it() -> None:
    """Field(description=...) is the single source: no `# ...` comment on a field or the line above it."""
    source = Path(settings_module.__file__).read_text(encoding="utf-8")
    comment_lines = {
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT and token.string != "# fmt: skip"
    }
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name.endswith("Settings"):
            for item in node.body:
                if isinstance(item, ast.AnnAssign):
                    span = set(range(item.lineno - 1, (item.end_lineno or item.lineno) + 1))
                    assert not span & comment_lines, (
                        f"{node.name}, line {item.lineno}: a comment documents it"
                    )
