"""graphs/reward_model.py on the tiny model: the Bradley-Terry loss, pairs kept whole by the engine,
held-out pair accuracy rising, the checkpoint as an HF sequence-classification model that scores as
the trained model did, PPO with it as its reward model, and an exact resume.

The pairs are the built-in ``copy`` task's (`TaskBase.pairs`): its prompts, the correct answer chosen and
a plausible wrong one (a character changed) rejected."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import resumed_after_step_1, untimed

from flowrl import api
from flowrl.algorithms import losses, ops
from flowrl.contract.data import Completion, Prompt
from flowrl.errors import GraphError, PlanError
from flowrl.runtime.dispatch import micro_batches
from flowrl.runtime.offline import completions_of, offline_sequences
from flowrl.tasks.tokenizer import build_tokenizer

SMALL = ["progress=false", "rollout.prompts_per_step=16", "train.dtype=float32"]


def rm_plan(overrides: list[str], steps: int):
    return api.plan(
        "graphs/reward_model.py", overrides=[*SMALL, *overrides], flags={"steps": steps}, emit=lambda s: None
    )


# ---------------------------------------------------------------- the loss


def test_bradley_terry_loss_matches_a_hand_computation():
    chosen = torch.tensor([1.0, 0.0], requires_grad=True)
    rejected = torch.tensor([0.0, 2.0])
    loss, stats = losses.bradley_terry_loss(chosen, rejected, margin=0.5, center_coef=0.1)
    # -log sigmoid(1 - 0.5) = log(1 + e^-0.5); -log sigmoid(-2 - 0.5) = log(1 + e^2.5); centering: (1^2 + 2^2) / 2
    hand = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(2.5))) / 2 + 0.1 * (1.0 + 4.0) / 2
    assert float(loss.detach()) == pytest.approx(hand, rel=1e-6)
    assert stats == pytest.approx({"pref_accuracy": 0.5, "margin": -0.5, "reward_chosen": 0.5, "reward_rejected": 1.0})
    loss.backward()  # d/dr_c of the pair terms: -sigmoid(-(d - m)) / 2, plus the centering's 0.1 * (r_c + r_r)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert chosen.grad.tolist() == pytest.approx([-sig(-0.5) / 2 + 0.1, -sig(2.5) / 2 + 0.1 * 2.0], rel=1e-6)


def test_the_pair_loss_reads_chosen_then_rejected_rows_of_one_prompt_and_refuses_others():
    tok = build_tokenizer()
    prompts = [Prompt(text="ab>", answer="ab", completions=(
        Completion(pieces=("ab",), trained=(True,)), Completion(pieces=("ba",), trained=(True,))))]  # fmt: skip
    seqs, metrics = offline_sequences(prompts, None, tok, tok.pad_token_id, rows="pairs")
    assert metrics["rows"] == 2 and seqs.texts == ("ab", "ba")
    loss, stats = ops.bradley_terry_op(torch.tensor([2.0, -1.0]), {"responses": seqs}, None)
    assert stats["pref_accuracy"] == 1.0 and stats["margin"] == 3.0
    assert float(loss) == pytest.approx(math.log1p(math.exp(-3.0)))
    two = offline_sequences([prompts[0], prompts[0]], None, tok, tok.pad_token_id, rows="pairs")[0]
    with pytest.raises(GraphError, match="rows='pairs'"):  # rows 1 and 2 are of different prompts
        ops.bradley_terry_op(torch.zeros(2), {"responses": two.select(torch.tensor([1, 2]))}, None)


def test_micro_batches_keep_each_pair_whole_and_in_order():
    tok = build_tokenizer()
    answers = ["a", "abcdef", "ab", "abcd", "abc", "bb"]
    prompts = [
        Prompt(text=f"{a}>", answer=a, completions=(
            Completion(pieces=(a,), trained=(True,)), Completion(pieces=(a * 2,), trained=(True,))))
        for a in answers
    ]  # fmt: skip
    seqs, _ = offline_sequences(prompts, None, tok, tok.pad_token_id, rows="pairs")
    rows = torch.tensor([4, 5, 0, 1, 10, 11, 2, 3, 8, 9, 6, 7])  # a shuffled mini-batch of whole pairs
    for world, micro, budget, packed in ((1, 4, None, False), (2, 3, None, False), (2, 8, 30, False), (1, 8, 24, True)):
        shares = micro_batches(seqs, rows, world, micro, budget, packed, group=2)
        got = sorted(int(r) for share in shares for part in share for r in part)
        assert got == sorted(rows.tolist())  # every row once
        for share in shares:
            for part in share:
                assert len(part) % 2 == 0 and all(int(part[i]) % 2 == 0 for i in range(0, len(part), 2))
                assert (part[1::2] == part[0::2] + 1).all()  # chosen, then its rejected
                assert len(part) <= max(micro // 2, 1) * 2


def test_a_pair_loss_on_generated_rows_is_refused_before_the_run(tmp_path):
    graph = tmp_path / "bad.py"
    graph.write_text(
        "from flowrl.graph import Graph\n\n\ndef build(cfg):\n    g = Graph('bad')\n"
        "    g.model('actor', 'actor', trainable=False)\n    g.model('rm', 'reward', trainable=True)\n"
        "    g.generate('rollout', model='actor', reads='prompts', writes='responses', n=2)\n"
        "    g.train('train_rm', model='rm', loss='bradley_terry', reads='responses')\n    return g\n"
    )
    with pytest.raises(PlanError, match=r"node 'train_rm'.*'responses' comes from node 'rollout'.*rows='pairs'"):
        api.plan(str(graph), overrides=["progress=false"], emit=lambda s: None)


# ---------------------------------------------------------------- whole runs


def test_the_reward_model_plan_has_a_train_stage_only():
    from flowrl.planner.passes.residency import model_spec
    from flowrl.runtime.schedule import lower

    graph, plan = rm_plan([], 1)
    assert [t.kind for t in lower(graph, plan).tasks] == ["source", "train"]
    assert [n.kind for n in plan.nodes] == ["source", "train"]
    assert model_spec(graph, plan, "rm").scalar_head  # costed with its scalar head, no vocabulary logits
    assert plan.models["rm"].optimizer is not None and plan.memory


def test_a_cluster_forecast_of_a_reward_model_plans_no_pipeline_stages_that_would_cut_its_pairs(tmp_path, capsys):
    from flowrl.cli import main
    from flowrl.contract.plan import load_plan

    out = tmp_path / "plan.yaml"
    argv = ["plan", "graphs/reward_model.py", "--cluster", "8xA100-80G", "--model", "llama-7b", "--budget", "1"]
    assert main([*argv, "--out", str(out), "--explain"]) == 0
    assert not re.search(r"\bpp[2-9]", capsys.readouterr().out)  # neither the winner nor a runner-up
    plan = load_plan(out)
    assert [n.kind for n in plan.nodes] == ["source", "train"] and plan.layout.layout("rm").parallel.pp == 1
    assert main([*argv, "--require", "rm.pp=2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "splits model 'rm' into pipeline stages, but its loss reads rows in pairs" in err


@pytest.mark.slow
def test_a_reward_model_step_split_into_micro_batches_computes_the_one_micro_batch_loss(tmp_path):
    first = {}
    for split in ([], ["train.micro_batch_size=2"], ["train.max_tokens_per_micro_batch=40", "train.pack=true"]):
        graph, plan = rm_plan(["checkpoint=false", "rollout.prompts_per_step=8", *split], 1)
        first[tuple(split)] = api.run(graph, plan, out_dir=tmp_path / str(len(first))).metrics[0]
    whole, pairs, packed = first.values()
    assert whole["train_rm/pad_frac"] != pairs["train_rm/pad_frac"] and packed["train_rm/pad_frac"] == 0.0
    for part in (pairs, packed):  # each micro-batch weighs by its pairs: the mini-batch's loss
        assert part["train_rm/loss"] == pytest.approx(whole["train_rm/loss"], rel=1e-5)
    # one pair per micro-batch: the mean of their stats is the mini-batch's
    assert pairs["train_rm/margin"] == pytest.approx(whole["train_rm/margin"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_a_reward_model_learns_to_rank_held_out_pairs(tmp_path):
    graph, plan = rm_plan(["eval.every=25", "eval.prompts=64", "checkpoint=false", "train.lr=1e-3"], 50)
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    accuracy = [e["eval/preference_accuracy"] for e in result.evals]
    assert len(accuracy) == 3 and all(e["eval/pairs"] == 64 for e in result.evals)
    assert accuracy[-1] >= 0.8 and accuracy[-1] > accuracy[0] + 0.3
    assert result.evals[-1]["eval/margin"] > result.evals[0]["eval/margin"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/preference_accuracy"] for r in rows if r.get("kind") == "eval"] == accuracy
    assert {"train_rm/pref_accuracy", "train_rm/margin", "train_rm/reward_chosen"} <= set(result.metrics[-1])
    assert (tmp_path / "run" / "reward.png").stat().st_size > 0  # accuracy and margin panels


def hf_scores(folder: Path, texts: list[str]) -> list[float]:
    """Each text's score by transformers' own sequence-classification model loaded from ``folder``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model.eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt")["input_ids"]
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory):
    """A reward model trained for a few steps, with its last held-out evaluation."""
    out = tmp_path_factory.mktemp("rm") / "run"
    graph, plan = rm_plan(["eval.every=4", "eval.prompts=8", "train.lr=3e-3"], 4)
    result = api.run(graph, plan, out_dir=out)
    return result, plan


