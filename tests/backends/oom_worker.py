"""Run by test_out_of_memory.py in a process of its own (its address space is limited): the same
forward and train steps on long rows, first without a limit, then on copies of the model under an
address-space limit the whole micro-batch does not fit in. Prints one JSON line."""

from __future__ import annotations

import copy
import json
import resource

import torch

from flowrl import api
from flowrl.backends.local import training as local_engine
from flowrl.contract.data import Sequences
from flowrl.contract.protocols import TrainStep
from flowrl.plugins.manager import registry
from flowrl.runtime.executor import PlanExecutor

ROWS, PROMPT, RESPONSE = 8, 24, 1000


def vm(field: str) -> int:
    """This process's virtual memory (``VmSize``) or its peak (``VmPeak``), in bytes."""
    with open("/proc/self/status") as fh:
        line = next(line for line in fh if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def capped(fraction: float, need: int) -> None:
    """Allow this process ``fraction`` of ``need`` bytes more than it holds now."""
    resource.setrlimit(resource.RLIMIT_AS, (vm("VmSize") + int(fraction * need), resource.RLIM_INFINITY))


def uncapped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def main() -> None:
    torch.set_num_threads(1)
    overrides = ["tiny_model.max_position_embeddings=1024", "rollout.max_new_tokens=1000", "train.grad_clip=1e9"]
    g, plan = api.plan("grpo", overrides=overrides, emit=lambda s: None)
    actor = PlanExecutor(registry()).engines(g, plan)[0]["actor"]
    gen = torch.Generator().manual_seed(0)
    vocab = actor.hf_config.vocab_size
    seqs = Sequences(
        prompt_ids=torch.randint(3, vocab, (ROWS, PROMPT), generator=gen),
        prompt_mask=torch.ones(ROWS, PROMPT, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (ROWS, RESPONSE), generator=gen),
        response_mask=torch.ones(ROWS, RESPONSE),
        prompt_index=torch.arange(ROWS),
        texts=("",) * ROWS,
    )
    batch = {"responses": seqs, "advantages": torch.randn(ROWS, 1, generator=gen).expand(ROWS, RESPONSE)}
    loss = registry().get("losses", "ppo")
    copies = [copy.deepcopy(actor) for _ in range(3)]
    start = actor.export_weights()

    def step() -> TrainStep:
        return TrainStep(
            node="train_actor", sequences_key="responses", output="logprobs", micro_batch=ROWS, epochs=1,
            mini_batches=1, algo=plan.config.algo, generator=torch.Generator().manual_seed(1),
        )  # fmt: skip

    restarts = []  # which path a split took: a backward that ran out of memory restarts the mini-batch
    restart = local_engine._SplitAndRestart.__init__

    def counted(self, *args):
        restarts.append(1)
        restart(self, *args)

    local_engine._SplitAndRestart.__init__ = counted
    before = vm("VmSize")
    logprobs = actor.forward(seqs, "logprobs", ROWS)
    need_forward = vm("VmPeak") - before
    batch["old_logprobs"] = logprobs
    free = actor.train(loss, batch, step())
    need_train = vm("VmPeak") - before
    after = actor.export_weights()

    out = {"need_forward_mib": need_forward / 2**20, "need_train_mib": need_train / 2**20}
    capped(0.6, need_forward)  # the forward of all the rows does not fit; half of them do
    split = copies[0].forward(seqs, "logprobs", ROWS)
    uncapped()
    out["forward"] = {"gap": float((split - logprobs).abs().max()), "splits": copies[0].oom_splits}
    # 0.6: the train forward of all the rows does not fit; 0.9: it does, but its backward does not
    for engine, fraction in zip(copies[1:], (0.6, 0.9)):
        restarts.clear()
        capped(fraction, need_train)
        stats = engine.train(loss, batch, step())
        uncapped()
        mine = engine.export_weights()
        out[f"train_{fraction}"] = {
            "gap": max(float((mine[k] - after[k]).abs().max()) for k in after),
            "loss_gap": abs(stats["loss"] - free["loss"]),
            "oom_splits": stats.get("oom_splits", 0.0),
            "restarts": len(restarts),
        }
    out["moved"] = max(float((after[k] - start[k]).abs().max()) for k in after)
    out["free_oom_splits"] = free.get("oom_splits", 0.0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
