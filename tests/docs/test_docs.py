"""The design docs are in the repo and what cites them finds them."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("fastdeploy", "custom_ops", "benchmarks", "tests")
SOURCE_SUFFIXES = {".py", ".cc", ".cu", ".cuh", ".h", ".md", ".yaml"}
DOCS = {"architecture", "memory_model", "retention_rule", "scheduler", "op_contract", "adding_a_model"}


def _sources():
    for top in SOURCE_DIRS:
        for path in (REPO / top).rglob("*"):
            if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts and path != Path(__file__):
                yield path


def test_the_docs_the_issue_asks_for_exist():
    assert DOCS <= {p.stem for p in (REPO / "docs").glob("*.md")}


def test_no_code_cites_a_design_document_that_is_not_in_the_repo():
    stale = [f"{p.relative_to(REPO)}:{i}" for p in _sources()
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if "DESIGN §" in line]
    assert stale == []


def test_every_cited_docs_path_exists():
    cited = {(p.relative_to(REPO), m) for p in [*_sources(), REPO / "README.md"]
             for m in re.findall(r"docs/[\w./-]+\.md", p.read_text(errors="replace"))}
    assert cited, "nothing cites docs/"
    assert [(str(p), m) for p, m in cited if not (REPO / m).is_file()] == []


def test_links_between_docs_resolve():
    broken = []
    for doc in (REPO / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.name} -> {target}")
    assert broken == []
