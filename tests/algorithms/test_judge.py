"""LLM-as-judge: `g.judge` expands into judge prompts, one greedy verdict per response from a frozen
model, and scores parsed from the verdicts, in the responses' order."""

from __future__ import annotations

import pytest
import torch

from flowrl import api
from flowrl.algorithms.ops import judge_prompts_op, judge_scores_op
from flowrl.contract.data import Prompt, Sequences, Turn
from flowrl.errors import GraphError
from flowrl.graph import Graph
from flowrl.specs import AlgoConfig


def seqs(texts, index, episodes=None):
    n = len(texts)
    z = torch.zeros(n, 1, dtype=torch.long)
    return Sequences(z, z + 1, z, torch.ones(n, 1), torch.tensor(index), tuple(texts), episodes=episodes)


def test_judge_prompts_fill_the_template_per_response_with_an_episodes_final_turn():
    prompts = [Prompt(text="2+2", answer="4"), Prompt(text="3+3", answer="6")]
    turns = ((Turn(role="assistant", text="call", tokens=1), Turn(role="tool", text="4", tokens=1),
              Turn(role="assistant", text="four", tokens=1)),) * 3  # fmt: skip
    out = judge_prompts_op(
        {"prompts": prompts, "responses": seqs(["x", "y", "z"], [0, 0, 1], turns)},
        AlgoConfig(),
        template="Q {prompt} A {response} ref {answer}",
    )["judge_prompts"]
    assert [p.text for p in out] == ["Q 2+2 A four ref 4", "Q 2+2 A four ref 4", "Q 3+3 A four ref 6"]
    assert [p.meta["row"] for p in out] == [0, 1, 2]


def test_judge_scores_follow_the_verdicts_prompt_order_and_count_the_unparsed():
    # verdict rows out of order: the prompt index says which response each judges
    verdicts = seqs(["rating 9", "no idea", "7.5/9", "-3"], [2, 0, 1, 3])
    out, metrics = judge_scores_op({"verdicts": verdicts}, AlgoConfig(), scale=9.0, default=-1.0)
    assert out["scores"].tolist() == pytest.approx([-1.0, 7.5 / 9, 1.0, -3 / 9])
    assert metrics["unparsed"] == 1
    out, _ = judge_scores_op({"verdicts": verdicts}, AlgoConfig(), pattern=r"rating (\d)")
    assert out["scores"].tolist() == [0.0, 0.0, 9.0, 0.0]


def test_a_judge_needs_a_template_with_the_response_and_two_keys():
    g = Graph("j")
    g.model("actor", "actor")
    with pytest.raises(GraphError, match=r"must hold \{response\}"):
        g.judge("judge", model="actor", template="Rate {prompt}")
    with pytest.raises(GraphError, match="reads two keys"):
        g.judge("judge", model="actor", template="{response}", reads="responses")


@pytest.mark.slow
def test_the_judge_graph_runs_and_its_scores_are_the_reward(chat_model, tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n{"prompt": "What is 4 + 1?", "answer": "5"}\n')
    graph, plan = api.plan(
        "graphs/judge.py",
        overrides=[
            f"model={chat_model}",
            f"data.train={data}",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "rollout.max_new_tokens=8",
            "progress=false",
            "checkpoint=false",
            f"out={tmp_path}",
        ],  # fmt: skip
        flags={"steps": 2},
        emit=lambda s: None,
    )
    assert [n for n in graph.nodes if n.startswith("judge")] == ["judge_prompts", "judge_generate", "judge"]
    assert not graph.models["judge"].trainable
    result = api.run(graph, plan)
    m = result.metrics[-1]
    assert m["judge_generate/samples"] == 4  # one verdict per response
    assert m["reward"] == m["judge/reward"]
    assert m["judge_generate/sample"].startswith("Question: ")
