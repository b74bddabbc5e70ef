"""What runs' reward curves say about sample efficiency: the iterations each run took to a target reward,
and the penalties of `flowrl.contract.objective.SampleEfficiency` fitted to them (``flowrl calibrate``).

Each run folder gives its rollout policy (plan.yaml's layout) and, per step (metrics.jsonl), the reward
and what made its samples off-policy: ``<generate node>/staleness_mean`` (the samples' mean age in weight
versions), ``<train node>/offpolicy_frac`` (tokens sampled by older weights) and
``<generate node>/recycled_tokens`` (tokens a partial rollout decoded in earlier steps), averaged over the
run (a run without one of them: its policy's nominal value, `sample_efficiency.features`).

The target reward is ``--target-reward``, or `FRACTION` of the way from where the runs start (the mean of
their first `WINDOW` steps) to the best run's final reward (the mean of its last `WINDOW` steps). A run
reaches it at the first step whose trailing mean over `WINDOW` steps does (as ``benchmarks/rollout_modes.py``
counts); one that never does needs more steps than it ran (a lower bound: a prediction below it is off by
`CENSORED` times its log error, one above it not at all). The fit, by bounded
least squares on log steps::

    log steps(run) = log S + log(1 + staleness * s_run + offpolicy * f_run + partial * r_run)

with ``S`` (a synchronous run's steps) free and a weak pull (`PRIOR_WEIGHT`) of each penalty toward the
prior, so that what the runs cannot tell apart (one-step-off is as stale as it is off-policy) stays where
the prior put it relative to the other. Fewer than two policies, or no run reaching the target: the prior
is kept, and the fit says why.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flowrl.contract.layout import RolloutPolicy
from flowrl.contract.objective import SampleEfficiency
from flowrl.contract.plan import ExecutionPlan, load_plan
from flowrl.errors import ConfigError
from flowrl.planner.sample_efficiency import PRIOR, features
from flowrl.planner.traces import read_records

WINDOW = 5  # steps of the trailing mean a run's reward is read through
FRACTION = 0.9  # the default target: this far from the runs' start to the best run's final reward
PRIOR_WEIGHT = 0.1  # residual per unit of a penalty's distance from the prior, against log steps
CENSORED = 3.0  # weight of a run's proven bound (it had not reached the target when it stopped) against a count
FEATURES = ("staleness_mean", "offpolicy_frac", "recycled_tokens")  # metric suffixes, in penalty order


@dataclass(frozen=True)
class Curve:
    """One run's reward per step and what made its samples off-policy."""

    run: str
    policy: RolloutPolicy
    task: str
    rewards: list[float]
    features: tuple[float, float, float]  # (mean staleness, off-policy fraction, recycled share)
    measured: tuple[str, ...]  # which of FEATURES came from the run's metrics (the others: the policy's)

    def steps_to(self, target: float) -> int | None:
        """The steps until the trailing mean reward first reaches ``target`` (None: it never did)."""
        for i in range(len(self.rewards)):
            window = self.rewards[max(0, i + 1 - WINDOW) : i + 1]
            if sum(window) / len(window) >= target:
                return i + 1
        return None


def _number(value: object) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def read_curve(path: str | Path, plan: ExecutionPlan | None = None) -> Curve:
    """The reward curve of the run in folder ``path`` (its plan.yaml, unless ``plan`` is given, and metrics.jsonl)."""
    folder = Path(path)
    where = f"run '{path}'"
    if plan is None:
        if not (folder / "plan.yaml").is_file():
            raise ConfigError(f"{where}: no plan.yaml (a run writes it when it starts); give the folder a run wrote.")
        plan = load_plan(folder / "plan.yaml")
    if plan.layout is None:
        raise ConfigError(f"{where}: its plan.yaml has no placed layout, so no rollout policy to credit.")
    by_step: dict[int, dict] = {}
    for record in read_records(folder / "metrics.jsonl"):  # a resumed run's repeated step: its last record
        step, reward = record.get("step"), _number(record.get("reward"))
        if record.get("kind") in (None, "train") and isinstance(step, int) and reward is not None:
            by_step[step] = record
    if not by_step:
        raise ConfigError(f"{where}: metrics.jsonl has no step with a reward; run it for some steps first.")
    records = [by_step[s] for s in sorted(by_step)]
    nominal = features(plan.layout.rollout)
    values, measured = [], []
    for name, default in zip(FEATURES, nominal):
        seen = [v for r in records for k, x in r.items() if k.endswith("/" + name) and (v := _number(x)) is not None]
        values.append(statistics.fmean(seen) if seen else default)
        if seen:
            measured.append(name)
    return Curve(
        run=str(path),
        policy=plan.layout.rollout,
        task=plan.config.task,
        rewards=[float(r["reward"]) for r in records],
        features=(values[0], values[1], values[2]),
        measured=tuple(measured),
    )


@dataclass(frozen=True)
class RunFit:
    """One run in the fit: its steps to the target (None: not reached in ``ran`` steps) and the fit's."""

    curve: Curve
    steps: int | None
    ran: int
    predicted: float


@dataclass(frozen=True)
class EfficiencyFit:
    """The fitted (or kept) sample efficiency, the target reward, each run's steps, and why the prior was
    kept (``kept``: None when the runs were fitted)."""

    efficiency: SampleEfficiency
    target: float | None
    how: str  # how the target was chosen
    runs: list[RunFit] = field(default_factory=list)
    sync_steps: float | None = None  # the fitted S: a synchronous run's steps to the target
    kept: str | None = None


