"""Sample efficiency of a rollout policy: how many more iterations than a synchronous run it needs to
reach a target reward, and the objective the tuner ranks plans by (`Objective`).

A plan that overlaps generation with training (one-step-off, async with staleness eta, partial
rollouts) trains on samples that older weights produced. Per iteration it is faster; per iteration
it may also learn less. The planner predicts (`flowrl.contract.objective`)::

    iterations to target = target_steps x (1 + S * staleness + F * offpolicy + P * partial)
    time to target       = iterations to target x predicted seconds per iteration

``staleness`` is the samples' mean age in weight versions, ``offpolicy`` the fraction of trained tokens
older weights sampled, ``partial`` the fraction of tokens a partial rollout decoded in earlier steps.
For a plan the planner reads them off its rollout policy (`features`); ``flowrl calibrate`` reads what
runs measured (``<generate node>/staleness_mean``, ``<train node>/offpolicy_frac``,
``<generate node>/recycled_tokens`` in metrics.jsonl) and fits S, F, P to the iterations each run took
to the target (`flowrl.planner.reward_curves`).

The prior (`PRIOR`), from published equal-accuracy results, none measured here:

- AReaL (Fu et al. 2025, arXiv:2505.24298, Table 1; ``benchmarks/published/areal-*.yaml``): the
  asynchronous system (staleness eta = 8, decoupled PPO objective) and the same system run
  synchronously train the same 250 PPO steps to comparable AIME24 accuracy, 14.8 h against 41.0 h
  (1.5B) and 25.4 h against 57.7 h (7B): the "2.77x" is wall time at an equal number of steps. Its
  staleness ablation keeps final accuracy up to eta of about 4-8 with the decoupled objective (and loses
  it without): a penalty per version near 0, below what the runs resolve.
- verl fully-async (docs, "Asynchronous Training on 7B Model": DAPO, Qwen2.5-Math-7B, 400 steps;
  ``benchmarks/published/verl-fully-async-*.yaml``): async + partial rollout at staleness_threshold 0.5
  reaches acc/mean@1 max 0.330 / 0.368 / 0.352 (16:16, 32:32, 64:64 GPUs) against colocated sync's
  0.331 / 0.337 / 0.357 (32, 64, 128 GPUs) in the same 400 steps: no consistent penalty for off-policy
  samples or partial rollouts, within about +-10 % of accuracy.

Those runs resolve a step penalty to about 5 % at best, so the prior sets S = 0.01 per version, F =
0.05 and P = 0.05: time to target then ranks like throughput unless a faster policy gains less than
about 5-10 % per step, where on-policy wins the tie.

Measured on this project's machine (``benchmarks/rollout_modes.py``, the tiny model on the ``repeat``
copy task, lr 2e-3, not part of the prior): one-step-off gave 1.37-1.53x the samples/s of sync but
reached reward 0.8 later (28.7 s against 23.4 s), i.e. about 1.7-1.9x the iterations (penalty S + F of
about 0.7-0.9), and async eta = 2 did not reach it in 120 steps. A small model at a high learning rate
is far more sensitive to stale samples than the published large-model runs: calibrate from your own runs
(``flowrl calibrate RUN...``) before trusting a time to target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from flowrl.contract.hardware import default_profile_path
from flowrl.contract.layout import ClusterPlan, RolloutPolicy
from flowrl.contract.objective import OBJECTIVES, PlanObjective, SampleEfficiency
from flowrl.errors import ConfigError
from flowrl.specs import convert, read_document

#: From published equal-accuracy results (see the module): penalties below what those runs resolve.
PRIOR = SampleEfficiency(staleness=0.01, offpolicy=0.05, partial=0.05, source="prior")


def recycled_share(policy: RolloutPolicy) -> float:
    """The predicted share of a step's trained tokens that a partial rollout decoded in earlier steps: the
    over-provisioned groups carried over (``o / (1 + o)`` of those launched), about half decoded when
    carried. An estimate for ranking; a calibration fits the penalty to what runs measured."""
    if not policy.partial:
        return 0.0
    o = policy.overprovision
    return o / (2 * (1 + o))


def features(policy: RolloutPolicy) -> tuple[float, float, float]:
    """(mean staleness in versions, off-policy fraction, recycled share) a plan's samples will have: a
    policy whose generation leads training by ``lead`` versions samples every token that many versions
    behind (the bound, which generation reaches when it is faster than training), and its recycled
    tokens one version more."""
    share = recycled_share(policy)
    lead = policy.lead
    return lead + share, (1.0 if lead >= 1 else share), share


@dataclass(frozen=True)
class Objective:
    """What the tuner ranks plans by: ``throughput`` (seconds per iteration, i.e. samples per second) or
    ``time-to-target`` (seconds per iteration x the iterations the plan's rollout policy needs to the
    target: ``target_steps`` for a synchronous run, more by ``efficiency``'s penalties)."""

    kind: str = "throughput"
    target_steps: int = 600
    efficiency: SampleEfficiency = PRIOR

    def __post_init__(self) -> None:
        check_objective(self.kind)
        if self.target_steps < 1:
            raise ConfigError(f"--target-steps is {self.target_steps}; give the iterations a sync run needs (>= 1).")

    def steps(self, policy: RolloutPolicy) -> float:
        """The iterations ``policy`` needs to the target."""
        return self.target_steps * (1.0 + self.efficiency.penalty(*features(policy)))

    def time_to_target(self, plan: ClusterPlan, iteration_s: float) -> float:
        return self.steps(plan.rollout) * iteration_s

    def score(self, plan: ClusterPlan, iteration_s: float) -> float:
        """What the tuner minimises."""
        return iteration_s if self.kind == "throughput" else self.time_to_target(plan, iteration_s)

    def record(self, plan: ClusterPlan, iteration_s: float, samples: int) -> PlanObjective:
        """The plan's record of the objective and its prediction (``ExecutionPlan.objective``)."""
        steps = self.steps(plan.rollout)
        return PlanObjective(
            kind=self.kind,  # type: ignore[arg-type]
            target_steps=self.target_steps,
            steps=round(steps, 3),
            iteration_s=round(iteration_s, 6),
            time_to_target_s=round(steps * iteration_s, 3),
            samples_per_s=round(samples / iteration_s, 3) if iteration_s > 0 else 0.0,
            efficiency=self.efficiency,
        )


def check_objective(kind: str) -> str:
    """``kind`` if it is an objective the tuner ranks by, else a ConfigError listing them."""
    if kind not in OBJECTIVES:
        raise ConfigError(
            f"--objective '{kind}' is not an objective; use 'throughput' (rank plans by seconds per iteration, "
            "i.e. samples per second) or 'time-to-target' (by predicted seconds to the target reward: seconds per "
            "iteration x the iterations the rollout policy needs, see docs/guides/calibration.md)."
        )
    return kind


# ------------------------------------------------------------------ where a calibration keeps it


def efficiency_path() -> Path:
    """Where ``flowrl calibrate`` saves the fitted sample efficiency, beside the clusters' fitted factors:
    ``$FLOWRL_HOME/hardware/calibrated/sample_efficiency.yaml`` (one for all clusters: how fast a policy
    learns does not depend on the devices)."""
    return default_profile_path().parent / "calibrated" / "sample_efficiency.yaml"


def save_efficiency(efficiency: SampleEfficiency, path: str | Path | None = None) -> Path:
    path = Path(path) if path is not None else efficiency_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(msgspec.yaml.encode(efficiency))
        tmp.replace(path)
    except OSError as exc:
        raise ConfigError(f"cannot write sample-efficiency file '{path}': {exc.strerror or exc}.") from None
    return path


def load_efficiency(path: str | Path) -> SampleEfficiency:
    """A saved `SampleEfficiency`; errors name the file and field."""
    return convert(read_document(path), SampleEfficiency, f"sample-efficiency file '{path}'")


def in_use() -> SampleEfficiency:
    """What plans are ranked with: the calibrated sample efficiency where ``flowrl calibrate`` saved one,
    else `PRIOR`."""
    path = efficiency_path()
    return load_efficiency(path) if path.is_file() else PRIOR
