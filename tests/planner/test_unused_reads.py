"""A train node that reads a key its loss does not use is refused at plan time (computing it would be
wasted work), also for a loss that declares it reads nothing but the responses (the built-in `sft`:
``needs=()``, ``optional=()``), which is a declaration, not the absence of one."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from flowrl import api
from flowrl.errors import FlowRLError

GRAPH = """
from flowrl.graph import Graph


def build(cfg):
    g = Graph("{name}")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
{middle}    g.train("train_actor", model="actor", loss="{loss}", reads="{reads}")
    return g
"""

SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "train.mini_batches=1"]


GRPO = """\
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
"""
#: rejection SFT (graphs/rejection_sft.py) with a reference model added
RAFT = """\
    g.filter("select", fn="threshold", reads="rewards responses", by_row=True, min_reward=1.0)
"""


def plan(tmp_path: Path, name: str, loss: str, reads: str, middle: str) -> None:
    source = tmp_path / f"{name}.py"
    source.write_text(textwrap.dedent(GRAPH).format(name=name, loss=loss, reads=reads, middle=middle))
    api.plan(str(source), overrides=SMALL, emit=lambda s: None)


def test_gspo_reading_reference_logprobs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FlowRLError, match="reads 'ref_logprobs', which loss 'gspo' does not use"):
        plan(tmp_path, "gspo_ref", "gspo", "responses old_logprobs ref_logprobs advantages", GRPO)


def test_sft_reading_reference_logprobs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FlowRLError, match="reads 'ref_logprobs', which loss 'sft' does not use"):
        plan(tmp_path, "sft_ref", "sft", "responses ref_logprobs", RAFT)