def default_target(curves: Sequence[Curve]) -> tuple[float, str]:
    """`FRACTION` of the way from the runs' mean start to the best run's final reward, and how it was chosen."""
    start = statistics.fmean(statistics.fmean(c.rewards[:WINDOW]) for c in curves)
    best = max(curves, key=lambda c: statistics.fmean(c.rewards[-WINDOW:]))
    final = statistics.fmean(best.rewards[-WINDOW:])
    target = start + FRACTION * (final - start)
    return target, (
        f"{FRACTION:.0%} of the way from the runs' start ({start:.4g}, mean of the first {WINDOW} steps) to the best "
        f"final reward ({final:.4g}, {best.run}'s last {WINDOW} steps)"
    )


def fit_efficiency(
    curves: Sequence[Curve], target: float | None = None, prior: SampleEfficiency = PRIOR
) -> EfficiencyFit:
    """The penalties that best explain the runs' steps to ``target`` (default: `default_target`)."""
    if not curves:
        raise ConfigError("fitting sample efficiency needs at least one run's reward curve.")
    how = "--target-reward"
    if target is None:
        target, how = default_target(curves)
    rows = [(c, c.steps_to(target)) for c in curves]
    policies = {c.policy.describe() for c in curves}
    tasks = {c.task for c in curves}
    kept = None
    if len(tasks) > 1:
        kept = f"the runs train different tasks ({', '.join(sorted(tasks))}); their steps cannot be compared"
    elif len(policies) < 2:
        kept = (
            f"the runs all use one rollout policy ({next(iter(policies))}); calibrate from runs of at least two "
            "(e.g. sync and one_step_off) to fit it"
        )
    elif target <= statistics.fmean(statistics.fmean(c.rewards[:WINDOW]) for c in curves):
        kept = f"the runs' reward did not improve (target {target:.4g} is not above where they start)"
    elif all(steps is None for _, steps in rows):
        kept = f"no run reached the target reward {target:.4g}"
    if kept is not None:
        fits = [RunFit(c, steps, len(c.rewards), float("nan")) for c, steps in rows]
        return EfficiencyFit(efficiency=prior, target=target, how=how, runs=fits, kept=kept)
    return _fit(rows, target, how, prior)


def _fit(rows: list[tuple[Curve, int | None]], target: float, how: str, prior: SampleEfficiency) -> EfficiencyFit:
    from scipy.optimize import least_squares

    x = np.array([c.features for c, _ in rows])  # (runs, 3)
    reached = np.array([steps is not None for _, steps in rows])
    steps = np.array([float(s if s is not None else len(c.rewards)) for c, s in rows])
    theta0 = np.array([prior.staleness, prior.offpolicy, prior.partial])
    log_s0 = float(np.median(np.log(steps[reached]) - np.log1p(x[reached] @ theta0)))

    def residuals(p: np.ndarray) -> np.ndarray:
        predicted = p[0] + np.log1p(x @ p[1:])
        # a run that never reached the target needs more steps than it ran: only a prediction below that is off
        off = np.where(reached, predicted - np.log(steps), CENSORED * np.maximum(0.0, np.log(steps) - predicted))
        return np.concatenate([off, PRIOR_WEIGHT * (p[1:] - theta0)])

    lo = np.array([-np.inf, 0.0, 0.0, 0.0])
    hi = np.array([np.inf, 50.0, 50.0, 50.0])
    solution = least_squares(residuals, np.concatenate([[log_s0], theta0]), bounds=(lo, hi))
    p = solution.x
    efficiency = SampleEfficiency(
        staleness=round(float(p[1]), 4),
        offpolicy=round(float(p[2]), 4),
        partial=round(float(p[3]), 4),
        source="calibrated",
        runs=[c.run for c, _ in rows],
        target_reward=round(target, 6),
    )
    sync = float(np.exp(p[0]))
    fits = [
        RunFit(c, s, len(c.rewards), sync * (1 + efficiency.penalty(*c.features)))
        for (c, s) in rows  # fmt: skip
    ]
    return EfficiencyFit(efficiency=efficiency, target=target, how=how, runs=fits, sync_steps=sync)


def report(fit: EfficiencyFit) -> list[str]:
    """The fit, as ``flowrl calibrate`` prints it."""
    lines = [f"sample efficiency: target reward {fit.target:.4g} ({fit.how})"]
    lines.append(f"  {'run':<28} {'rollout':<26} {'stale':>6} {'offpol':>6} {'recyc':>6} {'steps':>7} {'fit':>7}")
    for r in fit.runs:
        steps = str(r.steps) if r.steps is not None else f">{r.ran}"
        fitted = f"{r.predicted:7.1f}" if math.isfinite(r.predicted) else f"{'-':>7}"
        s, f, p = r.curve.features
        lines.append(
            f"  {r.curve.run:<28} {r.curve.policy.describe():<26} {s:6.2f} {f:6.2f} {p:6.2f} {steps:>7} {fitted}"
        )
    if fit.kept is not None:
        lines.append(f"  kept the prior: {fit.kept}.")
    else:
        lines.append(f"  a synchronous run needs {fit.sync_steps:.1f} steps to the target")
    lines.append(f"  {fit.efficiency.describe()}")
    return lines
