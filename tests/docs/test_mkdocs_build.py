"""The docs site builds with ``mkdocs build --strict`` (no broken link, anchor or nav entry), and its
generated reference pages hold every CLI command and option and every config field."""

from __future__ import annotations

import argparse
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", page.read_text()))


@pytest.mark.slow
def test_every_nav_page_is_built(site):
    import yaml

    def pages(nav):
        for entry in nav:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from pages(value) if isinstance(value, list) else [value]

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    for page in pages(nav):
        built = site / (page.removesuffix(".md").removesuffix("index") + "/index.html").lstrip("/")
        assert built.is_file(), f"{page} was not built"


def test_the_cli_reference_lists_every_command_and_option(site):
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        from reference import cli_parser
    finally:
        sys.path.pop(0)
    text = _text(site / "reference" / "cli" / "index.html")
    sub = next(a for a in cli_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"run", "plan", "show", "plugins", "calibrate", "profile"} <= set(sub.choices)
    for name, parser in sub.choices.items():
        assert f"flowrl {name}" in text
        for action in parser._actions:
            for option in action.option_strings:
                assert option in text, f"flowrl {name} {option} is not in the CLI reference"


def test_the_config_reference_lists_every_field_with_its_default(site):
    from flowrl.specs import RunConfig

    text = _text(site / "reference" / "config" / "index.html")

    def fields(cls, prefix=""):
        for f in msgspec.structs.fields(cls):
            key = f"{prefix}{f.name}"
            if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
                yield from fields(f.type, f"{key}.")
            else:
                yield key

    keys = list(fields(RunConfig))
    assert "train.lora.rank" in keys
    for key in keys:
        assert key in text, f"config field {key} is not in the config reference"
    assert "0: no adapters, the whole model trains" in text  # a field's comment is its documentation


def test_the_generated_references_name_only_files_that_exist(site):
    for page in ("cli", "config"):
        text = _text(site / "reference" / page / "index.html")
        for path in re.findall(r"\b((?:flowrl|graphs|examples|benchmarks|plugins|tests)/[\w/-]+\.\w+)", text):
            assert (ROOT / path).exists(), f"the {page} reference names {path}, which does not exist"
