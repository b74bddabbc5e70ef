"""Supervised fine-tuning: train the policy on given responses, read from the data, with the
token-mean negative log-likelihood of the assistant's tokens (the ``sft`` loss). No generation,
no reward, no weight sync: the plan has a train stage only.

Data: ``--data train.jsonl`` with a ``prompt`` and a ``response`` column (rename them with
``--set data.prompt_key=... data.response_key=...``), or conversations (a list of ``{role, content}``
messages in the prompt column; every assistant turn is trained). Without ``--data``, the built-in
task's prompts and their correct answers (``copy``: ``cab>`` -> ``cab``). Held-out loss:
``--set eval.every=N`` (with ``data.val=FILE``, or the built-in task's own held-out prompts)
writes ``eval/loss`` (mean NLL per response token) to metrics.jsonl."""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {"data": {"response_key": "response", "verifier": "none"}, "algo": {"kl_coef": 0.0}}


def build(cfg: RunConfig) -> Graph:
    g = Graph("sft")
    g.model("actor", "actor")
    g.source("data", reads="prompts", writes="responses", rows="sft")
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    return g
