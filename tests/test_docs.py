"""The repository a user takes home: a short README, links that resolve, a LICENSE, and user-facing text
that speaks of the product, not of how it was built (no work items, no commit ids, no files outside the
repository or paths of the machine it was written on)."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
README_MAX_LINES = 200
# sha256 of the Apache License 2.0 as the ASF publishes it (https://www.apache.org/licenses/LICENSE-2.0.txt).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# An inline link or image: [text](target "title"); the text may hold backticks but no brackets.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
# Repository paths named in code spans: they must exist in a fresh clone.
REPO_PATH = re.compile(r"^(?:src|tests|benchmarks|docs|tools|config|helm)/[\w./-]*$")
GENERATED = ("benchmarks/results/",)  # written by the benchmarks, gitignored

# Words of our own work, not of the product, and places a user does not have.
FORBIDDEN = {
    "a design document outside the repository": re.compile(r"\.\./shared|\bDESIGN\.md\b"),
    "a path of the machine the text was written on": re.compile(
        r"(?<![\w.])/(?:work|home|Users|root)/|/tmp/bash_jobs"
    ),
    "a work item's number": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    "a commit id": re.compile(
        r"\b(?:git|at|before|after)\s+(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
    ),
    "a session or day of our work": re.compile(r"\b(?:session|day)\s+\d+\b", re.IGNORECASE),
}


def user_docs() -> list[Path]:
    docs = [README, *sorted((REPO / "docs").glob("*.md"))]
    docs += sorted((REPO / "benchmarks").rglob("*.md"))
    docs += sorted((REPO / "helm").rglob("*.md"))
    return docs


def linked_docs() -> list[Path]:
    """The documents whose links and repository paths are checked."""
    docs = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]
    return docs + sorted((REPO / "helm").rglob("*.md"))


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lower-cased, punctuation but `-` and `_`
    dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in ("L", "N"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 for repeated headings."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    problems: list[str] = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            where = f"{path.relative_to(root)}:{number}: {target}"
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{where}: no such file")
                continue
            if root not in dest.parents:
                problems.append(f"{where}: points outside the repository")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    return problems


def test_readme_is_at_most_200_lines() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


@pytest.mark.parametrize("path", linked_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", linked_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_named_exists(path: Path) -> None:
    missing = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for span in CODE_SPAN.findall(line):
            name = span.split()[0] if span.split() else ""
            if not REPO_PATH.match(name) or any(ch in name for ch in "*<{") or name.startswith(GENERATED):
                continue
            if not (REPO / name).exists():
                missing.append(f"{path.relative_to(REPO)}:{number}: {name}")
    assert missing == []


@pytest.mark.parametrize("path", user_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_user_facing_text_speaks_of_the_product(path: Path) -> None:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if match := pattern.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {what}: {match.group(0)!r}")
    assert found == []


def test_the_docs_the_readme_promises_exist() -> None:
    for name in ("routing", "operations", "kubernetes", "benchmarks", "real-vllm-cpu"):
        assert (REPO / "docs" / f"{name}.md").is_file(), f"docs/{name}.md"
    assert (REPO / "benchmarks" / "RESULTS.md").is_file()


def test_license_is_the_apache_license_2_0() -> None:
    text = (REPO / "LICENSE").read_bytes()
    assert b"Apache License" in text and b"Version 2.0, January 2004" in text
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256, "LICENSE differs from the ASF's text"
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text(encoding="utf-8")


def test_slugs_follow_github() -> None:
    assert github_slug("Stored responses (the Responses API)") == "stored-responses-the-responses-api"
    assert github_slug("Why our own HTTP/1.1, not httpx") == "why-our-own-http11-not-httpx"
    assert github_slug("`docker run`") == "docker-run"
    assert github_slug("503 overloaded, with `Retry-After`") == "503-overloaded-with-retry-after"


def test_broken_links_and_anchors_are_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Deploy\n\n## Several replicas\n\n## Several replicas\n")
    doc = tmp_path / "a.md"
    doc.write_text(
        "# Top\n"
        "[ok](docs/b.md#several-replicas) [ok](docs/b.md#several-replicas-1) [ok](#top) "
        "[web](https://example.com/x.md)\n"
        "[gone](docs/c.md) [no anchor](docs/b.md#deploying) [self](#nowhere)\n"
        "```\n[in code](docs/d.md)\n```\n"
    )
    assert broken_links(doc, tmp_path) == [
        "a.md:3: docs/c.md: no such file",
        "a.md:3: docs/b.md#deploying: no heading with anchor #deploying in docs/b.md",
        "a.md:3: #nowhere: no heading with anchor #nowhere in a.md",
    ]
