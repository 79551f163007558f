"""The design docs are in the repo and what cites them finds them."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("fastdeploy", "custom_ops", "benchmarks", "tests")
SOURCE_SUFFIXES = {".py", ".cc", ".cu", ".cuh", ".h", ".md", ".yaml"}
DOCS = {"architecture", "memory_model", "retention_rule", "scheduler", "op_contract", "models", "serving",
        "benchmarks", "swa_quality", "gpu", "tensor_parallel", "testing"}


def _sources():
    for top in SOURCE_DIRS:
        for path in (REPO / top).rglob("*"):
            if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts and path != Path(__file__):
                yield path


def test_the_docs_the_issue_asks_for_exist():
    assert DOCS <= {p.stem for p in (REPO / "docs").glob("*.md")}


def test_no_code_cites_a_design_document_that_is_not_in_the_repo():
    stale = [f"{p.relative_to(REPO)}:{i}" for p in _sources()
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if "DESIGN §" in line or "DESIGN.md" in line]
    assert stale == []


def test_every_cited_docs_path_exists():
    cited = {(p.relative_to(REPO), m) for p in [*_sources(), REPO / "README.md"]
             for m in re.findall(r"docs/[\w./-]+\.md", p.read_text(errors="replace"))}
    assert cited, "nothing cites docs/"
    assert [(str(p), m) for p, m in cited if not (REPO / m).is_file()] == []


def _pages():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_readme_and_the_docs_resolves_to_a_file_and_heading():
    broken = []
    for page in _pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # an outside address: not checked (no network here)
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.relative_to(REPO)} -> {target} (no such heading)")
    assert broken == []


def test_every_docs_page_is_in_the_index():
    index = REPO / "docs" / "README.md"
    pages = [p for p in (REPO / "docs").glob("*.md") if p != index]
    assert [p.name for p in pages if f"]({p.name})" not in index.read_text()] == []


def test_the_readme_stays_one_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_user_documentation_names_no_issue_or_work_session():
    words = re.compile(r"\bissue \d+|\bthis (round|session)\b|\blast round\b|\bthe lead\b|DESIGN §", re.I)
    found = [f"{p.relative_to(REPO)}:{i}: {m.group(0)}" for p in _pages()
             for i, line in enumerate(p.read_text().splitlines(), 1) for m in [words.search(line)] if m]
    assert found == []


def test_committed_pictures_are_small_and_shown():
    shown = "".join(p.read_text() for p in _pages())
    for image in (REPO / "docs" / "images").iterdir():
        assert image.stat().st_size < 200_000, image.name
        assert f"images/{image.name}" in shown, f"{image.name} is not shown on any page"
