"""The passes every plan goes through, one module each; a pass is a plain function ``(ctx, plan) -> plan``.

resolve     -> every function, loss, task, engine and node option a plan names exists and fits;
               the workload follows from the run config unless one was given        (resolve.py)
place       -> models on device groups: the one colocated layout of a one-device cluster,
               or the auto-tuner's best plan for a larger one (placement, parallel sizes,
               rollout policy, weight sync)                                          (place.py)
micro_batch -> per node: its rows per step and micro-batch (configured, or the layout's,
               halved until its activations fit)                                     (micro_batch.py)
memory      -> per device group: the bytes one device needs; verification refuses a plan
               that does not fit, with the breakdown                                 (memory.py)

A pass's by-products are typed fields of ``ctx.results`` (`PassResults`; ``place`` leaves a
`PlaceResult`), never string keys. Shared helpers: ``context`` (PlanContext, the results),
``options`` (node options), ``ports`` (port bindings), ``numerics`` (engine numerics), ``lengths``
(workload lengths), ``runs`` (per-model runs), ``rows`` (rows per node), ``residency`` (what a
device holds), ``tuning`` (the tuner for a plan, replay).
Plan verification, run after every pass by the manager, is `flowrl.contract.reading.verify_plan`
(the executor checks plans with it too). Passes are registered as plugins (`register_passes`);
this module's names are what the rest of flowrl imports.
"""

from __future__ import annotations

from flowrl.contract.reading import episode_budget, fusable, generating_models, model_checkpoints, verify_plan
from flowrl.planner.passes.context import PassResults, PlaceResult, PlanContext, PlanOptions, plan_options
from flowrl.planner.passes.lengths import episode_lengths, task_lengths
from flowrl.planner.passes.memory import memory
from flowrl.planner.passes.micro_batch import fit_micro_batches, micro_batch
from flowrl.planner.passes.numerics import CPU_BF16_PARAMETERS, cpu_has_bf16, engine_memory, resolve_numerics
from flowrl.planner.passes.options import configured_options, node_options, node_plan_options
from flowrl.planner.passes.place import colocated, generation_engines, place, rollout_policy, with_candidate
from flowrl.planner.passes.residency import budgeted_rows, generates_in_place, group_states, lora_base
from flowrl.planner.passes.resolve import resolve
from flowrl.planner.passes.rows import node_rows, plan_rows
from flowrl.planner.passes.runs import fused_forwards, model_runs
from flowrl.planner.passes.tuning import plan_tuner, replay

PIPELINE = ("resolve", "place", "micro_batch", "memory")
BUILTIN_PASSES = {"resolve": resolve, "place": place, "micro_batch": micro_batch, "memory": memory}

__all__ = [
    "BUILTIN_PASSES",
    "CPU_BF16_PARAMETERS",
    "PIPELINE",
    "PassResults",
    "PlaceResult",
    "PlanContext",
    "PlanOptions",
    "budgeted_rows",
    "colocated",
    "configured_options",
    "cpu_has_bf16",
    "engine_memory",
    "episode_budget",
    "episode_lengths",
    "fit_micro_batches",
    "fused_forwards",
    "fusable",
    "generates_in_place",
    "generating_models",
    "generation_engines",
    "group_states",
    "lora_base",
    "memory",
    "micro_batch",
    "model_checkpoints",
    "model_runs",
    "node_options",
    "node_plan_options",
    "node_rows",
    "place",
    "plan_options",
    "plan_rows",
    "plan_tuner",
    "replay",
    "resolve",
    "resolve_numerics",
    "rollout_policy",
    "task_lengths",
    "verify_plan",
    "with_candidate",
]
