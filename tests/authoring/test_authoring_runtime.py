"""Ports, graph state, dynamic sampling, in-file registration and environments, run for real
on tiny runs of the local backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from flowrl import api
from flowrl.errors import FlowRLError

TINY = ["rollout.prompts_per_step=4", "progress=false"]


def run(src, tmp_path, steps, *extra):
    graph, plan = api.plan(src, overrides=[f"steps={steps}", f"out={tmp_path}", *TINY, *extra], emit=lambda s: None)
    return graph, plan, api.run(graph, plan)


def test_dynamic_sampling_runs_rounds_until_groups_pass_and_writes_the_acceptance_into_plan_yaml(tmp_path):
    _, _, result = run("graphs/dapo.py", tmp_path, 3, "checkpoint=false", "rollout.samples_per_prompt=4")
    for m in result.metrics:
        assert 1 <= m["dynamic_sampling/rounds"] <= 3
        assert 0.0 <= m["dynamic_sampling/acceptance"] <= 1.0
        # the batch holds the groups that passed (up to prompts_per_step), or the last round when none did
        assert m["dynamic_sampling/groups"] <= 4 or m["dynamic_sampling/fallback"] == 1
        assert m["rollout/samples"] == 4 * m["dynamic_sampling/groups"]
    rates = [m["dynamic_sampling/acceptance"] for m in result.metrics]
    workload = yaml.safe_load((result.out_dir / "plan.yaml").read_text())["target"]["workload"]
    assert workload["acceptance_rate"] == pytest.approx(max(sum(rates) / len(rates), 0.01), abs=1e-4)


def test_the_filter_keeps_only_groups_whose_rewards_differ():
    from flowrl.algorithms.ops import nonconstant_filter
    from flowrl.contract.data import Sequences
    from flowrl.specs import AlgoConfig

    index = torch.tensor([0, 0, 1, 1, 2, 2])
    seqs = Sequences(
        prompt_ids=torch.ones(6, 2, dtype=torch.long),
        prompt_mask=torch.ones(6, 2, dtype=torch.long),
        response_ids=torch.ones(6, 3, dtype=torch.long),
        response_mask=torch.ones(6, 3),
        prompt_index=index,
        texts=("",) * 6,
    )
    keep = nonconstant_filter(
        {"rewards": torch.tensor([1.0, 1.0, 0.0, 0.5, 0.2, 0.2]), "responses": seqs}, AlgoConfig()
    )
    assert keep.tolist() == [False, True, False]


class Crash(Exception):
    pass


@pytest.mark.slow
def test_graph_state_is_updated_checkpointed_and_resumed_exactly(tmp_path):
    from flowrl.contract.plan import load_plan
    from flowrl.runtime.executor import run_dir

    over = [*TINY, "rollout.samples_per_prompt=2", "save_every=2", "steps=5"]
    graph, plan = api.plan("graphs/safe_rlhf.py", overrides=over, emit=lambda s: None)
    whole = api.run(graph, plan, out_dir=run_dir(str(tmp_path), "whole"))
    lam = [m["multiplier_step/multiplier"] for m in whole.metrics]
    assert lam[0] != 1.0 and all(x >= 0.0 for x in lam)  # dual ascent moved it, within its bound
    state = json.loads((whole.out_dir / "checkpoints" / "step-000004" / "state.json").read_text())
    assert state["graph_state"]["multiplier"] == pytest.approx(lam[-1])

    def crash(record):
        if record["step"] == 2:
            raise Crash

    part = run_dir(str(tmp_path), "part")
    with pytest.raises(Crash):
        api.run(graph, plan, out_dir=part, on_step=crash)
    resumed = api.run(graph, load_plan(part / "plan.yaml"), out_dir=part, resume=True)
    assert resumed.resumed_from == 2
    assert [m["multiplier_step/multiplier"] for m in resumed.metrics] == lam


GRAPH_WITH_OWN_FUNCTIONS = '''
"""A custom algorithm in one file: its own reward and estimator."""
import torch
from flowrl import register
from flowrl.graph import Graph


@register.reward("short_answers")
def short_answers(prompts, responses, task):
    return [task.score(p, r) - 0.01 * len(r) for p, r in zip(prompts, responses)]


@register.estimator("centered", needs=("scores", "responses"), gives=("advantages",))
def centered(inputs, algo):
    seqs = inputs["responses"]
    a = inputs["scores"] - inputs["scores"].mean()
    return {"advantages": a[:, None] * seqs.sampled_mask}


def build(cfg):
    g = Graph("own")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=2)
    g.forward("old", model="actor", output="logprobs", writes="old_logprobs")
    g.reward("reward", fn="short_answers")
    g.compute("adv", fn="centered", reads="rewards responses", writes="advantages", ports={"scores": "rewards"})
    g.train("train", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
'''


@pytest.mark.slow
def test_a_graph_file_registers_its_own_reward_and_estimator_and_runs_from_the_cli(tmp_path):
    src = tmp_path / "own.py"
    src.write_text(GRAPH_WITH_OWN_FUNCTIONS)
    cmd = [
        sys.executable,
        "-m",
        "flowrl",
        "run",
        str(src),
        "--steps",
        "2",
        "--out",
        str(tmp_path / "runs"),
        "--set",
        "rollout.prompts_per_step=2",
        "--set",
        "checkpoint=false",
        "--set",
        "progress=false",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "flowrl: done." in done.stdout + done.stderr
    # loading the same file twice in one process (plan, then run) does not clash with itself
    for _ in range(2):
        api.load(str(src))


def test_an_in_file_function_with_a_builtin_name_shadows_it_in_that_graph(tmp_path, capsys):
    src = tmp_path / "clash.py"
    src.write_text(GRAPH_WITH_OWN_FUNCTIONS.replace('register.reward("short_answers")', 'register.reward("task")'))
    api.load(str(src))
    assert "registers reward function 'task', which shadows the built-in" in " ".join(capsys.readouterr().err.split())


def test_episodes_train_only_the_model_tokens(tmp_path):
    from flowrl.contract.data import Prompt
    from flowrl.runtime.episodes import Episodes
    from flowrl.tasks.builtin import Calc
    from flowrl.tasks.environments import calculator
    from flowrl.tasks.tokenizer import build_tokenizer

    class ScriptedEngine:  # a stand-in generation engine that always presses '=' and then answers '42'
        def __init__(self, tok):
            self.tok = tok

        def _rollout(self, prompt_ids, index, tokens):
            from flowrl.contract.data import Rollout, Sequences
            from flowrl.runtime.batch import padded_rows

            p, pm, r, rm = padded_rows(prompt_ids, tokens, 0)
            seqs = Sequences(p, pm, r, rm, index, tuple("" for _ in tokens))
            return Rollout(
                sequences=seqs, logprobs=-torch.ones(r.shape), finished=torch.ones(len(tokens), dtype=torch.bool)
            )

        def generate(self, prompts, *, n, greedy, generator, max_new_tokens=None):
            ids = [self.tok.encode(p.text) for p in prompts for _ in range(n)]
            index = torch.arange(len(prompts)).repeat_interleave(n)
            return self._rollout(ids, index, [self.tok.encode("=", add_special_tokens=False) + [2]] * len(ids))

        def resume(self, rollout, *, generator, max_new_tokens=None):
            s = rollout.sequences
            rows = [s.response_ids[i][s.response_mask[i].bool()].tolist() for i in range(len(s))]
            prompts = [s.prompt_ids[i][s.prompt_mask[i].bool()].tolist() for i in range(len(s))]
            return self._rollout(
                prompts, None, [r + self.tok.encode("42", add_special_tokens=False) + [2] for r in rows]
            )

    tok = build_tokenizer()
    episodes = Episodes("ep", "calculator", calculator(Calc()), 2, tok, 30, 15)
    seqs = episodes.run(ScriptedEngine(tok), [Prompt(text="6*7:", answer="42")], 2, torch.Generator())
    assert seqs.texts == ("=42|42", "=42|42")
    # '=' EOS (sampled) | '42|' (the calculator's, not trained) | '42' EOS (sampled)
    assert seqs.action_mask[0].tolist() == [1, 1, 0, 0, 0, 1, 1, 1]
    assert seqs.response_mask[0].tolist() == [1.0] * 8
    assert Calc().score(Prompt(text="6*7:", answer="42"), seqs.texts[0]) == 1.0
    m = episodes.take_metrics(seqs)
    assert (m["turns"], m["env_replies"], m["env_tokens"]) == (2.0, 1.0, 3.0)
    assert [t.role for t in seqs.episodes[0]] == ["assistant", "env", "assistant", "env"]
    assert [t.text for t in seqs.episodes[0]] == ["=", "42|", "42", ""]


def test_reading_rows_of_two_generate_nodes_is_an_error_naming_the_node(tmp_path):
    src = tmp_path / "mixed.py"
    src.write_text(
        """
