"""DPO: Direct Preference Optimization (Rafailov et al., 2023). The policy learns from preference
pairs read from the data -- for each prompt a chosen and a rejected response -- with no reward
model and no generation: the loss raises the policy's log-ratio to a frozen reference (the actor's
starting weights) on the chosen response over the rejected one,

    -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)))).

The reference's log-probs are computed once per pair (a forward node on the ``ref`` model); the plan
has a train stage only.

Data: ``--data pairs.jsonl`` with ``prompt``, ``chosen`` and ``rejected`` columns (rename them with
``--set data.prompt_key=... data.chosen_key=... data.rejected_key=...``); each is text or a list of
``{role, content}`` messages (TRL's conversational preference format). Without ``--data``: the
built-in task's prompts, its correct answer chosen and a plausible wrong one rejected.

Options of the loss (``--set nodes.train_actor.OPTION=VALUE``): ``beta`` (0.1), ``label_smoothing``
(0: the chance a label is flipped, cDPO), ``loss_type`` (sigmoid | robust | ipo). Held-out pairs:
``--set eval.every=N`` (with ``data.val=FILE``, or the built-in task's held-out prompts) writes
``eval/preference_accuracy`` and ``eval/margin`` to metrics.jsonl."""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {
    "data": {"chosen_key": "chosen", "rejected_key": "rejected", "verifier": "none"},
    "algo": {"kl_coef": 0.0},
}


def build(cfg: RunConfig) -> Graph:
    g = Graph("dpo")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    g.source("data", reads="prompts", writes="responses", rows="pairs")
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.train("train_actor", model="actor", loss="dpo", reads="responses ref_logprobs", beta=0.1)
    return g