@pytest.mark.slow
def test_the_checkpoint_is_an_hf_classifier_that_scores_as_the_trained_model(trained_rm):
    from safetensors import safe_open

    result, plan = trained_rm
    folder = result.checkpoints["rm"]
    assert folder.name == "checkpoint"  # the run's product: no actor in this graph
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert len(config["id2label"]) == 1  # num_labels=1
    assert config["pad_token_id"] == build_tokenizer().pad_token_id
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        assert fh.get_tensor("score.weight").shape == (1, config["hidden_size"])
    assert "model.embed_tokens.weight" in names and not any(n.startswith("lm_head") for n in names)
    # the held-out pairs the run evaluated last, scored by transformers: the same margin and accuracy
    from flowrl.runtime.evaluate import eval_prompts
    from flowrl.tasks.builtin import task_for

    task = task_for(plan.config)
    prompts = eval_prompts(plan.config, task)
    texts = [p.text + c.text for p in prompts for c in completions_of(task, p, "pairs", "pairs")]
    eos = build_tokenizer().eos_token
    scores = hf_scores(folder, [t + eos for t in texts])  # each response ends with the end-of-text token
    diffs = [c - r for c, r in zip(scores[0::2], scores[1::2])]
    last = result.evals[-1]
    assert sum(diffs) / len(diffs) == pytest.approx(last["eval/margin"], abs=1e-4)
    assert sum(d > 0 for d in diffs) / len(diffs) == last["eval/preference_accuracy"]