from flowrl.graph import Graph
def build(cfg):
    g = Graph("mixed")
    g.model("a", "actor")
    g.model("b", "actor")
    g.generate("ga", model="a", writes="ra", n=2)
    g.generate("gb", model="b", writes="rb", n=4)
    g.forward("lpa", model="a", output="logprobs", reads="ra", writes="old_a")
    g.forward("lpb", model="b", output="logprobs", reads="rb", writes="old_b")
    g.reward("reward", fn="task", reads="prompts ra", writes="score_a")
    g.compute("adv", fn="grpo", reads="score_a rb", writes="adv_b",
              ports={"rewards": "score_a", "responses": "rb", "advantages": "adv_b"})
    g.compute("adv_a", fn="grpo", reads="score_a ra", writes="adv_a",
              ports={"rewards": "score_a", "responses": "ra", "advantages": "adv_a"})
    g.train("ta", model="a", loss="ppo", reads="ra old_a adv_a", ports={"old_logprobs": "old_a", "advantages": "adv_a"})
    g.train("tb", model="b", loss="ppo", reads="rb old_b adv_b", ports={"old_logprobs": "old_b", "advantages": "adv_b"})
    return g
"""
    )
    with pytest.raises(FlowRLError, match=r"node 'adv' reads 'score_a' with 8 rows and 'rb' with 16 responses"):
        run(str(src), tmp_path, 1, "checkpoint=false")


@pytest.mark.slow
def test_a_runs_plan_yaml_is_a_workload_file_with_its_measured_acceptance(tmp_path):
    from flowrl.planner.workload import load_workload

    _, _, result = run("graphs/dapo.py", tmp_path, 2, "checkpoint=false", "rollout.samples_per_prompt=4")
    workload = load_workload(result.out_dir / "plan.yaml")
    rates = [m["dynamic_sampling/acceptance"] for m in result.metrics]
    assert workload.acceptance_rate == pytest.approx(max(sum(rates) / len(rates), 0.01), abs=1e-4)
    assert workload.prompts_per_step == 4
