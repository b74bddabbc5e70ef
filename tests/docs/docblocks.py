"""The fenced blocks of README.md and docs/, and how each one runs (the docs tests' helpers).

A block's kind is its fence's language: ``bash`` blocks run command by command (``flowrl``
commands only, in-process, in a fresh folder with this checkout's ``graphs/`` and ``examples/``;
``flowrl run`` and ``flowrl plan`` at two steps of a few prompts), ``python`` blocks run as a script,
``yaml`` blocks load as a run config, ``json`` and ``toml`` blocks parse; ``text`` blocks are output
and are not run. An HTML comment on the lines right above a block tells this test about it:

- ``<!-- docs: needs gpu|cluster|model: WHY -->`` or ``<!-- docs: skip WHY -->``: skipped, with WHY;
- ``<!-- docs: learns TEST -->``: the block's learning claim is asserted by the test function TEST
  (tests/e2e), which must exist; the block itself still runs at a small size;
- ``<!-- docs: same-as PATH -->``: the block is the file PATH, verbatim;
- ``<!-- docs: steps N -->``: its runs take N steps, not 2 (a command that needs more);
- ``<!-- docs: slow -->``: only in the full suite (every block with ``flowrl run``, ``profile`` or
  ``calibrate``, or a ``cpu:N`` cluster, is slow too).

A ``--8<-- "PATH"`` line (pymdownx.snippets) stands for the file PATH, as mkdocs renders it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"bash", "python", "yaml", "json", "toml", "text"}
MARK = re.compile(r"^<!--\s*docs:\s*(\S+)\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$')
# a comment on a command that claims learning: it must name the test that asserts it
LEARNING_CLAIM = re.compile(r"\blearns?\b|reward (climbs|rises|goes)|\d\.\d+\s*->", re.I)
SMALL_RUN = {"rollout.prompts_per_step": "2", "rollout.samples_per_prompt": "4"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str
    marks: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def commands(self) -> list[list[str]]:
        """The block's shell commands, continuation lines joined, comments dropped."""
        joined = self.text.replace("\\\n", " ")
        return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]

    @property
    def uses_ray(self) -> bool:
        runs = self.lang == "bash" and any(c[1:2] == ["run"] for c in self.commands())
        return runs and ("cpu:" in self.text or "--executor ray" in self.text)

    @property
    def slow(self) -> bool:
        if "slow" in self.marks:
            return True
        if self.lang != "bash":
            return False
        return any(c[1:2] in (["run"], ["profile"], ["calibrate"]) for c in self.commands()) or "cpu:" in self.text


def _marks(lines: list[str], fence: int) -> dict[str, str]:
    marks: dict[str, str] = {}
    i = fence - 1
    while i >= 0 and (not lines[i].strip() or MARK.match(lines[i].strip())):
        if m := MARK.match(lines[i].strip()):
            marks[m.group(1).rstrip(":")] = m.group(2)
        i -= 1
    return marks


def _expand(text: str) -> str:
    out = []
    for line in text.splitlines(keepends=True):
        m = SNIPPET.match(line.strip())
        out.append((ROOT / m.group(1)).read_text() if m else line)
    return "".join(out)


def page_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        blocks.append(Block(page, start + 1, lang, _expand("\n".join(body) + "\n"), _marks(lines, start)))
        i += 1
    return blocks


BLOCKS = [b for page in PAGES for b in page_blocks(page)]
RUNNABLE = [b for b in BLOCKS if b.lang != "text"]


def _small(argv: list[str], steps: int = 2) -> list[str]:
    """A documented command at the docs tests' size: ``steps`` steps of a few prompts, a short search."""
    argv = list(argv)
    command = argv[1] if len(argv) > 1 else ""
    if command not in ("run", "plan"):
        return argv
    if "--plan" in argv or "--resume" in argv:
        if "--steps" in argv and "--resume" in argv:
            argv[argv.index("--steps") + 1] = str(steps + 1)
        return argv
    if "--steps" in argv:
        argv[argv.index("--steps") + 1] = str(steps)
    else:
        argv += ["--steps", str(steps)]
    cluster = argv[argv.index("--cluster") + 1] if "--cluster" in argv else None
    if cluster is None or cluster.startswith(("cpu:", "local")):
        given = {a.split("=", 1)[0] for a in argv}
        argv += [x for key, value in SMALL_RUN.items() if key not in given for x in ("--set", f"{key}={value}")]
    if command == "plan" and cluster is not None and "--budget" not in argv:
        argv += ["--budget", "1"]
    return argv


@contextmanager
def _one_ray_at_a_time(block: Block) -> Iterator[None]:
    """A block that starts a private Ray waits for the Ray test modules' lock (tests/ray/conftest.py), so
    two private Rays never run at once."""
    if not block.uses_ray:
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), "flowrl-tests-ray.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run_bash(block: Block, capsys: pytest.CaptureFixture[str]) -> None:
    from flowrl import cli
    from flowrl.plugins import manager

    for argv in block.commands():
        assert argv[0] == "flowrl", (
            f"{block.id}: the docs test runs flowrl commands only; mark the block "
            f"(<!-- docs: needs ... -->) or make it text: {shlex.join(argv)}"
        )
        argv = _small(argv, int(block.marks.get("steps", 2)))
        manager.set_registry(None)  # plugins load for each command, as in a fresh process
        try:
            code = cli.main(argv[1:])
        finally:
            manager.set_registry(None)
        out = capsys.readouterr()
        assert code == 0, f"{block.id}: `{shlex.join(argv)}` exited {code}:\n{out.out[-2000:]}\n{out.err[-3000:]}"


def _run_python(block: Block, folder: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", block.text], cwd=folder, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def _load_config(block: Block) -> None:
    from flowrl.specs import RunConfig, convert

    convert(yaml.safe_load(block.text), RunConfig, f"the config in {block.id}")


def params(blocks: list[Block]) -> list:
    """``blocks`` as pytest parameters, named by page and line, the slow ones marked."""
    return [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else []) for b in blocks]


def run_block(block: Block, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run (or load) one block in ``folder``; skip it with its reason when it is marked as needing more."""
    for key in ("needs", "skip"):
        if key in block.marks:
            pytest.skip(f"{key} {block.marks[key]}".strip())
    if block.lang == "bash":
        with _one_ray_at_a_time(block):
            _run_bash(block, capsys)
    elif block.lang == "python":
        _run_python(block, folder)
    elif block.lang == "yaml":
        _load_config(block)
    elif block.lang == "json":
        json.loads(block.text)
    elif block.lang == "toml":
        pytest.importorskip("tomllib").loads(block.text)  # Python 3.11+
