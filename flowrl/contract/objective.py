"""What a plan was chosen for: the objective the tuner ranked its candidates by, and the winner's
predicted time to a target reward (``ExecutionPlan.objective``).

Samples per second is not what a user waits for: a rollout policy that trains on older samples may
take more iterations to reach the same reward. The planner predicts

    time to target = seconds per iteration (the simulator's) x iterations to target
    iterations to target = target_steps x (1 + penalty(policy))
    penalty(policy) = staleness * mean staleness + offpolicy * off-policy fraction + partial * recycled share

``target_steps`` are the iterations a synchronous run needs (``--target-steps``; default the run
config's steps); `SampleEfficiency` holds the three penalties (the planner's documented prior, or what
``flowrl calibrate`` fitted to the user's runs: `flowrl.planner.sample_efficiency`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from flowrl.specs import Spec

ObjectiveKind = Literal["throughput", "time-to-target"]
#: What ``--objective`` accepts: ``throughput`` ranks by seconds per iteration (samples per second),
#: ``time-to-target`` by predicted seconds to the target reward.
OBJECTIVES: tuple[str, ...] = ("throughput", "time-to-target")

Penalty = Annotated[float, Meta(ge=0)]


class SampleEfficiency(Spec):
    """Extra iterations to a target reward, as a fraction of a synchronous run's, per unit of what makes a
    step's samples off-policy (see the module): ``staleness`` per version of mean staleness (how many
    weight versions behind the trainer a sample's oldest token is), ``offpolicy`` per unit of the
    off-policy fraction (tokens sampled by older weights), ``partial`` per unit of the recycled share
    (tokens a partial rollout decoded in earlier steps). ``source``: ``prior`` or ``calibrated``;
    ``runs``: the runs a calibration fitted it to; ``target_reward``: the reward those runs' steps were
    counted to."""

    staleness: Penalty = 0.0
    offpolicy: Penalty = 0.0
    partial: Penalty = 0.0
    source: str = "prior"
    runs: list[str] = []
    target_reward: float | None = None

    def penalty(self, staleness: float, offpolicy: float, partial: float) -> float:
        """The extra iterations, as a fraction of a synchronous run's, of samples this stale and off-policy."""
        return self.staleness * staleness + self.offpolicy * offpolicy + self.partial * partial

    def describe(self) -> str:
        """``prior: +0.01/version, +0.05 off-policy, +0.05 partial`` (which numbers the planner used)."""
        where = f"calibrated from {', '.join(self.runs)}" if self.source == "calibrated" and self.runs else self.source
        return (
            f"{where}: +{self.staleness:.3g} steps/version of staleness, +{self.offpolicy:.3g} x off-policy "
            f"fraction, +{self.partial:.3g} x recycled share (fractions of a sync run's steps)"
        )


class PlanObjective(Spec, kw_only=True):
    """The objective a plan was ranked by and its winner's prediction: ``steps`` iterations to the target
    (``target_steps`` for a synchronous run, more for stale samples), ``time_to_target_s`` = ``steps`` x
    ``iteration_s``; ``samples_per_s`` = trained samples per iteration / ``iteration_s``."""

    kind: ObjectiveKind = "throughput"
    target_steps: Annotated[int, Meta(ge=1)]
    steps: float
    iteration_s: float
    time_to_target_s: float
    samples_per_s: float
    efficiency: SampleEfficiency
