"""Every fenced block in README.md and docs/ runs at a small size (but those that start a Ray cluster:
test_docs_ray_examples.py), learning claims name the test that asserts them, and the files the docs
name exist. How blocks are read, marked and run: ``docblocks``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docblocks import BLOCKS, LANGUAGES, LEARNING_CLAIM, PAGES, ROOT, RUNNABLE, Block, params, run_block


def test_the_docs_have_blocks_and_every_block_a_known_language():
    assert len(BLOCKS) > 30
    unknown = [f"{b.id} ({b.lang or 'no language'})" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not unknown, f"fence languages must be one of {sorted(LANGUAGES)}: {unknown}"


def _test_names() -> set[str]:
    files = [*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "plugins").glob("*/tests/test_*.py")]
    return {m for f in files for m in re.findall(r"^\s*def (test_\w+)\(", f.read_text(), re.M)}


def test_every_learning_claim_names_a_test_that_exists():
    names = _test_names()
    missing = [f"{b.id}: {b.marks['learns']}" for b in BLOCKS if "learns" in b.marks and b.marks["learns"] not in names]
    assert not missing, f"these blocks name a learning test that does not exist: {missing}"
    unclaimed = [
        f"{b.id}: {line.strip()}"
        for b in BLOCKS
        if b.lang == "bash" and "learns" not in b.marks and not {"needs", "skip"} & b.marks.keys()
        for line in b.text.splitlines()
        if "#" in line and LEARNING_CLAIM.search(line.split("#", 1)[1])
    ]
    assert not unclaimed, f"a command that claims learning needs <!-- docs: learns TEST --> above it: {unclaimed}"


PATH_IN_CODE = re.compile(r"`((?:flowrl|graphs|examples|benchmarks|plugins|tests|docs)/[\w./*-]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_files_the_docs_name_exist():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for path in PATH_IN_CODE.findall(text):
            if not list(ROOT.glob(path.rstrip("/"))):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
        for target in LINK.findall(text):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: link {target}")
    assert not missing, missing


def test_a_block_marked_as_a_file_is_that_file():
    marked = [b for b in BLOCKS if "same-as" in b.marks]
    assert marked
    for b in marked:
        assert b.text == (ROOT / b.marks["same-as"]).read_text(), f"{b.id} differs from {b.marks['same-as']}"


@pytest.mark.parametrize("block", params([b for b in RUNNABLE if not b.uses_ray]))
@pytest.mark.slow
def test_the_block_runs(block: Block, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_block(block, folder, capsys)
