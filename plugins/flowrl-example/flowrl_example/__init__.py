"""An example flowrl plugin: a reward function, a sequence-level loss, a preference loss (SimPO), algorithm
graphs and a CLI command."""

from __future__ import annotations

import argparse
import random
from typing import Any

from flowrl.contract import Graph, hookimpl
from flowrl_example.simpo import build_simpo, simpo_loss


def concise_reward(prompts: list[Any], responses: list[str], task: Any, *, per_char: float = 0.05) -> list[float]:
    """score - per_char * (characters beyond the reference answer), floored at 0."""
    out = []
    for prompt, text in zip(prompts, responses):
        extra = max(len(text) - len(prompt.answer), 0)
        out.append(max(task.score(prompt, text) - per_char * extra, 0.0))
    return out  # plain floats: loading the plugin (every CLI call) does not import torch


def sequence_pg_loss(logprobs: Any, batch: Any, algo: Any) -> tuple[Any, dict[str, float]]:
    """A sequence-level policy gradient: each response's advantage times the mean log-prob of its
    tokens, averaged over responses (each response weighs the same, whatever its length). Registered
    with ``aggregate="seq-mean"``, so the engine weighs its micro-batches by their rows."""
    from flowrl.contract import sequences_in

    mask = sequences_in(batch, "loss 'sequence_pg'").sampled_mask
    tokens = mask.sum(-1).clamp_min(1.0)
    mean_logp = (logprobs * mask).sum(-1) / tokens
    advantage = (batch["advantages"] * mask).sum(-1) / tokens
    loss = -(advantage * mean_logp).mean()
    return loss, {"mean_logprob": float(mean_logp.detach().mean()) if len(mean_logp) else 0.0}


def build_grpo_concise(cfg: Any) -> Graph:
    g = Graph("grpo_concise")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="concise", reads="prompts responses", writes="rewards", per_char=0.05)
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g


def _sample_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("task", help="a registered task name")
    parser.add_argument("-n", type=int, default=5, help="how many prompts")
    parser.add_argument("--seed", type=int, default=0)


def _sample_run(args: argparse.Namespace) -> int:
    from flowrl.plugins.manager import registry
    from flowrl.tasks.builtin import make_task

    tasks = {e.name: e.obj for e in registry().entries("tasks")}
    task = make_task(args.task, {}, registry=tasks)
    for p in task.prompts(random.Random(args.seed), args.n):
        print(f"{p.text!r:>16} -> {p.answer!r}")
    return 0


@hookimpl
def register_reward_functions(register):
    register("concise", concise_reward, description="task score minus a penalty per extra character")


@hookimpl
def register_losses(register):
    register(
        "sequence_pg",
        sequence_pg_loss,
        description="sequence-level policy gradient (a mean over responses)",
        needs=("advantages",),
        output="logprobs",
        aggregate="seq-mean",
    )
    register(
        "simpo",
        simpo_loss,
        description="SimPO: reference-free, length-normalised preference loss with a target margin",
        output="logprobs",
        aggregate="seq-mean",  # a mean over pairs: the engine weighs micro-batches by their rows
        rows="pairs",  # rows 2i (chosen) and 2i+1 (rejected) in one micro-batch
    )


@hookimpl
def register_algorithms(register):
    register("grpo_concise", build_grpo_concise, description="GRPO scored by the 'concise' reward")
    register("simpo", build_simpo, description="SimPO on preference pairs (--data with chosen/rejected columns)")


@hookimpl
def register_cli_commands(register):
    register("sample-prompts", _sample_args, run=_sample_run, help="print sample prompts and answers of a task")