def test_flowrl_loads_the_classifier_back_with_its_head(trained_rm):
    from flowrl.backends.local.models import ValueModel, build_model, load_tokenizer, model_config, scalar_checkpoint

    folder = str(trained_rm[0].checkpoints["rm"])
    assert scalar_checkpoint(folder) == "classifier"
    tok = load_tokenizer(folder)
    model = build_model(folder, model_config(folder, None, tok), 0, True, "rm", head_bias=False)
    assert isinstance(model, ValueModel) and model.head.bias is None
    ids = tok("ab>ab" + tok.eos_token, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours = model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])[0, -1]
    assert float(ours) == pytest.approx(hf_scores(Path(folder), ["ab>ab" + tok.eos_token])[0], abs=1e-5)


def test_ppo_with_the_trained_reward_model_scores_with_its_folder(trained_rm, tmp_path):
    folder = trained_rm[0].checkpoints["rm"]
    graph, plan = api.plan(
        "graphs/ppo_rm.py",
        overrides=["progress=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
                   "rollout.max_new_tokens=3", "rollout.ignore_eos=true", "train.dtype=float32",
                   f"model=reward={folder}", "log.samples_every=1", "log.samples=4", "checkpoint=false"],
        flags={"steps": 1}, emit=lambda s: None,
    )  # fmt: skip
    result = api.run(graph, plan, out_dir=tmp_path / "ppo")
    assert result.metrics and result.metrics[0]["step"] == 0
    rows = [json.loads(line) for line in (tmp_path / "ppo" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    scores = hf_scores(folder, [r["prompt"] + r["response"] for r in rows])
    assert [r["reward"] for r in rows] == pytest.approx(scores, abs=1e-4)


@pytest.mark.slow
def test_a_resumed_reward_model_run_equals_the_uninterrupted_run(tmp_path):
    graph, plan = rm_plan(["save_every=2", "rollout.prompts_per_step=4"], 4)
    whole, resumed = resumed_after_step_1(graph, plan, tmp_path)
    assert resumed.resumed_from == 2
    a = untimed([json.loads(x) for x in (whole.out_dir / "metrics.jsonl").read_text().splitlines()])
    b = untimed([json.loads(x) for x in (resumed.out_dir / "metrics.jsonl").read_text().splitlines()])
    assert a == b and a[-1]["train_rm/loss"] > 0
    from safetensors.torch import load_file

    wa, wb = (load_file(str(r.out_dir / "checkpoint" / "model.safetensors")) for r in (whole, resumed))
    assert set(wa) == set(wb) and "score.weight" in wa and all(torch.equal(wa[k], wb[k]) for k in wa)
