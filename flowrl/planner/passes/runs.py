"""What each graph model's engines run (`ModelRun`: weights, sampling, optimizer, numerics, LoRA) and
which forward nodes their train node computes itself: written into the plan by `resolve`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from flowrl.contract.capabilities import declared
from flowrl.contract.reading import episode_budget, fusable, generating_models, model_checkpoints
from flowrl.contract.resolved import EngineNumerics, ModelRun, NodeOptions, OptimizerSpec, SamplingSpec
from flowrl.graph.ir import Graph
from flowrl.specs import RunConfig

if TYPE_CHECKING:
    from flowrl.plugins.manager import Registry


def model_runs(
    graph: Graph, cfg: RunConfig, budget: int, numerics: EngineNumerics | None = None
) -> dict[str, ModelRun]:
    """What each graph model's engines run: where its weights come from, how it samples (and takes
    log-probs), its optimizer when trainable; ``budget``: the response budget. The generation engine
    and its tp are `place`'s."""
    generating = set(generating_models(graph))
    checkpoints = model_checkpoints(graph, cfg.model)
    roll, train = cfg.rollout, cfg.train
    sampling = SamplingSpec(
        temperature=roll.temperature,
        top_p=roll.top_p,
        max_new_tokens=budget,
        ignore_eos=roll.ignore_eos,
        stop=tuple(roll.stop),
        dtype=cfg.generation.dtype,
    )
    runs = {}
    for name, decl in graph.models.items():
        optimizer = None
        if decl.trainable:
            lr = train.critic_lr if decl.scalar_head and train.critic_lr else train.lr
            optimizer = OptimizerSpec(
                lr=lr,
                betas=train.betas,
                weight_decay=train.weight_decay,
                grad_clip=train.grad_clip,
                skip_nonfinite=train.skip_nonfinite,
            )
        budget_of = episode_budget(graph, name, budget)
        runs[name] = ModelRun(
            model=name,
            checkpoint=checkpoints[name],
            tiny=cfg.tiny_model,
            seed=cfg.seed,
            training_engine=train.engine,
            generation_engine=cfg.generation.engine if name in generating else None,
            sampling=sampling if budget_of == budget else msgspec.structs.replace(sampling, max_new_tokens=budget_of),
            optimizer=optimizer,
            numerics=numerics or EngineNumerics(),
            max_tokens_per_micro_batch=train.max_tokens_per_micro_batch,
            pack=train.pack,
            lora=train.lora if decl.trainable and train.lora.rank > 0 else None,
        )
    return runs


def fused_forwards(graph: Graph, options: dict[str, NodeOptions], registry: Registry, engine: str) -> dict[str, str]:
    """Forward nodes whose output their model's train node computes itself (forward -> train node).

    A policy that takes one optimizer step per batch (one epoch, one mini-batch) trains on the very
    weights that computed its old log-probs, so they are its own log-probs, detached (TRL's
    ``num_iterations=1``): the train step computes them in its forward and the forward pass is
    saved. Only where the training engine ``engine`` declares it can (`EngineCapabilities.own_outputs`)
    and the loss trains on log-probs; the structure `fusable` checks besides."""
    if not declared(registry, "training_engines", engine).own_outputs:
        return {}
    return {
        fwd: train
        for fwd, train in fusable(graph, options).items()
        if registry.entry("losses", graph.nodes[train].loss).meta.get("output", "logprobs") == "logprobs"
    }
