"""The same flag means the same thing in every subcommand: --backend URL (repeatable), --count N."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from clikit import run_cli

REPO = Path(__file__).resolve().parents[2]


def test_serve_help_ends_with_examples_as_written() -> None:
    done = run_cli("serve", "--help")
    assert done.returncode == 0
    tail = done.stdout[done.stdout.index("examples:") :].splitlines()
    # RawDescriptionHelpFormatter: one example a line, indented as written, not re-wrapped into a paragraph.
    assert "  prefix-router serve --backend http://vllm-0:8000 --backend http://vllm-1:8000" in tail
    assert any(line.startswith("  PREFIX_ROUTER_BACKENDS=") for line in tail)
    assert "--backend URL" in done.stdout


@pytest.mark.parametrize("command", ["demo", "sim"])
def test_a_number_of_backends_is_count(command: str) -> None:
    done = run_cli(command, "--help")
    assert done.returncode == 0
    assert "--count N" in done.stdout or re.search(r"--count COUNT", done.stdout)
    assert "--backends" not in done.stdout


def test_the_old_demo_spelling_still_works_and_says_so() -> None:
    done = run_cli("demo", "--backends", "0")  # 0: refused right after parsing, so nothing starts
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "prefix-router demo: --backends is deprecated; use --count N",
        "prefix-router demo: --count must be at least 1",
    ]


def test_docs_use_the_new_spellings() -> None:
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        assert not re.search(r"prefix-router demo[^\n`]*--backends", text), doc
        assert not re.search(r"prefix_router(\.sim)?[^\n`]* sim [^\n`]*--backends", text), doc
