"""Reward-model training on preference pairs (Ouyang et al., 2022; TRL's RewardTrainer): a model with a
scalar head scores each response at its last token, and the Bradley-Terry loss
-log sigmoid(r_chosen - r_rejected) teaches it to score the chosen response of each pair above the
rejected one. No generation: the plan has a train stage only.

The model starts from ``--model`` (the policy's checkpoint) with a fresh head, and is saved as an HF
sequence-classification model (``LlamaForSequenceClassification``, ``num_labels=1``: its ``score``
head) in the run's ``checkpoint`` folder, which transformers' ``AutoModelForSequenceClassification``
loads and ``graphs/ppo_rm.py`` scores with: ``--model reward=runs/reward_model/checkpoint``.

Data: a source with ``rows="pairs"`` gives two rows per prompt, the chosen response then the rejected
one: ``--data pairs.jsonl`` with ``prompt``, ``chosen`` and ``rejected`` columns (rename them with
``--set data.prompt_key=... data.chosen_key=... data.rejected_key=...``), each text or a list of
``{role, content}`` messages, as ``graphs/dpo.py`` reads them. Without ``--data``: the built-in task's
prompts, its correct answer chosen and a plausible wrong one rejected.

Options of the loss (``--set nodes.train_rm.margin=1.0 nodes.train_rm.center_coef=0.01``): a margin
the chosen must win by, and TRL's reward-centering term (``center_rewards_coefficient``).

Metrics, as DPO's with the scores as the rewards: ``train_rm/pref_accuracy`` (pairs ranked right),
``train_rm/margin`` (mean r_chosen - r_rejected), ``train_rm/reward_chosen``, ``train_rm/reward_rejected``
(mean scores). Held-out pairs: ``--set eval.every=N`` (with ``data.val=FILE``, or the task's own held-out
prompts) writes ``eval/preference_accuracy`` and ``eval/margin`` to metrics.jsonl."""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {
    "data": {"chosen_key": "chosen", "rejected_key": "rejected", "verifier": "none"},
    "algo": {"kl_coef": 0.0},
}


def build(cfg: RunConfig) -> Graph:
    g = Graph("reward_model")
    g.model("rm", "reward", trainable=True)
    g.source("pairs", reads="prompts", writes="responses", rows="pairs")
    g.train("train_rm", model="rm", loss="bradley_terry", reads="responses")
    return g
