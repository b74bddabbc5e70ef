"""Issue 21: a filter with by_row=True may keep no row; the train node then skips its step
(``train_actor/empty``). Nodes between the filter and the train node see the same empty batch: a
forward node (old / reference log-probs, as in GRPO with a row filter) crashes the local engine
with a raw traceback (``RuntimeError: cannot reshape tensor of 0 elements`` in transformers' Llama
attention), not naming the node, instead of producing an empty result."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from flowrl import api
from flowrl.runtime.executor import run_dir

GRAPH = """
from flowrl.graph import Graph


def build(cfg):
    g = Graph("row_grpo")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    # min_reward above any reward: no row is kept
    g.filter("select", fn="threshold", reads="rewards responses", by_row=True, min_reward=2.0)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs ref_logprobs advantages")
    return g
"""

SMALL = [
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=2",
    "train.mini_batches=1",
    "progress=false",
    "checkpoint=false",
]


def test_forward_nodes_after_a_row_filter_that_kept_nothing_skip_like_the_train_node(tmp_path: Path) -> None:
    source = tmp_path / "row_grpo.py"
    source.write_text(textwrap.dedent(GRAPH))
    graph, plan = api.plan(str(source), overrides=SMALL, flags={"steps": 1}, emit=lambda s: None)
    out = api.run(graph, plan, out_dir=run_dir(str(tmp_path), "run")).out_dir
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train_actor/empty"] == 1
